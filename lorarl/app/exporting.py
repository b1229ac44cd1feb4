"""The Export tab's backend: ``lorarl export`` of a run, into ``RUNS/exports/NAME`` only, with the fidelity gate's
figures returned for the page to show before the user takes the files.

Merged, adapter and GGUF exports all pass through :func:`lorarl.export.export` and its fidelity gate
(:mod:`lorarl.export.gate`): the export run by its own runtime against the model as it trained, on ``gate_n``
held-out prompts. ``gate`` (a minimum greedy agreement) makes a failing export write nothing, as ``--gate`` does.

An export runs in the app's process, and the gate of an agent run runs the run's tools and environment (and a
``model.trust_remote_code`` run loads the model's own code): code a run folder names, which runs only with the
user's consent (:mod:`lorarl.chat.consent`; :func:`export_code` lists it, the Export button shows it first).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from lorarl.app.paths import checked_run, export_folder, run_label
from lorarl.chat.consent import CodeConsent, run_code
from lorarl.errors import LorarlError
from lorarl.runstate import error_line
from lorarl.user_code import guarded

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
EXPORT_CODE = ("tool", "environment", "model")  # what an export may run of a run's code (its gate's agent, its model)


def export_code(run_dir: str | os.PathLike, runs_dir: str | os.PathLike, checkpoint: str | None = None, strict=True):
    """The code an export of run ``run_dir`` (``checkpoint`` a step name, else its final adapter) would run in this
    process (:data:`EXPORT_CODE` of the recipe the export reads, :func:`lorarl.export.locate`), as a
    :class:`~lorarl.chat.consent.RunCode`; None when it names none. When the export cannot find the run's adapter or
    recipe: LorarlError, or with ``strict`` False None (the page's listing: the export then stops with that line,
    before anything of the run is loaded)."""
    from lorarl.export import locate

    run = checked_run(run_dir, runs_dir)
    try:
        src = locate(run, checkpoint or None)
    except LorarlError:
        if strict:
            raise
        return None
    recipe = dataclasses.asdict(src.recipe) if src.recipe is not None else None
    return run_code(recipe, src.recipe_path, f"run {run_label(run, Path(runs_dir))}", EXPORT_CODE)


def export_with_gate(
    run_dir: str | os.PathLike,
    fmt: Format,
    out_dir: str,
    *,
    runs_dir: str | os.PathLike,
    consent: CodeConsent,
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
    a path outside the runs folder, an unknown format, an existing export without ``force``, a failed ``gate``, code
    of the run's (:func:`export_code`) that ``consent`` has not allowed -- checked again at each load inside
    (:func:`lorarl.user_code.guarded`); and for any other failure of the export (its one line,
    :func:`lorarl.runstate.error_line`, the cause chained)."""
    from lorarl.export import export
    from lorarl.export.gate import summary_line

    if fmt not in FORMATS:
        raise LorarlError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    runs_dir = Path(runs_dir)
    run = checked_run(run_dir, runs_dir)
    out = export_folder(out_dir, runs_dir)
    if gate_n < 1:
        raise LorarlError("the workbench always runs the fidelity gate: gate_n must be >= 1")
    consent.require(export_code(run, runs_dir, checkpoint), f"the export of {run.name}", "press Export again")
    try:
        with guarded(consent.check_load):  # whatever inside loads a run's code: allowed code only
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
