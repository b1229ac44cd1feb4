"""Preference pairs for DPO: TRL's preference format, tokenized as prompt + two responses.

Rows are read, mapped and checked as the reward model reads them (:mod:`lorarl.data.preferences`: TRL's explicit or
implicit prompt, conversational or plain, ``pkg:NAME`` / files / folders / hub names, ``data.columns``,
``data.as_chat``). A plain-text row with an implicit prompt gets TRL's prompt: the longest common prefix of the two
strings (``trl.extract_prompt``). The chat's votes file (``RUNS/preferences.jsonl``, :mod:`lorarl.chat.votes`) is
such a file; a row marked ``"tie": true`` is left out and counted, and the ties the chat keeps beside a votes file
(``preferences_ties.jsonl``) are counted too.

Tokenization follows the one rendering of RL and SFT: the prompt exactly as a rollout renders it
(:func:`lorarl.data.prompt_text`: chat template with the generation prompt, ``data.system_prompt``), each response
its own tokens ending with the end-of-turn EOS a finished rollout ends with
(:func:`lorarl.model.tokens.with_end_of_turn`), so DPO scores the sequences the policy would sample.

Unusable rows are left out and counted by kind, whatever ``data.on_bad_row`` says: a row without ``chosen`` or
``rejected`` (missing, null or empty: ``missing``), identical chosen and rejected responses (``identical``), a pair
longer than ``dpo.max_length`` -- among them a prompt that leaves no room for a response (``too_long``) -- and chat
ties (``tie``). Malformed rows (wrong types, broken message lists) follow ``data.on_bad_row``: stop with one line
naming the row and column, or skip and count (``bad``). A split with no usable pair stops with one line naming the
first problem's row and column.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lorarl.config import DataConfig
from lorarl.data.preferences import (
    encode_response,
    normalize_pair,
    pair_too_long_by_chars,
    read_rows,
    resolve_source,
    shape_pair,
)
from lorarl.data.prompts import encode_prompt, prompt_text
from lorarl.errors import DataError, LorarlError
from lorarl.model.tokens import with_end_of_turn

SKIP_KINDS = ("missing", "identical", "too_long", "tie", "bad")


@dataclass
class PairSet:
    """The usable pairs of one split, tokenized.

    pairs:        normalised rows (``prompt``, ``chosen`` / ``rejected`` holding only the response, ``columns``).
    prompt_ids:   ``[n]`` prompt token ids (rendered as rollouts render prompts).
    chosen_ids, rejected_ids: ``[n]`` response token ids, each ending with the end-of-turn EOS.
    skipped:      ``[(row index, reason)]`` of every row left out; ``counts``: how many of each kind
                  (:data:`SKIP_KINDS`).
    ties_beside:  rows of the chat's ties file beside the source (None: no such file).
    source:       where the rows came from.
    """

    pairs: list[dict]
    prompt_ids: list[list[int]] = field(default_factory=list)
    chosen_ids: list[list[int]] = field(default_factory=list)
    rejected_ids: list[list[int]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    ties_beside: int | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.pairs)


def implicit_text_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """TRL's prompt of a plain implicit-prompt pair (``trl.extract_prompt``): the longest common prefix of the two
    strings, ending before the space that precedes the first differing character -> ``(prompt, chosen, rejected)``.

    Example: ``"2 + 2 = 4"``, ``"2 + 2 = 5"`` -> ``("2 + 2 =", " 4", " 5")``.
    """
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _missing(row: Any) -> str | None:
    """The TRL column (``chosen`` / ``rejected``) a row lacks: absent, null, an empty string or message list."""
    if not isinstance(row, dict):
        return None
    for col in ("chosen", "rejected"):
        value = row.get(col)
        if value is None or (
            isinstance(value, (str, list, tuple)) and not (value.strip() if isinstance(value, str) else value)
        ):
            return col
    return None


def encode_dpo_pair(
    pair: dict, tokenizer, system_prompt: str | None, eos_ids: list[int], end_id: int, i: int
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, chosen ids, rejected ids)`` of one normalised pair; responses end with ``end_id``."""
    prompt = pair["prompt"]
    text = prompt_text(prompt, tokenizer, system_prompt, i)
    p_ids = encode_prompt(text, tokenizer, templated=not isinstance(prompt, str))
    chosen = with_end_of_turn(encode_response(pair["chosen"], tokenizer, i, "chosen"), eos_ids, end_id)
    rejected = with_end_of_turn(encode_response(pair["rejected"], tokenizer, i, "rejected"), eos_ids, end_id)
    return p_ids, chosen, rejected


def count_ties_beside(source: str, recipe_path: str | None) -> int | None:
    """Rows of the chat's ties file beside a votes file (``NAME_ties.jsonl`` next to ``NAME.jsonl``), or None."""
    try:
        path = resolve_source(source, recipe_path)
    except LorarlError:  # a hub name
        return None
    ties = path.with_name(path.stem + "_ties" + path.suffix) if path.is_file() else None
    if ties is None or not ties.is_file():
        return None
    return sum(1 for line in ties.read_text(encoding="utf-8").splitlines() if line.strip())


def read_pair_row(row: Any, i: int, data: DataConfig, tokenizer, eos_ids, end_id, max_length: int):
    """One raw row -> ``(pair, ids)``, or ``(kind, reason)`` for a row left out. DataError: a malformed row."""
    if isinstance(row, dict) and row.get("tie") is True:
        return "tie", f"row {i}: a tie (column 'tie' is true)"
    row = shape_pair(row, data, i)
    col = _missing(row)
    if col is not None:
        return "missing", f"row {i}: column '{col}' is missing or empty"
    pair = normalize_pair(row, i)
    if pair["prompt"] is None:  # plain text, implicit prompt
        prompt, chosen, rejected = implicit_text_prompt(pair["chosen"], pair["rejected"])
        if not prompt.strip():
            raise DataError(f"row {i}: column 'prompt' is missing and 'chosen' / 'rejected' share no prefix")
        pair = dict(pair, prompt=prompt, chosen=chosen, rejected=rejected)
    why = pair_too_long_by_chars(pair, tokenizer, data.system_prompt, max_length, i)
    if why:
        return "too_long", f"row {i}: prompt + longer response: more than dpo.max_length={max_length} tokens: it {why}"
    ids = encode_dpo_pair(pair, tokenizer, data.system_prompt, eos_ids, end_id, i)
    p_ids, c_ids, r_ids = ids
    if c_ids == r_ids:
        return "identical", f"row {i}: columns 'chosen' and 'rejected' are the same response"
    if len(p_ids) + 1 >= max_length:
        return "too_long", (
            f"row {i}: column 'prompt' has {len(p_ids)} tokens: no room for a response under dpo.max_length={max_length}"
        )
    longest = len(p_ids) + max(len(c_ids), len(r_ids))
    if longest > max_length:
        return (
            "too_long",
            f"row {i}: prompt + longer response have {longest} tokens, more than dpo.max_length={max_length}",
        )
    return pair, ids


def usable_rows(rows: list, read, where: str, on_bad_row: str, counts: Counter, skipped: list, full) -> Iterator:
    """What ``read(row, i)`` gives for each usable row of ``rows``, until ``full()``; a row it leaves out (a
    ``(kind, reason)`` result) is counted in ``counts`` and listed in ``skipped``, and so is a malformed row (a
    DataError) under ``on_bad_row: skip`` (kind ``bad``); under ``fail`` the error stops the load, prefixed by
    ``where``."""
    for i, row in enumerate(rows):
        if full():
            break
        try:
            got = read(row, i)
        except DataError as e:
            if on_bad_row == "fail":
                raise DataError(f"{where}: {e} (set data.on_bad_row: skip to drop bad rows)") from None
            got = ("bad", str(e))
        if isinstance(got, tuple) and isinstance(got[0], str):
            counts[got[0]] += 1
            skipped.append((i, got[1]))
            continue
        yield got


def load_pairs(
    data: DataConfig,
    tokenizer,
    split: str,
    *,
    eos_ids: list[int],
    end_id: int,
    max_length: int,
    recipe_path: str | None = None,
    limit: int | None = None,
) -> PairSet | None:
    """The recipe's pairs of ``split``, tokenized (see the module docstring). Training reads ``data.source``;
    evaluation ``data.eval_source``, else the held-out split of ``data.source`` (None when it has none). ``limit``
    keeps the first ``limit`` usable pairs."""
    if data.source == "arithmetic":
        raise DataError(
            "dpo needs preference pairs: set data.source to a hub dataset, a file, a folder, the chat's votes file "
            "(RUNS/preferences.jsonl) or pkg:prefs_arith_train.jsonl (and data.eval_source to held-out pairs)"
        )
    source = data.eval_source if split == "eval" and data.eval_source else data.source
    rows, where = read_rows(source, split, recipe_path, data)
    if rows is None:
        return None
    out = PairSet(pairs=[], source=where, ties_beside=count_ties_beside(source, recipe_path))
    counts: Counter = Counter()

    def read(row, i):
        return read_pair_row(row, i, data, tokenizer, eos_ids, end_id, max_length)

    full = (lambda: len(out) >= limit) if limit is not None else (lambda: False)
    for pair, ids in usable_rows(rows, read, where, data.on_bad_row, counts, out.skipped, full):
        out.pairs.append(pair)
        out.prompt_ids.append(ids[0])
        out.chosen_ids.append(ids[1])
        out.rejected_ids.append(ids[2])
    out.counts = {k: counts.get(k, 0) for k in SKIP_KINDS}
    if not out.pairs:
        why = f"; first problem: {out.skipped[0][1]}" if out.skipped else ""
        raise DataError(f"{where}: no usable preference pairs{why}")
    return out


def skipped_summary(pairs: PairSet) -> str | None:
    """One line saying what was left out (None when nothing was), e.g. ``left out 3 of 10 rows: 2 identical, 1
    tie; 5 ties in the chat's ties file beside it``."""
    parts = [f"{n} {k.replace('_', ' ')}" for k, n in pairs.counts.items() if n]
    line = (
        f"left out {len(pairs.skipped)} of {len(pairs.skipped) + len(pairs)} rows: {', '.join(parts)}" if parts else ""
    )
    if pairs.ties_beside:
        line += (
            "; " if line else ""
        ) + f"{pairs.ties_beside} ties in the chat's ties file beside it (never trained on)"
    return f"{pairs.source}: {line}" if line else None
