"""Direct preference losses (layer 0: torch only, no I/O): DPO and its variants, by TRL's names.

Every loss takes the summed response log-probs of a batch of pairs (:class:`PairLogps`) and the settings
(:class:`LossSettings`) and returns the per-pair loss ``[B]`` and the implicit rewards of the chosen and rejected
responses ``[B]`` (what TRL logs as ``rewards/chosen`` / ``rewards/rejected``). The batch loss is the mean over pairs
(TRL's); an algorithm that splits a batch into micro-batches divides each micro-batch's sum by the batch's pair count.

With ``pi`` the policy, ``ref`` the reference, ``y_w`` / ``y_l`` the chosen / rejected response to prompt ``x``,
``log pi(y|x)`` the SUM of the response tokens' log-probs, ``|y|`` its token count, ``ratio = log pi(y|x) - log
ref(y|x)`` and ``s_w``, ``s_l`` the scores of :func:`~lorarl.core.preference_scores.pair_scores` (the log-ratios
themselves unless f-DPO's ``f_divergence`` is set), ``h = s_w - s_l``:

* here, the losses of the score difference ``h`` (the ones f-DPO's divergences apply to, as in TRL): ``sigmoid``
  (DPO), ``hinge``, ``ipo``, ``sigmoid_norm``, ``robust``, ``exo_pair``, ``discopop``; and the reference-free
  ``simpo`` (TRL's CPOTrainer);
* in :mod:`lorarl.core.preference_ratio_losses`, those that read each response's log-ratio (or log-probs) apart:
  ``nca_pair``, ``bco_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired``, ``apo_zero``, ``apo_down``;
* ``sft`` (TRL 1.x's ``sft`` loss type, only beside one of the above, weighted by ``loss_weights``: RPO / MPO): the
  chosen responses' NLL, a token mean over the batch (:func:`sft_term`, :func:`combined_loss`).

Implicit rewards: ``beta * ratio`` for the reference-based losses (TRL's DPOTrainer logs this for every loss type,
whatever the f-divergence); ``beta * log pi(y|x) / |y|`` for ``simpo`` (TRL's CPOTrainer).

Label smoothing: TRL 1.x's DPOTrainer reads ``label_smoothing`` in ``robust``, ``exo_pair``, ``aot`` and
``aot_unpaired``; lorarl's ``sigmoid`` / ``simpo`` also read it (the conservative DPO of TRL's CPOTrainer and TRL
0.x's DPO ``sigmoid``); the other losses take none (the recipe refuses one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lorarl.core.preference_ratio_losses import (
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    nca_pair_loss,
    sppo_hard_loss,
)
from lorarl.core.preference_scores import LossSettings, PairLogps, implicit_rewards, pair_scores, smoothed_logistic

__all__ = [
    "PairLogps",
    "LossSettings",
    "PREFERENCE_LOSSES",
    "sigmoid_loss",
    "hinge_loss",
    "ipo_loss",
    "simpo_loss",
    "sigmoid_norm_loss",
    "robust_loss",
    "exo_pair_loss",
    "discopop_loss",
    "preference_loss",
    "SFT",
    "sft_term",
    "combined_loss",
]

Result = tuple[Tensor, Tensor, Tensor]  # (loss [B], chosen_rewards [B], rejected_rewards [B])


def _per_token(score_w: Tensor, score_l: Tensor, pair: PairLogps) -> Tensor:
    """``s_w / |y_w| - s_l / |y_l|``: the score difference with each score divided by its response's length."""
    return score_w / pair.chosen_tokens.clamp(min=1.0) - score_l / pair.rejected_tokens.clamp(min=1.0)


def sigmoid_loss(pair: PairLogps, s: LossSettings) -> Result:
    """DPO (Rafailov et al. 2023, Eq. 7), conservative with ``label_smoothing`` eps (Mitchell 2023):
    ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, ``h = s_w - s_l``.

    Shapes: every field of ``pair`` ``[B]`` -> ``(loss [B], chosen_rewards [B], rejected_rewards [B])``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``h = 3``, loss ``-log sigmoid(1.5) = 0.20141``; rewards
    ``1.0`` and ``-0.5``. With eps = 0.1: ``0.9 * 0.20141 + 0.1 * 1.70141 = 0.35141``.
    """
    score_w, score_l = pair_scores(pair, s)  # [B], [B]
    return smoothed_logistic(s.beta * (score_w - score_l), s.label_smoothing), *implicit_rewards(pair, s.beta)


def hinge_loss(pair: PairLogps, s: LossSettings) -> Result:
    """Hinge loss on the score difference (SLiC, Zhao et al. 2023; TRL's ``hinge``): ``loss = max(0, 1 - beta h)``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.1 -> ``max(0, 1 - 0.3) = 0.7``; beta = 0.5 -> ``0``.
    """
    score_w, score_l = pair_scores(pair, s)
    return (1.0 - s.beta * (score_w - score_l)).clamp(min=0.0), *implicit_rewards(pair, s.beta)


def ipo_loss(pair: PairLogps, s: LossSettings) -> Result:
    """IPO (Azar et al. 2023, Eq. 17; beta is the paper's tau), each score divided by its response's token count as
    TRL does: ``loss = (s_w / |y_w| - s_l / |y_l| - 1 / (2 beta))^2``.

    Example: ratio_w = 2 over 4 tokens, ratio_l = -1 over 2 tokens, beta = 0.5 -> ``(0.5 + 0.5 - 1)^2 = 0``;
    beta = 1 -> ``(1 - 0.5)^2 = 0.25``. Rewards are ``beta * ratio`` (unnormalised, as TRL logs them).
    """
    score_w, score_l = pair_scores(pair, s)
    return (_per_token(score_w, score_l, pair) - 1.0 / (2.0 * s.beta)) ** 2, *implicit_rewards(pair, s.beta)


def sigmoid_norm_loss(pair: PairLogps, s: LossSettings) -> Result:
    """DPO on length-normalised scores (TRL's ``sigmoid_norm``; the length normalisation of SimPO, Meng et al. 2024,
    kept with the reference): ``loss = -log sigmoid(beta (s_w / |y_w| - s_l / |y_l|))``.

    Example: ratio_w = 2 over 4 tokens, ratio_l = -1 over 2 tokens, beta = 1 -> ``-log sigmoid(1) = 0.31326``.
    """
    score_w, score_l = pair_scores(pair, s)
    return -F.logsigmoid(s.beta * _per_token(score_w, score_l, pair)), *implicit_rewards(pair, s.beta)


def robust_loss(pair: PairLogps, s: LossSettings) -> Result:
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy Feedback"): an unbiased loss under labels flipped with
    probability eps = ``label_smoothing`` (< 0.5): ``loss = (-(1 - eps) log sigmoid(beta h) + eps log
    sigmoid(-beta h)) / (1 - 2 eps)`` (eps = 0: DPO).

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5, eps = 0.1 -> ``(0.9 * 0.20141 - 0.1 * 1.70141) / 0.8 =
    0.01391``.
    """
    score_w, score_l = pair_scores(pair, s)
    z, eps = s.beta * (score_w - score_l), s.label_smoothing
    loss = (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    return loss, *implicit_rewards(pair, s.beta)


def exo_pair_loss(pair: PairLogps, s: LossSettings) -> Result:
    """EXO's pairwise loss (Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment",
    Eq. 16): the reverse KL from the policy's preference distribution ``q = softmax(beta (s_w, s_l))`` to the
    label's ``p = (1 - eps, eps)``, eps = ``label_smoothing`` (> 0; the paper uses 1e-3):
    ``loss = q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps)``, ``q_w = sigmoid(beta h)``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5, eps = 0.1 -> ``q_w = sigmoid(1.5) = 0.81757``:
    ``0.81757 (-0.20141 + 0.10536) + 0.18243 (-1.70141 + 2.30259) = 0.03114``.
    """
    score_w, score_l = pair_scores(pair, s)
    z, eps = s.beta * (score_w - score_l), s.label_smoothing
    q_w, q_l = torch.sigmoid(z), torch.sigmoid(-z)
    loss = q_w * (F.logsigmoid(z) - torch.log1p(torch.tensor(-eps, dtype=z.dtype))) + q_l * (
        F.logsigmoid(-z) - torch.log(torch.tensor(eps, dtype=z.dtype))
    )
    return loss, *implicit_rewards(pair, s.beta)


def discopop_loss(pair: PairLogps, s: LossSettings) -> Result:
    """DiscoPOP (Chris Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for Large Language
    Models", Eq. 5): the logistic and the exponential loss blended by a sigmoid of the margin, ``z = beta h``,
    ``m = sigmoid(z / tau)`` (tau = ``discopop_tau``, 0.05): ``loss = (1 - m) (-log sigmoid(z)) + m exp(-z)``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.1, tau = 0.05 -> ``z = 0.3``, ``m = sigmoid(6) = 0.99753``:
    ``0.00247 * 0.55436 + 0.99753 * 0.74082 = 0.74036``.
    """
    score_w, score_l = pair_scores(pair, s)
    z = s.beta * (score_w - score_l)
    m = torch.sigmoid(z / s.discopop_tau)
    return -F.logsigmoid(z) * (1.0 - m) + torch.exp(-z) * m, *implicit_rewards(pair, s.beta)


def simpo_loss(pair: PairLogps, s: LossSettings) -> Result:
    """SimPO (Meng et al. 2024, Eq. 6): reference-free, length-normalised, with a target margin ``gamma``:
    ``loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``, ``z = beta (log pi(y_w) / |y_w| - log pi(y_l) /
    |y_l|) - gamma`` (TRL's CPOTrainer ``simpo``: its ``simpo_gamma`` is gamma, ``logits - gamma / beta`` scaled by
    beta). Implicit rewards ``beta * log pi(y) / |y|``.

    Example: log pi(y_w) = -4 over 4 tokens, log pi(y_l) = -6 over 2 tokens, beta = 2, gamma = 0.5 ->
    ``z = 2 (-1 + 3) - 0.5 = 3.5``, loss ``-log sigmoid(3.5) = 0.02975``; rewards ``-2`` and ``-6``.
    """
    avg_w = pair.chosen / pair.chosen_tokens.clamp(min=1.0)
    avg_l = pair.rejected / pair.rejected_tokens.clamp(min=1.0)
    loss = smoothed_logistic(s.beta * (avg_w - avg_l) - s.simpo_gamma, s.label_smoothing)
    return loss, s.beta * avg_w.detach(), s.beta * avg_l.detach()


PREFERENCE_LOSSES: dict[str, Callable[[PairLogps, LossSettings], Result]] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "robust": robust_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sigmoid_norm": sigmoid_norm_loss,
}
SFT = "sft"  # TRL's `sft` loss type: an NLL term on the chosen responses, combined with a preference loss


def sft_term(pair: PairLogps, batch_pairs: int, batch_chosen_tokens: float) -> Tensor:
    """TRL's ``sft`` loss type (the chosen responses' NLL, a token mean over the batch), spread over the pairs:
    ``s_i = -log pi(y_w,i|x_i) * N / T_w``, with ``N`` the batch's pairs and ``T_w`` its chosen response tokens, so
    that ``mean_i s_i`` over the batch is ``-sum_i log pi(y_w,i|x_i) / T_w`` = TRL's
    ``-chosen_per_token_logps[chosen_mask].mean()``. A micro-batch passes its batch's ``N`` and ``T_w``. The plain
    sum (``pair.chosen_full``) where LD-DPO weights ``pair.chosen``: TRL's NLL reads the unweighted log-probs.

    Example: two pairs, log pi(y_w) = -2 over 4 tokens and -6 over 4 tokens -> ``s = (2 * 2 / 8, 6 * 2 / 8) = (0.5,
    1.5)``, mean ``1.0`` = ``8 / 8``.
    """
    chosen = pair.chosen if pair.chosen_full is None else pair.chosen_full
    return -chosen * (batch_pairs / batch_chosen_tokens)


def combined_loss(
    pair: PairLogps,
    losses: tuple[tuple[str, float], ...],
    settings: LossSettings,
    batch_pairs: int | None = None,
    batch_chosen_tokens: float | None = None,
) -> Result:
    """TRL 1.x's weighted sum of loss types (``loss_type: [sigmoid, sft]`` with ``loss_weights``, e.g. RPO / MPO):
    ``loss_i = sum_k w_k l_k(i) + w_sft s_i`` per pair (:func:`sft_term` for ``sft``, the registered losses for the
    others), each term multiplied by WPO's pair weight when ``pair.weights`` is set (TRL's ``use_weighting``), so
    the batch's mean over pairs is ``sum_k w_k mean_i l_k(i) + w_sft NLL_w`` as TRL computes it. Implicit rewards:
    the first preference loss's. ``batch_pairs`` / ``batch_chosen_tokens``: the batch the pairs belong to (default:
    ``pair`` is the whole batch).

    Example: sigmoid with weight 1 and sft with weight 0.5, ratio_w = 2, ratio_l = -1, beta = 0.5, one pair with
    log pi(y_w) = -2 over 4 tokens -> ``0.20141 + 0.5 * 0.5 = 0.45141``.
    """
    n = len(pair.chosen) if batch_pairs is None else batch_pairs
    t_w = float(pair.chosen_tokens.sum()) if batch_chosen_tokens is None else batch_chosen_tokens
    total, rewards = None, None
    for name, weight in losses:
        if name == SFT:
            part = sft_term(pair, n, max(t_w, 1.0))
        else:
            part, rc, rr = PREFERENCE_LOSSES[name](pair, settings)
            rewards = rewards or (rc, rr)
        if pair.weights is not None:
            part = part * pair.weights
        total = part * weight if total is None else total + part * weight
    if total is None or rewards is None:
        raise ValueError(f"loss types {[n for n, _ in losses]}: at least one preference loss is needed besides sft")
    return total, rewards[0], rewards[1]


def preference_loss(name: str) -> Callable[[PairLogps, LossSettings], Result]:
    """The loss registered as ``name`` (chosen once at set-up): ``fn(pair, settings)``."""
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(f"preference loss must be one of {tuple(PREFERENCE_LOSSES)}, got {name!r}") from None
