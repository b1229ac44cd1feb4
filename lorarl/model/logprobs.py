"""Log-probs of completion tokens under the active role: the forward paths, all exact rewrites of one full forward.

* :func:`~lorarl.model.chunked.chunked_token_logprobs` (below :class:`~lorarl.model.shared.SharedBase`, which
  uses it): ``log softmax(logits / T)`` of the target tokens from hidden states, a chunk of positions at a time.
* :func:`completion_logprobs`: picks the path for a batch of completions --
  the full forward (every row ``[prompt | completion]``), the **prefix-shared** forward (each distinct prompt once,
  its keys / values indexed out to the rows that share it; needs a KV cache, so no activation checkpointing), or the
  **packed** forward (a prompt's completions packed behind one copy of it with a 4-D attention mask; works under
  activation checkpointing).

A batch is anything with the fields of :class:`TokenBatch` (a :class:`lorarl.batch.Rollout` is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from lorarl.errors import LorarlError
from lorarl.model.kvcache import cache_arg, output_cache
from lorarl.model.tokens import position_ids

if TYPE_CHECKING:
    from lorarl.model.shared import SharedBase


class TokenBatch(Protocol):
    """Prompts and completions, grouped by prompt.

    prompt_ids / prompt_mask:         ``[B, P]`` left padded (mask True on prompt tokens).
    completion_ids / completion_mask: ``[B, T]`` right padded (mask True through the first EOS).
    prompt_index:                     ``B`` labels; rows with the same label share the same prompt.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    prompt_index: list[int]

    def __len__(self) -> int: ...


def joined(batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """``(input_ids [B, P + T], attention_mask [B, P + T] long)``: prompt then completion, through the first EOS."""
    return (
        torch.cat([batch.prompt_ids, batch.completion_ids], dim=1),
        torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).long(),
    )


def prompt_groups(prompt_index: list[int]) -> tuple[list[int], Tensor]:
    """Rows that share a prompt: ``(first row of each distinct prompt [U], row -> distinct prompt [B])``.

    Example: ``[7, 7, 3, 7]`` -> ``([0, 2], tensor([0, 0, 1, 0]))``.
    """
    first: dict[int, int] = {}
    inverse = []
    for p in prompt_index:
        if p not in first:
            first[p] = len(first)
        inverse.append(first[p])
    starts = [prompt_index.index(p) for p in first]
    return starts, torch.as_tensor(inverse, dtype=torch.long)


def select_cache_rows(cache, rows: Tensor) -> None:
    """Row ``i`` of every layer's keys / values becomes row ``rows[i]`` of what it was (``[U, ...] -> [B, ...]``).

    transformers' ``batch_select_indices`` does the same with advanced indexing, whose backward on CPU
    (``index_put_`` with accumulation) adds the rows that share a prompt with parallel atomic adds when more than one
    thread runs: the order of the additions, and so the last bits of the gradient, change from run to run
    (measured: a 4-step quickstart run's adapter differed by up to 9e-7 between two identical runs).
    ``index_select``'s backward (``index_add_``) adds them in row order, the same on every run."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def attention_window(config) -> int | None:
    """The shortest attention window of any layer of a transformers config, in tokens (None: every layer attends
    to the whole sequence). Sliding-window layers (``layer_types`` with ``sliding_attention``: Gemma 2/3, Cohere 2;
    or a ``sliding_window`` applied to every layer: Mistral, Phi-3) see the last ``sliding_window`` positions;
    chunked layers (``chunked_attention``) their ``attention_chunk_size`` chunk.

    Example: Gemma-2 (``layer_types`` alternating sliding / full, ``sliding_window`` 4096) -> 4096; Qwen2 with
    ``use_sliding_window: false`` -> None; Llama -> None.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or [])
    sizes = []
    if "sliding_attention" in types or (not types and getattr(text, "use_sliding_window", True)):
        sizes.append(getattr(text, "sliding_window", None))
    if "chunked_attention" in types:
        sizes.append(getattr(text, "attention_chunk_size", None))
    sizes = [int(s) for s in sizes if s]
    return min(sizes) if sizes else None


def completion_logprobs(
    shared: SharedBase,
    batch: TokenBatch,
    temperature: float,
    with_entropy: bool = False,
    share_prompts: bool = True,
    entropy_grad: bool = True,
    token_stat=None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[B, T]`` (and entropies) of the completion tokens of ``batch`` under the active role, with
    gradients if enabled (the entropy's only if ``entropy_grad``: an entropy that is only logged costs a chunk's
    backward no memory, :func:`~lorarl.model.chunked.chunked_token_logprobs`).

    With ``share_prompts`` each distinct prompt runs through the model once: its keys / values are indexed out to
    the rows that share it (an exact rewrite of the full forward -- gradients flow back through the shared prompt
    once per row, summed), and the completions run on top. For a group of ``G`` completions of a ``P``-token
    prompt this processes ``P + G*T`` tokens instead of ``G*(P + T)``. With gradient checkpointing on in train mode
    (no cache there) the completions are packed behind their prompt instead (:func:`packed_completion_logprobs`).
    Falls back to one full forward when the prompts are all distinct, or under checkpointing with an attention
    implementation that takes no 4-D mask (sdpa and eager do) or with layers whose attention window
    (:func:`attention_window`) is shorter than a row: the packs' mask would let those layers see past their window
    (measured on a tiny Gemma-2 with an 8-token window: 0.11 nats per token from what the sampler drew with).
    ``token_stat`` (with ``with_entropy``): another per-position statistic in the entropy's place
    (:func:`~lorarl.model.chunked.chunked_token_logprobs`).
    """
    P = batch.prompt_ids.shape[1]
    starts, inverse = prompt_groups(batch.prompt_index)
    checkpointing = shared.module.training and shared.cfg.gradient_checkpointing
    window = attention_window(shared.base.config)
    # a 4-D mask replaces every layer's own mask: exact only when no layer's window cuts a row short
    packs_exact = shared.attn_implementation in ("sdpa", "eager") and (
        window is None or window >= P + batch.completion_ids.shape[1]
    )
    if not share_prompts or len(starts) == len(batch) or P < 2 or (checkpointing and not packs_exact):
        ids, att = joined(batch)
        return shared.token_logprobs(
            ids.to(shared.device), att.to(shared.device), P, temperature, with_entropy, entropy_grad, token_stat
        )
    if checkpointing:
        return packed_completion_logprobs(
            shared, batch, temperature, with_entropy, entropy_grad=entropy_grad, token_stat=token_stat
        )
    from transformers import DynamicCache

    dev = shared.device
    decoder = shared.decoder()
    starts_t = torch.as_tensor(starts, dtype=torch.long)
    p_ids, p_mask = batch.prompt_ids[starts_t].to(dev), batch.prompt_mask[starts_t].long().to(dev)  # [U, P]
    p_pos = position_ids(p_mask)
    out = decoder(
        input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, **cache_arg(DynamicCache()), use_cache=True
    )
    cache = output_cache(out)
    rows = inverse.to(dev)
    select_cache_rows(cache, rows)  # [U, ...] -> [B, ...], differentiable, deterministic backward
    full_mask = joined(batch)[1].to(dev)  # [B, P + T]
    c_pos = position_ids(full_mask)[:, P:]  # [B, T]
    c_out = decoder(
        input_ids=batch.completion_ids.to(dev),
        attention_mask=full_mask,
        position_ids=c_pos,
        **cache_arg(cache),
        use_cache=True,
    )
    last_prompt = out.last_hidden_state[:, -1:].index_select(0, rows)  # [B, 1, H]: predicts completion token 0
    hidden = torch.cat([last_prompt, c_out.last_hidden_state[:, :-1]], dim=1)  # [B, T, H]: state before token t
    targets = batch.completion_ids.to(dev)
    return shared.hidden_logprobs(hidden, targets, temperature, with_entropy, entropy_grad, token_stat)


PACK_TOKENS = 1024  # a pack holds one prompt and as many of its completions as fit in this many tokens


@dataclass
class PrefixPacks:
    """Completions packed behind their shared prompt, one pack per row (see :func:`pack_completions`).

    input_ids [R, L], position_ids [R, L] long; attention_mask [R, 1, L, L] bool (True: query may attend to key);
    pack [B, T] and column [B, T] long: where the hidden state that predicts completion token ``(b, t)`` sits.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    pack: Tensor
    column: Tensor


def pack_completions(batch: TokenBatch, pad_id: int, pack_tokens: int = PACK_TOKENS) -> PrefixPacks:
    """Lay out the rows of ``batch`` as packs ``[prompt | completion 1 | completion 2 | ...]``: each distinct
    prompt is written once and its completions follow it (only their masked tokens). Every completion token
    attends to the whole prompt and causally to its own completion, never to a sibling; its position id continues
    the prompt's (``p, p+1, ...``), so each completion sees exactly what it sees in its own row. A pack is closed
    when the next completion would take it past ``pack_tokens`` (a pack always takes at least one completion).
    Padding attends only to itself (no empty softmax rows).

    Example: prompt ``[a, b]``, completions ``[x, y]`` and ``[z]`` -> ids ``[a, b, x, y, z]``, positions
    ``[0, 1, 2, 3, 2]``; ``z`` attends to ``a, b, z``; ``x`` is predicted at column 1 (``b``), ``y`` at 2, ``z`` at 1.
    """
    B, T = batch.completion_ids.shape
    packs: list[tuple[list[int], list[int], list[int]]] = []  # (ids, positions, segment: -1 prompt, k completion k)
    pack_of = torch.zeros(B, T, dtype=torch.long)
    column_of = torch.zeros(B, T, dtype=torch.long)
    open_pack: dict[int, int] = {}  # prompt index -> its pack still taking completions
    for b in range(B):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b]].tolist()
        completion = batch.completion_ids[b][batch.completion_mask[b]].tolist()
        key = batch.prompt_index[b]
        k = open_pack.get(key)
        if k is None or len(packs[k][0]) + len(completion) > max(pack_tokens, len(prompt) + len(completion)):
            k = len(packs)
            packs.append((list(prompt), list(range(len(prompt))), [-1] * len(prompt)))
            open_pack[key] = k
        ids, pos, seg = packs[k]
        p, start = len(prompt), len(ids)
        ids.extend(completion)
        pos.extend(range(p, p + len(completion)))
        seg.extend([b] * len(completion))
        pack_of[b] = k
        cols = torch.arange(T) + start - 1  # token t is predicted by the state just before it ...
        cols[0] = p - 1  # ... and the first one by the prompt's last token
        column_of[b] = cols.clamp(max=max(start + len(completion) - 1, p - 1))
    L = max(len(ids) for ids, _, _ in packs)
    R = len(packs)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segment = torch.full((R, L), -2, dtype=torch.long)  # -2: padding
    for r, (ids, pos, seg) in enumerate(packs):
        input_ids[r, : len(ids)] = torch.as_tensor(ids)
        position_ids[r, : len(ids)] = torch.as_tensor(pos)
        segment[r, : len(ids)] = torch.as_tensor(seg)
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]  # [R, L, 1], [R, 1, L]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = (k_seg == q_seg) & (q_seg != -2)
    allowed = causal & ((k_seg == -1) | same)
    allowed |= torch.eye(L, dtype=torch.bool)  # padding rows see themselves
    return PrefixPacks(input_ids, position_ids, allowed[:, None], pack_of, column_of)


def packed_completion_logprobs(
    shared: SharedBase,
    batch: TokenBatch,
    temperature: float,
    with_entropy: bool = False,
    pack_tokens: int = PACK_TOKENS,
    entropy_grad: bool = True,
    token_stat=None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`completion_logprobs` through prompt-sharing packs (:func:`pack_completions`): one plain forward with
    a 4-D attention mask and no cache, so it works under activation checkpointing. For ``G`` completions of a
    ``P``-token prompt the model runs ``P + sum(lengths)`` tokens instead of ``G * (P + T)``. Positions past a
    row's completion mask get log-prob (and entropy) 0."""
    dev = shared.device
    packs = pack_completions(batch, shared.tokenizer.pad_token_id, pack_tokens)
    decoder = shared.decoder()
    dtype = decoder.get_input_embeddings().weight.dtype
    allowed = packs.attention_mask.to(dev)  # moved as bool: a quarter of fp32's bytes
    bias = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    out = decoder(  # an additive 4-D mask: eager and sdpa both take it
        input_ids=packs.input_ids.to(dev),
        attention_mask=bias,
        position_ids=packs.position_ids.to(dev),
        use_cache=False,
    )
    R, L, H = out.last_hidden_state.shape
    where = (packs.pack * L + packs.column).to(dev)  # [B, T] flat positions in the packs
    hidden = out.last_hidden_state.reshape(R * L, H).index_select(0, where.reshape(-1)).view(*where.shape, H)
    mask = batch.completion_mask.to(dev)
    targets = batch.completion_ids.to(dev)
    lp, ent = shared.hidden_logprobs(hidden, targets, temperature, with_entropy, entropy_grad, token_stat)
    lp = lp.masked_fill(~mask, 0.0)
    return lp, (ent.masked_fill(~mask, 0.0) if ent is not None else None)


PACKED_ATTENTION = ("sdpa", "eager")  # attention implementations transformers builds a packed-sequence mask for


def packed_logprobs(shared: SharedBase, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """``log p(input_ids[:, t] | its segment's tokens before t)`` for ``t >= 1``: ``[R, L - 1]`` fp32 under the active
    role (temperature 1), with gradients if enabled. Rows are packed examples (SFT packing,
    :mod:`lorarl.data.packing`): ``position_ids [R, L]`` restart at 0 at each example (segment).

    No attention mask is passed, so transformers builds the block-diagonal causal mask from the position ids, as
    for TRL's padding-free batches (``masking_utils.find_packed_sequence_indices``: a new segment wherever a position
    is not its predecessor's + 1; every family lorarl supports passes its position ids to its mask builder, and
    sliding-window layers keep their window inside the segment). A token never attends across segments, and sees
    the positions it has unpacked: the same log-probs as each example's own forward. Flash-attention reads packing
    from position ids only for a batch of one row: refused."""
    if shared.attn_implementation not in PACKED_ATTENTION:
        raise LorarlError(
            f"sft.packing: the base runs attention implementation {shared.attn_implementation!r}; lorarl packs with "
            f"{' or '.join(PACKED_ATTENTION)} (transformers' packed-sequence mask): set sft.packing: false"
        )
    dev = shared.device
    ids = input_ids.to(dev)
    out = shared.decoder()(input_ids=ids, attention_mask=None, position_ids=position_ids.to(dev), use_cache=False)
    return shared.hidden_logprobs(out.last_hidden_state[:, :-1], ids[:, 1:], 1.0)[0]
