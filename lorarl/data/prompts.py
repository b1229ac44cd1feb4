"""Prompt datasets: the built-in arithmetic generator, hub datasets, local files and folders
(:mod:`lorarl.data.sources`).

Rows follow TRL's fields: ``prompt`` is a string (used as is) or a list of chat messages (conversational: the
recipe's ``data.system_prompt`` is prepended as a system message when the row has none, and the tokenizer's chat
template is applied with the generation prompt). Every other column is kept and handed to reward functions by name.
A dataset with other names is mapped in the recipe (:func:`shape_row`): ``data.columns: {prompt: question}``
renames columns, ``data.answer_pattern`` extracts the answer (``gsm8k``: the text after ``####``), and
``data.as_chat: true`` makes a string prompt one user message so the chat template applies.

Every row is checked: a missing or empty ``prompt``, a malformed message list (a role that is not a string, a row
the chat template refuses), or a prompt longer than ``data.max_prompt_tokens`` (told by its length in characters,
before it is tokenized, when it is far too long: :func:`too_long_by_chars`) raises :class:`DataError` naming the row
index and the column, or, with ``data.on_bad_row: skip``, drops the row and counts it.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.config import DataConfig
from lorarl.data.files import Split
from lorarl.data.sources import answer_regex, extract_answer_column, map_columns, read_data_source
from lorarl.errors import DataError, quote

CHARS_MARGIN = 2  # see too_long_by_chars
_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> max_token_chars


@dataclass
class PromptSet:
    """The usable rows of one split.

    rows:       the rows as read (``prompt`` plus extra columns), bad rows left out.
    texts:      ``[n]`` the prompt text the model sees (chat template applied for conversational prompts).
    token_ids:  ``[n]`` lists of prompt token ids (no padding).
    skipped:    ``[(row index, reason)]`` for rows dropped with ``on_bad_row: skip``.
    source:     where the rows came from.
    """

    rows: list[dict]
    texts: list[str]
    token_ids: list[list[int]]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def conversational(self) -> bool:
        """True when prompts are chat messages (TRL then passes completions as messages too)."""
        return bool(self.rows) and not isinstance(self.rows[0]["prompt"], str)

    def columns(self, indices: list[int]) -> dict[str, list]:
        """The extra columns (everything but ``prompt``) of rows ``indices``, as TRL passes them to rewards."""
        names: list[str] = []
        for i in indices:
            for k in self.rows[i]:
                if k != "prompt" and k not in names:
                    names.append(k)
        return {k: [self.rows[i].get(k) for i in indices] for k in names}


def source_rows(
    cfg: DataConfig, split: Split, size: int | None = None, recipe_path: str | Path | None = None
) -> tuple[list[dict], str]:
    """The rows of ``split`` as the source holds them (before ``data.columns`` and ``data.answer_pattern``) and a
    description of where they came from; the columns ``data.columns`` maps from are checked against the first row.

    ``arithmetic`` generates ``size`` rows (default ``data.train_size`` / ``data.eval_size``) of the split. Anything
    else is read by :func:`lorarl.data.sources.read_source` (hub names, files, folders; relative paths from the
    current directory, then beside ``recipe_path``): the eval split reads ``data.eval_source``, else the held-out
    split of ``data.source`` (``data.eval_split``, or its test / validation / eval split).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    whole = split == "eval" and bool(cfg.eval_source)
    source = cfg.eval_source if whole else cfg.source
    if source == "arithmetic":
        from lorarl.tasks.arithmetic import make_problems, task_options

        n = size or (cfg.train_size if split == "train" else cfg.eval_size)
        rows = make_problems(split, n, **task_options(cfg))
        return rows, f"arithmetic ({split}, {n} rows, seed {cfg.seed})"
    rows, where = read_data_source(cfg, source, split, recipe_path=recipe_path, whole=whole)
    if rows is None:
        raise DataError(
            f"data.source {source}: no held-out split (test / validation / eval) to evaluate on; set "
            "data.eval_source to a held-out file or data.eval_split to a split of the source"
        )
    return rows, where


def shape_row(row: Any, cfg: DataConfig, i: int, regex: re.Pattern | None = None) -> dict:
    """Row ``i`` under lorarl's names: ``data.columns`` mapped, the answer extracted with ``data.answer_pattern``
    (``regex``: it compiled, see :func:`lorarl.data.sources.answer_regex`), and with ``data.as_chat`` a string
    prompt made one user message. With the defaults the row is returned unchanged."""
    if not isinstance(row, dict):
        raise DataError(f"row {i} is not a JSON object")
    row = map_columns(row, cfg.columns, i)
    if regex is not None:
        row = {**row, "answer": extract_answer_column(row.get("answer"), regex, i)}
    if cfg.as_chat and isinstance(row.get("prompt"), str):
        row = {**row, "prompt": [{"role": "user", "content": row["prompt"]}]}
    return row


def read_rows(
    cfg: DataConfig, split: Split, size: int | None = None, recipe_path: str | Path | None = None
) -> tuple[list[dict], str]:
    """The rows of ``split`` under lorarl's names (:func:`source_rows` then :func:`shape_row`; a row that cannot be
    shaped stops, or with ``data.on_bad_row: skip`` is left out) and where they came from. Prompts are not
    validated or tokenized here (:func:`load_prompts` does that)."""
    raw, where = source_rows(cfg, split, size, recipe_path)
    regex = answer_regex(cfg.answer_pattern)
    rows = []
    for i, row in enumerate(raw):
        try:
            rows.append(shape_row(row, cfg, i, regex))
        except DataError as e:
            if cfg.on_bad_row == "fail":
                raise DataError(f"{where}: {e} (set data.on_bad_row: skip to drop bad rows)") from None
    return rows, where


# ---------------------------------------------------------------------------------------------------------------
# Validation and templating
# ---------------------------------------------------------------------------------------------------------------


def check_message(m: Any, i: int, column: str, j: int) -> None:
    """Message ``j`` of row ``i``'s ``column``: a mapping whose ``role`` is a non-empty string and whose ``content``
    is a string (a role of another type made the chat template raise outside these checks, past ``on_bad_row``)."""
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise DataError(f"row {i}: column '{column}' message {j} must be a mapping with 'role' and 'content'")
    if not isinstance(m["role"], str) or not m["role"].strip():
        raise DataError(
            f"row {i}: column '{column}' message {j} role must be a string (system, user, assistant, tool), "
            f"got {quote(m['role'])}"
        )
    if not isinstance(m["content"], str):
        raise DataError(f"row {i}: column '{column}' message {j} content must be a string")


def render_chat(tokenizer, messages: list, i: int, column: str, **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)``; a template that refuses the row (its
    ``raise_exception``, a role it cannot render) is a DataError naming row ``i`` and ``column``, so ``on_bad_row``
    applies."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise DataError(
            f"row {i}: column '{column}': the chat template cannot render it ({type(e).__name__}: {e})"
        ) from None


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry (byte-level BPE writes
    one character per byte, SentencePiece one per character; 81 for SmolLM2); None without a vocabulary. Cached per
    tokenizer."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = getattr(tokenizer, "get_vocab", None)
    n = max(map(len, vocab()), default=1) if callable(vocab) else None
    try:
        _TOKEN_CHARS[tokenizer] = n
    except TypeError:
        pass
    return n


def too_long_by_chars(chars: int, max_tokens: int, tokenizer) -> str | None:
    """Whether a text of ``chars`` characters has more than ``max_tokens`` tokens for certain, told by its length
    alone, before it is tokenized (a 10 MB prompt took 10.8 s and 2.7 GB to tokenize before its length was checked):
    None when it may fit, else why not. One token stands for at most :func:`max_token_chars` characters; a text
    longer than :data:`CHARS_MARGIN` times that times ``max_tokens`` cannot fit (the margin: normalizers that join
    characters).

    Example (SmolLM2, 81): 512 tokens hold at most 82,944 characters."""
    per = max_token_chars(tokenizer)
    if per is None or chars <= CHARS_MARGIN * per * max_tokens:
        return None
    return f"has {chars:,} characters, more than {max_tokens} tokens hold (at most {per} characters each)"


def _check_messages(messages: list, i: int) -> None:
    if not messages:
        raise DataError(f"row {i}: column 'prompt' is an empty message list")
    for j, m in enumerate(messages):
        check_message(m, i, "prompt", j)
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise DataError(f"row {i}: column 'prompt' is empty (no non-empty user message)")


def prompt_text(prompt: Any, tokenizer, system_prompt: str | None, i: int = 0) -> str:
    """One row's prompt as the text the model is given. Raises DataError naming row ``i`` when unusable."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"row {i}: column 'prompt' is empty")
        return prompt
    if isinstance(prompt, (list, tuple)):
        messages = list(prompt)
        _check_messages(messages, i)
        if system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"row {i}: column 'prompt' is a message list but the tokenizer has no chat template")
        return render_chat(tokenizer, messages, i, "prompt", add_generation_prompt=True)
    if prompt is None:
        raise DataError(f"row {i}: column 'prompt' is missing")
    raise DataError(
        f"row {i}: column 'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}"
    )


def encode_prompt(text: str, tokenizer, templated: bool) -> list[int]:
    """Token ids of a prompt text. Chat-templated text already holds its special tokens, so none are added then."""
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


def encode_rows(rows: list, encode, where: str, on_bad_row: str, what: str) -> tuple[list, list, list]:
    """``encode(row, i) -> (kept row, encoded)`` over ``rows``; a row whose ``encode`` raises :class:`DataError` is
    bad: ``on_bad_row: fail`` stops with that error (prefixed by ``where``), ``skip`` lists it in ``skipped`` as
    ``(i, message)``. Returns ``(kept rows, encoded, skipped)``; no usable row at all is always an error."""
    good, encoded, skipped = [], [], []
    for i, raw in enumerate(rows):
        try:
            row, out = encode(raw, i)
        except DataError as e:
            if on_bad_row == "fail":
                raise DataError(f"{where}: {e} (set data.on_bad_row: skip to drop bad rows)") from None
            skipped.append((i, str(e)))
            continue
        good.append(row)
        encoded.append(out)
    if not good:
        why = f"; first problem: {skipped[0][1]}" if skipped else ""
        raise DataError(f"{where}: no usable {what}{why}")
    return good, encoded, skipped


def load_prompts(
    cfg: DataConfig, tokenizer, split: Split = "train", size: int | None = None, recipe_path: str | Path | None = None
) -> PromptSet:
    """Read, shape, validate, template and tokenize the prompts of ``split`` (see :func:`source_rows` for ``size``
    and ``recipe_path``, :func:`shape_row` for the recipe's column mapping).

    Bad rows raise :class:`DataError` (``on_bad_row: fail``) or are skipped and listed in ``PromptSet.skipped``.
    A split with no usable row is always an error.
    """
    rows, where = source_rows(cfg, split, size, recipe_path)
    regex = answer_regex(cfg.answer_pattern)

    def encode(raw: Any, i: int) -> tuple[dict, tuple[str, list[int]]]:
        row = shape_row(raw, cfg, i, regex)
        if "prompt" not in row:
            raise DataError(f"row {i}: column 'prompt' is missing")
        text = prompt_text(row["prompt"], tokenizer, cfg.system_prompt, i)
        why = too_long_by_chars(len(text), cfg.max_prompt_tokens, tokenizer)
        if why:
            raise DataError(f"row {i}: column 'prompt' {why} (data.max_prompt_tokens={cfg.max_prompt_tokens})")
        tokens = encode_prompt(text, tokenizer, templated=not isinstance(row["prompt"], str))
        if len(tokens) > cfg.max_prompt_tokens:
            raise DataError(
                f"row {i}: column 'prompt' has {len(tokens)} tokens, more than data.max_prompt_tokens="
                f"{cfg.max_prompt_tokens}"
            )
        return row, (text, tokens)

    good_rows, encoded, skipped = encode_rows(rows, encode, where, cfg.on_bad_row, f"rows in the {split} split")
    texts = [t for t, _ in encoded]
    ids = [ids for _, ids in encoded]
    return PromptSet(rows=good_rows, texts=texts, token_ids=ids, skipped=skipped, source=where)
