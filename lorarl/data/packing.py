"""SFT packing (``sft.packing``): examples laid end to end in rows of at most ``sft.max_length`` tokens, as TRL's
``SFTTrainer(args=SFTConfig(packing=True))`` lays them out.

The rows are TRL's own: :func:`trl.pack_dataset` (TRL 1.16, ``trl/data_utils.py``) packs the token lists, so the
strategies are TRL's and so is every row's content:

* ``bfd`` (TRL's default): best-fit decreasing -- the examples sorted longest first go each into the fullest row it
  still fits (within each block of 1,000 examples, as ``datasets.map`` hands them over). Whole examples only; lorarl
  never truncates (a longer one is a bad row before packing: TRL would keep its first ``max_length`` tokens).
* ``bfd_split``: the same, an example longer than ``max_length`` cut into ``max_length`` pieces first, each its own
  segment.
* ``wrapped``: every example end to end, one stream cut every ``max_length`` tokens (the last row shorter); a row is
  one segment, so a token attends to the examples before it in its row (TRL's wrapped attends across examples too:
  it pads no boundary and passes no position ids).

A row's **segments** (``seq_lengths``) are the examples (or pieces) it holds, in order: position ids restart at 0
at each (:func:`segment_positions`), and the forward lets a token attend only within its segment
(:func:`lorarl.model.logprobs.packed_logprobs`: transformers builds a block-diagonal causal mask from restarting
position ids, as for TRL's padding-free batches). A token is a **target** when its label says it is trained (a
completion token; every token of a ``text`` row) and it is not the first of its segment (nothing before it in the
segment predicts it): :func:`pack_targets`. So a ``bfd`` / ``bfd_split`` row trains exactly the tokens its examples
train unpacked, and the loss is the same (``tests/test_sft_packing.py``).

Why not write the packer: TRL's is the reference a TRL user compares against, and it is maintained; this module
only turns its rows into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from lorarl.config import DataConfig
from lorarl.config.algorithms import PackingStrategy
from lorarl.data.prompts import shape_row
from lorarl.data.sft import SFTSet, is_text_row, load_sft

STRATEGIES: tuple[str, ...] = get_args(PackingStrategy)  # ("bfd", "bfd_split", "wrapped"): TRL's


@dataclass
class Packs:
    """Examples packed into rows of at most ``length`` tokens.

    ids:          ``[R]`` token lists, each at most ``length`` long.
    labels:       ``[R]`` per token: the token is trained when it is predicted (see :func:`pack_targets`).
    seq_lengths:  ``[R]`` the lengths of the segments each row holds, in order (they sum to the row's length).
    length:       the rows' capacity (``sft.max_length``).
    """

    ids: list[list[int]]
    labels: list[list[bool]]
    seq_lengths: list[list[int]]
    length: int

    def __len__(self) -> int:
        return len(self.ids)

    def targets(self, rows: list[int]) -> int:
        """The number of trained targets in rows ``rows`` (the loss's token count)."""
        return sum(sum(pack_targets(self.labels[r], self.seq_lengths[r])) for r in rows)

    def tokens(self, rows: list[int]) -> int:
        """The number of tokens in rows ``rows`` (what the forward runs, padding excluded)."""
        return sum(len(self.ids[r]) for r in rows)


def pack_examples(ids: list[list[int]], labels: list[list[bool]], length: int, strategy: str = "bfd") -> Packs:
    """Pack examples ``ids`` (their per-token ``labels``) into rows of at most ``length`` tokens with TRL's
    :func:`trl.pack_dataset` and ``strategy`` (see the module docstring).

    Example: ``[[1, 2, 3], [4, 5], [6]]``, length 4, ``bfd`` -> rows ``[[1, 2, 3, 6], [4, 5]]``, segments
    ``[[3, 1], [2]]``; ``wrapped`` -> ``[[1, 2, 3, 4], [5, 6]]``, segments ``[[4], [2]]``."""
    import datasets
    from trl import pack_dataset

    if strategy not in STRATEGIES:
        raise ValueError(f"packing strategy must be one of {STRATEGIES}, got {strategy!r}")
    table = datasets.Dataset.from_dict({"input_ids": ids, "labels": [[int(b) for b in m] for m in labels]})
    quiet = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        packed = pack_dataset(table, length, strategy)[:]
    finally:
        if quiet:
            datasets.enable_progress_bars()
    rows = packed["input_ids"]
    segments = packed.get("seq_lengths") or [[len(r)] for r in rows]  # wrapped: a row is one segment
    return Packs(rows, [[bool(b) for b in m] for m in packed["labels"]], [list(s) for s in segments], length)


def segment_positions(seq_lengths: list[int]) -> list[int]:
    """Position ids of a row of segments: ``0 .. n - 1`` for each segment of ``n`` tokens.

    Example: ``[3, 1, 2]`` -> ``[0, 1, 2, 0, 0, 1]``."""
    return [p for n in seq_lengths for p in range(n)]


def pack_targets(labels: list[bool], seq_lengths: list[int]) -> list[bool]:
    """Per position ``t >= 1`` of a row (``len(labels) - 1`` flags): whether token ``t``, predicted from the hidden
    state at ``t - 1``, counts in the loss -- its label is set and it does not start a segment (the first token of a
    segment has nothing before it in its segment).

    Example: labels ``[T, T, T, F, T]``, segments ``[3, 2]`` -> ``[T, T, F, T]`` (token 3 starts the second
    segment)."""
    starts = set()
    at = 0
    for n in seq_lengths:
        starts.add(at)
        at += n
    return [labels[t] and t not in starts for t in range(1, len(labels))]


def pack_batch(packs: Packs, rows: list[int], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``rows`` of ``packs`` as tensors ``(input_ids [R, L], position_ids [R, L], targets [R, L - 1] bool)``,
    right padded to the longest row. Padding gets position 0 at every token (each pad token its own one-token
    segment: it attends only to itself, and no target reads it)."""
    width = max(len(packs.ids[r]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    tgt = torch.zeros((len(rows), max(width - 1, 0)), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(packs.ids[r])
        ids[i, :n] = torch.as_tensor(packs.ids[r])
        pos[i, :n] = torch.as_tensor(segment_positions(packs.seq_lengths[r]))
        tgt[i, : n - 1] = torch.as_tensor(pack_targets(packs.labels[r], packs.seq_lengths[r]), dtype=torch.bool)
    return ids, pos, tgt


def example_labels(data: SFTSet, i: int) -> list[bool]:
    """Per token of example ``i`` (prompt then completion): trained or not, as TRL labels it -- a prompt's tokens
    are not, a completion's are (a tool-use trace's assistant turns only), and every token of a ``text`` row is
    (its first is predicted only when ``wrapped`` packing puts another example before it)."""
    prompt, completion = data.prompt_ids[i], data.completion_ids[i]
    trained = data.loss_masks[i] if data.loss_masks is not None else [True] * len(completion)
    return [is_text_row(data.rows[i])] * len(prompt) + [bool(b) for b in trained]


def pack_sft(data: SFTSet, length: int, strategy: str = "bfd") -> Packs:
    """The supervised examples of ``data`` packed into rows of at most ``length`` tokens (:func:`pack_examples`);
    a row with no target (a ``wrapped`` tail of one token, a piece of prompt only) is left out: it trains nothing."""
    ids = [p + c for p, c in zip(data.prompt_ids, data.completion_ids)]
    packs = pack_examples(ids, [example_labels(data, i) for i in range(len(data))], length, strategy)
    keep = [r for r in range(len(packs)) if packs.targets([r])]
    return Packs(
        [packs.ids[r] for r in keep], [packs.labels[r] for r in keep], [packs.seq_lengths[r] for r in keep], length
    )


def packed_row_count(rows: list, cfg: DataConfig, tokenizer, eos_id: int, length: int, strategy: str) -> int:
    """How many packed rows SFT makes of ``rows`` (raw dataset rows, ``data.columns`` of ``cfg`` applied): what a
    run with ``sft.packing`` counts its epochs in, known before it starts (``lorarl.trl``'s step count, as TRL
    counts the packed dataset's rows). A bad row raises as the run would (``data.on_bad_row``)."""
    shaped = [shape_row(row, cfg, i) for i, row in enumerate(rows)]
    data = load_sft(cfg, tokenizer, eos_id, length, rows=shaped, long_rows=strategy != "bfd")
    return len(pack_sft(data, length, strategy))
