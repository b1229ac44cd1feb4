"""One optimizer step over micro-batches, with gradient accumulation. Knows nothing of GRPO or PPO.

The caller passes a loss function that returns each micro-batch's *contribution* to the full-batch loss (e.g.
:func:`lorarl.core.losses.reduce_loss` with the whole batch's totals), so the accumulated gradient equals the gradient
of the full-batch loss without further scaling. A NaN or inf loss or gradient skips the step: gradients are
dropped, the weights and the optimizer state are not touched, and the result says so.

**fp16 (dynamic loss scaling).** A base that computes in fp16 (GPUs without bf16: T4, RTX 20xx) trains with a
``torch.amp.GradScaler`` (:func:`loss_scaler`), with its semantics: each micro-batch's loss is multiplied by the
scale ``S`` before backward, so small activation gradients do not flush to 0 in fp16; the gradients of the (fp32)
LoRA parameters are divided by ``S`` before clipping; when they overflowed ``S`` halves, and ``S`` doubles after
``growth_interval`` steps in a row without overflow. Where a GradScaler loop skips the step, lorarl redoes the
step's backward passes at the halved scale (an RL step's rollout is too dear to throw away); only gradients that
overflow even at a scale below 1 skip the step, as non-finite (:class:`NonFiniteGuard`). The scaler's state is
saved with its optimizer's (:func:`attach_loss_scaler`), so a resumed run continues at the same scale.
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
from lorarl.model.precision import needs_loss_scaling
from lorarl.phases import phase
from lorarl.stepprogress import note_micro_batch

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
    overflow:     True when the skip was a loss-scaled fp16 gradient overflow (the scale was lowered).
    loss_scale:   the loss scale the step's backward ran at (None without loss scaling).
    overflows:    passes redone at a halved loss scale before this one (:func:`optimizer_step`).
    """

    loss: float
    grad_norm: float
    skipped: bool
    micro_batches: int
    stats: dict[str, float] = field(default_factory=dict)
    lr: float = 0.0
    held: bool = False
    overflow: bool = False
    loss_scale: float | None = None
    overflows: int = 0


SCALER_KEY = "lorarl_loss_scaler"  # where a loss scaler's state sits in its optimizer's state dict


def loss_scaler(compute_dtype: torch.dtype, device_type: str) -> torch.amp.GradScaler | None:
    """A ``torch.amp.GradScaler`` (its defaults: initial scale 2^16, x2 after 2000 clean steps, x0.5 on overflow)
    for a base computing in ``compute_dtype`` on ``device_type`` when it needs loss scaling (fp16), else None."""
    if not needs_loss_scaling(compute_dtype):
        return None
    return torch.amp.GradScaler(device_type)


def attach_loss_scaler(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    """Save ``scaler``'s state inside ``optimizer.state_dict()`` (key :data:`SCALER_KEY`) and restore it with
    ``optimizer.load_state_dict``, so checkpoints and resumes carry the loss scale with no other change."""

    def save(_opt, state: dict) -> dict:
        state[SCALER_KEY] = scaler.state_dict()
        return state

    def load(_opt, state: dict) -> dict:
        state = dict(state)
        saved = state.pop(SCALER_KEY, None)
        if saved is not None:
            scaler.load_state_dict(saved)
        return state

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load)


def micro_batches(n: int, size: int) -> Iterator[slice]:
    """Row slices ``[0, size), [size, 2 size), ...`` covering ``n`` rows (each one begun is reported to the running
    step's ``RUN/step.json``: :func:`lorarl.stepprogress.note_micro_batch`)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    total = -(-n // size)
    for i, s in enumerate(range(0, n, size), 1):
        note_micro_batch(i, total)
        yield slice(s, min(s + size, n))


def optimizer_step(
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: LossFn,
    *,
    scaler: torch.amp.GradScaler | None = None,
    **options: Any,
) -> StepResult:
    """:func:`one_pass` over ``batches`` (``options``: its ``max_grad_norm`` and ``hold``); with a ``scaler``, a pass
    whose gradients overflowed is redone at the halved scale (the batch is kept: an RL step's rollout is not wasted)
    until one fits or the scale falls below 1 (then the step is skipped as non-finite). ``overflows`` in the result
    counts the passes redone."""
    if scaler is None:
        return one_pass(params, optimizer, batches, loss_fn, **options)
    batches, overflows = list(batches), 0
    while True:
        result = one_pass(params, optimizer, batches, loss_fn, scaler=scaler, **options)
        if not (result.overflow and scaler.get_scale() >= 1.0):
            result.overflows = overflows
            return result
        overflows += 1


def one_pass(
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: LossFn,
    *,
    max_grad_norm: float | None = None,
    hold: Callable[[dict[str, float]], bool] | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    """Accumulate gradients of ``loss_fn`` over ``batches`` (backward per micro-batch), then clip the total norm to
    ``max_grad_norm`` and take one optimizer step. LR schedules are stepped by the caller, once per RL step.

    A non-finite micro-batch loss stops the accumulation; a non-finite loss or gradient norm skips the optimizer
    step and returns ``skipped=True``. ``hold(stats)`` is asked with the batch's stats before the step: True holds
    the update back (``held=True``, weights and optimizer state untouched) -- PPO's early stop on the approx KL of
    the minibatch about to be applied. ``scaler``: dynamic loss scaling for fp16 (the module doc); the gradient
    norm, clipping and the step then see the unscaled gradients.
    """
    optimizer.zero_grad(set_to_none=True)
    lr = float(optimizer.param_groups[0]["lr"])
    scale = float(scaler.get_scale()) if scaler is not None else None
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
            (scaler.scale(loss) if scaler is not None else loss).backward()
    stats_out = acc.means()
    grad_norm = float("nan")
    loss_finite, unscaled = finite, False
    if finite:
        if scaler is not None and any(p.grad is not None for p in params):
            scaler.unscale_(optimizer)  # grads / S, and records whether any overflowed
            unscaled = True
        grads = [p.grad for p in params if p.grad is not None]
        # a NaN or inf in any gradient makes the total 2-norm NaN or inf: the one host read checks them all (a
        # check per tensor cost 3 ops and a device sync per parameter: 420 syncs a step for SmolLM2's adapter)
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        finite = math.isfinite(grad_norm)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        if unscaled:
            scaler.update()  # an overflow: S halves
        overflow = scaler is not None and loss_finite
        return StepResult(total_loss, grad_norm, True, n_micro, stats_out, lr, overflow=overflow, loss_scale=scale)
    if hold is not None and hold(stats_out):
        optimizer.zero_grad(set_to_none=True)
        if unscaled:
            scaler.update()
        return StepResult(total_loss, grad_norm, False, n_micro, stats_out, lr, held=True, loss_scale=scale)
    if max_grad_norm is not None and grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, torch.tensor(grad_norm))
    with phase("optimizer"):
        if unscaled:
            scaler.step(optimizer)  # no overflow was found: steps
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, False, n_micro, stats_out, lr, loss_scale=scale)


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
    scaler: torch.amp.GradScaler | None = None,
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
                scaler=scaler,
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
    loss_scales: dict[str, float] = field(default_factory=dict)  # who -> the loss scale of its last update
    overflows: int = 0  # overflowed backward passes since the last :meth:`loss_scale_metrics`

    def check(self, result: StepResult, step: int, who: str = "") -> bool:
        """Count ``result`` if it was skipped; raise LorarlError at ``max_in_row`` in a row. Returns skipped.
        An fp16 overflow skip at a loss scale of 1 or more (a lone :func:`one_pass`; :func:`optimizer_step`
        retries those) is counted but never stops the run. A loss-scaled result's scale and overflowed passes
        (``overflows`` redone, plus 1 when it was itself skipped as an overflow) are kept for the metrics."""
        if result.loss_scale is not None:
            self.loss_scales[who] = float(result.loss_scale)
            self.overflows += result.overflows + int(result.overflow)
        if not result.skipped:
            self.in_row = 0
            return False
        self.skipped += 1
        if result.overflow and (result.loss_scale or 0.0) >= 1.0:
            return True
        self.in_row += 1
        from tqdm.auto import tqdm

        tqdm.write(f"step {step}: non-finite {who + ' ' if who else ''}loss or gradient, update skipped")
        if self.in_row >= self.max_in_row:
            raise LorarlError(
                f"step {step}: {self.in_row} non-finite losses or gradients in a row "
                f"(train.max_nonfinite_in_row={self.max_in_row}); lower train.learning_rate or check the reward functions"
            )
        return True

    def loss_scale_metrics(self) -> dict[str, float | int]:
        """The step's loss-scaling metrics, empty without a loss scaler (only fp16 bases have one):
        ``loss_scale`` (``<who>_loss_scale`` for a role checked under another name than "" or "policy", e.g. PPO's
        ``critic_loss_scale``), the scale of the last update's backward; ``loss_scale_overflows``, the backward
        passes that overflowed in fp16 since the previous call (each redone at half the scale, or skipped)."""
        if not self.loss_scales:
            return {}
        out: dict[str, float | int] = {
            ("loss_scale" if who in ("", "policy") else f"{who}_loss_scale"): scale
            for who, scale in self.loss_scales.items()
        }
        out["loss_scale_overflows"], self.overflows = self.overflows, 0
        return out

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_row": self.in_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_row = int(state["skipped"]), int(state["in_row"])
