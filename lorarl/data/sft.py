"""Supervised (SFT) examples in TRL's formats, rendered exactly as RL renders its prompts.

A row is either

* **prompt-completion**: ``prompt`` (a string, or chat messages) and ``completion`` (a string, or a list holding one
  assistant message) -- TRL's prompt-completion format; or
* **conversational**: ``messages``, a chat whose LAST message is the assistant's answer: the messages before it are
  the prompt, the last one is the completion (earlier assistant turns are context, not trained on); or
* **language modeling**: ``text`` (and neither ``prompt`` nor ``messages``), trained on every token as TRL's
  ``SFTTrainer`` trains its standard language-modeling rows: the tokenizer's EOS is appended unless the text ends
  with it, the text is tokenized as is (special tokens the tokenizer adds, a BOS, included; no chat template) and
  every token after the first is a target (:func:`encode_text`). ``data.columns: {text: review}`` reads another
  column (TRL's ``dataset_text_field``).

The prompt goes through :func:`lorarl.data.prompt_text` / :func:`lorarl.data.encode_prompt` (the chat template with
the generation prompt, ``data.system_prompt`` prepended), so a supervised example starts exactly where a rollout
starts. The completion is tokenized on its own and ends with the end-of-turn EOS a rollout's response ends with
(:func:`lorarl.model.tokens.end_of_turn_id`). Every other column is kept (e.g. ``answer``).

``data.source: arithmetic`` gives the built-in task's cold-start rows (worked solutions in the ``<think>`` /
``<answer>`` format, training problems only: :func:`lorarl.tasks.arithmetic.make_worked_examples`).

A bad row (no completion, an empty one, a malformed message list, too long) raises :class:`DataError` naming the
source, the row and the column, or with ``data.on_bad_row: skip`` is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorarl.config import DataConfig
from lorarl.data.prompts import encode_prompt, encode_rows, prompt_text, read_rows, too_long_by_chars
from lorarl.errors import DataError


@dataclass
class SFTSet:
    """The usable supervised examples.

    rows:            the rows as read, bad rows left out.
    prompt_ids:      ``[n]`` prompt token ids (chat template applied, as RL prompts).
    completion_ids:  ``[n]`` completion token ids, each ending with the end-of-turn EOS.
    loss_masks:      ``[n]`` per completion token, True where the loss counts (tool-use traces: the assistant's
                     turns; their tool messages are context), or None (every completion token counts).
    skipped:         ``[(row index, reason)]`` of rows dropped with ``on_bad_row: skip``.
    source:          where the rows came from.
    """

    rows: list[dict]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    source: str = ""
    loss_masks: list[list[bool]] | None = None  # per completion token: trained on (None: all); tool-use traces

    def __len__(self) -> int:
        return len(self.rows)


def completion_of(value: Any, i: int, column: str = "completion") -> str:
    """A row's completion as text: a string, an assistant message, or a list holding exactly one assistant message.
    Raises DataError naming row ``i`` and ``column`` otherwise (missing, empty, a user message, several messages)."""
    if value is None:
        raise DataError(
            f"row {i}: column '{column}' is missing (an SFT row needs prompt + completion, or messages ending "
            f"with the assistant's answer)"
        )
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise DataError(f"row {i}: column '{column}' must hold exactly one assistant message, got {len(value)}")
        value = value[0]
    if isinstance(value, dict):
        if value.get("role") != "assistant" or not isinstance(value.get("content"), str):
            raise DataError(f"row {i}: column '{column}' must be an assistant message with a string 'content'")
        value = value["content"]
    if not isinstance(value, str):
        raise DataError(
            f"row {i}: column '{column}' must be a string or an assistant message, got {type(value).__name__}"
        )
    if not value.strip():
        raise DataError(f"row {i}: column '{column}' is empty")
    return value


def split_row(row: Any, i: int) -> tuple[Any, str]:
    """``(prompt, completion text)`` of one row in either format (see the module docstring)."""
    if not isinstance(row, dict):
        raise DataError(f"row {i}: must be a mapping with prompt + completion, messages, or text")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise DataError(f"row {i}: column 'messages' must list the prompt messages and then the assistant's answer")
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise DataError(f"row {i}: column 'messages' must end with an assistant message (the completion)")
        return messages[:-1], completion_of(last, i, "messages")
    if "prompt" not in row:
        raise DataError(
            f"row {i}: column 'prompt' is missing (an SFT row needs prompt + completion, messages, or text)"
        )
    return row["prompt"], completion_of(row.get("completion"), i)


def is_text_row(row: Any) -> bool:
    """Whether ``row`` is a language-modeling row: a ``text`` column and neither ``prompt`` nor ``messages`` (TRL
    reads ``prompt`` first, then ``messages``, then its ``dataset_text_field``)."""
    return isinstance(row, dict) and "text" in row and "prompt" not in row and "messages" not in row


def encode_text(value: Any, tokenizer, max_length: int | None, i: int) -> tuple[list[int], list[int]]:
    """``(first token, the rest)`` of language-modeling row ``i``, as TRL's ``SFTTrainer`` prepares a standard
    ``text`` row: the tokenizer's EOS appended unless the text ends with it, then ``tokenizer(text)`` (the special
    tokens it adds, e.g. a BOS, included). Every token after the first is trained (it is the row's "completion"; the
    first has nothing before it to be predicted from). DataError for a value that is not a non-empty string, or
    (``max_length`` not None) a row longer than ``max_length`` tokens: lorarl never truncates (TRL keeps the first
    ``max_length``).

    Example (SmolLM2, EOS ``<|im_end|>`` = 2): ``"hello world"`` -> ``([28120], [905, 2])``."""
    if not isinstance(value, str):
        raise DataError(f"row {i}: column 'text' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"row {i}: column 'text' is empty")
    eos = tokenizer.eos_token
    ids = tokenizer(value if eos is None or value.endswith(eos) else value + eos)["input_ids"]
    if len(ids) < 2:
        raise DataError(f"row {i}: column 'text' has {len(ids)} token, nothing to train on")
    if max_length is not None and len(ids) > max_length:
        raise DataError(f"row {i}: column 'text' has {len(ids)} tokens, more than sft.max_length={max_length}")
    return ids[:1], ids[1:]


def read_sft_rows(cfg: DataConfig, recipe_path: str | None = None) -> tuple[list[dict], str]:
    """The raw supervised rows of ``data.source`` and where they came from: the arithmetic task's worked solutions
    for ``arithmetic``, else the training split of whatever :func:`lorarl.data.read_rows` reads (files, folders, hub
    datasets; ``data.columns`` maps other column names to ``prompt`` / ``completion`` / ``messages``)."""
    if cfg.source == "arithmetic":
        from lorarl.tasks.arithmetic import make_worked_examples, task_options

        rows = make_worked_examples(cfg.train_size, **task_options(cfg))
        return rows, f"arithmetic worked solutions ({cfg.train_size} rows, seed {cfg.seed})"
    return read_rows(cfg, "train", recipe_path=recipe_path)


def encode_example(
    prompt: Any, completion: str, tokenizer, cfg: DataConfig, eos_id: int, max_length: int | None, i: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids + [eos_id])`` of one example; DataError when the prompt or the whole example is
    longer than ``data.max_prompt_tokens`` / ``max_length`` tokens (None: any length, packing splits it)."""
    text = prompt_text(prompt, tokenizer, cfg.system_prompt, i)
    for name, part, limit, key in (
        ("prompt", text, cfg.max_prompt_tokens, "data.max_prompt_tokens"),
        ("completion", completion, max_length, "sft.max_length"),
    ):
        why = too_long_by_chars(len(part), limit, tokenizer)  # before tokenizing it
        if why:
            raise DataError(f"row {i}: the {name} {why} ({key}={limit})")
    p_ids = encode_prompt(text, tokenizer, templated=not isinstance(prompt, str))
    if len(p_ids) > cfg.max_prompt_tokens:
        raise DataError(
            f"row {i}: the prompt has {len(p_ids)} tokens, more than data.max_prompt_tokens={cfg.max_prompt_tokens}"
        )
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos_id]
    if max_length is not None and len(p_ids) + len(c_ids) > max_length:
        raise DataError(
            f"row {i}: prompt + completion have {len(p_ids) + len(c_ids)} tokens, more than sft.max_length={max_length}"
        )
    return p_ids, c_ids


def load_sft(
    cfg: DataConfig,
    tokenizer,
    eos_id: int,
    max_length: int,
    rows: list[dict] | None = None,
    recipe_path: str | None = None,
    long_rows: bool = False,
) -> SFTSet:
    """Read (unless ``rows`` are given; relative paths from the current directory, then beside ``recipe_path``),
    check and tokenize the supervised examples. Bad rows raise DataError (``on_bad_row: fail``) or are skipped and
    listed; a set with no usable row is always an error. ``long_rows``: rows longer than ``max_length`` are kept
    (packing that splits them, ``sft.packing_strategy`` bfd_split / wrapped), not bad rows."""
    if rows is None:
        rows, where = read_sft_rows(cfg, recipe_path)
    else:
        where = "<rows>"
    limit = None if long_rows else max_length

    def encode(row: Any, i: int) -> tuple[Any, tuple[list[int], list[int]]]:
        if is_text_row(row):
            return row, encode_text(row["text"], tokenizer, limit, i)
        prompt, completion = split_row(row, i)
        return row, encode_example(prompt, completion, tokenizer, cfg, eos_id, limit, i)

    good, encoded, skipped = encode_rows(rows, encode, where, cfg.on_bad_row, "SFT rows")
    p_all = [p for p, _ in encoded]
    c_all = [c for _, c in encoded]
    return SFTSet(rows=good, prompt_ids=p_all, completion_ids=c_all, skipped=skipped, source=where)
