"""Direct preference losses (layer 0: torch only, no I/O): DPO and its common variants, by TRL's names.

Every loss takes the summed response log-probs of a batch of pairs (:class:`PairLogps`) and returns the per-pair
loss ``[B]`` and the implicit rewards of the chosen and rejected responses ``[B]`` (what TRL logs as
``rewards/chosen`` / ``rewards/rejected``). The batch loss is the mean over pairs (TRL's); an algorithm that splits a
batch into micro-batches divides each micro-batch's sum by the batch's pair count.

With ``pi`` the policy, ``ref`` the reference, ``y_w`` / ``y_l`` the chosen / rejected response to prompt ``x``,
``log pi(y|x)`` the SUM of the response tokens' log-probs and ``|y|`` its token count:

* ``h = [log pi(y_w|x) - log ref(y_w|x)] - [log pi(y_l|x) - log ref(y_l|x)]`` (the difference of log-ratios);
* ``sigmoid`` (DPO, Rafailov et al. 2023, Eq. 7; with label smoothing eps the conservative DPO of Mitchell 2023):
  ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
* ``hinge`` (SLiC, Zhao et al. 2023): ``loss = max(0, 1 - beta h)``;
* ``ipo`` (Azar et al. 2023, Eq. 17, with TRL's length normalisation: each log-ratio divided by its response's
  token count): ``loss = (h_avg - 1 / (2 beta))^2``, ``h_avg = ratio_w / |y_w| - ratio_l / |y_l|``;
* ``simpo`` (Meng et al. 2024, Eq. 6; reference-free and length-normalised, TRL: ``CPOTrainer`` with
  ``loss_type="simpo"``): ``loss = -(1 - eps) log sigmoid(beta m - gamma) - eps log sigmoid(-(beta m - gamma))``,
  ``m = log pi(y_w|x) / |y_w| - log pi(y_l|x) / |y_l|``.

* ``sft`` (TRL 1.x's ``sft`` loss type, only beside one of the above, weighted by ``loss_weights``: RPO / MPO): the
  chosen responses' NLL, a token mean over the batch (:func:`sft_term`, :func:`combined_loss`).

Implicit rewards: ``beta * (log pi(y|x) - log ref(y|x))`` for the reference-based losses (TRL's DPOTrainer logs
this for every loss type); ``beta * log pi(y|x) / |y|`` for ``simpo`` (TRL's CPOTrainer).

Label smoothing: TRL 1.x's DPOTrainer reads ``label_smoothing`` only in its ``robust`` / ``exo_pair`` losses; the
smoothed sigmoid above is TRL's CPOTrainer ``sigmoid`` / ``simpo`` and TRL 0.x's DPO ``sigmoid``. ``hinge`` and
``ipo`` take none (the recipe refuses one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PairLogps",
    "PreferenceLoss",
    "PREFERENCE_LOSSES",
    "sigmoid_loss",
    "hinge_loss",
    "ipo_loss",
    "simpo_loss",
    "preference_loss",
    "SFT",
    "sft_term",
    "combined_loss",
]

PreferenceLoss = Literal["sigmoid", "hinge", "ipo", "simpo"]


@dataclass
class PairLogps:
    """Summed response log-probs of ``B`` pairs, all ``[B]`` fp32.

    chosen / rejected:          ``log pi(y|x)``, the sum over the response's tokens under the policy;
    ref_chosen / ref_rejected:  the same under the reference (None for a reference-free loss);
    chosen_tokens / rejected_tokens: ``|y|``, the response's token count (EOS included), as floats.
    """

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None

    def logratios(self) -> tuple[Tensor, Tensor]:
        """``(log pi(y_w) - log ref(y_w), log pi(y_l) - log ref(y_l))``, each ``[B]``."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("this loss needs the reference log-probs (ref_chosen, ref_rejected)")
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected


def _smoothed_logistic(z: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`` (eps = 0: the plain logistic loss)."""
    loss = -F.logsigmoid(z) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-z) * label_smoothing
    return loss


def sigmoid_loss(
    pair: PairLogps, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO (Rafailov et al. 2023, Eq. 7), conservative with ``label_smoothing`` eps (Mitchell 2023):
    ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, ``h = ratio_w - ratio_l``.

    Shapes: every field of ``pair`` ``[B]`` -> ``(loss [B], chosen_rewards [B], rejected_rewards [B])``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.5 -> ``h = 3``, loss ``-log sigmoid(1.5) = 0.20141``; rewards
    ``1.0`` and ``-0.5``. With eps = 0.1: ``0.9 * 0.20141 + 0.1 * 1.70141 = 0.35141``.
    """
    ratio_w, ratio_l = pair.logratios()  # [B], [B]
    loss = _smoothed_logistic(beta * (ratio_w - ratio_l), label_smoothing)
    return loss, beta * ratio_w.detach(), beta * ratio_l.detach()


def hinge_loss(
    pair: PairLogps, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Hinge loss on the log-ratio difference (SLiC, Zhao et al. 2023; TRL's ``hinge``):
    ``loss = max(0, 1 - beta h)``, ``h = ratio_w - ratio_l``.

    Example: ratio_w = 2, ratio_l = -1, beta = 0.1 -> ``max(0, 1 - 0.3) = 0.7``; beta = 0.5 -> ``0``.
    """
    ratio_w, ratio_l = pair.logratios()
    loss = (1.0 - beta * (ratio_w - ratio_l)).clamp(min=0.0)
    return loss, beta * ratio_w.detach(), beta * ratio_l.detach()


def ipo_loss(
    pair: PairLogps, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al. 2023, Eq. 17; beta is the paper's tau), each log-ratio divided by its response's token
    count as TRL does: ``loss = (ratio_w / |y_w| - ratio_l / |y_l| - 1 / (2 beta))^2``.

    Example: ratio_w = 2 over 4 tokens, ratio_l = -1 over 2 tokens, beta = 0.5 -> ``(0.5 + 0.5 - 1)^2 = 0``;
    beta = 1 -> ``(1 - 0.5)^2 = 0.25``. Rewards are ``beta * ratio`` (unnormalised, as TRL logs them).
    """
    ratio_w, ratio_l = pair.logratios()
    h_avg = ratio_w / pair.chosen_tokens.clamp(min=1.0) - ratio_l / pair.rejected_tokens.clamp(min=1.0)
    loss = (h_avg - 1.0 / (2.0 * beta)) ** 2
    return loss, beta * ratio_w.detach(), beta * ratio_l.detach()


def simpo_loss(
    pair: PairLogps, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5
) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al. 2024, Eq. 6): reference-free, length-normalised, with a target margin ``gamma``:
    ``loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``, ``z = beta (log pi(y_w) / |y_w| - log pi(y_l) /
    |y_l|) - gamma`` (TRL's CPOTrainer ``simpo``: its ``simpo_gamma`` is gamma, ``logits - gamma / beta`` scaled by
    beta). Implicit rewards ``beta * log pi(y) / |y|``.

    Example: log pi(y_w) = -4 over 4 tokens, log pi(y_l) = -6 over 2 tokens, beta = 2, gamma = 0.5 ->
    ``z = 2 (-1 + 3) - 0.5 = 3.5``, loss ``-log sigmoid(3.5) = 0.02975``; rewards ``-2`` and ``-6``.
    """
    avg_w = pair.chosen / pair.chosen_tokens.clamp(min=1.0)
    avg_l = pair.rejected / pair.rejected_tokens.clamp(min=1.0)
    loss = _smoothed_logistic(beta * (avg_w - avg_l) - gamma, label_smoothing)
    return loss, beta * avg_w.detach(), beta * avg_l.detach()


PREFERENCE_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
}
SFT = "sft"  # TRL's `sft` loss type: an NLL term on the chosen responses, combined with a preference loss


def sft_term(pair: PairLogps, batch_pairs: int, batch_chosen_tokens: float) -> Tensor:
    """TRL's ``sft`` loss type (the chosen responses' NLL, a token mean over the batch), spread over the pairs:
    ``s_i = -log pi(y_w,i|x_i) * N / T_w``, with ``N`` the batch's pairs and ``T_w`` its chosen response tokens, so
    that ``mean_i s_i`` over the batch is ``-sum_i log pi(y_w,i|x_i) / T_w`` = TRL's
    ``-chosen_per_token_logps[chosen_mask].mean()``. A micro-batch passes its batch's ``N`` and ``T_w``.

    Example: two pairs, log pi(y_w) = -2 over 4 tokens and -6 over 4 tokens -> ``s = (2 * 2 / 8, 6 * 2 / 8) = (0.5,
    1.5)``, mean ``1.0`` = ``8 / 8``.
    """
    return -pair.chosen * (batch_pairs / batch_chosen_tokens)


def combined_loss(
    pair: PairLogps,
    losses: tuple[tuple[str, float], ...],
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    batch_pairs: int | None = None,
    batch_chosen_tokens: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """TRL 1.x's weighted sum of loss types (``loss_type: [sigmoid, sft]`` with ``loss_weights``, e.g. RPO / MPO):
    ``loss_i = sum_k w_k l_k(i) + w_sft s_i`` per pair (:func:`sft_term` for ``sft``, the registered losses for the
    others), so the batch's mean over pairs is ``sum_k w_k mean_i l_k(i) + w_sft NLL_w`` as TRL computes it.
    Implicit rewards: the first preference loss's. ``batch_pairs`` / ``batch_chosen_tokens``: the batch the pairs
    belong to (default: ``pair`` is the whole batch).

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
            part, rc, rr = PREFERENCE_LOSSES[name](pair, beta=beta, label_smoothing=label_smoothing, gamma=gamma)
            rewards = rewards or (rc, rr)
        total = part * weight if total is None else total + part * weight
    if total is None or rewards is None:
        raise ValueError(f"loss types {[n for n, _ in losses]}: at least one preference loss is needed besides sft")
    return total, rewards[0], rewards[1]


def preference_loss(name: str) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The loss registered as ``name`` (chosen once at set-up): ``fn(pair, beta, label_smoothing, gamma)``."""
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(f"preference loss must be one of {tuple(PREFERENCE_LOSSES)}, got {name!r}") from None
