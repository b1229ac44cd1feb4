"""GRPO's per-token loss (step 5 of :mod:`lorarl.algos.grpo`, before the one reduction): the policy-gradient term
``grpo.policy_loss`` chosen once from a registry (PPO's clip -- GSPO's at sequence level --, CISPO, SAPO, VESPO), TIS's
weights, the KL term to the reference, and their statistics by TRL's names."""

from __future__ import annotations

import functools

import torch

from lorarl.config import GRPOConfig
from lorarl.core.losses import (
    gspo_clip_loss,
    kl_k3,
    kl_k3_importance_weighted,
    ppo_clip_loss,
    tis_weights,
)
from lorarl.core.policy_losses import cispo_loss, sapo_loss, vespo_loss

# the clipped policy-gradient term per importance-sampling level (grpo.importance_sampling_level)
POLICY_LOSSES = {"token": ppo_clip_loss, "sequence": gspo_clip_loss}
# at sequence level: means over sequences (TRL); phi_seq_mean is one per sequence at any level
SEQUENCE_STATS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "cispo_clip_ratio")
PER_SEQUENCE_STATS = ("phi_seq_mean",)
# grpo.policy_loss -> its function with the recipe's settings bound: fn(logprobs, old, advantages, mask)
POLICY_TERMS = {
    "clip": lambda c: functools.partial(
        POLICY_LOSSES[c.importance_sampling_level], eps_low=c.clip_eps_low, eps_high=c.clip_eps_high
    ),
    "cispo": lambda c: functools.partial(cispo_loss, eps_max=c.cispo_eps_max, level=c.importance_sampling_level),
    "sapo": lambda c: functools.partial(
        sapo_loss,
        temperature_pos=c.sapo_temperature_pos,
        temperature_neg=c.sapo_temperature_neg,
        level=c.importance_sampling_level,
    ),
    "vespo": lambda c: functools.partial(
        vespo_loss,
        k_pos=c.vespo_k_pos,
        lambda_pos=c.vespo_lambda_pos,
        k_neg=c.vespo_k_neg,
        lambda_neg=c.vespo_lambda_neg,
    ),
}
IS_WEIGHTS_INSIDE = ("vespo",)  # take TIS's weights inside the loss (in its sequence weight), not as a multiplier
POLICY_METRICS = {"cispo_clip_ratio": "cispo_clip_ratio", "phi_seq_mean": "vespo/phi_seq_mean"}  # TRL's names


def policy_term(cfg: GRPOConfig):
    """The policy-gradient term ``grpo.policy_loss`` with its settings bound (chosen once at set-up):
    ``fn(logprobs, old_logprobs, advantages, mask) -> (loss [B, T], stats)`` (:mod:`lorarl.core.losses`,
    :mod:`lorarl.core.policy_losses`)."""
    return POLICY_TERMS[cfg.policy_loss](cfg)


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Step 5's per-token GRPO loss ``[B, T]`` (before the one reduction) from log-probs, and its stats:

    ``l_t = w_t pg_t + kl_coef * KL_t`` (the entropy bonus is not a per-token term here: :func:`grpo_loss`
    subtracts ``entropy_coef`` x the token mean of ``H``, as TRL does), ``pg_t`` the policy term of
    ``grpo.policy_loss`` (:func:`policy_term`): by default PPO's ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``
    with ``rho`` the token ratio ``pi_theta / pi_old`` (``importance_sampling_level: token``,
    :func:`~lorarl.core.losses.ppo_clip_loss`) or GSPO's sequence ratio ``exp(mean_t log(pi_theta / pi_old))``
    (``sequence``, :func:`~lorarl.core.losses.gspo_clip_loss`); CISPO / SAPO / VESPO's
    (:mod:`lorarl.core.policy_losses`). ``w_t = min(exp(old_t - sampler_t), tis_cap)`` when ``sampler_logprobs`` is
    given (TIS, :func:`~lorarl.core.losses.tis_weights`), else 1 -- VESPO takes it inside its sequence weight
    instead, as TRL; ``KL_t`` the k3 estimate (or k3 weighted by the token ratio, ``kl.estimator: k3_unbiased``)
    when ``ref_logprobs`` is given; ``H_t`` the entropy (its stats only). As TRL's ``_compute_loss``, the TIS weight
    multiplies the policy-gradient term only.

    Shapes: ``logprobs`` (with gradient), ``old_logprobs``, ``mask``, ``entropy``, ``ref_logprobs``,
    ``sampler_logprobs`` ``[B, T]``; ``advantages`` ``[B]``. Stats: ``{name: (sum, count)}`` over tokens (over
    sequences for the ratio stats at sequence level).
    """
    m = mask.bool()
    n_tok, n_seq = float(m.sum()), float(m.any(dim=-1).sum())
    term = policy_term(cfg)
    w = None if sampler_logprobs is None else tis_weights(old_logprobs, sampler_logprobs, mask, tis_cap)  # [B, T]
    if w is not None and cfg.policy_loss in IS_WEIGHTS_INSIDE:
        per_token, pstats = term(logprobs, old_logprobs, advantages, mask, is_weights=w)  # [B, T]
    else:
        per_token, pstats = term(logprobs, old_logprobs, advantages, mask)  # [B, T]
        per_token = per_token if w is None else per_token * w
    per_seq = set(PER_SEQUENCE_STATS) | (set(SEQUENCE_STATS) if cfg.importance_sampling_level == "sequence" else set())
    unit = {k: n_seq if k in per_seq else n_tok for k in pstats}  # what each stat is a mean over
    stats = {k: (float(v) * unit[k], unit[k]) for k, v in pstats.items()}
    if w is not None:
        stats["tis_weight"] = (float(w[m].sum()), n_tok)
        stats["tis_truncated"] = (float((w[m] >= tis_cap).sum()), n_tok)
    if entropy is not None:
        stats["entropy"] = (float(entropy.detach()[m].sum()), n_tok)
    if ref_logprobs is not None:
        if cfg.kl.estimator == "k3_unbiased":
            kl = kl_k3_importance_weighted(logprobs, ref_logprobs, old_logprobs)  # [B, T] DeepSeek-V3.2
        else:
            kl = kl_k3(logprobs, ref_logprobs)  # [B, T]
        per_token = per_token + cfg.kl.coef * kl
        stats["kl"] = (float(kl.detach()[m].sum()), n_tok)
    return per_token, stats
