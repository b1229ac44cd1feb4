"""Learning-rate schedules (a multiplier of the base LR per optimizer step)."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, kind: str, warmup_steps: int, total_steps: int) -> float:
    """The LR multiplier after ``step`` optimizer steps: linear warm-up ``(step + 1) / warmup_steps`` for
    ``step < warmup_steps``, then ``constant`` 1, ``linear`` ``1 - p`` or ``cosine`` ``(1 + cos(pi p)) / 2`` with
    ``p = (step - warmup) / (total - warmup)`` clamped to [0, 1] (so the LR reaches 0 at ``total_steps``).

    Example: cosine, warmup 0, total 4 -> 1, 0.854, 0.5, 0.146, 0 at steps 0..4.
    """
    total = max(total_steps, 1)
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(max(step - warmup_steps, 0) / max(total - warmup_steps, 1), 1.0)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr scheduler {kind!r}")


def make_scheduler(
    optimizer: torch.optim.Optimizer, kind: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with :func:`lr_factor`: one ``scheduler.step()`` per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, kind, warmup_steps, total_steps))


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One scheduler step (once per RL step, after its updates). A step whose updates were all skipped (no rows to
    learn from, a non-finite loss) still advances the schedule, which would make PyTorch warn that the scheduler
    stepped before the optimizer: that order is intended here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
