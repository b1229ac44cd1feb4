"""Greedy evaluation on the recipe's held-out prompts.

``evaluate(recipe, checkpoint, n)`` decodes greedily with the base (``checkpoint="base"``: adapters off) or a
trained policy (a run directory -- its ``policy/`` -- or a PEFT adapter folder, e.g. a step checkpoint's
``policy/``), scores the completions with the recipe's reward functions, and returns accuracy (final answer ==
the ``answer`` column), the weighted reward mean and each reward's mean. The base is evaluated under the same prompt
format (chat template, system prompt, template) as the policy, so the two numbers compare like with like.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from lorarl.config import Recipe
from lorarl.data import load_prompts
from lorarl.errors import LorarlError
from lorarl.model import SharedBase
from lorarl.rewards import RewardScorer, is_correct, trl_completions
from lorarl.rollout import generate_rollout

POLICY = "policy"
EVAL_ROLE = "eval_policy"  # the adapter under evaluation, loaded frozen beside the others


def resolve_checkpoint(checkpoint: str) -> Path | None:
    """``"base"`` -> None; a run dir -> its ``policy/`` (else its newest step checkpoint's ``policy/``); an adapter
    folder -> itself. Raises LorarlError when nothing usable is there."""
    if checkpoint == "base":
        return None
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise LorarlError(
            f"checkpoint {checkpoint}: no such folder (give a run directory, an adapter folder or `base`)"
        )
    candidates = [path, path / POLICY]
    if (path / "checkpoints").is_dir():
        steps = sorted(p for p in (path / "checkpoints").glob("step-*") if (p / "COMPLETE").is_file())
        if steps:
            candidates.append(steps[-1] / POLICY)
    for c in candidates:
        if (c / "adapter_config.json").is_file():
            return c
    raise LorarlError(f"checkpoint {checkpoint}: no PEFT adapter (adapter_config.json) in it or in its policy/ folder")


def load_eval_adapter(shared: SharedBase, adapter: Path | None) -> str:
    """The role that runs ``adapter`` for an evaluation: ``"base"`` for None, else the frozen adapter loaded as
    ``eval_policy`` (replacing an earlier one)."""
    if adapter is None:
        return "base"
    if shared.has_adapter(EVAL_ROLE):
        shared.peft.delete_adapter(EVAL_ROLE)
    shared.add_adapter(EVAL_ROLE, init_from=adapter, trainable=False)
    return EVAL_ROLE


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Greedy decoding on ``n`` held-out prompts (default ``eval.n``); returns
    ``{accuracy, n, reward_mean, reward/<name>..., completion_len, truncated_frac, checkpoint, seconds}``.

    ``shared`` reuses an already loaded base (its ``policy`` adapter, if any, is replaced for the evaluation).
    """
    t0 = time.perf_counter()
    ecfg = recipe.eval
    n = n or ecfg.n
    if n < 1:
        raise LorarlError(f"eval: n must be >= 1, got {n}")
    adapter = resolve_checkpoint(checkpoint)
    if shared is None:
        shared = SharedBase.load(recipe.model)
    role = load_eval_adapter(shared, adapter)
    # generated held-out sets grow to n (their first rows do not change); files are read whole
    prompts = load_prompts(recipe.data, shared.tokenizer, "eval", size=max(n, recipe.data.eval_size))
    k = min(n, len(prompts))
    completions, completion_ids, lengths, truncated = [], [], [], []
    with torch.no_grad():
        for s in range(0, k, ecfg.batch_size):
            idx = list(range(s, min(s + ecfg.batch_size, k)))
            r = generate_rollout(
                shared,
                [prompts.token_ids[i] for i in idx],
                recipe.generation,
                group_size=1,
                role=role,
                greedy=True,
                max_new_tokens=ecfg.max_new_tokens,
                prompt_index=idx,
            )
            completions += r.completions
            completion_ids += r.completion_token_lists()
            lengths += r.lengths.tolist()
            truncated += r.truncated.tolist()
    rows = list(range(k))
    columns = prompts.columns(rows)
    scorer = RewardScorer(recipe.rewards, timeout_s=recipe.train.reward_timeout_s or None)
    given = trl_completions(completions, prompts.conversational)
    scores = scorer([prompts.rows[i]["prompt"] for i in rows], given, columns, completion_ids)
    answers = columns.get("answer")
    valid = ~torch.isnan(scores.total)
    out = {
        "checkpoint": "base" if adapter is None else str(adapter),
        "n": k,
        "accuracy": (sum(is_correct(c, a) for c, a in zip(completions, answers)) / k) if answers else None,
        "reward_mean": float(scores.total[valid].mean()) if valid.any() else None,
        **{f"reward/{name}": (v if math.isfinite(v) else None) for name, v in scores.means().items()},
        "completion_len": sum(lengths) / k,
        "truncated_frac": sum(truncated) / k,
        "reward_failures": {name: err for name, err in scores.failures.items()} or None,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if adapter is not None and adapter.name == POLICY and (adapter.parent / "recipe.yaml").is_file():
        (adapter.parent / "eval.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    return out
