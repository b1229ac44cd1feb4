"""Data: prompt sets for RL (TRL's ``prompt`` plus extra columns), preference pairs for reward models, and where
they come from (:mod:`lorarl.data.sources`: hub datasets, files, folders). ``data/*.jsonl`` beside this package are
the shipped arithmetic preference pairs (``pkg:NAME``)."""

from lorarl.data.files import read_jsonl
from lorarl.data.prompts import PromptSet, encode_prompt, load_prompts, prompt_text, read_rows, shape_row, source_rows
from lorarl.data.sources import read_source

__all__ = [
    "PromptSet",
    "encode_prompt",
    "load_prompts",
    "prompt_text",
    "read_jsonl",
    "read_rows",
    "read_source",
    "shape_row",
    "source_rows",
]
