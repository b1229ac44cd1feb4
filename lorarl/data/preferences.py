"""Preference pairs for the Bradley-Terry reward model: reading, validating and tokenizing TRL's format.

Rows follow TRL's preference format, in any of its four shapes:

* plain, explicit prompt:          ``{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}``
* plain, implicit prompt:          ``{"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}``
* conversational, explicit prompt: ``{"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
  "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}``
* conversational, implicit prompt: ``{"chosen": [user message, assistant message], "rejected": [user, assistant]}``
  (the messages the two share at the start are the prompt).

An optional numeric ``margin`` column is read when ``reward_model.margin`` is on (Llama 2's margin loss).

Where pairs come from (``data.source`` / ``data.eval_source`` of a reward-model recipe):

* ``pkg:NAME`` -- a file shipped inside lorarl, ``lorarl/data/NAME`` (``pkg:prefs_arith_train.jsonl``);
* a hub dataset, a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a folder written by ``save_to_disk`` or a
  folder of data files, by the one rule of :mod:`lorarl.data.sources` (relative paths: the current directory, then
  beside the recipe; the ``train`` split for training and the ``test`` / ``validation`` / ``eval`` split for
  evaluation when no ``eval_source`` is given; ``data.split`` / ``data.eval_split`` name others);
* other column names are mapped in the recipe: ``data.columns: {chosen: pos, rejected: neg}`` (:func:`shape_pair`).

Tokenization matches what PPO scores, token for token: the prompt is rendered exactly as the rollout renders it
(:func:`lorarl.data.prompt_text`: the chat template with the generation prompt, the recipe's system prompt), and the
response is its text's tokens followed by one EOS -- what a finished sampled completion is. The score is read at
that EOS (the last non-pad token, located with the attention mask).

Every problem raises :class:`~lorarl.errors.DataError` naming the source, the row index and the column, or (with
``data.on_bad_row: skip``) drops the row and lists it in :attr:`PreferenceSet.skipped`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from lorarl.config import DataConfig
from lorarl.data.prompts import check_message, prompt_text, render_chat, too_long_by_chars
from lorarl.data.sources import map_columns, read_data_source
from lorarl.errors import DataError, LorarlError
from lorarl.runs import PKG_PREFIX, resolve_path

Split = Literal["train", "eval"]

__all__ = [
    "PKG_PREFIX",
    "PreferenceSet",
    "resolve_source",
    "read_rows",
    "normalize_pair",
    "load_preferences",
    "preferences_for",
    "shape_pair",
    "encode_pair",
    "encode_response",
]


@dataclass
class PreferenceSet:
    """The usable pairs of one split.

    pairs:    normalised rows ``{"prompt": str | messages | None, "chosen": ..., "rejected": ..., "margin": float |
              None, "columns": {other columns}}``; ``chosen`` / ``rejected`` hold only the response (a string or a
              list of messages).
    chosen_ids, rejected_ids: ``[n]`` token-id lists (prompt + response + EOS), filled by :func:`load_preferences`
              when a tokenizer is given.
    skipped:  ``[(row index, reason)]`` rows dropped with ``on_bad_row: skip`` (or longer than ``max_length``).
    source:   where the rows came from.
    """

    pairs: list[dict]
    chosen_ids: list[list[int]] = field(default_factory=list)
    rejected_ids: list[list[int]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.pairs)

    def margins(self, indices: list[int]) -> Tensor | None:
        """``[b]`` margins of rows ``indices`` (0 where a row has none), or None when no row of the set has one."""
        if not any(p["margin"] is not None for p in self.pairs):
            return None
        return torch.tensor([self.pairs[i]["margin"] or 0.0 for i in indices], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Where the rows are
# ---------------------------------------------------------------------------------------------------------------


def resolve_source(source: str, recipe_path: str | Path | None = None) -> Path:
    """Where a preference source is: ``pkg:NAME``, or a path by :func:`lorarl.runs.resolve_path`'s order (the
    current directory, then beside the recipe). Raises DataError when nothing is there."""
    try:
        return resolve_path(source, recipe_path, "preference source")
    except LorarlError as e:
        raise DataError(str(e)) from None


def read_rows(
    source: str,
    split: Split = "train",
    recipe_path: str | Path | None = None,
    data: DataConfig | None = None,
    *,
    whole: bool | None = None,
) -> tuple[list[Any] | None, str]:
    """The raw rows of a preference source (:func:`lorarl.data.sources.read_source`: ``pkg:NAME``, files, folders,
    hub names) and a description of where they came from. ``data`` gives the subset, split names and the columns
    ``data.columns`` maps from (checked against the first row). Rows are None when an evaluation finds no held-out
    split; ``whole`` (default: ``split == "eval"`` and ``source`` is ``data.eval_source``, or no ``data`` is given)
    reads a one-split source (a file) as the held-out set."""
    if whole is None:
        whole = split == "eval" and (data is None or source == data.eval_source)
    data = data or DataConfig(source=source)
    return read_data_source(data, source, split, recipe_path=recipe_path, whole=whole, objects=False)


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


def _is_messages(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def check_messages(messages: Any, i: int, column: str) -> list[dict]:
    if not messages:
        raise DataError(f"row {i}: column '{column}' is an empty message list")
    out = []
    for j, m in enumerate(messages):
        check_message(m, i, column, j)
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_text(x: Any, i: int, column: str) -> str:
    if not isinstance(x, str):
        raise DataError(
            f"row {i}: column '{column}' must be a string or a list of chat messages, got {type(x).__name__}"
        )
    if not x.strip():
        raise DataError(f"row {i}: column '{column}' is empty")
    return x


def normalize_pair(row: Any, i: int) -> dict:
    """One raw row -> ``{"prompt", "chosen", "rejected", "margin"}`` with the response alone in chosen / rejected.

    Raises DataError naming row ``i`` and the column when the row is unusable.

    Example: ``{"chosen": [u, a1], "rejected": [u, a2]}`` -> ``{"prompt": [u], "chosen": [a1], "rejected": [a2],
    "margin": None, "columns": {}}``.
    """
    if not isinstance(row, dict):
        raise DataError(f"row {i} is not a JSON object")
    for col in ("chosen", "rejected"):
        if col not in row or row[col] is None:
            raise DataError(f"row {i}: column '{col}' is missing")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    conversational = _is_messages(chosen)
    if _is_messages(rejected) != conversational:
        raise DataError(
            f"row {i}: column 'rejected' must have the same format as 'chosen' (both strings or both messages)"
        )
    if conversational:
        chosen = check_messages(chosen, i, "chosen")
        rejected = check_messages(rejected, i, "rejected")
        if prompt is None:  # implicit prompt: the shared leading messages
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            if k == 0:
                raise DataError(
                    f"row {i}: column 'prompt' is missing and 'chosen' / 'rejected' share no leading message"
                )
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        elif not _is_messages(prompt):
            raise DataError(f"row {i}: column 'prompt' must be a list of messages when 'chosen' is")
        else:
            prompt = check_messages(prompt, i, "prompt")
        for col, msgs in (("chosen", chosen), ("rejected", rejected)):
            if msgs[-1]["role"] != "assistant":
                raise DataError(f"row {i}: column '{col}' must end with an assistant message")
    else:
        chosen = check_text(chosen, i, "chosen")
        rejected = check_text(rejected, i, "rejected")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise DataError(f"row {i}: column 'prompt' must be a string when 'chosen' is")
            if not prompt.strip():
                raise DataError(f"row {i}: column 'prompt' is empty")
    margin = row.get("margin")
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise DataError(f"row {i}: column 'margin' must be a finite number, got {margin!r}")
        margin = float(margin)
    columns = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected", "margin")}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin, "columns": columns}


# ---------------------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------------------


def response_chars(response: str | list[dict]) -> int:
    """The characters a response is tokenized from (:func:`encode_response`; several messages: their contents, which
    the chat template wraps)."""
    return len(response) if isinstance(response, str) else sum(len(m["content"]) for m in response)


def encode_response(response: str | list[dict], tokenizer, i: int = 0, column: str = "chosen") -> list[int]:
    """The response's token ids followed by one EOS (the shape of a finished sampled completion).

    A single assistant message contributes its content; several messages (a multi-turn continuation) are rendered
    with the chat template, minus its trailing EOS, so only one EOS ends the response."""
    eos = tokenizer.eos_token_id
    if isinstance(response, str):
        ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    elif len(response) == 1:
        ids = tokenizer(response[0]["content"], add_special_tokens=False)["input_ids"]
    else:
        text = render_chat(tokenizer, response, i, column)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while ids and ids[-1] != eos and tokenizer.decode(ids[-1:]).strip() == "":
            ids = ids[:-1]  # a template's trailing newline after its end-of-turn token
    if not ids or ids[-1] != eos:
        ids = ids + [eos]
    return ids


def pair_too_long_by_chars(pair: dict, tokenizer, system_prompt: str | None, max_length: int, i: int) -> str | None:
    """Whether the prompt with the longer response of a normalised pair has more than ``max_length`` tokens for
    certain, by its length in characters (:func:`lorarl.data.prompts.too_long_by_chars`), before either is
    tokenized; None when it may fit."""
    prompt = pair["prompt"]
    longer = max(response_chars(pair["chosen"]), response_chars(pair["rejected"]))
    raw = longer + (0 if prompt is None else response_chars(prompt)) + len(system_prompt or "")
    if too_long_by_chars(raw, max_length, tokenizer) is None:
        return None  # may fit: the tokens decide (the prompt is not templated twice for nothing)
    text = "" if prompt is None else prompt_text(prompt, tokenizer, system_prompt, i)
    return too_long_by_chars(len(text) + longer, max_length, tokenizer)


def encode_pair(pair: dict, tokenizer, system_prompt: str | None = None, i: int = 0) -> tuple[list[int], list[int]]:
    """``(chosen_ids, rejected_ids)``: prompt tokens (rendered as the rollout renders prompts) + response + EOS."""
    from lorarl.data.prompts import encode_prompt

    prompt = pair["prompt"]
    if prompt is None:
        prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])  # a BOS, for tokenizers that add one
    else:
        text = prompt_text(prompt, tokenizer, system_prompt, i)
        prefix = encode_prompt(text, tokenizer, templated=not isinstance(prompt, str))
    chosen, rejected = (encode_response(pair[c], tokenizer, i, c) for c in ("chosen", "rejected"))
    return prefix + chosen, prefix + rejected


def shape_pair(row: Any, data: DataConfig | None, i: int) -> Any:
    """Row ``i`` under TRL's names: ``data.columns`` mapped (``{chosen: pos, rejected: neg, prompt: question}``);
    with ``data.as_chat`` a string prompt becomes a user message and string responses assistant messages (rows with
    an explicit prompt; implicit-prompt rows are kept as they are)."""
    if data is None or not isinstance(row, dict):
        return row
    row = map_columns(row, data.columns, i)
    if data.as_chat and isinstance(row.get("prompt"), str):
        row = dict(row, prompt=[{"role": "user", "content": row["prompt"]}])
        for col in ("chosen", "rejected"):
            if isinstance(row.get(col), str):
                row[col] = [{"role": "assistant", "content": row[col]}]
    return row


def load_preferences(
    source: str,
    tokenizer=None,
    *,
    split: Split = "train",
    recipe_path: str | Path | None = None,
    system_prompt: str | None = None,
    max_length: int | None = None,
    on_bad_row: Literal["skip", "fail"] = "fail",
    limit: int | None = None,
    data: DataConfig | None = None,
    missing_ok: bool = False,
) -> PreferenceSet | None:
    """Read, validate and (with a ``tokenizer``) tokenize the preference pairs of ``source``.

    ``data`` (the recipe's section) gives the subset, split names, column mapping and ``as_chat``
    (:func:`shape_pair`). ``max_length`` drops pairs whose longer side has more tokens (listed in ``skipped``,
    never an error, like TRL), and so does a pair whose two responses tokenize identically. ``limit`` keeps the first ``limit`` usable pairs. A source with no usable pair is
    always an error; one with no held-out split (``split="eval"``) gives None with ``missing_ok``, else an error.
    """
    rows, where = read_rows(source, split, recipe_path, data)
    if rows is None:
        if missing_ok:
            return None
        raise DataError(
            f"{where}: no held-out split (test / validation / eval); set data.eval_source or data.eval_split"
        )
    out = PreferenceSet(pairs=[], source=where)
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        try:
            pair = normalize_pair(shape_pair(row, data, i), i)
            why = (
                tokenizer is not None
                and max_length
                and pair_too_long_by_chars(pair, tokenizer, system_prompt, max_length, i)
            )
            if why:
                out.skipped.append((i, f"row {i}: longer than reward_model.max_length={max_length} tokens: it {why}"))
                continue
            if tokenizer is not None:
                c, r = encode_pair(pair, tokenizer, system_prompt, i)
        except DataError as e:
            if on_bad_row == "fail":
                raise DataError(f"{where}: {e} (set data.on_bad_row: skip to drop bad rows)") from None
            out.skipped.append((i, str(e)))
            continue
        if tokenizer is not None:
            if max_length is not None and max(len(c), len(r)) > max_length:
                out.skipped.append((i, f"row {i}: longer than reward_model.max_length={max_length} tokens"))
                continue
            if c == r:  # no preference to learn (as dpo's loader: lorarl.data.pairs, kind `identical`)
                out.skipped.append((i, f"row {i}: columns 'chosen' and 'rejected' are the same response"))
                continue
            out.chosen_ids.append(c)
            out.rejected_ids.append(r)
        out.pairs.append(pair)
    if not out.pairs:
        why = f"; first problem: {out.skipped[0][1]}" if out.skipped else ""
        raise DataError(f"{where}: no usable preference pairs{why}")
    return out


def preferences_for(
    data: DataConfig,
    tokenizer,
    split: Split = "train",
    *,
    recipe_path: str | Path | None = None,
    max_length: int | None = None,
    limit: int | None = None,
) -> PreferenceSet | None:
    """A recipe's preference pairs of ``split``: training reads ``data.source``; evaluation ``data.eval_source``,
    else the held-out split of ``data.source`` (None when it has none: a single file)."""
    if data.source == "arithmetic":
        raise DataError(
            "reward_model needs preference pairs: set data.source to a hub dataset, a file, a folder or "
            "pkg:prefs_arith_train.jsonl (and data.eval_source to the held-out pairs)"
        )
    source = data.eval_source if split == "eval" and data.eval_source else data.source
    return load_preferences(
        source,
        tokenizer,
        split=split,
        recipe_path=recipe_path,
        system_prompt=data.system_prompt,
        max_length=max_length,
        on_bad_row=data.on_bad_row,
        limit=limit,
        data=data,
        missing_ok=split == "eval",
    )
