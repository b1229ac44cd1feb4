"""The Export tab's callbacks (a mixin of :class:`lorarl.app.handlers.Workbench`): pick a run's checkpoint (the
newest run's final adapter by default), a format, a name (empty: the default name, said where the export went), a
minimum greedy agreement for the fidelity gate (empty: the figures are reported, not gated) and whether an export
of that name may be replaced; the export runs with the button disabled and a line saying what runs, then the gate's
figures end with its verdict. One export at a time: a second one (another browser tab) is refused with a line. An
export whose run names code of its own lists it first and runs on the second press (:mod:`lorarl.chat.consent`)."""

from __future__ import annotations

import threading
import time

import gradio as gr

from lorarl import runstate
from lorarl.app import exporting, watch
from lorarl.app.memory import Work
from lorarl.app.paths import export_folder
from lorarl.chat.catalog import BASE_ID
from lorarl.errors import LorarlError

REPLACE = "Replace an existing export of that name"


def default_name(run: str, step: str | None, fmt: str) -> str:
    """The export's name when the box is empty: ``RUN-final-merged``, ``RUN-step-000010-gguf``."""
    return f"{run}-{step or 'final'}-{fmt}"


def verdict(gate: dict) -> str:
    """The gate's verdict in words: passed / failed against its minimum, or reported without one."""
    agreement, minimum = gate.get("greedy_agreement"), gate.get("threshold")
    if not isinstance(agreement, (int, float)):
        return "no verdict: the gate measured no agreement"
    if minimum is None:
        return f"reported, not gated: greedy agreement {agreement:.1%} (no minimum set)"
    word = "passed" if agreement >= minimum else "failed"
    return f"**{word}**: greedy agreement {agreement:.1%} {'≥' if word == 'passed' else '<'} minimum {minimum:.0%}"


def gate_view(result: dict) -> tuple[str, list[list[str]]]:
    """The export result's gate as (summary line ending with the verdict, table rows of its figures: the minimum
    and the verdict instead of the raw ``threshold`` / ``passed``)."""
    gate = result.get("gate")
    line = result.get("summary") or result.get("summary_line") or ""
    if not gate:
        return (line or "no fidelity gate for this format"), []
    if not line:
        from lorarl.export.gate import summary_line

        line = summary_line(gate)
    rows = []
    for key, value in gate.items():
        if isinstance(value, (dict, list)) or key in ("threshold", "passed"):
            continue
        shown = "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        rows.append([key, shown])  # (None: a figure this export has not, e.g. accuracy without an answer column)
    minimum = gate.get("threshold")
    rows.append(["minimum greedy agreement", "none set" if minimum is None else f"{minimum:g}"])
    rows.append(["verdict", verdict(gate).replace("**", "")])
    return f"{line} — {verdict(gate)}", rows


class ExportTab:
    """The Export tab's callbacks; needs ``self.catalog``, ``self.runs_dir``, ``self.memory``,
    ``self.checkpoint_choices`` and ``self._consented`` (code of a run's folder runs on the second press, as Resume)
    of the Workbench."""

    _export_lock = threading.Lock()  # one export at a time in this app (each loads a model)
    _exporting: tuple[str, float] | None = None  # what runs, since when

    def export_choices(self) -> tuple[list[tuple[str, str]], str | None]:
        """The runs' adapter checkpoints, and the default pick: the newest run's final adapter (else the first)."""
        choices = [c for c in self.checkpoint_choices() if c[1] != BASE_ID]
        ids = {c[1] for c in choices}
        newest = next((f"{r.name}/policy" for r in watch.list_runs(self.runs_dir) if f"{r.name}/policy" in ids), None)
        return choices, newest or (choices[0][1] if choices else None)

    def on_export_refresh(self, current: str | None):
        choices, default = self.export_choices()
        return gr.Dropdown(choices=choices, value=current if current in {c[1] for c in choices} else default)

    def _export_plan(self, checkpoint_id: str, fmt: str, name: str, force: bool):
        """``(entry, step, name, named)`` of the export asked for; ``named``: the name was typed. Refused (one
        line): no run checkpoint picked, an existing export without ``force``."""
        if not checkpoint_id or checkpoint_id == BASE_ID:
            raise LorarlError("pick a run's checkpoint to export")
        entry = self.catalog.get(checkpoint_id)
        if entry.run is None or entry.kind != "adapter":
            raise LorarlError(f"{checkpoint_id}: only a run's adapter checkpoints export from here")
        step = checkpoint_id.split("/", 1)[1] if entry.step is not None else None
        typed = (name or "").strip()
        out_name = typed or default_name(entry.run, step, fmt)
        out = export_folder(out_name, self.runs_dir)
        if out.exists() and any(out.iterdir()) and not force:
            raise LorarlError(f"{out} already exists: tick “{REPLACE}” to replace it, or give another name")
        return entry, step, out_name, bool(typed)

    def on_export(self, checkpoint_id: str, fmt: str, name: str, force: bool, minimum):
        """Export the picked checkpoint: first a line saying what runs (the button disabled), then the fidelity
        gate's figures and verdict. Yields (status, summary, figures, button)."""
        idle = gr.Button(interactive=True)
        try:
            entry, step, out_name, named = self._export_plan(checkpoint_id, fmt, name, bool(force))
            gate = None if minimum in (None, "") else float(minimum)
            if gate is not None and not 0 <= gate <= 1:
                raise LorarlError(f"minimum greedy agreement must be between 0 and 1, got {minimum}")
            code = exporting.export_code(self.runs_dir / entry.run, self.runs_dir, step, strict=False)
        except (LorarlError, ValueError) as e:
            yield f"**not exported:** {e}", "", gr.Dataframe(visible=False), idle
            return
        if not self._consented(f"export:{checkpoint_id}", code):  # listed first; the second press is the consent
            line = f"**not exported yet:** exporting `{checkpoint_id}` runs code from its run's folder in this "
            yield line + f"app: {code.describe()}; read it, then press Export again to run it", "", gr.skip(), idle
            return
        if not self._export_lock.acquire(blocking=False):
            what, since = ExportTab._exporting or ("an export", time.time())
            yield f"**not started:** {what} is running (for {time.time() - since:.0f} s); wait for it", *[gr.skip()] * 3
            return
        try:
            ExportTab._exporting = (f"the export of {checkpoint_id}", time.time())
            auto = "" if named else " (the default name: the name box was empty)"
            where = f"`RUNS/exports/{out_name}`{auto}"
            yield (
                f"exporting `{checkpoint_id}` as {fmt} to {where}: writing it, then the fidelity gate runs it "
                "on 64 held-out prompts beside the model as it trained (a minute or more on a CPU)…",
                "",
                gr.Dataframe(visible=False),
                gr.Button(interactive=False),
            )
            result, _ = self.memory.start(
                Work(f"the export of {checkpoint_id}", None),
                lambda _: exporting.export_with_gate(
                    self.runs_dir / entry.run, fmt, out_name, runs_dir=self.runs_dir, consent=self.catalog.consent,
                    checkpoint=step, gate=gate, force=bool(force),
                ),
            )  # fmt: skip
        except LorarlError as e:
            yield f"**not exported:** {e}", "", gr.Dataframe(visible=False), idle
            return
        except Exception as e:  # noqa: BLE001 - a failure outside the export's own (the catalog, the guard): one line
            yield f"**not exported:** {runstate.error_line(e)}", "", gr.Dataframe(visible=False), idle
            return
        finally:
            ExportTab._exporting = None
            self._export_lock.release()
        summary, rows = gate_view(result)
        status = f"exported `{entry.id}` as {fmt} to `{result.get('out')}`{auto}"
        yield status, summary, gr.Dataframe(value=rows, visible=bool(rows)), idle
