"""Choosing sizes for a budget: the largest micro-batch whose training fits, then the largest generation batch.

A budget is in GB (10^9 bytes) of device memory and is checked against :func:`lorarl.plan.terms.total_bytes` of a
phase's predicted peak: ``peak (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES``.
"""

from __future__ import annotations

from typing import Any

from lorarl.plan.estimate import estimate_memory
from lorarl.plan.settings import PlanSettings, plan_settings
from lorarl.plan.terms import GB, total_bytes
from lorarl.shapes import ModelShape

TRAINING_PHASES = ("training", "critic_training", "optimizer", "reference")  # reference: DPO's, micro-batch sized


def _divisors_desc(n: int) -> list[int]:
    """The divisors of ``n``, largest first (so micro-batches split the rows into equal parts)."""
    return sorted({d for d in range(1, n + 1) if n % d == 0}, reverse=True)


def training_total_bytes(est: dict[str, Any]) -> int:
    """Device memory the training phases of an :func:`estimate_memory` result need (the largest of them)."""
    return total_bytes(max(v for k, v in est["phases"].items() if k in TRAINING_PHASES))


def largest_fitting_micro_batch(shape: ModelShape, s: PlanSettings, budget: float) -> tuple[int, list[list[float]]]:
    """``(micro-batch, tried)``: the largest divisor of the rows micro-batches split whose training phases fit
    ``budget`` bytes (1 when none fits), and each size tried with the GB it needs (``[[mb, GB], ...]``)."""
    tried: list[list[float]] = []
    for mb in _divisors_desc(s.split_rows):
        need = training_total_bytes(estimate_memory(shape, s, micro_batch_size=mb))
        tried.append([mb, round(need / GB, 3)])
        if need <= budget:
            return mb, tried
    return 1, tried


def largest_fitting_generation_batch(shape: ModelShape, s: PlanSettings, micro_batch: int, budget: float) -> int:
    """The largest divisor of the step's rows, at most ``s.generation_batch_size`` (all rows when None), whose
    generation and scoring phases fit ``budget`` bytes; the smallest divisor when none fits."""
    gen_b = s.generation_batch_size or s.rows
    for g in _divisors_desc(s.rows):
        if g > gen_b:
            continue
        est = estimate_memory(shape, s, micro_batch_size=micro_batch, generation_batch_size=g)
        gen_b = g
        if total_bytes(max(est["phases"].get("generation", 0), est["phases"].get("scoring", 0))) <= budget:
            break
    return gen_b


def budget_advice(est: dict[str, Any], budget_gb: float, micro_batch: int, generation_batch: int) -> list[str]:
    """What to change when ``est`` does not fit ``budget_gb`` (its largest phase and that phase's largest term),
    or a note when a chunk of logits is over a quarter of the training phase."""
    if est["peak_total_bytes"] > budget_gb * GB:
        worst = max(est["phases"], key=est["phases"].get)
        top = max(est["breakdown"][worst].items(), key=lambda kv: kv[1])
        return [
            f"does not fit {budget_gb:g} GB even at micro-batch {micro_batch} / generation batch {generation_batch}: "
            f"the {worst} phase needs {total_bytes(est['phases'][worst]) / GB:.2f} GB; its largest term is {top[0]} "
            f"({top[1] / GB:.2f} GB). Lower max_new_tokens, prompt length, model.logprob_chunk_tokens or the "
            "model size."
        ]
    if est["breakdown"]["training"].get("logits_chunk", 0) > 0.25 * est["phases"]["training"]:
        return ["logits dominate training memory: a smaller model.logprob_chunk_tokens saves memory"]
    return []


def pick_micro_batch(
    shape: ModelShape, budget_gb: float = 24.0, settings: PlanSettings | None = None, **overrides: Any
) -> dict[str, Any]:
    """The largest micro-batch (a divisor of the rows it splits, so micro-batches are equal) whose training
    phase fits ``budget_gb`` (10^9 bytes, with runtime overhead and slack); then, if generation does not fit
    with all rows at once, the largest generation batch (a divisor of the step's rows) that does.

    Returns ``{"micro_batch_size", "generation_batch_size", "fits", "estimate", "tried": [[mb, total GB], ...],
    "advice": [...]}``; ``fits`` is False (with the smallest sizes and advice) when nothing fits.
    """
    s = plan_settings(settings, **overrides)
    budget = budget_gb * GB
    chosen, tried = largest_fitting_micro_batch(shape, s, budget)
    gen_b = largest_fitting_generation_batch(shape, s, chosen, budget)
    est = estimate_memory(shape, s, micro_batch_size=chosen, generation_batch_size=gen_b)
    return {
        "micro_batch_size": chosen,
        "generation_batch_size": gen_b,
        "fits": est["peak_total_bytes"] <= budget,
        "estimate": est,
        "tried": tried,
        "advice": budget_advice(est, budget_gb, chosen, gen_b),
    }
