"""Keys and values kept from one decode call for the next: a multi-turn rollout prefills only each row's new tokens.

In a tool-use rollout, turn ``k + 1`` of a row is the row's turn-``k`` context, the tokens it sampled, and the tool
message appended to them. Prefilling that whole context again each turn (what a stateless engine does) repeats the
work of every earlier turn. Inside :meth:`PrefixKV.scope` an engine instead keeps, after each call, the keys /
values of every row's *real* tokens (its prompt without padding, then the sampled tokens that were fed back, up to
and including the first EOS; padding and the tokens decoded after a row ended are left out) together with their
ids. On the next call each prompt is matched against those ids (:func:`match_prefixes`): the longest kept row that
is a prefix of the prompt gives its keys / values, and only the rest of the prompt goes through the model
(:meth:`PrefixKV.prefill_cache`). Nothing is matched by position or row number, only by token ids, so a prompt
that does not extend a kept row is simply prefilled in full.

Why this is exact: a token's keys / values depend only on the tokens before it, their positions, and the weights.
The kept rows were computed by the same role in the same rollout (the scope is one ``agent_rollout``, inside one
``shared.role``; the adapter's :func:`~lorarl.rollout.fast.graphs.adapter_key` is checked at every use), with
position ids that count real tokens only (left padding gets none), which is what a fresh left-padded prefill of the
longer prompt gives them too. Rounding may differ in the last bits (other matmul shapes), as between any two
batchings; the sampler / trainer parity check covers it.

Layout of the assembled cache for ``M`` prompts (lengths ``n_j``, matched ``m_j < n_j``): every prompt is left
padded to ``W = max n_j``; the last ``S = max (n_j - m_j)`` columns go through the model, the first ``W - S`` come
from the kept keys / values. Since ``n_j - S <= m_j``, every cached column of row ``j`` holds a matched token (a few
matched tokens of rows with ``n_j - m_j < S`` are computed again: harmless, and the batch stays one forward).

Memory: the kept keys / values of a call are at most the size of that call's own KV cache; they replace the previous
call's and are freed when the scope ends. (The memory planner does not model multi-turn rollouts yet.)

Not for every model (:func:`reuse_refusal`): sliding-window layers keep only their last columns, and ``dynamic`` /
``longrope`` rotary scaling changes its factors with the sequence length; the turn loop then prefills each turn's
whole context, as ``agent.reuse_kv: false`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # rotary factors chosen from the current sequence length


def reuse_refusal(config) -> str | None:
    """Why keys / values of a model with ``config`` cannot be kept between calls (None when they can): cache layers
    other than full attention (sliding windows keep only their last columns, so a kept row would miss keys), or a
    rotary scaling whose factors depend on the sequence length (``dynamic`` / ``longrope``: keys computed at one
    length differ from those a longer prefill computes)."""
    from transformers import DynamicCache

    try:
        kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    except Exception as e:  # noqa: BLE001 - a config transformers builds no cache for
        return f"no cache for this config ({type(e).__name__}: {e})"
    if kinds - {"DynamicLayer"}:
        return f"cache layers {sorted(kinds)} (only full-attention layers keep every column)"
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        kind = (rope or {}).get("rope_type", (rope or {}).get("type")) if isinstance(rope, dict) else None
        if kind in LENGTH_DEPENDENT_ROPE:
            return f"rotary scaling {kind!r} depends on the sequence length"
    return None


def match_prefixes(kept: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """For each prompt, ``(row, m)``: the kept row whose ids are the longest prefix of the prompt, and ``m``, how many
    of the prompt's leading tokens it covers, capped at ``len(prompt) - 1`` (the last prompt token always goes
    through the model: its logits draw the first new token). ``(-1, 0)`` where no kept row is a prefix.

    Example: kept ``[[1, 2], [1, 2, 3, 4]]``, prompts ``[[1, 2, 3, 4, 5], [1, 2, 9], [1, 2, 3, 4], [7]]``
    -> ``[(1, 4), (0, 2), (1, 3), (-1, 0)]``.
    """
    by_length: dict[int, dict[tuple[int, ...], int]] = {}
    for r, ids in enumerate(kept):
        if ids:
            by_length.setdefault(len(ids), {}).setdefault(tuple(ids), r)
    lengths = sorted(by_length, reverse=True)
    out = []
    for p in prompts:
        found = (-1, 0)
        for n in lengths:
            if n <= len(p):
                r = by_length[n].get(tuple(p[:n]))
                if r is not None:
                    found = (r, min(n, len(p) - 1))
                    break
        out.append(found)
    return out


def right_aligned_columns(columns: Sequence[Sequence[int]], width: int) -> tuple[Tensor, Tensor]:
    """Per row, the cache columns of its real tokens, right aligned in ``width`` slots -> ``(index [n, width] long,
    valid [n, width] bool)``; empty slots (on the left) point at column 0 and are not valid.

    Example: ``[[3, 4], [0, 1, 2]]``, width 3 -> index ``[[0, 3, 4], [0, 1, 2]]``, valid ``[[0, 1, 1], [1, 1, 1]]``.
    """
    index = torch.zeros(len(columns), width, dtype=torch.long)
    valid = torch.zeros(len(columns), width, dtype=torch.bool)
    for r, cols in enumerate(columns):
        if cols:
            index[r, width - len(cols) :] = torch.as_tensor(list(cols), dtype=torch.long)
            valid[r, width - len(cols) :] = True
    return index, valid


def gather_columns(x: Tensor, rows: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """``x [n, heads, L, dim]`` -> ``[M, heads, W, dim]``: output row ``j`` takes ``x[rows[j], :, index[j, c]]`` at
    column ``c`` where ``valid[j, c]``, zeros elsewhere (those columns are masked out by the attention mask)."""
    picked = x.index_select(0, rows.to(x.device))
    idx = index.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    out = picked.gather(2, idx)
    return out.masked_fill(~valid.to(x.device)[:, None, :, None], 0)


def fed_columns(prompt_mask: Tensor, sampled: Tensor, fed: int, eos_ids: Sequence[int]) -> list[list[int]]:
    """The cache columns holding each row's real tokens after a decode call whose prompts took columns
    ``[0, P)`` (``prompt_mask [n, P]`` bool) and whose sampled token ``s`` was written at column ``P + s`` for
    ``s < fed``: the prompt's real columns, then the sampled ones up to and including the row's first EOS.

    Example: mask ``[[0, 1], [1, 1]]``, sampled ``[[5, 2, 7], [6, 6, 6]]``, fed 2, EOS 2
    -> ``[[1, 2, 3], [0, 1, 2, 3]]``."""
    P = prompt_mask.shape[1]
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long)
    sampled, prompt_mask = sampled[:, :fed].cpu(), prompt_mask.cpu()
    out = []
    for r in range(prompt_mask.shape[0]):
        row = sampled[r]
        hits = torch.isin(row, eos).nonzero()
        k = int(hits[0]) + 1 if len(hits) else fed
        real = prompt_mask[r].nonzero().flatten().tolist()
        out.append(real + list(range(P, P + k)))
    return out


@dataclass
class KeptRows:
    """The keys / values of ``n`` rows' real tokens, right aligned: per layer ``keys[l]``, ``values[l]``
    ``[n, heads, L, dim]``, row ``r``'s tokens in the last ``len(ids[r])`` columns."""

    keys: list[Tensor]
    values: list[Tensor]
    ids: list[list[int]]

    @staticmethod
    def from_cache(layers, columns: list[list[int]], ids: list[list[int]]) -> KeptRows:
        """Rows of a cache (``layers``: objects with ``.keys`` / ``.values`` ``[n, heads, L, dim]``): row ``r``
        keeps columns ``columns[r]`` (its real tokens, ids ``ids[r]``)."""
        width = max((len(c) for c in columns), default=0)
        index, valid = right_aligned_columns(columns, width)
        rows = torch.arange(len(columns))
        keys = [gather_columns(layer.keys, rows, index, valid) for layer in layers]
        values = [gather_columns(layer.values, rows, index, valid) for layer in layers]
        return KeptRows(keys, values, [list(x) for x in ids])

    @staticmethod
    def cat(parts: list[KeptRows]) -> KeptRows:
        """The rows of ``parts`` in order, right aligned to the widest."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.keys[0].shape[2] for p in parts)

        def pad(x: Tensor) -> Tensor:
            return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))

        layers = range(len(parts[0].keys))
        keys = [torch.cat([pad(p.keys[l_]) for p in parts]) for l_ in layers]
        values = [torch.cat([pad(p.values[l_]) for p in parts]) for l_ in layers]
        return KeptRows(keys, values, [i for p in parts for i in p.ids])


@dataclass
class PrefixKV:
    """What an engine keeps between the calls of one scope (see the module doc), and counts of the work saved:
    ``reused_tokens`` (prompt tokens taken from kept keys / values) and ``prefilled_tokens`` (prompt tokens that went
    through the model), summed over the scope's calls."""

    kept: KeptRows | None = None
    key: tuple | None = None
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    _parts: list[KeptRows] = field(default_factory=list)

    def check(self, shared) -> None:
        """Refuse kept rows computed with another adapter state (a stale adapter must never feed a rollout)."""
        from lorarl.rollout.fast.graphs import adapter_key

        key = adapter_key(shared)
        if self.key is None:
            self.key = key
        elif key != self.key:
            raise RuntimeError(
                "kept keys / values were computed with another adapter state: a reuse scope spans one "
                "role and no weight update"
            )

    def prefill_cache(self, shared, prompts: list[list[int]]):
        """The prompts left padded to ``W`` and a cache of their first ``W - S`` columns built from the kept rows ->
        ``(ids [M, W], mask [M, W] bool, cache or None, S)``; ``cache`` is None (and ``S = W``) when nothing
        matches. Counts the reused and prefilled tokens."""
        from transformers import DynamicCache

        from lorarl.model.tokens import pad_left

        self.check(shared)
        ids, mask = pad_left(prompts, shared.pad_id)
        W = ids.shape[1]
        matches = match_prefixes(self.kept.ids if self.kept is not None else [], prompts)
        S = max((len(p) - m for p, (_, m) in zip(prompts, matches)), default=W)
        cached = W - S
        self.prefilled_tokens += sum(min(len(p), S) for p in prompts)
        if cached <= 0:
            return ids, mask, None, W
        self.reused_tokens += sum(len(p) - min(len(p), S) for p in prompts)
        L = self.kept.keys[0].shape[2]
        columns, rows = [], []
        for p, (r, _) in zip(prompts, matches):
            n_cached = max(len(p) - S, 0)  # this row's tokens in the cached columns, all matched (see module doc)
            start = L - len(self.kept.ids[max(r, 0)])
            columns.append(list(range(start, start + n_cached)))
            rows.append(max(r, 0))
        index, valid = right_aligned_columns(columns, cached)
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        data = [
            (gather_columns(k, rows_t, index, valid), gather_columns(v, rows_t, index, valid))
            for k, v in zip(self.kept.keys, self.kept.values)
        ]
        return ids, mask, DynamicCache(ddp_cache_data=data, config=shared.decoder().config), S

    def begin(self) -> None:
        """A new call: its rows will replace the kept ones when it :meth:`commit` s."""
        self._parts = []

    def add(self, rows: KeptRows) -> None:
        """Rows of the current call (one decode batch), in the call's row order."""
        self._parts.append(rows)

    def commit(self) -> None:
        """The current call's rows become the kept rows (the previous call's are dropped)."""
        self.kept = KeptRows.cat(self._parts) if self._parts else None
        self._parts = []

    def release(self) -> None:
        self.kept, self._parts = None, []


class ReusesKV:
    """Mixin of the engines that can keep keys / values between calls: ``with engine.reusing_kv() as kv:`` -- every
    call inside continues the rows of the previous one where a prompt extends them (:class:`PrefixKV`)."""

    prefix_kv: PrefixKV | None = None

    @contextlib.contextmanager
    def reusing_kv(self) -> Iterator[PrefixKV]:
        kv = PrefixKV()
        previous, self.prefix_kv = self.prefix_kv, kv
        try:
            yield kv
        finally:
            kv.release()
            self.prefix_kv = previous
