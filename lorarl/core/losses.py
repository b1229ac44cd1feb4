"""Loss terms (layer 0: torch + stdlib only, no I/O).

Every loss here returns a PER-TOKEN (or per-pair) tensor; :func:`reduce_loss` is the only function that reduces,
so that one reduction mode is chosen once and applied the same way to every term.

``mask`` is a bool or 0/1 float tensor ``[B, T]``, True where a token counts. Entries outside the mask are never
read arithmetically (they may hold NaN/inf padding): the per-token loss is 0 there, and so is its gradient.
Pure functions never modify their arguments. Statistics are returned as detached 0-d tensors (no ``.item()``,
no device sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lorarl.core.ops import masked_mean, masked_sum

__all__ = [
    "ppo_clip_loss",
    "gspo_clip_loss",
    "tis_weights",
    "value_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_importance_weighted",
    "entropy_from_logits",
    "bradley_terry_loss",
    "LossReduction",
    "LOSS_REDUCTIONS",
    "reduce_loss",
]


def _bool(mask: Tensor, like: Tensor) -> Tensor:
    m = mask if mask.dtype == torch.bool else mask != 0
    return torch.broadcast_to(m, like.shape)


def _zero_outside(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", Eq. 7),
    with decoupled clip bounds ("clip-higher", Yu et al. 2025, DAPO, when ``eps_high > eps_low``).

    ``ratio_t = exp(logprobs_t - old_logprobs_t)``,
    ``loss_t = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)`` (a loss: minimise it).

    The clipped branch is the active one (and the gradient is 0) exactly when ``A > 0`` and
    ``ratio > 1 + eps_high``, or ``A < 0`` and ``ratio < 1 - eps_low``.

    Stats (detached 0-d tensors, means over the valid tokens):

    * ``clip_frac_low``:  fraction with ``ratio < 1 - eps_low`` and ``A < 0``,
    * ``clip_frac_high``: fraction with ``ratio > 1 + eps_high`` and ``A > 0``,
    * ``approx_kl``: mean of the k3 estimator of ``KL(pi_old || pi_theta)`` on tokens sampled from ``pi_old``,
      ``(ratio - 1) - log(ratio)`` (Schulman 2020, "Approximating KL Divergence"; always >= 0),
    * ``ratio_mean``: mean of ``ratio``.

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` ``[B, T]``; ``advantages`` ``[B, T]`` (per token, PPO/GAE)
    or ``[B]`` / ``[B, 1]`` (per sequence, GRPO; broadcast over ``T``); they are detached. Returns ``(loss [B, T], stats)``;
    ``loss`` is 0 outside the mask.

    Example (the seed's): ``logprobs - old_logprobs = 0.3`` -> ``ratio = 1.3499``; ``eps = 0.2``, ``A = 0.2``:
    unclipped ``0.270``, clipped ``1.2 * 0.2 = 0.24`` -> ``loss = -0.24`` (zero gradient).
    """
    advantages = advantages.detach()  # a target: never differentiated
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [B] -> [B, 1]
    m = _bool(mask, logprobs)  # [B, T]
    log_ratio = _zero_outside(logprobs - old_logprobs, m)  # [B, T]
    adv = _zero_outside(torch.broadcast_to(advantages, logprobs.shape).to(logprobs.dtype), m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    surr_unclipped = ratio * adv  # [B, T]
    surr_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # [B, T]
    loss = _zero_outside(-torch.minimum(surr_unclipped, surr_clipped), m)  # [B, T]

    with torch.no_grad():
        r = ratio.detach()
        a = adv.detach()
        clipped_low = (r < 1.0 - eps_low) & (a < 0)
        clipped_high = (r > 1.0 + eps_high) & (a > 0)
        stats = {
            "clip_frac_low": masked_mean(clipped_low.to(r.dtype), m),
            "clip_frac_high": masked_mean(clipped_high.to(r.dtype), m),
            "approx_kl": masked_mean((r - 1.0) - log_ratio.detach(), m),
            "ratio_mean": masked_mean(r, m),
        }
    return loss, stats


def gspo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token view of GSPO's sequence-level clipped surrogate (Zheng et al. 2025, "Group Sequence Policy
    Optimization", Eqs. 5-7; TRL ``importance_sampling_level="sequence"``).

    The importance ratio of sequence ``i`` is the geometric mean of its token ratios over its ``|y_i|`` loss tokens:
    ``s_i = exp((1/|y_i|) sum_t m_it (logprobs_it - old_logprobs_it))``, and
    ``loss_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)`` is clipped per sequence. The returned
    ``[B, T]`` tensor holds ``loss_i`` on each of the row's mask tokens (0 elsewhere), so a token mean within the
    row (``reduce_loss(..., "seq_mean_token_mean")``) gives ``(1/N) sum_i loss_i``, GSPO's objective, with the
    gradient ``-(s_i A_i / |y_i|) sum_t grad logprobs_it`` where unclipped (the paper's Eq. 10).

    Stats (detached 0-d tensors): ``clip_frac_low`` / ``clip_frac_high`` -- fraction of the rows with a mask token
    whose ``s_i < 1 - eps_low`` with ``A_i < 0`` / ``s_i > 1 + eps_high`` with ``A_i > 0`` (TRL counts sequences
    too); ``ratio_mean`` -- mean of ``s_i`` over those rows; ``approx_kl`` -- the token-level k3 of
    ``KL(pi_old || pi_theta)``, as :func:`ppo_clip_loss` (how far the policy moved, whatever the ratio's level).

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` ``[B, T]``; ``advantages`` ``[B]`` or ``[B, 1]`` (one per
    sequence: a per-token advantage has no sequence-level ratio). Returns ``(loss [B, T], stats)``.

    Example: token log-ratios ``[0.3, -0.1]`` (both in the mask) -> ``s = exp(0.1) = 1.10517``; ``A = 1``,
    ``eps_high = 0.05`` -> clipped at ``1.05``: ``loss = [[-1.05, -1.05]]`` (zero gradient).
    """
    advantages = advantages.detach()
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages[:, 0]
    if advantages.dim() != 1 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(
            f"sequence-level ratios need one advantage per sequence [B], got shape {tuple(advantages.shape)}"
        )
    m = _bool(mask, logprobs)  # [B, T]
    log_ratio = _zero_outside(logprobs - old_logprobs, m)  # [B, T]
    n_tok = m.sum(dim=-1)  # [B]
    seq_log_ratio = log_ratio.sum(dim=-1) / n_tok.clamp(min=1).to(logprobs.dtype)  # [B]
    s = torch.exp(seq_log_ratio)  # [B]
    adv = advantages.to(logprobs.dtype)  # [B]
    loss_seq = -torch.minimum(s * adv, torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high) * adv)  # [B]
    loss = _zero_outside(torch.broadcast_to(loss_seq[:, None], logprobs.shape), m)  # [B, T]

    with torch.no_grad():
        rows = n_tok > 0  # [B]
        r = s.detach()
        lr_tok = log_ratio.detach()
        stats = {
            "clip_frac_low": masked_mean(((r < 1.0 - eps_low) & (adv < 0)).to(r.dtype), rows),
            "clip_frac_high": masked_mean(((r > 1.0 + eps_high) & (adv > 0)).to(r.dtype), rows),
            "approx_kl": masked_mean(torch.expm1(lr_tok) - lr_tok, m),
            "ratio_mean": masked_mean(r, rows),
        }
    return loss, stats


def tis_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights for a sampler that differs from the trainer (Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's ``rollout_is: token``, TRL's
    ``vllm_importance_sampling_mode="token_truncate"`` with ``vllm_importance_sampling_clip_max``):

    ``w_t = min(exp(old_logprobs_t - sampler_logprobs_t), cap)``,

    ``old_logprobs`` the trainer's log-probs of the sampled tokens under the policy that sampled them,
    ``sampler_logprobs`` what the sampler (another kernel, precision or engine) drew them with. Multiplying the
    policy-gradient per-token loss by ``w`` makes the update's expectation over the sampler's tokens an expectation
    over the trainer's policy, with the variance bounded by ``cap``. Detached (a weight, never differentiated);
    1 outside the mask and where a log-prob is NaN (no correction, as TRL does).

    Shapes: all ``[B, T]`` -> ``[B, T]``.

    Example: ``old = [-1.0, -0.5]``, ``sampler = [-1.2, -2.0]``, ``cap = 2``: ``[exp(0.2), min(exp(1.5), 2)]``
    ``= [1.22140, 2.0]``.
    """
    m = _bool(mask, old_logprobs)
    diff = torch.nan_to_num(_zero_outside(old_logprobs.detach() - sampler_logprobs.detach(), m), nan=0.0)
    return torch.clamp(torch.exp(diff), max=cap)


# ---------------------------------------------------------------------------------------------------------------
# Critic
# ---------------------------------------------------------------------------------------------------------------


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = None,
    kind: Literal["mse", "huber"] = "mse",
    huber_delta: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token critic loss, optionally with PPO value clipping (the OpenAI baselines ``ppo2`` recipe; see
    Andrychowicz et al. 2021, "What Matters in On-Policy RL", Sec. 3.1).

    With ``l(x)`` the element loss of the error ``x = v - R``:

    * ``"mse"``: ``l(x) = 0.5 * x^2`` -- the 0.5 is *inside* this loss (as in the seed's
      ``L_value = 1/2 (V - R)^2``), so a value coefficient ``c_V`` multiplies ``0.5 * (V - R)^2``;
    * ``"huber"``: ``l(x) = 0.5 * x^2`` if ``|x| <= huber_delta`` else ``huber_delta * (|x| - 0.5 * huber_delta)``
      (``torch.nn.functional.huber_loss``; equal to the mse form for small errors).

    Without clipping, ``loss_t = l(v_t - R_t)``. With ``clip_range = c``:
    ``v_clip = old + clip(v - old, -c, c)`` and ``loss_t = max(l(v_t - R_t), l(v_clip_t - R_t))``.

    Stats: ``clip_frac`` -- fraction of valid tokens where the clipped term is strictly larger (active);
    0 without clipping. A detached 0-d tensor.

    Shapes: ``values``, ``old_values``, ``returns``, ``mask`` ``[B, T]``; returns ``(loss [B, T], stats)``; ``loss``
    is 0 outside the mask.

    Example (mse, ``c = 0.2``): ``v = 1.0``, ``old = 0.5``, ``R = 1.2`` -> unclipped ``0.5 * 0.04 = 0.02``,
    ``v_clip = 0.7``, clipped ``0.5 * 0.25 = 0.125`` -> ``loss = 0.125`` (clipped branch active).
    """
    if kind not in ("mse", "huber"):
        raise ValueError(f"kind must be 'mse' or 'huber', got {kind!r}")
    m = _bool(mask, values)
    v = _zero_outside(values, m)
    old = _zero_outside(old_values.to(values.dtype), m)
    ret = _zero_outside(returns.to(values.dtype), m)

    def element_loss(pred: Tensor) -> Tensor:
        if kind == "mse":
            return 0.5 * (pred - ret) ** 2
        return F.huber_loss(pred, ret, reduction="none", delta=huber_delta)

    unclipped = element_loss(v)  # [B, T]
    if clip_range is None:
        loss = unclipped
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clip = old + torch.clamp(v - old, -clip_range, clip_range)  # [B, T]
        clipped = element_loss(v_clip)  # [B, T]
        loss = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).detach().to(values.dtype), m)
    return _zero_outside(loss, m), {"clip_frac": clip_frac}


# ---------------------------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020, "Approximating KL Divergence"), per token, for KL(pi_theta || pi_ref)
# on tokens sampled from pi_theta.
# ---------------------------------------------------------------------------------------------------------------


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator of ``KL(pi || pi_ref)``: ``k1 = log pi(x) - log pi_ref(x)``, ``x ~ pi`` (Schulman 2020).

    Unbiased, but high variance and negative on some samples. Shapes: any, e.g. ``[B, T]`` -> ``[B, T]``.

    Example: ``kl_k1(tensor(-1.0), tensor(-1.5))`` -> ``0.5``.
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator: ``k2 = 0.5 * (log pi(x) - log pi_ref(x))^2``, ``x ~ pi`` (Schulman 2020).

    Biased (low bias when the distributions are close), always >= 0, low variance. Shapes: any -> same.

    Example: ``kl_k2(tensor(-1.0), tensor(-1.5))`` -> ``0.125``.
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator (Schulman 2020; the GRPO KL term, Shao et al. 2024 Eq. 4), with ``d = log pi_ref(x) - log pi(x)``:
    ``k3 = exp(d) - d - 1 = pi_ref/pi - log(pi_ref/pi) - 1``, ``x ~ pi``.

    Unbiased for ``KL(pi || pi_ref)`` (``E_pi[pi_ref/pi] = 1``), always >= 0 (``e^d >= 1 + d``), and of lower
    variance than k1 when the distributions are close. Computed as ``expm1(d) - d`` (no cancellation for small
    ``d``) and clamped at 0 against rounding. Not clamped above: ``d`` above ~88 overflows float32.

    Shapes: any, e.g. ``[B, T]`` -> ``[B, T]``.

    Example: ``kl_k3(tensor(-1.0), tensor(-1.5))``: ``d = -0.5`` -> ``e^-0.5 + 0.5 - 1 = 0.10653``.
    """
    d = ref_logprobs - logprobs
    return torch.clamp(torch.expm1(d) - d, min=0.0)


def kl_k3_importance_weighted(logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """Importance-weighted k3 -- the unbiased KL estimate of DeepSeek-V3.2 (DeepSeek-AI 2025, Sec. "Unbiased KL
    Estimate"), for tokens sampled from the *old* (rollout) policy:

    ``rho = pi_theta(x) / pi_old(x) = exp(logprobs - old_logprobs)``, ``kl = rho * k3(logprobs, ref_logprobs)``,
    ``x ~ pi_old``.

    Value: ``E_{x~pi_old}[rho * k3] = E_{x~pi_theta}[k3] = KL(pi_theta || pi_ref)``, where plain k3 on samples from
    ``pi_old`` estimates a KL of the wrong distribution once ``pi_theta`` has moved.

    Why ``rho`` is NOT detached: the loss must have the gradient of ``KL(pi_theta || pi_ref)`` w.r.t. theta. Because
    ``sum_x pi_theta(x) k3(x) = KL(pi_theta || pi_ref)`` for every theta,
    ``grad E_old[rho k3] = E_old[rho (k3 * grad log pi_theta + grad k3)] = grad KL(pi_theta || pi_ref)``. The first
    term (a score-function term) only exists because ``rho`` is differentiated -- even on the first step, where
    ``rho == 1`` in value but ``grad rho = grad log pi_theta``. Detaching ``rho`` leaves
    ``E_theta[grad k3] = -E_ref[grad log pi_theta]``, the gradient of the *reverse* ``KL(pi_ref || pi_theta)``.

    Shapes: all ``[B, T]`` (any, broadcastable) -> ``[B, T]``.

    Example: ``logprobs = -1.0``, ``ref = -1.5``, ``old = -1.2``: ``rho = e^0.2 = 1.22140``,
    ``k3 = 0.10653`` -> ``0.13012``.
    """
    return torch.exp(logprobs - old_logprobs) * kl_k3(logprobs, ref_logprobs)


# ---------------------------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Shannon entropy of the categorical distribution ``softmax(logits)`` over the last dimension:
    ``H = -sum_v p_v log p_v``, ``p = softmax(logits)``, ``log p = log_softmax(logits)``.

    ``-inf`` logits (banned tokens) contribute 0 with a finite gradient (``log p`` is clamped at the dtype's most
    negative finite value, as ``torch.distributions.Categorical.entropy`` does). Materialises ``[..., V]``
    temporaries: call it on chunks of positions for large vocabularies.

    Shapes: ``logits`` ``[..., V]`` (e.g. ``[B, T, V]``) -> ``[...]`` (``[B, T]``).

    Example: ``entropy_from_logits(zeros(4))`` -> ``log 4 = 1.3863``.
    """
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """:func:`entropy_from_logits` from ``logp = log_softmax(logits)`` already computed: ``H = -sum_v p_v log p_v``
    with ``log p`` clamped at the dtype's most negative finite value, so ``-inf`` entries contribute 0 (not NaN).

    Example: ``entropy_from_logprobs(log_softmax(tensor([0., -inf])))`` -> ``0.0``.
    """
    logp = torch.clamp(logp, min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------------------------


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> Tensor:
    """Per-pair Bradley-Terry reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022, InstructGPT Eq. 1), with
    an optional margin (Touvron et al. 2023, Llama 2, Eq. 2) and reward centring (Eisenstein et al. 2023):

    ``loss_i = -log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2``.

    ``d loss / d r_c = -(1 - sigmoid(r_c - r_r - margin)) + 2 * center_coef * (r_c + r_r)``.

    Shapes: ``chosen_scores``, ``rejected_scores`` ``[B]``, ``margin`` ``[B]`` or ``None`` -> ``[B]``.

    Example: ``r_c = 1``, ``r_r = 0`` -> ``-log sigmoid(1) = 0.31326``.
    """
    diff = chosen_scores - rejected_scores  # [B]
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen_scores + rejected_scores) ** 2
    return loss


# ---------------------------------------------------------------------------------------------------------------
# The one reduction
# ---------------------------------------------------------------------------------------------------------------

LossReduction = Literal[
    "seq_mean_token_mean", "token_mean", "seq_sum_norm", "seq_mean_token_sum", "micro_batch_token_mean"
]


def _seq_mean_token_mean(
    per_token: Tensor, mask: Tensor, *, total_rows: int, total_sequences: int, total_tokens: float, max_len: int
) -> Tensor:
    """GRPO (Shao et al. 2024, Eq. 3): ``(1/N) sum_i (1/|o_i|) sum_t l_{i,t}``; ``N = total_sequences``."""
    return masked_mean(per_token, mask, dim=-1).sum() / total_sequences


def _token_mean(
    per_token: Tensor, mask: Tensor, *, total_rows: int, total_sequences: int, total_tokens: float, max_len: int
) -> Tensor:
    """DAPO (Yu et al. 2025, token-level loss): ``sum_{i,t} l_{i,t} / total_tokens``."""
    return masked_sum(per_token, mask) / total_tokens


def _seq_sum_norm(
    per_token: Tensor, mask: Tensor, *, total_rows: int, total_sequences: int, total_tokens: float, max_len: int
) -> Tensor:
    """Dr. GRPO (Liu et al. 2025; TRL's ``dr_grpo``): ``sum_{i,t} l_{i,t} / (total_rows * max_len)``, the same
    normaliser every step: ``total_rows`` counts every row of the batch, masked or not."""
    return masked_sum(per_token, mask) / (total_rows * max_len)


def _seq_mean_token_sum(
    per_token: Tensor, mask: Tensor, *, total_rows: int, total_sequences: int, total_tokens: float, max_len: int
) -> Tensor:
    """LUSPO ("Length-Unbiased Sequence Policy Optimization", arXiv 2602.05261; TRL's ``luspo``, verl's ``seq-mean-token-sum``): ``sum_{i,t} l_{i,t} / total_rows``,
    each sequence's loss summed over its tokens (scaled by its length), averaged over every row."""
    return masked_sum(per_token, mask) / total_rows


def _micro_batch_token_mean(
    per_token: Tensor, mask: Tensor, *, total_rows: int, total_sequences: int, total_tokens: float, max_len: int
) -> Tensor:
    """BNPO (TRL's ``bnpo``): the token mean of THIS micro-batch, weighted by its share of the batch's rows:
    ``(sum_{i,t} l_{i,t} / max(1, sum m)) * rows / total_rows`` (TRL: each micro-batch's token mean / the
    accumulation steps, equal when the micro-batches have one size)."""
    return masked_sum(per_token, mask) / mask.sum().clamp(min=1) * (mask.shape[0] / total_rows)


LOSS_REDUCTIONS: dict[str, Callable[..., Tensor]] = {
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_mean": _token_mean,
    "seq_sum_norm": _seq_sum_norm,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "micro_batch_token_mean": _micro_batch_token_mean,
}


def batch_totals(mask: Tensor) -> dict[str, int]:
    """The ``total_*`` keywords of :func:`reduce_loss` for a whole batch ``mask`` ``[N, T]``: ``total_rows`` (``N``,
    every row: Dr. GRPO's constant normaliser), ``total_sequences`` (the rows that contribute at least one token)
    and ``total_tokens``. A row with no valid token (e.g. a truncated row under DAPO's overlong filtering) is not a
    sequence of the GRPO mean: counting it would shrink every other row's weight. All are at least 1 (a batch with
    nothing to learn gives a zero loss, not a division by zero).

    Example: mask ``[[1, 1], [0, 0], [1, 0]]`` -> ``{total_rows: 3, total_sequences: 2, total_tokens: 3}``.
    """
    m = mask.bool()
    return {
        "total_rows": max(m.shape[0], 1),
        "total_sequences": max(int(m.any(dim=-1).sum()), 1),
        "total_tokens": max(int(m.sum()), 1),
    }


def reduce_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: LossReduction,
    *,
    total_rows: int,
    total_sequences: int,
    total_tokens: float | Tensor,
    max_len: int,
) -> Tensor:
    """This micro-batch's contribution to the full-batch loss (a 0-d tensor).

    ``total_*`` describe the WHOLE batch the optimizer step is for, not this micro-batch, so that summing
    ``reduce_loss`` over the micro-batches of a batch gives exactly ``reduce_loss`` of the whole batch -- values and
    gradients alike (gradient accumulation needs no further scaling). With ``l`` the per-token loss, ``m`` the mask:

    * ``"seq_mean_token_mean"`` (GRPO, Shao et al. 2024 Eq. 3):
      ``sum_{rows i} [sum_t m_it l_it / max(1, sum_t m_it)] / total_sequences``;
    * ``"token_mean"`` (DAPO, Yu et al. 2025): ``sum_{i,t} m_it l_it / total_tokens``;
    * ``"seq_sum_norm"`` (Dr. GRPO, Liu et al. 2025; TRL's ``dr_grpo``): ``sum_{i,t} m_it l_it / (total_rows *
      max_len)``, ``max_len`` a constant (``max_new_tokens``), not this batch's longest row, and ``total_rows`` every
      row of the batch, those with no valid token included (a truncated row under ``mask_truncated``): the
      normaliser is the same every step, as Dr. GRPO asks. TRL 1.16 divides each micro-batch by its own rows x
      ``max_completion_length`` x the accumulation steps; that equals this when the micro-batches are of one size
      (lorarl's uneven last micro-batch is weighted by its rows, TRL's as a whole micro-batch);
    * ``"seq_mean_token_sum"`` (LUSPO; TRL's ``luspo``): ``sum_{i,t} m_it l_it / total_rows``;
    * ``"micro_batch_token_mean"`` (TRL's ``bnpo``): this micro-batch's own token mean x its rows / ``total_rows``
      -- the one reduction that depends on how the batch is split (as TRL's ``bnpo`` does).

    ``total_rows``: rows of the whole batch; ``total_sequences``: those with at least one valid token;
    ``total_tokens``: valid tokens in the whole batch (``mask.sum()``) -- :func:`batch_totals` computes all three;
    ``max_len``: the constant of ``seq_sum_norm``. All are required whatever the mode, so a caller computes them
    once per batch and switches modes without other changes.

    Shapes: ``per_token``, ``mask`` ``[B, T]`` -> ``[]``.

    Example: ``l = [[1, 3], [5, 0], [7, 7]]``, ``m = [[1, 1], [1, 0], [0, 0]]``, one micro-batch = the batch
    (``total_rows=3, total_sequences=2, total_tokens=3, max_len=4``): ``(2 + 5)/2 = 3.5``; ``9/3 = 3``;
    ``9/(3*4) = 0.75``; ``9/3 = 3``; ``9/3 * 3/3 = 3``.
    """
    try:
        reduction = LOSS_REDUCTIONS[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {tuple(LOSS_REDUCTIONS)}, got {mode!r}") from None
    if min(total_rows, total_sequences, max_len) <= 0:
        got = f"{total_rows}, {total_sequences}, {max_len}"
        raise ValueError(f"total_rows, total_sequences and max_len must be > 0, got {got}")
    if not isinstance(total_tokens, Tensor) and total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    return reduction(
        per_token,
        mask,
        total_rows=total_rows,
        total_sequences=total_sequences,
        total_tokens=total_tokens,
        max_len=max_len,
    )
