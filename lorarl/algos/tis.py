"""Training through a sampler / trainer mismatch: truncated importance sampling (TIS) for GRPO and PPO.

When the log-probs the sampler drew tokens with differ from the trainer's beyond noise (bf16 / fp16 / NF4 kernels,
the fast decode engine), the update would optimise a distribution that did not generate the data. Instead of
stopping the run (the parity check, :mod:`lorarl.health`), ``grpo.tis`` / ``ppo.tis`` weight each token's
policy-gradient loss by ``min(exp(logp_old - logp_sampler), cap)`` (:func:`lorarl.core.losses.tis_weights`), as
verl (``rollout_is: token``) and TRL (``vllm_importance_sampling_correction``, ``token_truncate``) do:

* ``mode: auto`` (default): off while parity holds -- the run is exactly what it was without TIS; from the first
  parity check above ``health.parity_tolerance`` on, every rollout records the sampler's log-probs and the loss is
  weighted (kept for the rest of the run, and across a resume). Only where a gap can be precision noise: a base in
  bf16 / fp16 / NF4, and a gap at most :data:`AUTO_MAX_FACTOR` times the tolerance. An fp32 base, or a larger gap
  (a stale adapter, a logits processor the trainer does not apply), still stops the run: a bug is not corrected;
* ``always``: from step 1; ``off``: never (a parity failure stops the run).
"""

from __future__ import annotations

import sys

import torch

from lorarl.health import PARITY_MEAN, TIS_ACTIVE

AUTO_MAX_FACTOR = 5.0  # mode auto corrects gaps up to this many times health.parity_tolerance


def tis_engages(mode: str, health: dict, tolerance: float, precision: str, step: int) -> bool:
    """Whether ``mode: auto`` switches TIS on at this parity check: the mean gap is above ``tolerance`` but at most
    ``AUTO_MAX_FACTOR * tolerance``, on a base whose ``precision`` (:func:`lorarl.health.base_precision`) is not
    float32. Says so on stderr when it does."""
    gap = health.get(PARITY_MEAN)
    if mode != "auto" or precision == "float32" or gap is None:
        return False
    if not tolerance < gap <= AUTO_MAX_FACTOR * tolerance:
        return False
    print(
        f"step {step}: generator / trainer parity {gap:.4f} nats per token is above health.parity_tolerance "
        f"{tolerance:g}: from now on the loss is weighted by truncated importance sampling on the sampler's "
        "log-probs (tis.mode: auto; set it to off to stop instead)",
        file=sys.stderr,
    )
    return True


def tis_metrics(active: bool, seen: list[torch.Tensor], update_stats: dict) -> dict[str, float]:
    """``sampling/tis_active`` (1 while the correction is on) and, on steps that trained with it, TRL's
    ``sampling/importance_sampling_ratio/min|mean|max`` of the loss tokens' weights and the fraction of them at the
    cap (``.../truncated_frac``)."""
    out = {TIS_ACTIVE: 1.0 if active else 0.0}
    w = torch.cat(seen) if seen else torch.empty(0)
    if active and w.numel():
        out["sampling/importance_sampling_ratio/min"] = float(w.min())
        out["sampling/importance_sampling_ratio/mean"] = float(w.mean())
        out["sampling/importance_sampling_ratio/max"] = float(w.max())
        out["sampling/importance_sampling_ratio/truncated_frac"] = update_stats.get("tis_truncated")
    return out
