"""The decode state of the fast engine: a static KV cache and fixed buffers, and the one decode step that reads and
writes only them.

Layout for ``N`` rows, prompts left padded to ``P`` columns, at most ``C`` new tokens, a cache of ``Lc`` columns
(:func:`~lorarl.rollout.fast.sampling.cache_length`):

* the prompts are prefilled once per distinct prompt (``M`` of them) into a ``DynamicCache``; each layer's keys and
  values are then copied to the ``N`` rows that share them (columns ``[0, P)`` of transformers' ``StaticCache``);
* completion token ``s`` is drawn from the logits of the input at cache column ``P + s - 1`` (token 0 from the
  prefill's last position); the input token of a decode step is written at column ``col``, with position id
  ``col - P + n_i`` (``n_i`` the row's real prompt tokens: what ``generate`` uses for left-padded rows);
* the attention mask is a 4-D additive buffer ``[N, 1, 1, Lc]`` (transformers uses a 4-D mask as it is): 0 on
  each row's prompt tokens, the dtype's most negative value on its padding and on every column not written yet; a
  step first opens column ``col`` for every row (one ``index_fill_``), so row ``n`` attends to
  ``prompt_mask[n, j] or P <= j <= col``;
* the step draws the next token on the device, writes it (pad for rows that ended) and its log-prob into column
  ``s`` of the output buffers, updates ``unfinished`` and advances ``col`` and ``s`` in place.

Nothing in :meth:`DecodeState.step` reads a value on the host or allocates a tensor that outlives the step, so the
same function runs eagerly (CPU, or CUDA without graphs) and inside a CUDA graph
(:mod:`lorarl.rollout.fast.graphs`), which then replays it with new data copied into the same buffers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lorarl.model.kvcache import cache_arg, output_cache
from lorarl.model.tokens import pad_left, position_ids
from lorarl.rollout.fast.sampling import SamplerSettings, mask_finished, select_tokens

if TYPE_CHECKING:
    from lorarl.model import SharedBase


class PrefillSource(Protocol):
    """What :func:`prefill` reads of a kept-rows store (:class:`lorarl.rollout.prefix_kv.PrefixKV`, which sits above
    this module: it checks its rows against the captured steps' adapter key)."""

    def prefill_cache(self, shared: Any, prompts: list[list[int]]) -> tuple[Tensor, Tensor, Any, int]: ...


def unique_prompts(rows: list[int]) -> tuple[list[int], list[int]]:
    """Distinct prompt indices of ``rows`` in order of first appearance, and each row's position among them.

    Example: ``[4, 4, 7, 4]`` -> ``([4, 7], [0, 0, 1, 0])``.
    """
    first: dict[int, int] = {}
    inverse = [first.setdefault(r, len(first)) for r in rows]
    return list(first), inverse


@torch.no_grad()
def prefill(shared: SharedBase, prompts: list[list[int]], prefix_kv: PrefillSource | None = None):
    """Run the ``M`` distinct prompts (left padded to ``P``) through the active role once; with ``prefix_kv``, only
    the columns its kept rows do not cover (:meth:`~lorarl.rollout.prefix_kv.PrefixKV.prefill_cache`).

    Returns ``(cache, last_logits [M, V] in the model's dtype, mask [M, P] bool)``: a ``DynamicCache`` with their
    keys / values and the logits that predict each prompt's first completion token."""
    from transformers import DynamicCache

    if prefix_kv is not None:
        ids, mask, cache, S = prefix_kv.prefill_cache(shared, prompts)
    else:
        (ids, mask), cache = pad_left(prompts, shared.pad_id), None
        S = ids.shape[1]
    dev = shared.device
    out = shared.decoder()(
        input_ids=ids[:, -S:].to(dev),
        attention_mask=mask.long().to(dev),
        position_ids=position_ids(mask)[:, -S:].to(dev),
        **cache_arg(cache if cache is not None else DynamicCache()),
        use_cache=True,
    )
    logits = shared.output_head()(out.last_hidden_state[:, -1])
    return output_cache(out), logits, mask


def cache_layers(cache) -> list:
    """The per-layer key / value holders of a transformers cache (``.keys`` / ``.values`` tensors)."""
    return list(cache.layers)


class DecodeState:
    """A static KV cache of ``rows x length`` columns and the buffers of one decode loop (see the module doc).

    Built once for a shape and reused: :meth:`load` copies a new batch in place (same tensors, same addresses),
    :meth:`step` is the decode step, :meth:`first_token` records completion token 0 from the prefill's logits.
    """

    def __init__(self, shared: SharedBase, rows: int, length: int, new_tokens: int, kv_dtype, kv_heads, head_dim):
        from transformers import StaticCache

        dev = shared.device
        # A weak reference: the kept states live in a table keyed weakly by the shared base (graphs.pool_for), and a
        # strong one back to the key would keep the base, its weights, caches and graph pool alive for good.
        self.shared = weakref.proxy(shared)
        self.rows, self.length, self.new_tokens = rows, length, new_tokens
        self.kv_dtype = kv_dtype
        self.cache = StaticCache(config=shared.decoder().config, max_cache_len=length)
        self.cache.early_initialization(rows, kv_heads, head_dim, kv_dtype, dev)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)  # the input token of the next step
        self.column = torch.zeros(1, dtype=torch.long, device=dev)  # the cache column that token is written to
        self.step_index = torch.zeros(1, dtype=torch.long, device=dev)  # the completion column it writes
        self.pos_offset = torch.zeros(rows, dtype=torch.long, device=dev)  # position id = column + offset
        self.masked = torch.finfo(kv_dtype).min
        self.bias = torch.full((rows, 1, 1, length), self.masked, dtype=kv_dtype, device=dev)  # the attention mask
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=dev)
        self.out_tokens = torch.zeros(rows, new_tokens, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros(rows, new_tokens, dtype=torch.float32, device=dev)
        self.eos = torch.as_tensor(shared.eos_ids, dtype=torch.long, device=dev)
        self.pad_id = int(shared.pad_id)

    def fits(self, rows: int, length: int, new_tokens: int, kv_dtype) -> bool:
        """Whether a batch of this shape can be loaded into this state."""
        return (
            (rows, kv_dtype) == (self.rows, self.kv_dtype) and length <= self.length and new_tokens <= self.new_tokens
        )

    @torch.no_grad()
    def load(self, prompt_cache, inverse: list[int], prompt_mask: Tensor) -> None:
        """Copy a batch in place: each row's prompt keys / values (``prompt_cache`` row ``inverse[n]``) into cache
        columns ``[0, P)``, the prompt mask into the attention mask (every later column closed), the position
        offsets ``n_i - P``; reset the counters (``col = P``, ``s = 0``), ``unfinished`` and the outputs."""
        dev = self.shared.device
        P = prompt_mask.shape[1]
        idx = torch.as_tensor(inverse, dtype=torch.long, device=dev)
        for src, dst in zip(cache_layers(prompt_cache), cache_layers(self.cache)):
            dst.keys[:, :, :P].copy_(src.keys.index_select(0, idx))
            dst.values[:, :, :P].copy_(src.values.index_select(0, idx))
            dst.cumulative_length.fill_(P)
        mask = prompt_mask.to(dev).index_select(0, idx)
        self.bias.fill_(self.masked)
        self.bias[:, 0, 0, :P].masked_fill_(mask, 0.0)
        self.pos_offset.copy_(mask.long().sum(dim=1) - P)
        self.column.fill_(P)
        self.step_index.fill_(0)
        self.unfinished.fill_(True)
        self.out_tokens.fill_(self.pad_id)
        self.out_logprobs.zero_()

    def record(self, tokens: Tensor, logprobs: Tensor | None) -> None:
        """Write the drawn tokens (pad where a row already ended) and their log-probs (0 there) into output column
        ``s``, mark rows that drew an EOS as finished, feed the tokens to the next step, advance ``s``."""
        if logprobs is not None:
            logprobs = torch.where(self.unfinished, logprobs, torch.zeros_like(logprobs))
            self.out_logprobs.index_copy_(1, self.step_index, logprobs[:, None])
        tokens = mask_finished(tokens, self.unfinished, self.pad_id)
        self.out_tokens.index_copy_(1, self.step_index, tokens[:, None])
        self.unfinished &= ~torch.isin(tokens, self.eos)
        self.tokens.copy_(tokens)
        self.step_index.add_(1)

    @torch.no_grad()
    def first_token(self, logits: Tensor, sampler: SamplerSettings) -> None:
        """Completion token 0 of every row, from the prefill's logits ``[N, V]`` (prompt rows already expanded)."""
        tokens, logprobs = select_tokens(logits, sampler)
        self.record(tokens, logprobs)

    @torch.no_grad()
    def step(self, sampler: SamplerSettings) -> None:
        """One decode step on the buffers only: forward the input tokens at column ``col`` through the active role
        (the model's own decoder layers, PEFT LoRA wrappers and 4-bit linears), draw the next tokens, record them."""
        self.bias.index_fill_(-1, self.column, 0.0)  # the input token's own column opens for every row
        hidden = self.shared.decoder()(
            input_ids=self.tokens[:, None],
            attention_mask=self.bias,
            position_ids=(self.column + self.pos_offset)[:, None],
            **cache_arg(self.cache),
            use_cache=True,
        ).last_hidden_state[:, -1]
        tokens, logprobs = select_tokens(self.shared.output_head()(hidden), sampler)
        self.record(tokens, logprobs)
        self.column.add_(1)
