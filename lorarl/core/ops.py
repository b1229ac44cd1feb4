"""Masked tensor statistics (layer 0: torch + stdlib only, no I/O).

Conventions used across lorarl:

* ``mask`` is a bool or 0/1 float tensor, usually ``[B, T]``, True (1) where a token counts.
  It must broadcast to ``x``. Only *whether* an entry is set matters: a float mask is read as ``mask != 0``,
  never as a weight.
* Entries outside the mask are never read arithmetically: they may hold NaN or +-inf (padding) without
  poisoning the result or its gradient (selection is done with ``torch.where``, not by multiplying with the mask).
* Pure functions: arguments are never modified; results are new tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bool_mask", "zero_outside", "masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def bool_mask(mask: Tensor, x: Tensor) -> Tensor:
    """``mask`` as a bool tensor broadcast to the shape of ``x``."""
    m = mask if mask.dtype == torch.bool else mask != 0
    return torch.broadcast_to(m, x.shape)


def zero_outside(x: Tensor, m: Tensor) -> Tensor:
    """``x`` with entries outside the bool mask ``m`` replaced by 0 (gradient 0 there, even for NaN/inf)."""
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of the entries of ``x`` where ``mask`` is set.

    Formula: ``S = sum_i x_i * 1[mask_i]``, over all entries (``dim=None``, returns a 0-d tensor) or along ``dim``.

    Shapes: ``x`` ``[B, T]`` (any shape), ``mask`` broadcastable to ``x``; result ``[]`` for ``dim=None``,
    else ``x``'s shape with ``dim`` reduced (e.g. ``[B]`` for ``dim=-1``). An empty mask gives 0.

    Example: ``masked_sum(tensor([[1., 2., 9.]]), tensor([[1, 1, 0]]))`` -> ``tensor(3.)``.
    """
    selected = zero_outside(x, bool_mask(mask, x))
    if dim is None:
        return selected.sum()
    return selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of the entries of ``x`` where ``mask`` is set.

    Formula: ``mean = sum_i x_i 1[mask_i] / max(1, sum_i 1[mask_i])`` -- so an empty mask (or an empty row when
    ``dim`` is given) yields 0, never NaN.

    Shapes: ``x`` ``[B, T]``, ``mask`` broadcastable to ``x``; result ``[]`` for ``dim=None``, else ``x``'s shape
    with ``dim`` reduced (``[B]`` for ``dim=-1``: one mean per sequence).

    Example: ``masked_mean(tensor([[1., 3., 9.]]), tensor([[True, True, False]]))`` -> ``tensor(2.)``.
    """
    m = bool_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim=dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the entries of ``x`` where ``mask`` is set (over all masked entries, a 0-d tensor).

    Formula, with ``n = sum_i 1[mask_i]`` and ``mu = masked_mean(x, mask)``:
    ``var = sum_i 1[mask_i] (x_i - mu)^2 / (n - 1)`` if ``unbiased`` (Bessel's correction) else ``/ n``.

    Degenerate cases return 0 instead of NaN: an empty mask, and ``n == 1`` with ``unbiased=True``.

    Shapes: ``x`` ``[B, T]``, ``mask`` broadcastable to ``x``; result ``[]``.

    Example: ``masked_var(tensor([1., 2., 3., 100.]), tensor([1, 1, 1, 0]))`` -> ``tensor(1.)``
    (``2/3`` with ``unbiased=False``).
    """
    m = bool_mask(mask, x)
    x = zero_outside(x, m)  # padding may hold NaN/inf: keep it out of the graph
    n = m.sum().to(x.dtype)
    mu = masked_mean(x, m)
    sq = masked_sum((x - mu) ** 2, m)
    denom = (n - 1.0) if unbiased else n
    return sq / denom.clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the statistics of its masked entries (e.g. PPO advantage normalisation).

    Formula, with ``mu = masked_mean(x, mask)`` and ``var = masked_var(x, mask, unbiased=True)``:
    ``y = (x - mu) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back,
    ``y = (x - mu) / sqrt(var + eps) + mu`` (scale only; used for rewards/values in InstructGPT-style PPO).

    Entries outside the mask are set to 0 in the result. The statistics use the *unbiased* variance (as TRL's
    ``masked_whiten``).

    Shapes: ``x`` ``[B, T]``, ``mask`` broadcastable to ``x``; result same shape as ``x``.

    Example: ``masked_whiten(tensor([1., 3.]), tensor([1, 1]))`` -> ``~tensor([-0.7071, 0.7071])``
    (mean 2, unbiased var 2).
    """
    m = bool_mask(mask, x)
    x = zero_outside(x, m)  # padding may hold NaN/inf: keep it out of the graph
    mu = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    y = (x - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mu
    return zero_outside(y, m)
