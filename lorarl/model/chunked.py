"""``log softmax(logits / T)`` of target tokens from hidden states, a chunk of positions at a time (each chunk
recomputed in backward), so the ``[B, T, V]`` fp32 logits never exist at once. Below both
:class:`~lorarl.model.shared.SharedBase` (its ``token_logprobs``) and :mod:`lorarl.model.logprobs` (the completion
paths), which use it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lorarl.core.chunking import logit_chunk_positions
from lorarl.core.distillation import generalized_jsd
from lorarl.core.losses import entropy_from_logprobs


def chunk_positions(rows: int, positions: int, chunk_size: int, chunk_tokens: int | None) -> int:
    """Positions per chunk: ``chunk_size``, fewer when ``rows`` x that would pass ``chunk_tokens``
    (:func:`~lorarl.core.chunking.logit_chunk_positions`; None: no token bound)."""
    if chunk_tokens is None or rows == 0:
        return chunk_size
    return logit_chunk_positions(rows, positions, chunk_size, chunk_tokens)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    entropy_grad: bool = True,
    token_stat: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(lm_head(h_t) / temperature)[targets_t], computed a chunk of positions at a time.

    hidden [B, T, H], targets [B, T] -> logprobs [B, T] fp32 (and entropy [B, T] if asked; ``lm_head`` maps hidden
    states to logits, the model's own logit transform included: :meth:`SharedBase.output_head`). Each chunk's logits are
    recomputed in the backward pass (activation checkpointing), so at most one chunk of ``[B, chunk, V]`` fp32
    logits is alive at a time, forward or backward. A chunk is ``chunk_size`` positions, fewer when the rows times
    that would pass ``chunk_tokens`` (:func:`~lorarl.core.chunking.logit_chunk_positions`; None: no token bound), so
    the logits alive at once stay bounded however many rows a scoring pass takes.

    When no gradient flows through the entropy (``with_entropy`` False, or ``entropy_grad`` False: the entropy is
    only logged), each chunk is one :class:`ChunkLogprobs` (forward without a graph; backward recomputes the logits
    and writes the log-softmax gradient into one fp32 buffer), so a chunk's backward holds the logits once instead
    of the several fp32 copies autograd would keep; its values and gradients are the checkpointed path's bit for bit
    (tests/test_model.py). ``entropy_grad`` True with an entropy: the checkpointed autograd path (an entropy bonus).

    ``token_stat``: another statistic of each position's distribution returned in the entropy's place (with
    ``with_entropy``), a function of ``log softmax`` ``[..., V]`` -> ``[...]`` (WPO's
    :func:`~lorarl.core.preference_scores.log_sum_sq_probs`); None: the entropy.
    """

    def one_chunk(h: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lm_head(h).float() / temperature  # [B, c, V]
        lse = torch.logsumexp(logits, dim=-1)  # [B, c]
        lp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:  # -inf logits (banned tokens) give 0, not NaN
            ent = (token_stat or entropy_from_logprobs)(logits - lse.unsqueeze(-1))
        else:
            ent = torch.zeros_like(lse)
        return lp, ent

    rows, positions = hidden.shape[0], hidden.shape[1]
    step = chunk_positions(rows, positions, chunk_size, chunk_tokens)
    outs_lp, outs_ent = [], []
    for s in range(0, positions, step):
        h, tgt = hidden[:, s : s + step], targets[:, s : s + step]
        if torch.is_grad_enabled() and h.requires_grad and not (with_entropy and entropy_grad):
            lp, ent = ChunkLogprobs.apply(h, tgt, lm_head, temperature, with_entropy, token_stat)
        elif torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, tgt, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, tgt)
        outs_lp.append(lp)
        outs_ent.append(ent)
    lp = torch.cat(outs_lp, dim=1)
    return lp, (torch.cat(outs_ent, dim=1) if with_entropy else None)


class ChunkLogprobs(torch.autograd.Function):
    """One chunk's ``lp_t = x_t[y_t] - logsumexp(x_t)`` with ``x = head(h).float() / T`` (and the entropy, without a
    gradient), saving only ``h``, the targets and ``logsumexp``.

    Backward recomputes ``x`` and forms ``dL/dx = g (onehot(y) - softmax(x))`` in that one fp32 buffer, in place
    (``exp(x - lse) * (-g)``, then ``+ g`` at the target), divides by ``T``, casts to the head's dtype and runs the
    head's backward: the same operations, in the same order, as autograd's ``LogsumexpBackward`` +
    ``GatherBackward`` + ``DivBackward`` + ``ToCopyBackward`` on the checkpointed path, so the gradient is equal bit
    for bit, but the chunk's backward holds the head's output and one fp32 copy of the logits instead of the fp32
    logits, their ``/ T`` copy, the exp of logsumexp's backward, the gather's scatter buffer and their sum. Liger's
    fused linear cross entropy does the same for one fixed loss; its kernels take no logit transform (soft-capping,
    a scaled head) and no temperature, so lorarl keeps the model's own head (:meth:`SharedBase.output_head`).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, tgt: torch.Tensor, head, temperature: float, with_entropy: bool, token_stat=None):
        with torch.no_grad():  # no graph, so the fp32 logits are divided and shifted in place (same values)
            logits = head(h).float().div_(temperature)  # [B, c, V]
            lse = torch.logsumexp(logits, dim=-1)  # [B, c]
            lp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy and token_stat is not None:
                ent = token_stat(logits.sub_(lse.unsqueeze(-1)))
            elif with_entropy:  # entropy_from_logprobs, in place: -sum exp(lp') lp', lp' = max(x - lse, finfo.min)
                logp = logits.sub_(lse.unsqueeze(-1)).clamp_(min=torch.finfo(logits.dtype).min)
                ent = -logp.exp().mul_(logp).sum(dim=-1)
            else:
                ent = torch.zeros_like(lse)
            del logits
        ctx.save_for_backward(h, tgt, lse)
        ctx.head, ctx.temperature = head, temperature
        ctx.autocast = (torch.is_autocast_enabled(h.device.type), torch.get_autocast_dtype(h.device.type))
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, grad_ent: torch.Tensor | None):
        h, tgt, lse = ctx.saved_tensors
        h_in = h.detach().requires_grad_(h.requires_grad)
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(h.device.type, dtype=dtype, enabled=enabled):
            out = ctx.head(h_in)  # [B, c, V] in the head's dtype, with the head's graph
        with torch.no_grad():
            g = grad_lp.float()
            dx = out.float() / ctx.temperature  # x, as the forward computed it
            dx.sub_(lse.unsqueeze(-1)).exp_().mul_((-g).unsqueeze(-1))  # logsumexp's share: -g softmax(x)
            dx.scatter_add_(-1, tgt.unsqueeze(-1), g.unsqueeze(-1))  # the gather's share: + g at the target
            d_out = dx.div_(ctx.temperature).to(out.dtype)
            del dx
        torch.autograd.backward(out, d_out)  # into h_in.grad and any trainable parameter of the head
        return h_in.grad, None, None, None, None, None


def chunked_divergence(
    student_hidden: torch.Tensor,
    student_head: nn.Module,
    teacher_hidden: torch.Tensor,
    teacher_head: nn.Module,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 256,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's per-token divergence (:func:`lorarl.core.distillation.generalized_jsd`) and the
    student's entropy, from both models' hidden states, a chunk of positions at a time.

    student_hidden [B, T, H_S] (with gradient), teacher_hidden [B, T, H_T] (without) -> divergence [B, T] fp32 and
    entropy [B, T] fp32 (the student's ``softmax(logits / temperature)``, no gradient: TRL's ``entropy`` metric).
    Each head maps its model's hidden states to logits, the model's logit transform included
    (:meth:`SharedBase.output_head`). A chunk holds the student's and the teacher's ``[B, c, V]`` logits (``c`` as
    :func:`chunked_token_logprobs` sizes it) and is recomputed in the backward pass (activation checkpointing), so
    one chunk of the two models' logits is alive at a time, forward or backward; the teacher's logits never carry a
    graph. Values and gradients equal the unchunked computation's (tests/test_distill.py).
    """

    def one_chunk(h_s: torch.Tensor, h_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s_logits = student_head(h_s)  # [B, c, V_S]
        with torch.no_grad():
            t_logits = teacher_head(h_t)  # [B, c, V_T]
            ent = entropy_from_logprobs(torch.log_softmax(s_logits.detach().float() / temperature, dim=-1))
        return generalized_jsd(s_logits, t_logits, beta, temperature), ent

    rows, positions = student_hidden.shape[0], student_hidden.shape[1]
    step = chunk_positions(rows, positions, chunk_size, chunk_tokens)
    outs_div, outs_ent = [], []
    for s in range(0, positions, step):
        h_s, h_t = student_hidden[:, s : s + step], teacher_hidden[:, s : s + step].detach()
        if torch.is_grad_enabled() and h_s.requires_grad:
            div, ent = checkpoint(one_chunk, h_s, h_t, use_reentrant=False)
        else:
            div, ent = one_chunk(h_s, h_t)
        outs_div.append(div)
        outs_ent.append(ent)
    if not outs_div:  # no positions
        empty = student_hidden.new_zeros((rows, 0), dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(outs_div, dim=1), torch.cat(outs_ent, dim=1)
