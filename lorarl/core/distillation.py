"""On-policy distillation's loss: the generalized Jensen-Shannon divergence between the student's and the teacher's
next-token distributions, per token (GKD: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes", ICLR 2024, Eq. 1; TRL's ``DistillationTrainer``).

Pure functions on logits: :mod:`lorarl.model.chunked` feeds them one chunk of positions at a time (the ``[B, T, V]``
logits of the two models never exist at once) and the reduction is :func:`lorarl.core.losses.reduce_loss`'s
``token_mean`` over the whole step, as TRL reduces (the sum over the step's completion tokens divided by their
count).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["generalized_jsd"]


def _clamped(logp: Tensor) -> Tensor:
    """``log p`` clamped at the dtype's most negative finite value, so a token of probability 0 (a ``-inf`` logit)
    contributes ``0 * finite = 0`` to a divergence instead of ``0 * inf = NaN``."""
    return torch.clamp(logp, min=torch.finfo(logp.dtype).min)


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """The generalized JSD of each position's next-token distributions, summed over the vocabulary (nats).

    With ``log p_S = log_softmax(z_S / tau)`` (student), ``log p_T = log_softmax(z_T / tau)`` (teacher) and TRL's
    ``beta`` (the GKD paper's, with ``P`` the teacher and ``Q`` the student):

    * ``beta = 0``: the forward KL ``KL(p_T || p_S) = sum_v p_T (log p_T - log p_S)`` (mode covering);
    * ``beta = 1``: the reverse KL ``KL(p_S || p_T) = sum_v p_S (log p_S - log p_T)`` (mode seeking);
    * ``0 < beta < 1``: ``JSD(beta) = beta KL(p_T || m) + (1 - beta) KL(p_S || m)`` with the mixture
      ``m = beta p_T + (1 - beta) p_S``; ``beta = 0.5`` is the Jensen-Shannon divergence.

    The two ends are TRL's (and the paper's section 3.1 limits taken as the KLs themselves, unscaled): ``JSD(beta)``
    itself tends to 0, not to a KL, as ``beta`` tends to 0 or 1, so the loss's scale jumps at the two ends. The
    gradient reaches the student only through ``student_logits`` (pass the teacher's detached). Both logits are
    compared over their common vocabulary width ``V = min(V_S, V_T)`` (a model's head may be padded past its
    tokenizer, e.g. Qwen2.5-7B's 152,064 beside Qwen2.5-0.5B's 151,936; TRL refuses unequal widths).

    Shapes: ``student_logits`` ``[..., V_S]``, ``teacher_logits`` ``[..., V_T]`` -> ``[...]`` fp32.

    Example (hand-computed): ``p_S = [0.5, 0.5]`` (logits ``[0, 0]``), ``p_T = [0.8, 0.2]`` (logits ``[ln 4, 0]``):
    beta 0 -> ``0.8 ln 1.6 + 0.2 ln 0.4 = 0.192745``; beta 1 -> ``0.5 ln(5/8) + 0.5 ln(5/2) = 0.223144``;
    beta 0.5 -> ``m = [0.65, 0.35]``, ``0.5 (0.054188) + 0.5 (0.047155) = 0.050672``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    width = min(student_logits.shape[-1], teacher_logits.shape[-1])
    log_s = torch.log_softmax(student_logits[..., :width].float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits[..., :width].float() / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (_clamped(log_t) - _clamped(log_s))).sum(dim=-1)
    if beta == 1.0:
        return (log_s.exp() * (_clamped(log_s) - _clamped(log_t))).sum(dim=-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))  # log(beta p_T + (1 - beta) p_S)
    kl_teacher = (log_t.exp() * (_clamped(log_t) - _clamped(log_m))).sum(dim=-1)
    kl_student = (log_s.exp() * (_clamped(log_s) - _clamped(log_m))).sum(dim=-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student
