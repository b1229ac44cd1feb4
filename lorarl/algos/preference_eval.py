"""What the offline preference algorithms (DPO, KTO) share around their own scoring: the stderr report of what a split
holds and left out, the final policy's save with its held-out results, and ``lorarl eval`` of a checkpoint as the
policy against the recipe's reference (adapters off, or ``model.init_adapter`` frozen) -- the held-out figures are
each algorithm's own, the greedy task evaluation (``<algo>.task_source``) the one every policy algorithm uses."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from lorarl.config import Recipe
from lorarl.errors import DataError
from lorarl.model import REFERENCE, SharedBase
from lorarl.runfiles import write_atomic

POLICY = "policy"


def report_split(line: str | None, skipped: list[tuple[int, str]]) -> None:
    """``data: <line>`` on stderr, then the first three rows left out (nothing when ``line`` is None)."""
    if line:
        print(f"data: {line}", file=sys.stderr)
        for _, why in skipped[:3]:
            print(f"data:   {why}", file=sys.stderr)


def save_policy(shared: SharedBase, run_dir, eval_result: dict | None) -> None:
    """The policy adapter at ``run_dir/policy`` and the held-out results (when any) in ``run_dir/eval.json``."""
    shared.save_adapter(POLICY, run_dir / POLICY)
    if eval_result:
        write_atomic(run_dir / "eval.json", json.dumps(eval_result, indent=2))


def evaluate_against_reference(
    recipe: Recipe,
    checkpoint: str,
    n: int | None,
    shared: SharedBase | None,
    *,
    needs_reference: bool,
    held_out: Callable[[SharedBase, str | None, Callable[[], str]], dict | None],
    what: str,
) -> dict:
    """``lorarl eval`` of ``checkpoint`` (``base``, a run directory, a checkpoint or an adapter folder) for a DPO or
    KTO recipe: ``held_out(shared, reference role or None, policy role loader) -> prefixed metrics`` (None: the
    recipe has no held-out ``what``), then with ``<algo>.task_source`` the greedy task evaluation
    (:func:`lorarl.evaluate.evaluate`: ``accuracy``, ``reward_mean``, ...), ``seconds``; written to the run's
    ``eval.json`` when ``checkpoint`` is a run's final policy."""
    from lorarl.evaluate import checkpoint_adapter, load_eval_adapter
    from lorarl.evaluate import evaluate as evaluate_task

    t0 = time.perf_counter()
    shared = shared or SharedBase.load(recipe.model)
    adapter = checkpoint_adapter(recipe, checkpoint)
    reference = None
    if needs_reference:
        reference = REFERENCE
        if recipe.model.init_adapter and not shared.has_adapter(REFERENCE):
            shared.add_adapter(REFERENCE, init_from=recipe.model.init_adapter, trainable=False)
    task_source = getattr(recipe, recipe.algo).task_source
    metrics = held_out(shared, reference, lambda: load_eval_adapter(shared, adapter))
    if metrics is None and not task_source:
        raise DataError(
            f"nothing to evaluate: set data.eval_source (held-out {what}) and / or {recipe.algo}.task_source"
        )
    out: dict = {"checkpoint": "base" if adapter is None else str(adapter), **(metrics or {})}
    if task_source:
        task = evaluate_task(recipe, checkpoint, n=n, shared=shared)
        out.update({k: v for k, v in task.items() if k not in ("checkpoint", "seconds")})
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if adapter is not None and adapter.name == POLICY and (adapter.parent / "recipe.yaml").is_file():
        write_atomic(adapter.parent / "eval.json", json.dumps(out, indent=2))  # a run's final policy
    return out
