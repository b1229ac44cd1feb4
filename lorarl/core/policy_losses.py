"""Policy-gradient losses beside PPO's clipped surrogate (layer 0: torch only, no I/O): TRL 1.16's GRPO loss types
that change the per-token term, not only its reduction -- CISPO, SAPO and VESPO. The clipped surrogate and GSPO's
sequence ratio are :func:`lorarl.core.losses.ppo_clip_loss` / :func:`~lorarl.core.losses.gspo_clip_loss`; the
reductions (GRPO, DAPO, Dr. GRPO, BNPO, LUSPO) are :func:`lorarl.core.losses.reduce_loss`.

Conventions are :mod:`lorarl.core.losses`': ``logprobs`` (with gradient), ``old_logprobs``, ``mask`` ``[B, T]``,
``advantages`` ``[B]`` (one per sequence, broadcast) or ``[B, T]``; each returns ``(loss [B, T], stats)`` with the loss
0 outside the mask and the stats detached 0-d tensors. ``level`` is TRL's ``importance_sampling_level``: ``token``
ratios ``pi_theta / pi_old`` per token, or ``sequence`` (GSPO's geometric mean over the row's loss tokens, the same
on each of them).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lorarl.core.ops import bool_mask, masked_mean, zero_outside

__all__ = ["importance_log_ratio", "cispo_loss", "sapo_loss", "vespo_weights", "vespo_loss"]

Level = Literal["token", "sequence"]


def importance_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: Level = "token") -> Tensor:
    """``log(pi_theta / pi_old)`` per token (``token``), or GSPO's sequence log-ratio ``(1/|y_i|) sum_t m_it
    (logprobs_it - old_it)`` on each of the row's tokens (``sequence``); 0 outside the mask.

    Example: token log-ratios ``[[0.3, -0.1]]`` -> token ``[[0.3, -0.1]]``, sequence ``[[0.1, 0.1]]``."""
    m = bool_mask(mask, logprobs)
    log_ratio = zero_outside(logprobs - old_logprobs, m)  # [B, T]
    if level == "token":
        return log_ratio
    seq = log_ratio.sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    return zero_outside(torch.broadcast_to(seq, log_ratio.shape), m)


def _advantages(advantages: Tensor, like: Tensor, m: Tensor) -> Tensor:
    a = advantages.detach()
    a = a[:, None] if a.dim() == 1 else a
    return zero_outside(torch.broadcast_to(a, like.shape).to(like.dtype), m)


def _token_stats(logprobs: Tensor, old_logprobs: Tensor, m: Tensor) -> dict[str, Tensor]:
    """``approx_kl`` (token k3 of KL(pi_old || pi_theta), as :func:`~lorarl.core.losses.ppo_clip_loss`) and
    ``ratio_mean`` over the mask's tokens."""
    lr = zero_outside((logprobs - old_logprobs).detach(), m)
    return {"approx_kl": masked_mean(torch.expm1(lr) - lr, m), "ratio_mean": masked_mean(torch.exp(lr), m)}


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_max: float = 5.0,
    level: Level = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", Sec. 3.1;
    TRL's ``cispo``): the importance weight is clipped and detached, and every token keeps its gradient:

    ``loss_t = -sg(min(rho_t, eps_max)) A log pi_theta(y_t)``, gradient ``-min(rho_t, eps_max) A grad log pi_theta``,

    where PPO's clip zeroes the gradient of a token whose ratio left the trust region (often the rare "fork" tokens
    reasoning turns on). ``eps_max`` is an upper bound on the ratio itself, not ``1 + eps`` (ScaleRL, arXiv
    2510.13786, uses 5; TRL reads it from ``epsilon_high``); no lower bound, as in TRL.

    Stats: ``cispo_clip_ratio`` -- fraction of tokens (sequences at sequence level) with ``rho > eps_max`` and
    ``A > 0`` (TRL's metric), ``approx_kl``, ``ratio_mean``.

    Example: ``logprobs = log 0.5``, ``old = log 0.05`` (``rho = 10``), ``A = 1``, ``eps_max = 5``:
    ``loss = -5 log 0.5 = 3.46574``, gradient ``-5``.
    """
    m = bool_mask(mask, logprobs)
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, level)
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, max=eps_max)  # [B, T] detached
    adv = _advantages(advantages, logprobs, m)
    loss = zero_outside(-weight * adv * logprobs, m)
    with torch.no_grad():
        clipped = ((ratio > eps_max) & (adv > 0)).to(ratio.dtype)
        rows = m.any(dim=-1)
        clip = masked_mean(clipped.amax(dim=-1), rows) if level == "sequence" else masked_mean(clipped, m)
        stats = {"cispo_clip_ratio": clip, **_token_stats(logprobs, old_logprobs, m)}
    return loss, stats


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    level: Level = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO ("Soft Adaptive Policy Optimization", arXiv 2511.20347; TRL's ``sapo``): a smooth gate in place of the
    hard clip,

    ``loss_t = -(4 / tau) sigmoid(tau (rho_t - 1)) A``, ``tau = temperature_pos`` if ``A > 0`` else
    ``temperature_neg``,

    whose gradient ``-4 sigma (1 - sigma) rho A grad log pi`` is the policy gradient at ``rho = 1`` and fades
    smoothly as ``rho`` leaves 1 (faster for a larger ``tau``; the paper damps negative advantages a little more,
    ``1.05`` against ``1.0``).

    Stats: ``approx_kl``, ``ratio_mean`` (over tokens).

    Example: ``rho = 1``, ``A = 2``, ``tau = 1`` -> ``loss = -(4 / 1) 0.5 * 2 = -4``, gradient ``-2`` (the policy
    gradient ``-A``).
    """
    m = bool_mask(mask, logprobs)
    ratio = torch.exp(importance_log_ratio(logprobs, old_logprobs, mask, level))
    adv = _advantages(advantages, logprobs, m)
    tau = torch.where(adv > 0, temperature_pos, temperature_neg).to(ratio.dtype)
    loss = zero_outside(-torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv, m)
    with torch.no_grad():
        stats = _token_stats(logprobs, old_logprobs, m)
    return loss, stats


LOG_W_MIN = math.log(1e-8)  # VESPO's floor on log w (TRL's, after the reference implementation)


@torch.no_grad()
def vespo_weights(
    advantages: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    is_weights: Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> Tensor:
    """VESPO's gamma weight of each sequence (detached): with ``w`` the sequence importance weight
    ``exp(sum_t m_t clip(log rho_t, -20, 20))`` (times the sampler correction ``prod_t is_t`` when given, TIS's
    weights), ``log w`` clamped to ``[log 1e-8, 20]``:

    ``phi(w) = e^lambda w^k e^(-lambda w)`` (normalised so ``phi(1) = 1``), ``(k, lambda) = (k_pos, lambda_pos)`` if
    ``A >= 0`` else ``(k_neg, lambda_neg)``; non-finite values -> 0. It peaks at ``w = k / lambda`` and vanishes as
    ``w -> 0`` (power ``k``) or ``w -> inf`` (exponentially).

    Shapes: ``advantages`` ``[B]`` or ``[B, 1]``; ``log_ratio``, ``mask``, ``is_weights`` ``[B, T]`` -> ``[B]``.

    Example: ``sum_t log rho = log 0.5``, ``A = 1`` (k 2, lambda 3): ``e^3 0.25 e^-1.5 = 1.12042``.
    """
    m = bool_mask(mask, log_ratio)
    seq = zero_outside(torch.clamp(log_ratio, -20.0, 20.0), m).sum(dim=-1)  # [B]
    if is_weights is not None:
        log_is = torch.clamp(torch.log(is_weights), LOG_W_MIN, 20.0)
        seq = seq + zero_outside(log_is, m).sum(dim=-1)
    log_w = torch.clamp(seq, LOG_W_MIN, 20.0)
    a = advantages.reshape(-1)
    k = torch.where(a >= 0, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(a >= 0, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO ("Variational Sequence-Level Soft Policy Optimization", arXiv 2602.10693; TRL's ``vespo``): a smooth,
    asymmetric gamma weight of the sequence importance weight in place of clipping,

    ``loss_t = -phi(w_i) A_i log pi_theta(y_t)``, gradient ``-phi(w_i) A_i grad log pi_theta`` (:func:`vespo_weights`;
    ``phi`` detached). ``is_weights`` (TIS's truncated sampler ratios) enter ``w`` instead of multiplying the loss,
    as TRL does. The ratio is always per token inside ``w`` (TRL warns against ``importance_sampling_level``
    sequence; lorarl refuses it).

    Stats: ``phi_seq_mean`` (mean of ``phi`` over the rows with a loss token), ``approx_kl``, ``ratio_mean``.

    Example: one token, ``logprobs = old = log 0.5``, ``A = 1`` -> ``w = 1``, ``phi = 1``: ``loss = -log 0.5 =
    0.69315``.
    """
    m = bool_mask(mask, logprobs)
    log_ratio = zero_outside((logprobs - old_logprobs).detach(), m)
    phi = vespo_weights(advantages, log_ratio, mask, is_weights, k_pos, lambda_pos, k_neg, lambda_neg)  # [B]
    adv = _advantages(advantages, logprobs, m)
    loss = zero_outside(-phi[:, None].to(logprobs.dtype) * adv * logprobs, m)
    with torch.no_grad():
        stats = {"phi_seq_mean": masked_mean(phi, m.any(dim=-1)), **_token_stats(logprobs, old_logprobs, m)}
    return loss, stats
