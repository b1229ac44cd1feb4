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
from lorarl.core.losses import entropy_from_logprobs


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
    step = (
        chunk_size
        if chunk_tokens is None or rows == 0
        else logit_chunk_positions(rows, positions, chunk_size, chunk_tokens)
    )
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
