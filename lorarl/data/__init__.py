"""Data: prompt sets for RL (TRL's ``prompt`` plus extra columns), preference pairs for reward models, and the files
they come from. ``data/*.jsonl`` beside this package are the shipped arithmetic preference pairs (``pkg:NAME``)."""

from lorarl.data.files import read_datasets_folder, read_jsonl
from lorarl.data.prompts import PromptSet, encode_prompt, load_prompts, prompt_text, read_rows

__all__ = [
    "PromptSet",
    "encode_prompt",
    "load_prompts",
    "prompt_text",
    "read_datasets_folder",
    "read_jsonl",
    "read_rows",
]
