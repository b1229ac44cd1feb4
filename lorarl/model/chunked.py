"""``log softmax(logits / T)`` of target tokens from hidden states, a chunk of positions at a time (each chunk
recomputed in backward), so the ``[B, T, V]`` fp32 logits never exist at once. Below both
:class:`~lorarl.model.shared.SharedBase` (its ``token_logprobs``) and :mod:`lorarl.model.logprobs` (the completion
paths), which use it."""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(lm_head(h_t) / temperature)[targets_t], computed a chunk of positions at a time.

    hidden [B, T, H], targets [B, T] -> logprobs [B, T] fp32 (and entropy [B, T] if asked; ``lm_head`` maps hidden
    states to logits, the model's own logit transform included: :meth:`SharedBase.output_head`). Each chunk's logits are
    recomputed in the backward pass (activation checkpointing), so at most one chunk of ``[B, chunk, V]`` fp32
    logits is alive at a time, forward or backward. A chunk is ``chunk_size`` positions, fewer when the rows times
    that would pass ``chunk_tokens`` (:func:`~lorarl.core.chunking.logit_chunk_positions`; None: no token bound), so
    the logits alive at once stay bounded however many rows a scoring pass takes.
    """

    def one_chunk(h: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lm_head(h).float() / temperature  # [B, c, V]
        lse = torch.logsumexp(logits, dim=-1)  # [B, c]
        lp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:  # -inf logits (banned tokens) give 0, not NaN
            ent = entropy_from_logprobs(logits - lse.unsqueeze(-1))
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
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, tgt, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, tgt)
        outs_lp.append(lp)
        outs_ent.append(ent)
    lp = torch.cat(outs_lp, dim=1)
    return lp, (torch.cat(outs_ent, dim=1) if with_entropy else None)
