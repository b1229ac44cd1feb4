"""Export a run: a merged model, the policy adapter, a GGUF file (+ Ollama Modelfile), or a hand-off to verl / OpenRLHF.

``lorarl export RUN_DIR --out DIR --format merged|adapter|gguf|verl|openrlhf [--dtype bf16|fp16|fp32]
[--quant f16|bf16|q8_0|q4_k_m] [--gate MIN_AGREEMENT] [--gate-n 64] [--force]``

- ``merged`` (:mod:`.merged`): the base reloaded in full precision (fp32, on the CPU; never the NF4 weights the run
  trained on: merging a LoRA delta into 4-bit layers re-quantizes it and corrupts the outputs), the policy LoRA merged
  in, cast to ``--dtype`` and saved as safetensors with the tokenizer, chat template and generation config. Plain
  ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it; no lorarl import is needed.
- ``adapter`` (:mod:`.merged`): the policy adapter in PEFT format; ``base_model_name_or_path`` is the folder the base
  was loaded from (the converted default model's cache folder, or the user's model folder), so
  ``peft.AutoPeftModelForCausalLM`` / ``PeftModel.from_pretrained`` load it with plain transformers.
- ``gguf`` (:mod:`.gguf`, :mod:`.ollama`): the merged full-precision model converted by llama.cpp's own converter into
  one GGUF file (``--quant``; tokenizer and chat template in its metadata) and an Ollama ``Modelfile`` beside it.
- ``verl`` / ``openrlhf`` (:mod:`.engines`): what a run needs to continue on those distributed engines: the recipe's
  prompts (verl parquet / OpenRLHF JSONL), a self-contained ``reward.py`` (:mod:`.rewards_file`) with the recipe's
  rule rewards behind verl's ``compute_score`` and OpenRLHF's ``reward_func``, the adapter, a YAML file mapping the
  recipe's keys to the engine's keys, and a launch script.

Every export folder holds a model card ``README.md`` (:mod:`.card`: the recipe, the metrics at the exported step, how
to load it). What is exported is found by :mod:`.source` (on :mod:`lorarl.runs`); exports are atomic (:mod:`.writing`):
written into a temporary folder beside ``--out`` and renamed into place; replacing an existing folder needs ``force``.

Every merged, adapter and gguf export passes the fidelity gate (:mod:`.gate`, runtimes in :mod:`.runtimes`): on
``--gate-n`` held-out prompts, the exported artefact run by its own runtime (transformers, PEFT, llama.cpp) against
the model as it trained (greedy agreement, task accuracy of each, |delta log-prob| on the same tokens), written to
``gate.json`` and the model card; ``--gate MIN`` fails the export below a minimum agreement (nothing is written),
the default warns. :func:`measure_nf4_gap` (:mod:`.gap`) compares a merged export with the NF4 training model
(accuracy of each, logits max / mean |diff| and top-1 agreement on the same tokens, identical greedy completions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lorarl import forward_calls_to_api
from lorarl.errors import LorarlError
from lorarl.export.card import model_card
from lorarl.export.engines import KeyMap, Mapping, Unmapped, mapping_yaml, openrlhf_mapping, verl_mapping
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

FORMATS = ("merged", "adapter", "gguf", "verl", "openrlhf")
GATED = ("merged", "adapter", "gguf")  # formats whose artefact the fidelity gate runs
GATE_N = 64  # default --gate-n (lorarl.export.gate.DEFAULT_N; gate and gguf are imported on first use, so that
# `python -m lorarl.export.gate` / `python -m lorarl.export.gguf` do not find their module imported by this package)

__all__ = [
    "DTYPES",
    "FORMATS",
    "QUANTS",
    "KeyMap",
    "RunSource",
    "Unmapped",
    "export",
    "inline_source",
    "Mapping",
    "load_full_precision_base",
    "locate",
    "mapping_yaml",
    "measure_nf4_gap",
    "merge_adapter",
    "model_card",
    "openrlhf_mapping",
    "reward_module_source",
    "run_gate",
    "verl_mapping",
]


def _check_args(fmt: str, dtype: str | None, quant: str, gate: float | None, gate_n: int) -> None:
    """Every option checked before any slow work (an unknown value, or q4_k_m without a quantize tool)."""
    if fmt not in FORMATS:
        raise LorarlError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype is not None:
        torch_dtype(dtype)
    if fmt == "gguf":
        from lorarl.export.gguf import check_dependencies, check_quant

        check_quant(quant)
        check_dependencies()
    if gate is not None and not 0.0 <= gate <= 1.0:
        raise LorarlError(f"--gate is a minimum greedy agreement between 0 and 1, got {gate}")
    if gate_n < 0:
        raise LorarlError(f"--gate-n must be >= 0 (0 skips the gate), got {gate_n}")
    if gate is not None and (gate_n == 0 or fmt not in GATED):
        raise LorarlError(f"--gate needs the gate to run: --gate-n > 0 and --format {' | '.join(GATED)}")


def _gate(src: RunSource, fmt: str, tmp: Path, out: Path, info: dict, opts: dict) -> dict | None:
    """Run the fidelity gate on the artefact in the staging folder ``tmp``; raises below ``--gate``."""
    if fmt not in GATED or opts["gate_n"] == 0:
        return None
    from lorarl.export.gate import check_gate, run_gate, write_report

    artefact = Path(info["gguf"]) if fmt == "gguf" else tmp
    report = run_gate(
        src,
        fmt,
        artefact,
        n=opts["gate_n"],
        quant=info.get("quant"),
        device=opts.get("device"),
        runtime=opts.get("runtime"),
        train_quantization=opts.get("train_quantization"),
    )
    info["notes"] = info.get("notes", []) + check_gate(report, opts["gate"], out)
    write_report(report, tmp)
    return report


def export(
    run: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "merged",
    dtype: str | None = None,
    force: bool = False,
    checkpoint: str | None = None,
    quant: str = "f16",
    gate: float | None = None,
    gate_n: int = GATE_N,
    **gate_options: Any,
) -> dict:
    """Export ``run``'s policy to ``out`` in format ``fmt``; returns a summary (what ``lorarl export`` prints).

    ``dtype`` applies to merged weights (default bf16; for gguf, the merge handed to the converter, default fp32);
    adapters keep the precision they were trained in. ``quant`` is the GGUF type. Merged, adapter and gguf exports
    run the fidelity gate on ``gate_n`` held-out prompts (0 skips it); ``gate`` is a minimum greedy agreement below
    which the export fails and nothing is written. ``gate_options``: ``device``, ``runtime`` (``llama.cpp`` |
    ``transformers`` for a GGUF), ``train_quantization`` (see :func:`run_gate`).

    Raises :class:`LorarlError` for bad options, a missing run, a run without a policy adapter, an unsupported
    architecture (gguf), an existing ``out`` without ``force``, or a failed gate.
    """
    _check_args(fmt, dtype, quant, gate, gate_n)
    src = locate(run, checkpoint)
    if fmt == "gguf":
        from lorarl.export.gguf import check_architecture, converter_dir, write_gguf
        from lorarl.export.ollama import check_system_prompt

        check_architecture(src.base_path)
        check_system_prompt(src)
        converter_dir()  # fetched (once) before the slow merge
    out = Path(out).expanduser()
    check_out(out, force, [src.run_dir, src.adapter_dir])
    opts = {"gate": gate, "gate_n": gate_n, **gate_options}
    with staging_folder(out, force) as tmp:
        if fmt == "merged":
            info = write_merged(src, tmp, dtype or "bf16")
        elif fmt == "adapter":
            info = write_adapter(src, tmp)
        elif fmt == "gguf":
            info = write_gguf(src, tmp, quant, dtype)
        else:
            info = write_handoff(src, tmp, out, fmt)
        info["gate"] = _gate(src, fmt, tmp, out, info, opts)
        info["out"] = out
        (tmp / "README.md").write_text(model_card(src, fmt, dtype or "bf16", info), encoding="utf-8")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    report = info["gate"]
    return {
        "format": fmt,
        "out": str(out),
        "run": str(src.run_dir) if src.run_dir else None,
        "adapter": str(src.adapter_dir),
        "step": src.step,
        "base_model": src.base_path,
        "dtype": (dtype or "bf16") if fmt == "merged" else None,
        "quant": quant if fmt == "gguf" else None,
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "gate": {k: v for k, v in report.items() if k not in ("disagreements", "prompt_source")} if report else None,
        "notes": src.notes + info.get("notes", []),
    }


def __getattr__(name: str) -> Any:
    """:func:`measure_nf4_gap`, :func:`run_gate` and ``QUANTS`` are imported on first use: ``python -m
    lorarl.export.gap`` (``.gate``, ``.gguf``) must not find its module imported already by this package."""
    if name == "measure_nf4_gap":
        from lorarl.export.gap import measure_nf4_gap

        return measure_nf4_gap
    if name == "run_gate":
        from lorarl.export.gate import run_gate

        return run_gate
    if name == "QUANTS":
        from lorarl.export.gguf import QUANTS

        return QUANTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `from lorarl import export` gives this module once it is imported: calling it calls lorarl.api.export
forward_calls_to_api(__name__, "export")
