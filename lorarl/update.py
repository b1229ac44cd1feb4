"""One optimizer step over micro-batches, with gradient accumulation. Knows nothing of GRPO or PPO.

The caller passes a loss function that returns each micro-batch's *contribution* to the full-batch loss (e.g.
:func:`lorarl.core.losses.reduce_loss` with the whole batch's totals), so the accumulated gradient equals the gradient
of the full-batch loss without further scaling. A NaN or inf loss or gradient skips the step: gradients are
dropped, the weights and the optimizer state are not touched, and the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lorarl.core.stats import MeanAccumulator
from lorarl.errors import LorarlError
from lorarl.phases import phase

# A loss function: micro-batch -> (loss contribution, {stat name: (sum, count)}).
LossFn = Callable[[Any], tuple[Tensor, dict[str, tuple[float, float]]]]


@dataclass
class StepResult:
    """What one optimizer step did.

    loss:         sum of the micro-batch losses (= the full-batch loss); NaN/inf when non-finite.
    grad_norm:    total gradient norm before clipping (NaN when the step was skipped before backward finished).
    skipped:      True when a non-finite loss or gradient skipped the step (weights untouched).
    micro_batches: how many micro-batches ran.
    stats:        the loss function's stats, each ``sum / count`` over the micro-batches.
    lr:           learning rate used.
    held:         True when ``hold`` held the update back (PPO's approx-KL early stop; weights untouched).
    """

    loss: float
    grad_norm: float
    skipped: bool
    micro_batches: int
    stats: dict[str, float] = field(default_factory=dict)
    lr: float = 0.0
    held: bool = False


def micro_batches(n: int, size: int) -> Iterator[slice]:
    """Row slices ``[0, size), [size, 2 size), ...`` covering ``n`` rows."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    for s in range(0, n, size):
        yield slice(s, min(s + size, n))


def _grads_finite(params: list[Tensor]) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def optimizer_step(
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: LossFn,
    *,
    max_grad_norm: float | None = None,
    hold: Callable[[dict[str, float]], bool] | None = None,
) -> StepResult:
    """Accumulate gradients of ``loss_fn`` over ``batches`` (backward per micro-batch), then clip the total norm to
    ``max_grad_norm`` and take one optimizer step. LR schedules are stepped by the caller, once per RL step.

    A non-finite micro-batch loss stops the accumulation; a non-finite loss or gradient norm skips the optimizer
    step and returns ``skipped=True``. ``hold(stats)`` is asked with the batch's stats before the step: True holds
    the update back (``held=True``, weights and optimizer state untouched) -- PPO's early stop on the approx KL of
    the minibatch about to be applied.
    """
    optimizer.zero_grad(set_to_none=True)
    lr = float(optimizer.param_groups[0]["lr"])
    total_loss = 0.0
    acc = MeanAccumulator()
    n_micro = 0
    finite = True
    for batch in batches:
        loss, stats = loss_fn(batch)
        n_micro += 1
        value = float(loss.detach())
        total_loss += value
        for k, (s, c) in stats.items():
            acc.add(k, s, c)
        if not math.isfinite(value):
            finite = False
            break
        if loss.requires_grad:
            loss.backward()
    stats_out = acc.means()
    grad_norm = float("nan")
    if finite:
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        finite = math.isfinite(grad_norm) and _grads_finite(params)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total_loss, grad_norm, True, n_micro, stats_out, lr)
    if hold is not None and hold(stats_out):
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total_loss, grad_norm, False, n_micro, stats_out, lr, held=True)
    if max_grad_norm is not None and grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, torch.tensor(grad_norm))
    with phase("optimizer"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, False, n_micro, stats_out, lr)


def _is_oom(err: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(err, oom)) or "out of memory" in str(err).lower()


def optimizer_step_halving(
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    make_batches: Callable[[int], Iterable[Any]],
    micro_batch_size: int,
    loss_fn: LossFn,
    *,
    max_grad_norm: float | None = None,
    hold: Callable[[dict[str, float]], bool] | None = None,
    on_halve: Callable[[int, int], None] | None = None,
) -> tuple[StepResult, int]:
    """:func:`optimizer_step` over ``make_batches(micro_batch_size)`` (the micro-batches of one batch split into
    pieces of at most that many rows, e.g. ``lambda n: (rows[s] for s in micro_batches(len(rows), n))``); on an
    out-of-memory error in
    a micro-batch the partial gradients are dropped, the micro-batch size is halved and the whole step is redone
    (the loss contributions are normalised by the full batch, so the gradient does not depend on the split).

    Returns ``(result, micro_batch_size that worked)``; callers keep using the smaller size. Raises the OOM error
    when even one row per micro-batch does not fit.
    """
    size = max(1, int(micro_batch_size))
    while True:
        try:
            result = optimizer_step(
                params,
                optimizer,
                make_batches(size),
                loss_fn,
                max_grad_norm=max_grad_norm,
                hold=hold,
            )
            return result, size
        except (RuntimeError, MemoryError) as err:
            if not _is_oom(err) or size == 1:
                raise
            optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if on_halve is not None:
                on_halve(size, size // 2)
            size //= 2


@dataclass
class NonFiniteGuard:
    """Counts optimizer steps skipped for a NaN / inf loss or gradient and stops the run after ``max_in_row`` in a
    row (``train.max_nonfinite_in_row``). Its counters are part of a checkpoint (:meth:`state_dict`)."""

    max_in_row: int = 3
    skipped: int = 0
    in_row: int = 0

    def check(self, result: StepResult, step: int, who: str = "") -> bool:
        """Count ``result`` if it was skipped; raise LorarlError at ``max_in_row`` in a row. Returns skipped."""
        if not result.skipped:
            self.in_row = 0
            return False
        self.skipped += 1
        self.in_row += 1
        from tqdm.auto import tqdm

        tqdm.write(f"step {step}: non-finite {who + ' ' if who else ''}loss or gradient, update skipped")
        if self.in_row >= self.max_in_row:
            raise LorarlError(
                f"step {step}: {self.in_row} non-finite losses or gradients in a row "
                f"(train.max_nonfinite_in_row={self.max_in_row}); lower train.learning_rate or check the reward functions"
            )
        return True

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_row": self.in_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_row = int(state["skipped"]), int(state["in_row"])
