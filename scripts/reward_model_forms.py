"""What a reward model rewards on the arithmetic task: its mean score of fixed answer forms, each with the right sum
and with a wrong one, on the held-out prompts of a recipe.

    python scripts/reward_model_forms.py                                   # recipes/ppo.yaml, runs/reward_model
    python scripts/reward_model_forms.py --recipe recipes/ppo.yaml --reward-adapter runs/reward_model --n 100

Each prompt ("What is 23 + 45?") is rendered as training renders it (the recipe's chat template), each form's text
("{c} is the answer.", "{a} + {b} = {c}", ...) is tokenized and ended with the end-of-turn token, as a sampled
answer that stopped, and the frozen reward adapter scores it at that token (``lorarl.rewards.source``: the score
GRPO, PPO, online DPO and ``lorarl eval`` read). ``c`` is the right sum, or the right sum plus ``--offset`` (wrong).

A reward model that tells right from wrong scores every form higher with the right sum; one that learned the form of
its preferred answers scores both alike: a policy trained on it alone can then raise the score with wrong numbers.

The last stdout line is one JSON object: ``{forms: {name: {text, right, wrong, margin}}, n, offset, ...}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: a shared CPU set

import argparse
import json
import platform
import re

import torch

FORMS = {
    "bare": "{c}",
    "bare, full stop": "{c}.",
    "equation": "{a} + {b} = {c}",
    "equation, full stop": "{a} + {b} = {c}.",
    "the answer is": "The answer is {c}.",
    "is the answer": "{c} is the answer.",
    "the sum of": "The sum of {a} and {b} is {c}.",
    "worked": "To find {a} + {b}, we add the numbers: {a} + {b} = {c}. So the answer is {c}.",
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/ppo.yaml", help="a recipe on the arithmetic task (its data section)")
    ap.add_argument("--reward-adapter", default="runs/reward_model", help="a reward-model run or its adapter folder")
    ap.add_argument("--n", type=int, default=100, help="held-out prompts")
    ap.add_argument("--offset", type=int, default=7, help="the wrong sum is the right one plus this")
    args = ap.parse_args(argv)

    import transformers

    from lorarl.config import load_recipe
    from lorarl.data import load_prompts
    from lorarl.model import SharedBase
    from lorarl.rewards.source import add_reward_role, reward_model_scores

    recipe = load_recipe(args.recipe)
    shared = SharedBase.load(recipe.model)
    folder = add_reward_role(shared, args.reward_adapter)
    tok = shared.tokenizer
    prompts = load_prompts(recipe.data, tok, "eval", size=max(args.n, recipe.data.eval_size))
    n = min(args.n, len(prompts))
    eot = shared.end_of_turn_id
    scores = {name: {"right": [], "wrong": []} for name in FORMS}
    for i in range(n):
        ids = list(prompts.token_ids[i])
        m = re.search(r"(\d+)\s*\+\s*(\d+)", tok.decode(ids))
        if m is None:
            raise SystemExit(f"{args.recipe}: held-out prompt {i} is not 'a + b' arithmetic: {tok.decode(ids)!r}")
        a, b = int(m.group(1)), int(m.group(2))
        rows = []
        for form in FORMS.values():
            for c in (a + b, a + b + args.offset):
                rows.append(ids + tok(form.format(a=a, b=b, c=c), add_special_tokens=False)["input_ids"] + [eot])
        width = max(map(len, rows))
        pad = shared.pad_id
        seq = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padded: the score is read at the end
        att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        got = reward_model_scores(shared, seq, att, batch_size=len(rows)).tolist()
        for j, name in enumerate(FORMS):
            scores[name]["right"].append(got[2 * j])
            scores[name]["wrong"].append(got[2 * j + 1])

    out_forms = {}
    print(f"{'form':22s} {'right':>7s} {'wrong':>7s} {'right - wrong':>14s} {'right higher':>13s}   ({n} prompts)")
    for name, text in FORMS.items():
        right = sum(scores[name]["right"]) / n
        wrong = sum(scores[name]["wrong"]) / n
        prefers = sum(r > w for r, w in zip(scores[name]["right"], scores[name]["wrong"])) / n
        out_forms[name] = {
            "text": text,
            "right": right,
            "wrong": wrong,
            "margin": right - wrong,
            "right_higher": prefers,
        }
        print(f"{name:22s} {right:7.2f} {wrong:7.2f} {right - wrong:14.2f} {prefers:13.1%}")
    result = {
        "recipe": args.recipe,
        "reward_adapter": str(folder),
        "n": n,
        "offset": args.offset,
        "forms": out_forms,
        "machine": f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
