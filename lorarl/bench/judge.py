"""``lorarl bench judge``: how an LLM judge on the one base agrees with the rule reward, and what it costs per step.

On the quickstart task (``recipes/grpo_arithmetic.yaml``: two-digit additions, the embedded SmolLM2-135M-Instruct):

1. **Agreement.** ``prompts x group`` completions are sampled from the base (adapters off, the recipe's sampling),
   scored by ``numeric_match`` and by the judge -- the same base with adapters disabled, greedy -- pointwise with
   the default rubric (the judge sees the question and the reply), with and without ``judge.answer_prefix``
   (``Score:`` written as the start of its answer), pointwise with the reference answer in the rubric (prefixed),
   and group-relative (RULER-style, each group of ``G`` replies in one prompt), with and without the JSON's
   start as prefix. For each:
   the parse-failure rate, and over the rows that parsed the Pearson correlation with ``numeric_match``
   (:func:`pearson`) and the agreement of the thresholded judge (``score >= 0.5`` vs correct,
   :func:`threshold_agreement`), plus the judge's seconds.
2. **Cost per GRPO step.** The real :class:`~lorarl.algos.grpo.GRPO` step (``steps`` steps after one warm-up step,
   the recipe's 8 prompts x 8 completions) with the rule reward alone, then with ``numeric_match`` + a pointwise
   judge, then ``numeric_match`` + a group judge (``reward.max_failure_fraction: 1`` and ``max_failed_steps: 0``
   so a judge that cannot follow the format does not stop the bench); the ratios are measured in the same process.

The result is one JSON object (the CLI prints it last); ``--out`` gets ``result.json`` and ``judge.jsonl`` (a sample
of judge prompts and answers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no busy-waiting OpenMP threads

import torch  # noqa: E402

from lorarl.config import RewardSpec, load_recipe  # noqa: E402
from lorarl.config.rewards import JudgeConfig  # noqa: E402
from lorarl.config.shipped import shipped_recipes_dir  # noqa: E402

QUICKSTART = shipped_recipes_dir() / "grpo_arithmetic.yaml"

POINTWISE_PREFIX = "Score:"  # judge.answer_prefix: the judge only writes the number
GROUP_PREFIX = '{"scores": [{"id": 1, "score":'  # ... the first score onwards
REFERENCE_RUBRIC = (
    "You are checking an answer to an arithmetic question.\n\nQuestion:\n{prompt}\n\nCorrect result: {answer}\n\n"
    "Answer given:\n{completion}\n\nGive a high score if the answer given states the correct result, a low score "
    "otherwise."
)


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson's correlation ``r = sum (x - mx)(y - my) / sqrt(sum (x - mx)^2 sum (y - my)^2)`` over pairs; NaN
    when either side has no spread or fewer than 2 pairs.

    >>> round(pearson([0, 1, 2], [0, 2, 4]), 6)
    1.0
    """
    n = len(x)
    if n < 2:
        return float("nan")
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def threshold_agreement(judge: list[float], correct: list[float], threshold: float = 0.5) -> float:
    """Fraction of rows where ``judge >= threshold`` equals ``correct == 1`` (NaN without rows)."""
    if not judge:
        return float("nan")
    return sum((j >= threshold) == (c == 1.0) for j, c in zip(judge, correct)) / len(judge)


def agreement(judge: torch.Tensor, rule: torch.Tensor) -> dict[str, float]:
    """Judge scores ``[N]`` (NaN: did not parse) against the rule reward ``[N]`` (0 / 1)."""
    ok = ~torch.isnan(judge)
    j, r = judge[ok].tolist(), rule[ok].tolist()
    return {
        "rows": int(judge.numel()),
        "parse_failure_rate": float((~ok).float().mean()),
        "pearson": pearson(j, r),
        "threshold_agreement": threshold_agreement(j, r),
        "judge_mean": float(sum(j) / len(j)) if j else float("nan"),
    }


def _judge_scores(shared, prompts, rollout, cfg: JudgeConfig, log_dir: Path) -> tuple[torch.Tensor, float]:
    from lorarl.rewards import RewardScorer
    from lorarl.rewards.registry import RewardContext

    scorer = RewardScorer([RewardSpec(name="judge", judge=cfg)], context=RewardContext(shared=shared))
    scorer.fns[0].log_to(log_dir)
    t0 = time.perf_counter()
    scores = scorer.score_rollout(prompts, rollout)
    return scores.per_function[:, 0], time.perf_counter() - t0


def measure_agreement(recipe, shared, prompts_n: int, group: int, out: Path) -> dict:
    """Part 1 (module docstring) on ``prompts_n x group`` completions sampled from the base."""
    from lorarl.algos.base import batch_indices, load_train_prompts
    from lorarl.rewards import numeric_match
    from lorarl.rewards.scorer import trl_completions
    from lorarl.rollout import generate_rollout

    prompts = load_train_prompts(recipe, shared.tokenizer)
    index = batch_indices(len(prompts), prompts_n, recipe.train.seed, 1)
    torch.manual_seed(recipe.train.seed)
    t0 = time.perf_counter()
    rollout = generate_rollout(
        shared,
        [prompts.token_ids[i] for i in index],
        recipe.generation,
        group_size=group,
        role="base",
        prompt_index=index,
    )
    sample_s = time.perf_counter() - t0
    cols = prompts.columns(rollout.prompt_index)
    rule = torch.tensor(
        numeric_match([], trl_completions(rollout.completions, prompts.conversational), answer=cols["answer"])
    )
    variants = {
        "pointwise": JudgeConfig(mode="pointwise", batch_size=16),
        "pointwise_prefixed": JudgeConfig(mode="pointwise", batch_size=16, answer_prefix=POINTWISE_PREFIX),
        "pointwise_with_answer_prefixed": JudgeConfig(
            mode="pointwise", rubric=REFERENCE_RUBRIC, batch_size=16, answer_prefix=POINTWISE_PREFIX
        ),
        "group": JudgeConfig(mode="group", batch_size=4),
        "group_prefixed": JudgeConfig(mode="group", batch_size=4, answer_prefix=GROUP_PREFIX),
    }
    out_rows = {}
    for name, cfg in variants.items():
        scores, seconds = _judge_scores(shared, prompts, rollout, cfg, out)
        out_rows[name] = {**agreement(scores, rule), "judge_seconds": seconds}
        print(f"judge {name:22s} {out_rows[name]}", flush=True)
    return {
        "completions": len(rollout),
        "rule_accuracy": float(rule.mean()),
        "sample_seconds": sample_s,
        "variants": out_rows,
    }


def measure_step_cost(recipe_path: str, steps: int, overrides: list[str]) -> dict:
    """Part 2 (module docstring): mean GRPO step seconds per reward setting (one warm-up step not counted)."""
    from lorarl.algos.grpo import GRPO
    from lorarl.model import SharedBase
    from lorarl.phases import recording

    settings = {
        "rules": [RewardSpec(name="numeric_match")],
        "judge_pointwise": [
            RewardSpec(name="numeric_match"),
            RewardSpec(name="judge", judge=JudgeConfig(mode="pointwise", batch_size=16)),
        ],
        "judge_group": [
            RewardSpec(name="numeric_match"),
            RewardSpec(name="judge", judge=JudgeConfig(mode="group", batch_size=4)),
        ],
    }
    out = {}
    for name, functions in settings.items():
        recipe = load_recipe(recipe_path, overrides)
        recipe.reward.functions = functions
        recipe.reward.max_failure_fraction = 1.0
        recipe.reward.max_failed_steps = 0  # a judge that never parses is measured, not stopped
        shared = SharedBase.load(recipe.model)
        algo = GRPO(recipe, shared)
        times, reward_times = [], []
        for step in range(1, steps + 2):
            torch.manual_seed(step)
            t0 = time.perf_counter()
            with recording() as phases:
                row = algo.step(algo.batch(step))
            if step > 1:  # step 1 warms up
                times.append(time.perf_counter() - t0)
                reward_times.append(phases.seconds.get("rewards", 0.0))
        out[name] = {
            "step_seconds": sum(times) / len(times),
            "reward_seconds": sum(reward_times) / len(reward_times),
            "judge_failed_rows_last": row.get("rewards/judge/failed_rows"),
        }
        print(f"step cost {name:16s} {out[name]}", flush=True)
        del algo, shared
    base = out["rules"]["step_seconds"]
    for name in out:
        out[name]["ratio_to_rules"] = out[name]["step_seconds"] / base
    return out


def run(
    out_dir: Path,
    model: str = "smollm2-135m",
    prompts_n: int = 8,
    group: int = 8,
    steps: int = 2,
    recipe_path: str | Path = QUICKSTART,
    overrides: list[str] | None = None,
) -> dict:
    """Both parts on ``model`` with the quickstart recipe; returns the result dict (also ``out_dir/result.json``)."""
    from lorarl.bench.procs import bench_threads, machine_description
    from lorarl.model import SharedBase

    torch.set_num_threads(bench_threads())
    recipe_path = str(recipe_path)
    overrides = [f"model.name={model}", *(overrides or [])]
    recipe = load_recipe(recipe_path, overrides)
    shared = SharedBase.load(recipe.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    agree = measure_agreement(recipe, shared, prompts_n, group, out_dir)
    del shared
    cost = measure_step_cost(recipe_path, steps, overrides)
    result = {
        "bench": "judge",
        "model": model,
        "agreement": agree,
        "step_cost": cost,
        "threads": torch.get_num_threads(),
        "machine": machine_description(),
        "out": str(out_dir),
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorarl.bench.judge", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipe", default=str(QUICKSTART))
    p.add_argument("--prompts", type=int, default=8, help="prompts sampled for the agreement part")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--steps", type=int, default=2, help="timed GRPO steps per reward setting (after 1 warm-up)")
    p.add_argument("--out", default="runs/bench_judge")
    a = p.parse_args(argv)
    result = run(Path(a.out), a.model, a.prompts, a.group, a.steps, a.recipe)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
