"""Export a run: a merged model, the policy adapter, or a hand-off to verl / OpenRLHF.

``lorarl export RUN_DIR --out DIR --format merged|adapter|verl|openrlhf [--dtype bf16|fp16|fp32] [--force]``

- ``merged`` (:mod:`.merged`): the base reloaded in full precision (fp32, on the CPU; never the NF4 weights the run
  trained on: merging a LoRA delta into 4-bit layers re-quantizes it and corrupts the outputs), the policy LoRA merged
  in, cast to ``--dtype`` and saved as safetensors with the tokenizer, chat template and generation config. Plain
  ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it; no lorarl import is needed.
- ``adapter`` (:mod:`.merged`): the policy adapter in PEFT format; ``base_model_name_or_path`` is the folder the base
  was loaded from (the converted default model's cache folder, or the user's model folder), so
  ``peft.AutoPeftModelForCausalLM`` / ``PeftModel.from_pretrained`` load it with plain transformers.
- ``verl`` / ``openrlhf`` (:mod:`.engines`): what a run needs to continue on those distributed engines: the recipe's
  prompts (verl parquet / OpenRLHF JSONL), a self-contained ``reward.py`` (:mod:`.rewards_file`) with the recipe's
  rule rewards behind verl's ``compute_score`` and OpenRLHF's ``reward_func``, the adapter, a YAML file mapping the
  recipe's keys to the engine's keys, and a launch script.

Every export folder holds a model card ``README.md`` (:mod:`.card`: the recipe, the metrics at the exported step, how
to load it). What is exported is found by :mod:`.source` (on :mod:`lorarl.runs`); exports are atomic (:mod:`.writing`):
written into a temporary folder beside ``--out`` and renamed into place; replacing an existing folder needs ``force``.

:func:`measure_nf4_gap` (:mod:`.gap`, ``python -m lorarl.export.gap RUN_DIR``) measures what merging into a
full-precision base changes compared with the NF4 model the run trained with: logit differences and greedy-answer
agreement on sample prompts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError
from lorarl.export.card import model_card
from lorarl.export.engines import KeyMap, Unmapped, launch_script, mapping_yaml, openrlhf_mapping, verl_mapping
from lorarl.export.engines.handoff import write_handoff
from lorarl.export.merged import (
    DTYPES,
    load_full_precision_base,
    merge_adapter,
    torch_dtype,
    write_adapter,
    write_merged,
)
from lorarl.export.rewards_file import inline_source, reward_module_source
from lorarl.export.source import RunSource, locate
from lorarl.export.writing import check_out, staging_folder

FORMATS = ("merged", "adapter", "verl", "openrlhf")

__all__ = [
    "DTYPES",
    "FORMATS",
    "KeyMap",
    "RunSource",
    "Unmapped",
    "export",
    "inline_source",
    "launch_script",
    "load_full_precision_base",
    "locate",
    "mapping_yaml",
    "measure_nf4_gap",
    "merge_adapter",
    "model_card",
    "openrlhf_mapping",
    "reward_module_source",
    "verl_mapping",
]


def export(
    run: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "merged",
    dtype: str = "bf16",
    force: bool = False,
    checkpoint: str | None = None,
) -> dict:
    """Export ``run``'s policy to ``out`` in format ``fmt``; returns a summary (what ``lorarl export`` prints).

    Raises :class:`LorarlError` for a missing run, a run without a policy adapter, or an existing ``out`` without
    ``force``. ``dtype`` applies to the merged weights; adapters keep the precision they were trained in.
    """
    if fmt not in FORMATS:
        raise LorarlError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    torch_dtype(dtype)  # an unknown --dtype fails before any work
    src = locate(run, checkpoint)
    out = Path(out).expanduser()
    check_out(out, force, [src.run_dir, src.adapter_dir])
    with staging_folder(out, force) as tmp:
        if fmt == "merged":
            info = write_merged(src, tmp, dtype)
        elif fmt == "adapter":
            info = write_adapter(src, tmp)
        else:
            info = write_handoff(src, tmp, out, fmt)
        (tmp / "README.md").write_text(model_card(src, fmt, dtype, info), encoding="utf-8")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {
        "format": fmt,
        "out": str(out),
        "run": str(src.run_dir) if src.run_dir else None,
        "adapter": str(src.adapter_dir),
        "step": src.step,
        "base_model": src.base_path,
        "dtype": dtype if fmt == "merged" else None,
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "notes": src.notes + info.get("notes", []),
    }


def __getattr__(name: str) -> Any:
    """:func:`measure_nf4_gap` is imported on first use: it needs torch, and ``python -m lorarl.export.gap`` must not
    find its module imported already by this package."""
    if name == "measure_nf4_gap":
        from lorarl.export.gap import measure_nf4_gap

        return measure_nf4_gap
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
