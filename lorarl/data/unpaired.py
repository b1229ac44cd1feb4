"""Unpaired preference rows for KTO: TRL's unpaired format, tokenized as prompt + one completion with its label.

A row is TRL's unpaired preference row, plain or conversational:

* ``{"prompt": "The sky is", "completion": " blue.", "label": true}``
* ``{"prompt": [{"role": "user", "content": "What color is the sky?"}], "completion": [{"role": "assistant",
  "content": "It is blue."}], "label": false}``

``label`` is a JSON bool: true = desirable, false = undesirable. A paired preference row (TRL's ``chosen`` /
``rejected``, any shape :mod:`lorarl.data.pairs` reads) becomes two rows, its chosen response desirable and its
rejected one undesirable, as TRL's ``unpair_preference_dataset`` does; one file may hold both kinds (the workbench's
KTO retrain writes the chat's pairwise votes and its single thumbs-up / thumbs-down votes into one file). TRL decides
by the first row whether a whole dataset is paired; lorarl reads each row by its columns.

Where rows come from and how they are mapped is the preference loaders' rule (``pkg:NAME``, files, folders, hub
names, ``data.columns``, ``data.as_chat``: a string prompt becomes a user message and a string completion an
assistant message). Tokenization is DPO's (:mod:`lorarl.data.pairs`): the prompt as a rollout renders it, the
completion its own tokens ending with the end-of-turn EOS.

Rows left out and counted whatever ``data.on_bad_row`` says: an empty or missing prompt / completion
(``missing``), a prompt + completion longer than ``kto.max_length`` (``too_long``), a chat tie, a pair whose two
responses are the same (``identical``). Malformed rows -- no ``label``, a label that is not a bool, wrong types,
broken message lists -- follow ``data.on_bad_row``: one line naming the row and the column, or skipped and counted
(``bad``). A split with no usable row stops with one line naming the first problem.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lorarl.config import DataConfig
from lorarl.data.pairs import SKIP_KINDS, count_ties_beside, read_pair_row, usable_rows
from lorarl.data.preferences import check_messages, check_text, encode_response, read_rows, response_chars
from lorarl.data.prompts import encode_prompt, prompt_text, too_long_by_chars
from lorarl.data.sources import map_columns
from lorarl.errors import DataError
from lorarl.model.tokens import with_end_of_turn

PAIRED = ("chosen", "rejected")


@dataclass
class UnpairedSet:
    """The usable rows of one split, tokenized.

    rows:            normalised rows ``{"prompt", "completion" (the response alone), "label", "columns"}``.
    prompt_ids:      ``[n]`` prompt token ids (rendered as rollouts render prompts).
    completion_ids:  ``[n]`` completion token ids, each ending with the end-of-turn EOS.
    labels:          ``[n]`` True = desirable.
    from_pairs:      rows that came from a paired (``chosen`` / ``rejected``) row, two per pair.
    skipped:         ``[(row index, reason)]`` of every source row left out; ``counts``: how many of each kind
                     (:data:`lorarl.data.pairs.SKIP_KINDS`).
    ties_beside:     rows of the chat's ties file beside the source (None: no such file).
    source:          where the rows came from.
    """

    rows: list[dict]
    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    labels: list[bool] = field(default_factory=list)
    from_pairs: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    ties_beside: int | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def desirable(self) -> int:
        return sum(self.labels)

    def add(self, row: dict, ids: tuple[list[int], list[int]]) -> None:
        self.rows.append(row)
        self.prompt_ids.append(ids[0])
        self.completion_ids.append(ids[1])
        self.labels.append(bool(row["label"]))


def shape_unpaired(row: Any, data: DataConfig | None, i: int) -> Any:
    """Row ``i`` under TRL's names: ``data.columns`` mapped (``{completion: answer, label: thumbs_up}``); with
    ``data.as_chat`` a string prompt becomes a user message and a string completion an assistant message."""
    if data is None or not isinstance(row, dict):
        return row
    row = map_columns(row, data.columns, i)
    if data.as_chat and isinstance(row.get("prompt"), str):
        row = dict(row, prompt=[{"role": "user", "content": row["prompt"]}])
        if isinstance(row.get("completion"), str):
            row["completion"] = [{"role": "assistant", "content": row["completion"]}]
    return row


def check_label(row: dict, i: int) -> bool:
    """Row ``i``'s ``label``: a bool, else one line naming the row and the column."""
    if "label" not in row or row["label"] is None:
        raise DataError(f"row {i}: column 'label' is missing (true: a desirable completion, false: an undesirable one)")
    label = row["label"]
    if not isinstance(label, bool):
        raise DataError(f"row {i}: column 'label' must be true or false (a bool), got {label!r}")
    return label


def _empty(value: Any) -> bool:
    """None, an empty or blank string, an empty message list."""
    if isinstance(value, str):
        return not value.strip()
    return value is None or (isinstance(value, (list, tuple)) and not value)


def normalize_unpaired(row: Any, i: int) -> dict:
    """One raw unpaired row -> ``{"prompt", "completion", "label", "columns"}``, the completion holding only the
    response. Raises DataError naming row ``i`` and the column when the row is unusable.

    Example: ``{"prompt": [u], "completion": [a], "label": True, "id": 3}`` -> ``{"prompt": [u], "completion":
    [a], "label": True, "columns": {"id": 3}}``."""
    if not isinstance(row, dict):
        raise DataError(f"row {i} is not a JSON object")
    label = check_label(row, i)
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(completion, (list, tuple)):
        completion = check_messages(completion, i, "completion")
        if not isinstance(prompt, (list, tuple)):
            raise DataError(f"row {i}: column 'prompt' must be a list of messages when 'completion' is")
        prompt = check_messages(prompt, i, "prompt")
        if completion[-1]["role"] != "assistant":
            raise DataError(f"row {i}: column 'completion' must end with an assistant message")
    else:
        completion = check_text(completion, i, "completion")
        if not isinstance(prompt, str):
            raise DataError(f"row {i}: column 'prompt' must be a string when 'completion' is")
        check_text(prompt, i, "prompt")
    columns = {k: v for k, v in row.items() if k not in ("prompt", "completion", "label")}
    return {"prompt": prompt, "completion": completion, "label": label, "columns": columns}


def encode_unpaired(
    row: dict, tokenizer, system_prompt: str | None, eos_ids: list[int], end_id: int, i: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids)`` of one normalised row; the completion ends with ``end_id``."""
    prompt = row["prompt"]
    text = prompt_text(prompt, tokenizer, system_prompt, i)
    p_ids = encode_prompt(text, tokenizer, templated=not isinstance(prompt, str))
    return p_ids, with_end_of_turn(encode_response(row["completion"], tokenizer, i, "completion"), eos_ids, end_id)


def _too_long(row: dict, ids: tuple[list[int], list[int]] | None, max_length: int, tokenizer, system, i: int):
    """Why row ``i`` is longer than ``kto.max_length`` (by characters before tokenizing, ``ids`` None), or None."""
    limit = f"kto.max_length={max_length}"
    if ids is None:
        chars = response_chars(row["prompt"]) + response_chars(row["completion"]) + len(system or "")
        why = too_long_by_chars(chars, max_length, tokenizer)
        return f"row {i}: prompt + completion: more than {limit} tokens: it {why}" if why else None
    p_ids, c_ids = ids
    if len(p_ids) + 1 >= max_length:
        return f"row {i}: column 'prompt' has {len(p_ids)} tokens: no room for a completion under {limit}"
    if len(p_ids) + len(c_ids) > max_length:
        return f"row {i}: prompt + completion have {len(p_ids) + len(c_ids)} tokens, more than {limit}"
    return None


def read_unpaired_row(row: Any, i: int, data: DataConfig, tokenizer, eos_ids, end_id, max_length: int):
    """One raw row -> ``[(row, ids), ...]`` (two for a paired row), or ``(kind, reason)`` for a row left out.
    DataError: a malformed row."""
    if isinstance(row, dict) and row.get("tie") is True:
        return "tie", f"row {i}: a tie (column 'tie' is true)"
    mapped = map_columns(row, data.columns, i) if isinstance(row, dict) else row
    if isinstance(mapped, dict) and any(k in mapped for k in PAIRED) and "completion" not in mapped:
        pair, ids = read_pair_row(row, i, data, tokenizer, eos_ids, end_id, max_length)
        if isinstance(pair, str):
            return pair, ids.replace("dpo.max_length", "kto.max_length")
        p_ids, c_ids, r_ids = ids
        base = {"prompt": pair["prompt"], "columns": pair["columns"]}
        return [
            ({**base, "completion": pair["chosen"], "label": True}, (p_ids, c_ids)),
            ({**base, "completion": pair["rejected"], "label": False}, (p_ids, r_ids)),
        ]
    row = shape_unpaired(row, data, i)
    if isinstance(row, dict):
        for col in ("prompt", "completion"):
            if _empty(row.get(col)):
                return "missing", f"row {i}: column '{col}' is missing or empty"
    unpaired = normalize_unpaired(row, i)
    why = _too_long(unpaired, None, max_length, tokenizer, data.system_prompt, i)
    if why:
        return "too_long", why
    ids = encode_unpaired(unpaired, tokenizer, data.system_prompt, eos_ids, end_id, i)
    why = _too_long(unpaired, ids, max_length, tokenizer, data.system_prompt, i)
    return ("too_long", why) if why else [(unpaired, ids)]


def load_unpaired(
    data: DataConfig,
    tokenizer,
    split: str,
    *,
    eos_ids: list[int],
    end_id: int,
    max_length: int,
    recipe_path: str | None = None,
    limit: int | None = None,
) -> UnpairedSet | None:
    """The recipe's unpaired rows of ``split``, tokenized (see the module docstring). Training reads ``data.source``;
    evaluation ``data.eval_source``, else the held-out split of ``data.source`` (None when it has none). ``limit``
    keeps the first ``limit`` usable rows (a pair gives two)."""
    if data.source == "arithmetic":
        raise DataError(
            "kto needs labelled completions: set data.source to rows of prompt / completion / label (or preference "
            "pairs: each gives a desirable and an undesirable row), e.g. pkg:prefs_arith_train.jsonl or the "
            "workbench's votes"
        )
    source = data.eval_source if split == "eval" and data.eval_source else data.source
    rows, where = read_rows(source, split, recipe_path, data)
    if rows is None:
        return None
    out = UnpairedSet(rows=[], source=where, ties_beside=count_ties_beside(source, recipe_path))
    counts: Counter = Counter()

    def read(row, i):
        return read_unpaired_row(row, i, data, tokenizer, eos_ids, end_id, max_length)

    full = (lambda: len(out) >= limit) if limit is not None else (lambda: False)
    for got in usable_rows(rows, read, where, data.on_bad_row, counts, out.skipped, full):
        for kept, ids in got:
            out.add(kept, ids)
        out.from_pairs += 2 if len(got) == 2 else 0
    out.counts = {k: counts.get(k, 0) for k in SKIP_KINDS}
    if not out.rows:
        why = f"; first problem: {out.skipped[0][1]}" if out.skipped else ""
        raise DataError(f"{where}: no usable KTO rows (prompt, completion, label){why}")
    return out


def unpaired_summary(rows: UnpairedSet) -> str:
    """One line: the rows, how many are desirable, how many came from pairs, and what was left out, e.g.
    ``votes.jsonl: 6 rows (4 desirable, 2 undesirable; 4 from 2 pairs); left out 1 source rows: 1 tie``."""
    n, d = len(rows), rows.desirable
    pairs = f"; {rows.from_pairs} from {rows.from_pairs // 2} pairs" if rows.from_pairs else ""
    line = f"{rows.source}: {n} rows ({d} desirable, {n - d} undesirable{pairs})"
    parts = [f"{c} {k.replace('_', ' ')}" for k, c in rows.counts.items() if c]
    if parts:
        line += f"; left out {len(rows.skipped)} source rows: {', '.join(parts)}"
    if rows.ties_beside:
        line += f"; {rows.ties_beside} ties in the chat's ties file beside it (never trained on)"
    return line
