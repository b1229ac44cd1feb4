"""Preference losses that read each response's log-ratio (or log-probs) apart, not only the difference of the
chosen and rejected scores (layer 0: torch only, no I/O): TRL 1.16's ``nca_pair``, ``bco_pair``, ``sppo_hard``,
``aot``, ``aot_unpaired``, ``apo_zero``, ``apo_down``. f-DPO's divergences do not apply to them (TRL refuses the
combination too: the f-DPO reparameterisation only cancels the partition function in a chosen - rejected
difference). Registered with the others in :data:`lorarl.core.preference_losses.PREFERENCE_LOSSES`; the
signature, the shapes and the notation are that module's: ``ratio_w``, ``ratio_l`` the log-ratios ``log pi(y|x) -
log ref(y|x)`` of the chosen and rejected responses, all ``[B]``.

The per-response terms (:func:`apo_zero_terms`, :func:`nca_terms`) are written apart so that unpaired losses
(KTO's ``apo_zero_unpaired``) can reuse them on responses that come without a partner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorarl.core.preference_scores import LossSettings, PairLogps, implicit_rewards, smoothed_logistic

__all__ = [
    "nca_terms",
    "nca_pair_loss",
    "bco_pair_loss",
    "sppo_hard_loss",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_zero_terms",
    "apo_zero_loss",
    "apo_down_loss",
]

Result = tuple[Tensor, Tensor, Tensor]  # (loss [B], chosen_rewards [B], rejected_rewards [B])


def nca_terms(reward: Tensor, desirable: bool) -> Tensor:
    """NCA's term of one response with implicit reward ``r = beta ratio``: ``-log sigmoid(r) - 0.5 log
    sigmoid(-r)`` for a desirable response (raise it, against the partition term), ``-0.5 log sigmoid(-r)`` for an
    undesirable one.

    Example: ``r = 0`` -> ``1.5 log 2 = 1.03972`` (desirable), ``0.5 log 2 = 0.34657`` (undesirable)."""
    if desirable:
        return -F.logsigmoid(reward) - 0.5 * F.logsigmoid(-reward)
    return -0.5 * F.logsigmoid(-reward)


def nca_pair_loss(pair: PairLogps, s: LossSettings) -> Result:
    """NCA, pairwise (Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards", with
    two responses; TRL's ``nca_pair``): with ``r = beta ratio``,
    ``loss = -log sigmoid(r_w) - 0.5 log sigmoid(-r_w) - 0.5 log sigmoid(-r_l)``. Unlike DPO it pins the absolute
    rewards, so the chosen likelihood does not fall with the rejected one.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``r = (1, -0.5)``:
    ``0.31326 + 0.5 * 1.31326 + 0.5 * 0.47408 = 1.20693``."""
    ratio_w, ratio_l = pair.logratios()
    loss = nca_terms(s.beta * ratio_w, desirable=True) + nca_terms(s.beta * ratio_l, desirable=False)
    return loss, *implicit_rewards(pair, s.beta)


def bco_pair_loss(pair: PairLogps, s: LossSettings) -> Result:
    """BCO, pairwise (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment",
    without the running reward shift, as TRL 1.16's ``bco_pair``): each response classified on its own,
    ``loss = -log sigmoid(beta ratio_w) - log sigmoid(-beta ratio_l)``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``-log sigmoid(1) - log sigmoid(0.5) = 0.31326 + 0.47408 =
    0.78733``."""
    ratio_w, ratio_l = pair.logratios()
    loss = smoothed_logistic(s.beta * ratio_w) + smoothed_logistic(-s.beta * ratio_l)
    return loss, *implicit_rewards(pair, s.beta)


def sppo_hard_loss(pair: PairLogps, s: LossSettings) -> Result:
    """SPPO with hard labels (Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment",
    Eq. 4.7 with the win probability set to 1 for the chosen and 0 for the rejected response; TRL's
    ``sppo_hard``): ``loss = (ratio_w - 1 / (2 beta))^2 + (ratio_l + 1 / (2 beta))^2``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``(2 - 1)^2 + (-1 + 1)^2 = 1``."""
    ratio_w, ratio_l = pair.logratios()
    half = 0.5 / s.beta
    return (ratio_w - half) ** 2 + (ratio_l + half) ** 2, *implicit_rewards(pair, s.beta)


def aot_loss(pair: PairLogps, s: LossSettings) -> Result:
    """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport";
    TRL's ``aot``): first-order stochastic dominance of the policy's margins over the reference's, by
    sorting: with ``d = log pi(y_w) - log pi(y_l)`` and ``d_ref`` the same under the reference, each sorted over
    the batch, ``loss_k = -(1 - eps) log sigmoid(beta z_k) - eps log sigmoid(-beta z_k)``, ``z = sort(d) -
    sort(d_ref)`` (eps = ``label_smoothing``). The k-th loss belongs to the k-th smallest margin, not to pair k:
    the mean over the batch is the loss; the sort spans the pairs passed (a micro-batch: TRL's
    ``per_device_train_batch_size``).

    Example: d = (3, 1), d_ref = (0, 2), beta 1 -> sorted (1, 3) - (0, 2) = (1, 1): loss ``0.31326`` each."""
    if pair.ref_chosen is None or pair.ref_rejected is None:
        raise ValueError("this loss needs the reference log-probs (ref_chosen, ref_rejected)")
    d, _ = torch.sort(pair.chosen - pair.rejected, dim=0)
    d_ref, _ = torch.sort(pair.ref_chosen - pair.ref_rejected, dim=0)
    return smoothed_logistic(s.beta * (d - d_ref), s.label_smoothing), *implicit_rewards(pair, s.beta)


def aot_unpaired_loss(pair: PairLogps, s: LossSettings) -> Result:
    """AOT, unpaired (Melnyk et al. 2024; TRL's ``aot_unpaired``): the chosen log-ratios' distribution
    dominates the rejected ones', by sorting each over the batch: ``z = sort(ratio_w) - sort(ratio_l)``,
    ``loss_k = -(1 - eps) log sigmoid(beta z_k) - eps log sigmoid(-beta z_k)``. As :func:`aot_loss`, the k-th loss
    is the k-th quantile's, and the sort spans the pairs passed.

    Example: ratio_w = (2, -1), ratio_l = (0, 1), beta 1 -> sorted (-1, 2) - (0, 1) = (-1, 1): losses ``1.31326``
    and ``0.31326``."""
    ratio_w, ratio_l = pair.logratios()
    z = torch.sort(ratio_w, dim=0)[0] - torch.sort(ratio_l, dim=0)[0]
    return smoothed_logistic(s.beta * z, s.label_smoothing), *implicit_rewards(pair, s.beta)


def apo_zero_terms(reward_w: Tensor, reward_l: Tensor) -> tuple[Tensor, Tensor]:
    """APO-zero's two terms, with ``r = beta ratio``: ``1 - sigmoid(r_w)`` (raise the chosen likelihood) and
    ``sigmoid(r_l)`` (lower the rejected one); each reads one response only.

    Example: ``r = (1, -0.5)`` -> ``(0.26894, 0.37754)``."""
    return 1.0 - torch.sigmoid(reward_w), torch.sigmoid(reward_l)


def apo_zero_loss(pair: PairLogps, s: LossSettings) -> Result:
    """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions", Eq. 7;
    TRL's ``apo_zero``): for chosen responses better than the model's own outputs, ``loss = (1 - sigmoid(beta
    ratio_w)) + sigmoid(beta ratio_l)``: the chosen likelihood goes up, the rejected one down, each anchored at 0.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``0.26894 + 0.37754 = 0.64648``."""
    ratio_w, ratio_l = pair.logratios()
    term_w, term_l = apo_zero_terms(s.beta * ratio_w, s.beta * ratio_l)
    return term_w + term_l, *implicit_rewards(pair, s.beta)


def apo_down_loss(pair: PairLogps, s: LossSettings) -> Result:
    """APO-down (D'Oosterlinck et al. 2024, Eq. 8; TRL's ``apo_down``): for chosen responses worse than the
    model's own outputs, ``loss = sigmoid(beta ratio_w) + (1 - sigmoid(beta (ratio_w - ratio_l)))``: both
    likelihoods go down, the rejected one more.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``sigmoid(1) + 1 - sigmoid(1.5) = 0.73106 + 0.18243 =
    0.91349``."""
    ratio_w, ratio_l = pair.logratios()
    loss = torch.sigmoid(s.beta * ratio_w) + (1.0 - torch.sigmoid(s.beta * (ratio_w - ratio_l)))
    return loss, *implicit_rewards(pair, s.beta)
