"""The Export tab's backend: ``lorarl export`` of a run, into ``RUNS/exports/NAME`` only, with the fidelity gate's
figures returned for the page to show before the user takes the files.

Merged, adapter and GGUF exports all pass through :func:`lorarl.export.export` and its fidelity gate
(:mod:`lorarl.export.gate`): the export run by its own runtime against the model as it trained, on ``gate_n``
held-out prompts. ``gate`` (a minimum greedy agreement) makes a failing export write nothing, as ``--gate`` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from lorarl.app.paths import checked_run, export_folder
from lorarl.errors import LorarlError
from lorarl.runstate import error_line

Format = Literal["merged", "adapter", "gguf"]
FORMATS = ("merged", "adapter", "gguf")
GATE_FIGURES = (
    "greedy_agreement",
    "token_agreement",
    "agreed",
    "prompts",
    "accuracy_trained",
    "accuracy_export",
    "accuracy_delta",
    "logprob_mean_abs_delta",
    "logprob_max_abs_delta",
    "top1_agreement",
    "tokenizer_agreement",
    "export_runtime",
    "training_model",
    "threshold",
    "passed",
    "seconds",
)


def export_with_gate(
    run_dir: str | os.PathLike,
    fmt: Format,
    out_dir: str,
    *,
    runs_dir: str | os.PathLike,
    checkpoint: str | None = None,
    gate_n: int = 64,
    gate: float | None = None,
    dtype: str | None = None,
    quant: str = "f16",
    force: bool = False,
) -> dict:
    """Export run ``run_dir`` (a run folder inside ``runs_dir``; ``checkpoint`` a step name, else its final adapter)
    as ``fmt`` into ``RUNS/exports/out_dir``; returns ``{"out", "format", "step", "files", "bytes", "gate": the
    gate's figures, "summary": the gate's one line, "notes"}``. Raises LorarlError (one line) for anything refused:
    a path outside the runs folder, an unknown format, an existing export without ``force``, a failed ``gate``; and
    for any other failure of the export (its one line, :func:`lorarl.runstate.error_line`, the cause chained)."""
    from lorarl.export import export
    from lorarl.export.gate import summary_line

    if fmt not in FORMATS:
        raise LorarlError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    runs_dir = Path(runs_dir)
    run = checked_run(run_dir, runs_dir)
    out = export_folder(out_dir, runs_dir)
    if gate_n < 1:
        raise LorarlError("the workbench always runs the fidelity gate: gate_n must be >= 1")
    try:
        result = export(
            run,
            out,
            fmt=fmt,
            dtype=dtype,
            force=force,
            checkpoint=checkpoint or None,
            quant=quant,
            gate=gate,
            gate_n=gate_n,
        )
    except LorarlError:
        raise
    except Exception as e:  # a converter, a full disk, out of memory: the page shows one line, the app goes on
        raise LorarlError(f"export of {run.name} as {fmt} failed: {error_line(e)}") from e
    report = result["gate"]
    figures = {k: report.get(k) for k in GATE_FIGURES if k in report}
    return {
        "out": result["out"],
        "format": fmt,
        "run": run.name,
        "step": result["step"],
        "files": result["files"],
        "bytes": result["bytes"],
        "gate": figures,
        "summary": summary_line(report),
        "notes": result["notes"],
    }
