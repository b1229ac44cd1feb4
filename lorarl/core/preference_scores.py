"""What the preference losses read (layer 0: torch only, no I/O): the pairs' summed log-probs (:class:`PairLogps`),
the loss settings (:class:`LossSettings`), the f-divergence scores of f-DPO, LD-DPO's token weights, WPO's pair
weights, and the logistic helpers the losses (and KTO's unpaired losses) are built from.

With ``pi`` the policy, ``ref`` the reference, ``log pi(y|x)`` the SUM of a response's token log-probs and
``ratio = log pi(y|x) - log ref(y|x)`` its log-ratio; ``y_w`` / ``y_l`` the chosen / rejected response.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PairLogps",
    "LossSettings",
    "smoothed_logistic",
    "F_DIVERGENCES",
    "pair_scores",
    "implicit_rewards",
    "ld_token_weights",
    "log_sum_sq_probs",
    "wpo_weights",
]


@dataclass
class PairLogps:
    """Summed response log-probs of ``B`` pairs, all ``[B]`` fp32.

    chosen / rejected:          ``log pi(y|x)``, the sum over the response's tokens under the policy (LD-DPO's
                                length-desensitised sum under ``dpo.ld_alpha``: :func:`ld_token_weights`);
    chosen_tokens / rejected_tokens: ``|y|``, the response's token count (EOS included), as floats;
    ref_chosen / ref_rejected:  the same sums under the reference (None for a reference-free loss);
    weights:                    WPO's per-pair weight ``w(y_w) w(y_l)`` (:func:`wpo_weights`; None: no weighting);
    chosen_full:                the plain sum over the chosen response where ``chosen`` is LD-weighted (the ``sft``
                                term's NLL reads it, as TRL's); None: ``chosen`` is the plain sum.
    """

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None
    weights: Tensor | None = None
    chosen_full: Tensor | None = None

    def logratios(self) -> tuple[Tensor, Tensor]:
        """``(log pi(y_w) - log ref(y_w), log pi(y_l) - log ref(y_l))``, each ``[B]``."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("this loss needs the reference log-probs (ref_chosen, ref_rejected)")
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected


@dataclass(frozen=True)
class LossSettings:
    """The settings a preference loss may read (each reads those its docstring names), by TRL's names.

    beta: DPO's beta (IPO's tau); label_smoothing: eps (conservative DPO / SimPO, robust DPO, EXO, AOT);
    simpo_gamma: SimPO's target margin; discopop_tau: DiscoPOP's temperature; f_divergence /
    f_alpha_divergence_coef: f-DPO's divergence (:data:`F_DIVERGENCES`) and its alpha.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    discopop_tau: float = 0.05
    f_divergence: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5


def smoothed_logistic(z: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``: the logistic loss of the logit ``z`` with the label
    flipped with probability ``eps`` (eps = 0: ``-log sigmoid(z)``). DPO, SimPO, AOT and KTO's terms are this.

    Example: ``z = 1.5`` -> ``0.20141``; with eps = 0.1: ``0.9 * 0.20141 + 0.1 * 1.70141 = 0.35141``."""
    loss = -F.logsigmoid(z) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-z) * label_smoothing
    return loss


# ---- f-DPO (Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse
# Divergence Constraints"): the log-ratio u = pi / ref enters the loss through f'(u) ------------------------


def _reverse_kl(ratio: Tensor, alpha: float) -> Tensor:
    """``f'(u) = log u + 1``: the score is the log-ratio itself (DPO; the constant cancels in ``s_w - s_l``)."""
    return ratio


def _forward_kl(ratio: Tensor, alpha: float) -> Tensor:
    """``f'(u) = 1 - 1/u`` -> ``1 - exp(-ratio)``."""
    return 1.0 - torch.exp(-ratio)


def _js_divergence(ratio: Tensor, alpha: float) -> Tensor:
    """``f'(u) = log(2u / (1 + u))`` -> ``log 2 + log sigmoid(ratio)``."""
    return math.log(2.0) + F.logsigmoid(ratio)


def _alpha_divergence(ratio: Tensor, alpha: float) -> Tensor:
    """TRL's alpha-divergence score ``(u^(alpha - 1) - 1) / (alpha - 1)`` (the f-DPO paper writes ``(1 - u^-alpha) /
    alpha``; the two agree at alpha = 0.5, TRL's default), computed as ``(exp(min((alpha - 1) ratio, 80)) - 1) / (alpha
    - 1)`` in at least fp32 (TRL clamps at 80 against overflow, in fp32 for half-precision log-probs); the log-ratio
    itself (reverse KL, the limit) at ``|alpha - 1| < 1e-6``."""
    if abs(alpha - 1.0) < 1e-6:
        return ratio
    wide = torch.promote_types(ratio.dtype, torch.float32)
    t = torch.clamp(((alpha - 1.0) * ratio).to(wide), max=80.0)
    return (torch.exp(t) - 1.0).to(ratio.dtype) / (alpha - 1.0)


F_DIVERGENCES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "reverse_kl": _reverse_kl,
    "forward_kl": _forward_kl,
    "js_divergence": _js_divergence,
    "alpha_divergence": _alpha_divergence,
}


def pair_scores(pair: PairLogps, s: LossSettings) -> tuple[Tensor, Tensor]:
    """``(s_w, s_l)``: the log-ratios through f-DPO's ``f'`` (``s.f_divergence``; TRL's ``f_divergence_type``), the
    scores whose difference ``h = s_w - s_l`` the sigmoid / hinge / ipo / robust / exo_pair / discopop /
    sigmoid_norm losses read. Reverse KL (the default, DPO): the log-ratios themselves.

    Example: log-ratios ``(2, -1)``, forward KL -> ``(1 - e^-2, 1 - e^1) = (0.86466, -1.71828)``; JS ->
    ``(log 2 + log sigmoid(2), log 2 + log sigmoid(-1)) = (0.56622, -0.62011)``."""
    ratio_w, ratio_l = pair.logratios()
    f = F_DIVERGENCES[s.f_divergence]
    return f(ratio_w, s.f_alpha_divergence_coef), f(ratio_l, s.f_alpha_divergence_coef)


def implicit_rewards(pair: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """The implicit rewards TRL's DPOTrainer logs for every loss type: ``(beta ratio_w, beta ratio_l)``, detached.

    Example: log-ratios ``(2, -1)``, beta 0.5 -> ``(1.0, -0.5)``."""
    ratio_w, ratio_l = pair.logratios()
    return beta * ratio_w.detach(), beta * ratio_l.detach()


# ---- LD-DPO (Liu et al. 2024, "Length Desensitization in Direct Preference Optimization") --------------------


def ld_token_weights(mask: Tensor, shared_lengths: Tensor, alpha: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """LD-DPO's per-token weights: 1 on a response's first ``l_s`` tokens, ``alpha`` on the rest (0 outside the
    mask), ``l_s = min(|y_w|, |y_l|)`` the pair's shorter response length, so ``sum_t w_t log pi(y_t) = log
    pi(y_{<=l_s}) + alpha log pi(y_{>l_s})`` desensitises the longer response's excess length (TRL's ``ld_alpha``: 1
    is plain DPO, 0 drops the excess tokens). Applied alike under the policy and the reference.

    Shapes: ``mask`` ``[N, T]`` (right padded), ``shared_lengths`` ``[N]`` (each row's pair's ``l_s``) ->
    ``[N, T]`` of ``dtype`` (the log-probs').

    Example: mask ``[[1, 1, 1, 0]]``, ``l_s = 2``, alpha 0.5 -> ``[[1, 1, 0.5, 0]]``."""
    m = mask.bool()
    pos = torch.arange(m.shape[1], device=m.device)[None, :]  # [1, T]
    shared = pos < shared_lengths.to(m.device)[:, None]  # [N, T]
    one, a = (torch.full((), v, dtype=dtype, device=m.device) for v in (1.0, float(alpha)))
    return torch.where(m, torch.where(shared, one, a), torch.zeros((), dtype=dtype, device=m.device))


# ---- WPO (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization", Eq. 2 with TRL's
# sampling-aligned probabilities) --------------------------------------------------------------------------------------


def log_sum_sq_probs(logp: Tensor) -> Tensor:
    """``log sum_v p_v^2`` of the distribution ``logp = log_softmax(logits)`` over the last dimension: WPO's
    alignment term (TRL's fused head returns it as ``log_sum_sq_probs``). ``-inf`` entries contribute 0.

    Shapes: ``[..., V]`` -> ``[...]``. Example: uniform over 4 -> ``log(4 / 16) = -1.38629``."""
    return torch.logsumexp(2.0 * logp, dim=-1)


def wpo_weights(logprobs: Tensor, log_sum_sq: Tensor, mask: Tensor) -> Tensor:
    """WPO's weight of each response, detached: ``w(y) = exp(mean_t (log pi(y_t) - log sum_v pi(v)^2))``, the
    geometric mean of the token probabilities relative to ``sum_v pi(v)^2 = E_{v ~ pi}[pi(v)]`` (the probability a
    token the policy samples itself has, on average), so an off-policy response the policy would not sample weighs
    less. A pair's weight is ``w(y_w) w(y_l)``; it multiplies every loss term (TRL's ``use_weighting``).

    Shapes: ``logprobs``, ``log_sum_sq``, ``mask`` ``[N, T]`` -> ``[N]``.

    Example: one response of two tokens with ``log pi = (-1, -2)``, ``log sum p^2 = (-0.5, -1)`` ->
    ``exp((-0.5 - 1) / 2) = exp(-0.75) = 0.47237``."""
    m = mask.bool()
    aligned = torch.where(m, logprobs.detach() - log_sum_sq.detach(), torch.zeros((), device=logprobs.device))
    return torch.exp(aligned.sum(dim=-1) / m.sum(dim=-1).clamp(min=1).to(logprobs.dtype))
