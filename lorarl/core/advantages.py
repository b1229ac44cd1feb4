"""Advantages and reward shaping (layer 0: torch + stdlib only, no I/O).

* :func:`group_advantages` -- GRPO group normalisation (DeepSeekMath), with batch-std and Dr. GRPO variants.
* :func:`gae` -- Generalized Advantage Estimation for PPO.
* :func:`kl_penalized_reward`, :func:`kl_shaped_rewards` -- InstructGPT-style KL-penalised rewards.
* :class:`AdaptiveKLController`, :class:`FixedKLController` -- the KL coefficient (Ziegler et al. 2019).

``mask`` is a bool or 0/1 float tensor ``[B, T]``, True where a token counts. Pure functions never modify their
arguments. Advantages, returns and shaped rewards are training *targets*: every tensor returned here is detached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lorarl.core.losses import kl_k1, kl_k2, kl_k3

__all__ = [
    "StdScaling",
    "check_groups",
    "GroupAdvantages",
    "group_advantages",
    "gae",
    "kl_penalized_reward",
    "kl_shaped_rewards",
    "KL_PENALTIES",
    "AdaptiveKLController",
    "FixedKLController",
]

StdScaling = Literal["group", "batch", "none"]
_STD_SCALINGS = ("group", "batch", "none")


def _bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# ---------------------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------------------


def check_groups(rewards: Tensor, group_size: int) -> int:
    """``N``, the number of ``rewards`` laid out in groups of ``group_size`` (GRPO's and RLOO's layout); raises
    ``ValueError`` if ``rewards`` is not 1-D, ``group_size`` is not an int >= 2 or ``N % group_size != 0``."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"number of rewards ({n}) is not a multiple of group_size ({group_size})")
    return n


class GroupAdvantages(NamedTuple):
    """Result of :func:`group_advantages` (``N`` completions, ``G = group_size``, ``N / G`` prompts).

    advantages: ``[N]`` one advantage per completion (0 for NaN rewards and for zero-std groups).
    group_mean: ``[N/G]`` mean of each group's non-NaN rewards (0 for a group with none).
    group_std:  ``[N/G]`` std of each group's non-NaN rewards (population or unbiased, as requested; always the
                *group* std, whatever ``std_scaling`` is; 0 for a group with fewer than two valid rewards).
    zero_std:   ``[N/G]`` bool, True where the group carries no learning signal: all its valid rewards are equal
                (this includes groups with zero or one valid reward).
    """

    advantages: Tensor
    group_mean: Tensor
    group_std: Tensor
    zero_std: Tensor


def group_advantages(
    rewards: Tensor,
    group_size: int,
    std_scaling: StdScaling = "group",
    eps: float = 1e-4,
    unbiased_std: bool = False,
) -> GroupAdvantages:
    """Group-relative advantages of GRPO (Shao et al. 2024, DeepSeekMath, Sec. 4.1.2, outcome supervision).

    The rewards are laid out group by group: completions ``[g*G, (g+1)*G)`` answer prompt ``g``.
    For completion ``i`` of group ``g`` with mean ``mu_g`` and std ``sigma_g`` over the group's non-NaN rewards:

    * ``"group"`` (GRPO):      ``A_i = (r_i - mu_g) / (sigma_g + eps)``
    * ``"batch"``:             ``A_i = (r_i - mu_g) / (sigma_batch + eps)``, ``sigma_batch`` the std of all non-NaN
      rewards of the batch around their global mean (group baseline, batch scale; Hu 2025 REINFORCE++,
      Liu et al. 2025 "Tricks or Traps?"; TRL ``scale_rewards="batch"``).
    * ``"none"`` (Dr. GRPO, Liu et al. 2025 "Understanding R1-Zero-Like Training"): ``A_i = r_i - mu_g``.

    ``sigma`` is the population std (divide by ``n``) unless ``unbiased_std`` (divide by ``n - 1``).
    NaN marks a missing reward (e.g. a reward function that failed): it is left out of the mean and std and its
    completion gets advantage 0. A zero-std group (all valid rewards equal) gets all-zero advantages -- exactly 0,
    not ``0 / eps`` rounding noise -- and is flagged in ``zero_std``.

    Shapes: ``rewards`` ``[N]`` float; see :class:`GroupAdvantages` for the outputs.

    Example (population std, ``eps=0``): rewards ``[1.0, 0.8, 0.4, 0.2]``, ``G=4``: ``mu=0.6``,
    ``sigma=sqrt(0.1)=0.3162`` -> advantages ``[1.2649, 0.6325, -0.6325, -1.2649]``.

    Raises ``ValueError`` if ``rewards`` is not 1-D, ``group_size < 2``, ``N % group_size != 0`` or
    ``std_scaling`` is unknown.
    """
    n = check_groups(rewards, group_size)
    if std_scaling not in _STD_SCALINGS:
        raise ValueError(f"std_scaling must be one of {_STD_SCALINGS}, got {std_scaling!r}")

    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    r = r.reshape(n // group_size, group_size)  # [M, G]
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    valid = ~torch.isnan(r)  # [M, G]
    count = valid.sum(dim=1)  # [M]
    r0 = torch.where(valid, r, zero)  # [M, G]
    mean = r0.sum(dim=1) / count.clamp(min=1).to(r.dtype)  # [M]
    centered = torch.where(valid, r0 - mean[:, None], zero)  # [M, G]
    dof = (count - 1) if unbiased_std else count
    std = torch.sqrt((centered**2).sum(dim=1) / dof.clamp(min=1).to(r.dtype))  # [M]
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    hi = torch.where(valid, r, -inf).amax(dim=1)
    lo = torch.where(valid, r, inf).amin(dim=1)
    zero_std = ~(hi > lo)  # [M]; also True for groups with 0 or 1 valid reward

    if std_scaling == "group":
        scaled = centered / (std[:, None] + eps)
    elif std_scaling == "batch":
        n_valid = valid.sum()
        batch_mean = r0.sum() / n_valid.clamp(min=1).to(r.dtype)
        batch_dev = torch.where(valid, r0 - batch_mean, zero)
        batch_dof = (n_valid - 1) if unbiased_std else n_valid
        batch_std = torch.sqrt((batch_dev**2).sum() / batch_dof.clamp(min=1).to(r.dtype))
        scaled = centered / (batch_std + eps)
    else:  # "none"
        scaled = centered
    keep = valid & ~zero_std[:, None]
    finite = bool(torch.isfinite(std[count > 0]).all()) and bool(torch.isfinite(scaled[keep]).all())
    if r.dtype != torch.float64 and not finite and bool(torch.isfinite(r[valid]).all()):
        # finite rewards whose squares (or differences) overflow r's dtype (1e20 in float32): the same formula in
        # float64, cast back (a normalised advantage is at most sqrt(G) in size); rewards in range never come here
        wide = group_advantages(r.reshape(n).double(), group_size, std_scaling, eps, unbiased_std)
        return GroupAdvantages(*(t.to(r.dtype) if t.is_floating_point() else t for t in wide))
    advantages = torch.where(keep, scaled, zero).reshape(n)
    return GroupAdvantages(advantages=advantages, group_mean=mean, group_std=std, zero_std=zero_std)


# ---------------------------------------------------------------------------------------------------------------
# PPO: GAE
# ---------------------------------------------------------------------------------------------------------------


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE",
    Eqs. 11-16).

    Per row, over the valid tokens ``t = 0 .. L-1``:

    * ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_L = 0`` (the value after the last valid token is 0:
      the response ended, the episode is terminal -- also for responses truncated at the length limit),
    * ``A_t = sum_{l>=0} (gamma * lam)^l * delta_{t+l}``, computed backwards as ``A_t = delta_t + gamma*lam*A_{t+1}``,
    * ``returns_t = A_t + V_t`` (the critic's target, a lambda-return).

    Positions outside the mask get advantage 0 and return 0; their rewards and values are never read (they may be
    NaN). Vectorised over ``B``, a reverse Python loop over ``T``. Inputs are detached: the outputs are targets.

    Assumption: the valid tokens of each row are a prefix (right padding), which is what generation produces.
    A gap inside a row is not skipped over: the token before the gap is treated as the last one (terminal).

    Shapes: ``rewards``, ``values``, ``mask`` ``[B, T]``; returns ``(advantages [B, T], returns [B, T])``.

    Example (``gamma = lam = 1``, one row, all valid): ``r = [0, 0, 1]``, ``V = [0.5, 0.6, 0.7]`` ->
    ``delta = [0.1, 0.1, 0.3]``, ``A = [0.5, 0.4, 0.3]``, ``returns = [1, 1, 1]``.
    """
    m, zero, r, v = _gae_inputs(rewards, values, mask)  # V = 0 at and after the end of each row
    T = r.shape[1]
    next_adv = torch.zeros_like(v[:, 0])  # [B]
    next_value = torch.zeros_like(v[:, 0])  # [B]
    advs: list[Tensor] = []
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        adv_t = torch.where(m[:, t], delta + gamma * lam * next_adv, zero)  # [B]
        advs.append(adv_t)
        next_adv = adv_t
        next_value = v[:, t]
    advantages = torch.stack(advs[::-1], dim=1)  # [B, T]
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


def _gae_inputs(rewards: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GAE's inputs checked and masked: ``(mask [B, T] bool, a 0-d zero, rewards, values)``, the last two detached
    and 0 outside the mask (where they are never read: they may be NaN)."""
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards and values must both be [B, T], got {tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    m = torch.broadcast_to(_bool(mask), rewards.shape)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return m, zero, torch.where(m, rewards.detach(), zero), torch.where(m, values.detach(), zero)


def gae_skipping(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE over the model's own tokens of a multi-turn trajectory, the environment's tokens skipped.

    Per row, let ``t_0 < t_1 < ... < t_{K-1}`` be the positions where ``mask`` is True (the tokens the model
    sampled; tool / environment tokens between turns are False). GAE runs over that sequence as if the gaps were
    not there -- the environment's tokens are part of the transition from the last token of turn ``k`` to the
    first of turn ``k + 1``, not actions:

    * ``delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}`` with ``V_{t_K} = 0`` (terminal),
    * ``A_k = delta_k + gamma * lam * A_{k+1}``, ``returns_k = A_k + V_{t_k}``.

    Positions outside the mask get advantage 0 and return 0 (their rewards and values are never read). With a
    prefix mask (one turn) this is exactly :func:`gae`. Shapes: ``rewards``, ``values``, ``mask`` ``[B, T]``;
    returns ``(advantages [B, T], returns [B, T])``.

    Example (``gamma = lam = 1``): ``r = [0, x, 0, 1]``, ``V = [0.5, x, 0.6, 0.7]``, ``mask = [1, 0, 1, 1]``
    -> ``delta = [0.1, 0, 0.1, 0.3]``, ``A = [0.5, 0, 0.4, 0.3]``, ``returns = [1, 0, 1, 1]``.
    """
    m, zero, r, v = _gae_inputs(rewards, values, mask)
    next_adv = torch.zeros_like(v[:, 0])  # [B] A of the next model token (0 after the last)
    next_value = torch.zeros_like(v[:, 0])  # [B] V of the next model token (0 after the last: terminal)
    advs: list[Tensor] = []
    for t in range(r.shape[1] - 1, -1, -1):
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv  # [B]
        adv_t = torch.where(m[:, t], adv_t, zero)
        advs.append(adv_t)
        next_adv = torch.where(m[:, t], adv_t, next_adv)  # a skipped token carries the next model token's A, V
        next_value = torch.where(m[:, t], v[:, t], next_value)
    advantages = torch.stack(advs[::-1], dim=1)  # [B, T]
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------------
# KL-penalised rewards (InstructGPT) and the KL coefficient (Ziegler et al. 2019)
# ---------------------------------------------------------------------------------------------------------------


def kl_penalized_reward(score: Tensor | float, kl: Tensor | float, kl_coef: Tensor | float) -> Tensor | float:
    """Sequence-level KL-penalised reward: ``R_total = score - kl_coef * kl`` (Ouyang et al. 2022, InstructGPT,
    Eq. 2; Ziegler et al. 2019, Sec. 2.2).

    Shapes: any broadcastable shapes (e.g. ``[B]``) or Python floats; result the broadcast shape.

    Example: ``kl_penalized_reward(0.8, 0.05, 6.0)`` -> ``0.5``.
    """
    return score - kl_coef * kl


# PPO's per-token KL penalty estimators by ``ppo.kl.estimator`` name (verl's ``algorithm.kl_penalty``: ``kl`` / ``k1``,
# ``mse`` / ``k2``, ``low_var_kl`` / ``k3``); formulas in :mod:`lorarl.core.losses`
KL_PENALTIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: Tensor | float,
    estimator: Callable[[Tensor, Tensor], Tensor] = kl_k1,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards with a KL penalty (Ziegler et al. 2019; Ouyang et al. 2022, InstructGPT Eq. 2).

    ``kl_t = estimator(logprobs_t, ref_logprobs_t)``, an estimate of ``KL(pi || pi_ref)`` on the sampled token
    (:data:`KL_PENALTIES`: k1 ``= logprobs - ref_logprobs``, the default; k2 ``= 0.5 (logprobs - ref_logprobs)^2``;
    k3 ``= exp(d) - d - 1`` with ``d = ref_logprobs - logprobs``), and
    ``r_t = -kl_coef * kl_t + score * 1[t is the last valid token of the row]``.

    Positions outside the mask get reward 0 and kl 0 (their log-probs are never read). The last valid token of a
    row is its highest masked position; a row with no valid token receives nothing (its score is dropped).
    Inputs are detached.

    Shapes: ``scores`` ``[B]``, ``logprobs``, ``ref_logprobs``, ``mask`` ``[B, T]``; returns
    ``(rewards [B, T], kl [B, T])``.

    Example: ``scores=[1.0]``, ``logprobs=[[-1.0, -2.0]]``, ``ref_logprobs=[[-1.5, -1.0]]``, ``kl_coef=0.1``
    -> ``kl = [[0.5, -1.0]]``, ``rewards = [[-0.05, 1.1]]``; with ``estimator=kl_k2``: ``kl = [[0.125, 0.5]]``,
    ``rewards = [[-0.0125, 0.95]]``.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs and ref_logprobs must both be [B, T], got {tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    m = torch.broadcast_to(_bool(mask), logprobs.shape)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = torch.where(m, estimator(logprobs.detach(), ref_logprobs.detach()), zero)  # [B, T]
    rewards = -kl_coef * kl  # [B, T]
    T = logprobs.shape[1]
    positions = torch.arange(T, device=logprobs.device)
    last = torch.where(m, positions, -1).amax(dim=1)  # [B]; -1 for an empty row
    at_last = (positions[None, :] == last[:, None]) & m  # [B, T]
    rewards = rewards + torch.where(at_last, scores.detach().to(rewards.dtype)[:, None], zero)
    return rewards, kl


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2).

    ``e = clip(KL_current / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
    The coefficient grows while the measured KL is above ``target`` and shrinks while it is below.

    Example: ``AdaptiveKLController(0.2, target=6.0, horizon=10000).update(9.0, n_steps=256)``:
    ``e = clip(0.5) = 0.2``, ``beta = 0.2 * 1.00512 = 0.201024``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after ``n_steps`` samples (e.g. the batch size) whose mean KL was ``current_kl``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The coefficient's state (``target`` and ``horizon`` belong to the config, not the state)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """Constant KL coefficient with the interface of :class:`AdaptiveKLController` (``update`` does nothing)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
