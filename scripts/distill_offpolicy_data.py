"""Off-policy distillation's data: the teacher's greedy answers to exactly the prompts an on-policy distillation run
samples, as SFT rows (TRL's prompt-completion fields), so SFT on them (recipes/distill_offpolicy_sft.yaml) and
on-policy distillation (recipes/distill_arithmetic.yaml) train the same student on the same prompts for the same
number of optimizer steps (docs/distillation.md).

    python scripts/distill_offpolicy_data.py recipes/distill_arithmetic.yaml runs/distill_offpolicy.jsonl

The prompts are the training prompts of the distillation recipe's steps 1 .. train.steps, in order
(lorarl.algos.base.batch_indices of (train.seed, step): what the distillation run draws); the teacher is the recipe's
``distill.teacher`` (an adapter on the base or a second model, lorarl.model.teacher), decoding greedily at most
``generation.max_new_tokens`` tokens. Each row keeps the prompt as the data holds it, the teacher's answer as the
completion, and the ``answer`` column. Prints the rows written, the teacher's accuracy on them and the seconds the
teacher's decoding took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="an on-policy distillation recipe (algo: distill)")
    p.add_argument("out", help="the .jsonl file to write")
    p.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per greedy generate call")
    args = p.parse_args(argv)

    from lorarl.algos.base import batch_indices, load_train_prompts
    from lorarl.algos.loop import set_threads
    from lorarl.config import load_recipe
    from lorarl.model import SharedBase
    from lorarl.model.teacher import load_teacher
    from lorarl.rollout import generate_rollout
    from lorarl.tasks import accuracy

    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.algo != "distill":
        print(f"{args.recipe}: algo is {recipe.algo}, not distill", file=sys.stderr)
        return 2
    set_threads()
    shared = SharedBase.load(recipe.model)
    teacher = load_teacher(recipe.distill.teacher, shared)
    prompts = load_train_prompts(recipe, shared.tokenizer)
    tcfg = recipe.train
    index = [
        i
        for step in range(1, tcfg.steps + 1)
        for i in batch_indices(len(prompts), tcfg.prompts_per_step, tcfg.seed, step)
    ]
    t0 = time.perf_counter()
    rollout = generate_rollout(
        teacher.shared,
        [prompts.token_ids[i] for i in index],
        recipe.generation,
        role=teacher.role,
        greedy=True,
        prompt_index=index,
        batch_size=args.batch_size,
    )
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i, text in zip(index, rollout.completions):
            row = prompts.rows[i]
            f.write(json.dumps({"prompt": row["prompt"], "completion": text, "answer": row.get("answer")}) + "\n")
    acc = accuracy(recipe, rollout.completions, prompts.columns(index))
    print(json.dumps({"rows": len(index), "teacher_accuracy": acc, "generation_s": round(seconds, 1), "out": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
