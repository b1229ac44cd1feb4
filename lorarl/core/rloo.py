"""RLOO's reward shaping, leave-one-out advantages and sequence-level loss (layer 0: torch + stdlib only, no I/O).

REINFORCE Leave-One-Out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs")
as TRL 1.16's ``RLOOTrainer`` computes it (trl/trainer/rloo_trainer.py, ``_generate_and_score_completions`` and
``_compute_loss``; tests/test_rloo_losses.py calls both on the same tensors):

* :func:`sequence_kl` -- ``KL_i = sum_t m_it (log pi_old - log pi_ref)``, the k1 estimate summed over the sequence;
* :func:`shaped_rewards` -- ``r'_i = clip(r_i, lo, hi) - beta KL_i``: TRL folds the KL penalty into the reward, so it
  never carries a gradient (GRPO's ``beta`` is a differentiable per-token k3 loss term instead);
* :func:`leave_one_out_advantages` -- ``A_i = r'_i - mean_{j != i} r'_j`` within a prompt's group, optionally
  normalised over the batch;
* :func:`rloo_sequence_loss` -- PPO's clipped surrogate on the ratio of whole-sequence probabilities
  ``pi_theta(o_i) / pi_old(o_i)``, one loss per sequence; the step's loss is their mean over the step's rows.

``mask`` is a bool or 0/1 float tensor ``[B, T]``, True where a token counts; entries outside it are never read.
Pure functions never modify their arguments. Everything but the loss is a training *target* and returned detached.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lorarl.core.advantages import check_groups, kl_penalized_reward
from lorarl.core.losses import ppo_clip_loss
from lorarl.core.ops import masked_mean, masked_sum

__all__ = ["sequence_kl", "shaped_rewards", "LeaveOneOut", "leave_one_out_advantages", "rloo_sequence_loss"]

NORMALIZE_EPS = 1e-4  # TRL's: (A - mean) / (std + 1e-4)


def sequence_kl(old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The sequence's KL estimate of RLOO (Ahmadian et al. 2024; TRL's RLOO): the first-order log-ratio of
    the policy that sampled (``pi_old``) to the reference, summed over the sequence's tokens,
    ``KL_i = sum_t m_it (old_logprobs_it - ref_logprobs_it)``. Per token it can be negative (k1, unlike GRPO's k3);
    its expectation over ``pi_old``'s samples is ``KL(pi_old || pi_ref)``.

    Shapes: ``old_logprobs``, ``ref_logprobs``, ``mask`` ``[B, T]`` -> ``[B]`` (detached).

    Example: ``old = [[-1.0, -2.0]]``, ``ref = [[-1.5, -1.0]]``, both tokens counted -> ``0.5 - 1.0 = -0.5``.
    """
    return masked_sum(old_logprobs.detach() - ref_logprobs.detach(), mask, dim=-1)


def shaped_rewards(
    rewards: Tensor, kl: Tensor | None = None, beta: float = 0.0, clip_range: list[float] | None = None
) -> Tensor:
    """The reward RLOO's baseline and advantage read (TRL 1.16's order): each reward clipped to ``clip_range``
    (``[lo, hi]``, TRL's ``reward_clip_range``; None: unclipped), then the KL penalty subtracted,
    ``r'_i = clip(r_i, lo, hi) - beta KL_i`` (:func:`~lorarl.core.advantages.kl_penalized_reward`; ``kl`` from
    :func:`sequence_kl`, None or ``beta == 0``: no penalty). A NaN reward (no reward function had a value for the
    row) stays NaN: :func:`leave_one_out_advantages` leaves it out.

    Shapes: ``rewards``, ``kl`` ``[N]`` -> ``[N]`` (detached).

    Example: ``r = [2.0, -3.0, nan]``, ``clip_range = [-1, 1]``, ``kl = [0.5, 1.0, 0.0]``, ``beta = 0.1`` ->
    ``[0.95, -1.1, nan]``.
    """
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if clip_range is not None:
        r = r.clamp(min=clip_range[0], max=clip_range[1])
    if kl is not None and beta != 0:
        r = kl_penalized_reward(r, kl.detach().to(r.dtype), beta)
    return r


class LeaveOneOut(NamedTuple):
    """Result of :func:`leave_one_out_advantages` (``N`` completions, ``G = group_size``, ``N / G`` prompts).

    advantages: ``[N]`` one advantage per completion (0 for a NaN reward and for a group with one valid reward).
    baselines:  ``[N]`` the mean of the group's other valid rewards (NaN where there is none).
    zero_std:   ``[N/G]`` bool, True where the group's valid rewards are all equal (fewer than two included):
                every advantage of the group is then 0 before normalisation (TRL's ``frac_reward_zero_std``).
    """

    advantages: Tensor
    baselines: Tensor
    zero_std: Tensor


def leave_one_out_advantages(rewards: Tensor, group_size: int, normalize: bool = False) -> LeaveOneOut:
    """RLOO's advantages (Kool et al. 2019; Ahmadian et al. 2024; TRL 1.16's ``RLOOTrainer``).

    The rewards are laid out group by group: completions ``[g*G, (g+1)*G)`` answer prompt ``g``. With ``V_g`` the
    group's valid (non-NaN) rewards and ``k = |V_g|``, completion ``i``'s baseline is the mean of the OTHER valid
    rewards of its group and its advantage the difference,

    ``b_i = (sum_{j in V_g} r_j - r_i) / (k - 1)``,   ``A_i = r_i - b_i = k / (k - 1) (r_i - mean(V_g))``.

    A NaN reward, and the one valid reward of a group with ``k = 1``, get advantage 0 (TRL's 0/0 and NaN, zeroed); a
    group whose valid rewards are all equal gets exactly 0 (TRL's division leaves float rounding there, ~1e-8).
    ``normalize`` (TRL's ``normalize_advantages``): ``A <- (A - mean(A)) / (std(A) + 1e-4)`` over the batch's
    advantages that are defined (the rows zeroed above left out of the mean and the unbiased std, and 0 after).

    Shapes: ``rewards`` ``[N]`` float; see :class:`LeaveOneOut` for the outputs.

    Examples: ``[1, 0, 0, 1]``, ``G = 4``: baselines ``[1/3, 2/3, 2/3, 1/3]`` -> ``[2/3, -2/3, -2/3, 2/3]``;
    a group of 2 ``[3, 1]`` -> each is the other's baseline: ``[2, -2]``; equal rewards -> all 0;
    ``[1, nan, 0, 0]`` -> baselines over the 3 valid: ``[0, nan, 0.5, 0.5]``, advantages ``[1, 0, -0.5, -0.5]``.

    Raises ``ValueError`` if ``rewards`` is not 1-D, ``group_size < 2`` or ``N % group_size != 0``.
    """
    n = check_groups(rewards, group_size)
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    grouped = r.reshape(n // group_size, group_size)  # [M, G]
    valid = ~torch.isnan(grouped)  # [M, G]
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    r0 = torch.where(valid, grouped, zero)
    k = valid.sum(dim=1, keepdim=True).to(r.dtype)  # [M, 1]
    others = torch.where(valid, r0.sum(dim=1, keepdim=True) - r0, zero)  # [M, G] sum of the other valid rewards
    defined = valid & (k > 1)  # [M, G] rows with a baseline
    baselines = torch.where(defined, others / (k - 1).clamp(min=1), torch.full_like(r0, float("nan")))
    hi = torch.where(valid, grouped, torch.full_like(r0, -float("inf"))).amax(dim=1)
    lo = torch.where(valid, grouped, torch.full_like(r0, float("inf"))).amin(dim=1)
    zero_std = ~(hi > lo)  # [M]
    # a group without a spread: exactly 0 (the division would leave rounding noise, e.g. 6e-8 for 0.7s in float32)
    adv = torch.where(defined & ~zero_std[:, None], grouped - baselines, zero).reshape(n)  # [N]
    keep = defined.reshape(n)
    if normalize and keep.any():
        a = adv[keep]
        std = a.std(unbiased=True) if a.numel() > 1 else torch.full((), float("nan"), dtype=r.dtype)
        adv = torch.where(keep, (adv - a.mean()) / (std + NORMALIZE_EPS), zero)
        adv = torch.nan_to_num(adv, nan=0.0)  # a single defined advantage: TRL's NaN std, zeroed
    return LeaveOneOut(advantages=adv, baselines=baselines.reshape(n), zero_std=zero_std)


def rloo_sequence_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO's per-sequence loss (Ahmadian et al. 2024, with PPO's clip for reused samples; TRL 1.16's
    ``RLOOTrainer._compute_loss``): the ratio of the whole sequence's probabilities,

    ``rho_i = exp(sum_t m_it (logprobs_it - old_logprobs_it)) = pi_theta(o_i) / pi_old(o_i)`` (a SUM of token
    log-ratios: GSPO's is their mean), ``loss_i = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)``.
    That is :func:`lorarl.core.losses.ppo_clip_loss` with one "token" per sequence, its log-ratio.

    The step's loss is the mean over its ``N`` rows, ``(1/N) sum_i loss_i`` (TRL: each micro-batch's mean, divided by
    the accumulation steps); on-policy (``rho = 1``) its gradient is REINFORCE's ``-(1/N) sum_i A_i grad log
    pi_theta(o_i)``, every token of a sequence weighted by the sequence's advantage (not by ``1 / |o_i|``). A row
    with no mask token has ``rho = 1`` and ``loss = -A`` with no gradient, as in TRL.

    Stats (detached 0-d tensors, means over the ``B`` sequences, TRL's ``clip_ratio/*``): ``clip_frac_low``
    (``rho < 1 - eps_low`` with ``A < 0``), ``clip_frac_high`` (``rho > 1 + eps_high`` with ``A > 0``),
    ``clip_frac_region`` (either), ``ratio_mean``; ``approx_kl``: the token-level k3 of ``KL(pi_old || pi_theta)``
    over the mask tokens (how far the policy moved).

    Shapes: ``logprobs`` (with gradient), ``old_logprobs``, ``mask`` ``[B, T]``; ``advantages`` ``[B]``. Returns
    ``(loss [B], stats)``.

    Example: token log-ratios ``[0.1, 0.2]`` -> ``rho = exp(0.3) = 1.3499``; ``A = 1``, ``eps = 0.2``: clipped at
    ``1.2``, ``loss = -1.2`` (zero gradient); with ``A = -1`` unclipped: ``loss = 1.3499``.
    """
    advantages = advantages.detach()
    if advantages.dim() != 1 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(f"RLOO needs one advantage per sequence [B], got shape {tuple(advantages.shape)}")
    m = mask if mask.dtype == torch.bool else mask != 0
    log_ratio = masked_sum(logprobs - old_logprobs, m, dim=-1)[:, None]  # [B, 1] log pi_theta(o) - log pi_old(o)
    # PPO's clip, one "token" per sequence: the sequence's log-ratio against a zero old log-prob
    seq = torch.ones_like(log_ratio, dtype=torch.bool)
    loss, clip = ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), advantages, seq, eps_low, eps_high)
    with torch.no_grad():
        lr_tok = (logprobs - old_logprobs).detach()
        stats = {
            "clip_frac_low": clip["clip_frac_low"],
            "clip_frac_high": clip["clip_frac_high"],
            "clip_frac_region": clip["clip_frac_low"] + clip["clip_frac_high"],  # disjoint: A < 0 vs A > 0
            "ratio_mean": clip["ratio_mean"],
            "approx_kl": masked_mean(torch.expm1(lr_tok) - lr_tok, m),  # per token, not per sequence
        }
    return loss[:, 0], stats
