"""KTO and its unpaired APO variant (layer 0: torch only, no I/O), by TRL's names (``KTOConfig.loss_type``).

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv:2402.01306) trains
on UNPAIRED rows: a prompt ``x``, one completion ``y`` and a label, desirable or undesirable. With ``pi`` the policy,
``ref`` the reference, ``log pi(y|x)`` the SUM of the completion tokens' log-probs and
``r = log pi(y|x) - log ref(y|x)`` a row's log-ratio:

* the reference point ``z0`` (Eq. 7's KL term) is estimated from MISMATCHED pairs: each prompt of the batch with
  another row's completion (TRL rotates the completions by one, :func:`mismatched_rows`), ``z0 = max(0,
  mean_i [log pi(y_{i-1}|x_i) - log ref(y_{i-1}|x_i)])``, without gradients (:func:`kl_estimate`);
* ``kto`` (Eq. 7/8): ``loss = w_d (1 - sigmoid(beta (r - z0)))`` for a desirable row,
  ``w_u (1 - sigmoid(beta (z0 - r)))`` for an undesirable one;
* ``apo_zero_unpaired`` (D'Oosterlinck et al. 2024, "Anchored Preference Optimization", arXiv:2408.06266, Eq. 7
  unpaired, TRL's): no reference point: ``w_d (1 - sigmoid(beta r))`` and ``w_u sigmoid(beta r)``;
* ``w_d`` / ``w_u`` are ``desirable_weight`` / ``undesirable_weight``; the batch loss is the MEAN over its rows
  (TRL's ``losses.nanmean()`` of the weighted losses: the weights scale, they do not renormalise). An algorithm that
  splits a batch into micro-batches divides each micro-batch's sum by the batch's row count.

The implicit reward of a row is ``beta * r`` (TRL logs its mean over the desirable rows as ``rewards/chosen``, over
the undesirable ones as ``rewards/rejected``). TRL 1.16 computes all of this inline in
``KTOTrainer._compute_loss``; tests/test_kto_losses.py calls that method on identical tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "KTOLossName",
    "KTO_LOSSES",
    "NEEDS_KL",
    "mismatched_rows",
    "kl_estimate",
    "kto_loss",
    "apo_zero_unpaired_loss",
    "unpaired_loss",
    "weight_ranges",
]

KTOLossName = Literal["kto", "apo_zero_unpaired"]
NEEDS_KL = ("kto",)  # the loss types that read the reference point z0 (TRL's calculate_KL)


def mismatched_rows(n: int) -> list[int]:
    """The completion each of ``n`` rows is paired with for the KL estimate: the batch's completions rotated by one,
    row ``i`` taking row ``i - 1``'s and row 0 the last one's (TRL's ``KL_completion_ids``:
    ``[c[-1]] + c[:-1]``). A batch of one row has no mismatched pair.

    Example: ``n = 4`` -> ``[3, 0, 1, 2]``."""
    if n < 2:
        raise ValueError(f"the KL estimate needs at least 2 rows in a batch, got {n}")
    return [n - 1, *range(n - 1)]


def kl_estimate(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point ``z0 = max(0, mean(log pi(y'|x) - log ref(y'|x)))`` over the mismatched pairs
    ``(x, y')``, detached (TRL: ``(KL_logps - ref_KL_logps).mean().detach()``, gathered, ``.clamp(min=0)``).

    Shapes: ``[N]``, ``[N]`` -> a scalar.

    Example: policy ``[-3, -5]``, reference ``[-4, -4]`` -> ``max(0, (1 - 1) / 2) = 0``; policy ``[-3, -3]`` ->
    ``1``; ``[-5, -5]`` -> ``0`` (clamped)."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    logratios: Tensor, desirable: Tensor, kl: Tensor, beta: float, desirable_weight: float, undesirable_weight: float
) -> Tensor:
    """KTO (Ethayarajh et al. 2024, Eq. 7/8): per row ``w_d (1 - sigmoid(beta (r - z0)))`` where ``desirable``,
    else ``w_u (1 - sigmoid(beta (z0 - r)))``.

    Shapes: ``logratios`` ``[B]`` (``r``), ``desirable`` ``[B]`` bool, ``kl`` a scalar (``z0``) -> ``[B]``.

    Example: ``r = [2, -1]``, desirable ``[True, False]``, ``z0 = 0.5``, beta 1, weights 1 and 2 ->
    ``[1 - sigmoid(1.5), 2 (1 - sigmoid(1.5))] = [0.18243, 0.36485]``."""
    value = torch.where(desirable, torch.sigmoid(beta * (logratios - kl)), torch.sigmoid(beta * (kl - logratios)))
    return _weighted(1.0 - value, desirable, desirable_weight, undesirable_weight)


def apo_zero_unpaired_loss(
    logratios: Tensor, desirable: Tensor, kl: Tensor, beta: float, desirable_weight: float, undesirable_weight: float
) -> Tensor:
    """APO-zero, unpaired (D'Oosterlinck et al. 2024, Eq. 7; TRL's ``apo_zero_unpaired``): per row
    ``w_d (1 - sigmoid(beta r))`` where ``desirable``, else ``w_u sigmoid(beta r)``; ``kl`` is not read (TRL
    computes no KL for it).

    Example: ``r = [2, -1]``, desirable ``[True, False]``, beta 1, weights 1 -> ``[1 - sigmoid(2), sigmoid(-1)] =
    [0.11920, 0.26894]``."""
    value = torch.where(desirable, 1.0 - torch.sigmoid(beta * logratios), torch.sigmoid(beta * logratios))
    return _weighted(value, desirable, desirable_weight, undesirable_weight)


def _weighted(losses: Tensor, desirable: Tensor, desirable_weight: float, undesirable_weight: float) -> Tensor:
    """Each row's loss times ``desirable_weight`` or ``undesirable_weight`` by its label."""
    w = torch.full_like(losses, undesirable_weight).masked_fill(desirable, desirable_weight)  # in the losses' dtype
    return losses * w


KTO_LOSSES: dict[str, Callable[..., Tensor]] = {"kto": kto_loss, "apo_zero_unpaired": apo_zero_unpaired_loss}


def unpaired_loss(
    loss_type: str,
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``loss_type``'s per-row losses and implicit rewards: ``(losses [B], rewards [B])``, ``rewards = beta *
    (log pi - log ref)`` detached. The batch loss is ``losses.mean()`` (TRL's); ``kl`` is ``z0``
    (:func:`kl_estimate`; pass 0 for ``apo_zero_unpaired``).

    Shapes: ``logps`` / ``ref_logps`` ``[B]`` summed completion log-probs, ``desirable`` ``[B]`` bool."""
    logratios = logps - ref_logps
    losses = KTO_LOSSES[loss_type](logratios, desirable, kl, beta, desirable_weight, undesirable_weight)
    return losses, beta * logratios.detach()


def weight_ranges(
    n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """The ranges of ``desirable_weight`` and of ``undesirable_weight`` that balance unequal counts (the paper's
    Eq. 8 guidance as TRL checks it: ``w_d n_d / (w_u n_u)`` in ``[1, 4/3]``); None when the counts are equal or
    either weight already lies in its range. Counted as TRL counts: ``n_d = max(desirable, 1)``, ``n_u = max(rows -
    n_d, 1)``.

    Example: 100 desirable, 300 undesirable, weights 1 and 1 -> ``((3.0, 3.99), (0.25, 0.33))``: raise
    ``desirable_weight`` to 3-3.99, OR lower ``undesirable_weight`` to 0.25-0.33."""
    n_d = max(n_desirable, 1)
    n_u = max(n_desirable + n_undesirable - n_d, 1)
    if n_d == n_u:
        return None
    d_range = (round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2))
    u_range = (round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2))
    if d_range[0] <= desirable_weight <= d_range[1] or u_range[0] <= undesirable_weight <= u_range[1]:
        return None
    return d_range, u_range
