"""The workbench's callbacks and :func:`build_and_wire`, which builds the tabs (:mod:`lorarl.app.layout`) around the
chat and connects their events. No training code here: a launch, a stop, a resume, a retrain and an export are calls
into the backend (:mod:`lorarl.app.jobs`, :mod:`.watch`, :mod:`.recipes`, :mod:`.retrain`, :mod:`.exporting`),
and a run is ``lorarl train`` in its own process, so closing the browser never stops or loses it.

Every value the browser sends that names something on disk is a dropdown value, checked again here or in the
backend to be one of the configured folders' entries; every event is private (not in the client API).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from lorarl.app import jobs, recipes, retrain, watch
from lorarl.app.export_tab import ExportTab
from lorarl.app.layout import WorkbenchWidgets, base_note, build_workbench
from lorarl.app.memory import MemoryGuard, Work
from lorarl.app.paths import checked_run, shipped_recipes_dir
from lorarl.app.train_tab import TrainTab
from lorarl.app.views import POLL_OUTPUTS, view_outputs, view_stamp
from lorarl.chat.catalog import BASE_ID
from lorarl.errors import LorarlError

PRIVATE = {"api_visibility": "private"}
MODEL_KEY = "model.name"


def _err(e: Exception) -> str:
    return f"**error:** {e}"


class Workbench(TrainTab, ExportTab):
    """The callbacks of the Train, Watch, retrain and Export controls over one runs folder and its recipe folders."""

    def __init__(self, session, runs_dir: Path, recipe_dirs: list[Path]):
        self.session, self.catalog = session, session.catalog
        self.runs_dir = Path(runs_dir).expanduser().resolve()
        self.recipe_dirs = [Path(d).expanduser().resolve() for d in recipe_dirs]
        self.runner = jobs.JobRunner(self.runs_dir, self.recipe_dirs)
        self.memory = MemoryGuard(self.runner.live, lock=getattr(session.engine, "lock", None))
        session.pause = self.memory.chat_pause
        self._watches: dict[Path, Any] = {}
        self._shown: dict[tuple[str, Path], tuple] = {}  # (browser session, run) -> view_stamp last sent
        self._code_shown: dict[str, str] = {}  # button:target -> digest of the code its last press listed
        self._blockers: dict[tuple, str | None] = {}  # (run, recipe, its mtime, overrides) -> resume_blocker's line
        self._lock = threading.Lock()

    # ---- choices ----------------------------------------------------------------------------------------------
    def run_choices(self) -> list[tuple[str, str]]:
        """(label, name) of every run folder, newest first: its name and algorithm (its state when the algorithm is
        not known yet); the state line beside the dropdown says the rest."""
        return [(f"{r.name} · {r.algo or r.state}", r.name) for r in watch.list_runs(self.runs_dir)]

    def checkpoint_choices(self) -> list[tuple[str, str]]:
        """The base and every run's adapters (final and saved steps), as the chat's catalog lists them."""
        entries = self.catalog.scan().entries
        return [(label, cid) for label, cid in self.catalog.choices() if entries[cid].kind in ("base", "adapter")]

    def _recipe(self, path: str) -> Path:
        if not path:
            raise LorarlError("pick a recipe first")
        return recipes.check_recipe(path, self.recipe_dirs, self.runs_dir)

    # ---- the one door: every run, resume, retrain and export starts through the memory guard -----------------------
    def _launch(self, recipe: Path, name: str, overrides: list[str]) -> tuple[Path, str]:
        """Launch a new run through :meth:`MemoryGuard.start`; ``(run folder, the guard's note)``."""
        work = Work(f"the launch of run {name}", self.runs_dir / name, Path(recipe), tuple(overrides), pin=True)
        run_dir, admission = self.memory.start(work, lambda ov: self.runner.launch(recipe, name, ov))
        return run_dir, admission.note

    # ---- Watch ------------------------------------------------------------------------------------------------
    def _run_dir(self, run: str) -> Path:
        if not run:
            raise LorarlError("pick a run first")
        return checked_run(run, self.runs_dir)

    def _watch(self, run_dir: Path):
        w = self._watches.get(run_dir)
        if w is None:
            w = self._watches[run_dir] = watch.RunWatch(run_dir, self.runner.label(run_dir))
        return w

    def on_runs(self, current: str | None):
        runs = self.run_choices()
        names = [name for _, name in runs]
        return gr.Dropdown(choices=runs, value=current if current in names else (names[0] if names else None))

    def on_poll(self, run: str, request: gr.Request):
        """One look at the run (the timer's tick): state, progress, curves, warnings, crash lines, completions.
        Curves and completions are sent only when they changed since this browser last got them."""
        if not run:
            return ["_no run picked_", *[gr.skip()] * (POLL_OUTPUTS - 1)]
        try:
            run_dir = self._run_dir(run)
            with self._lock:  # one poll of a run at a time: RunWatch keeps file offsets
                follower = self._watch(run_dir)
                view = follower.poll()
        except LorarlError as e:
            return [_err(e), *[gr.skip()] * (POLL_OUTPUTS - 1)]
        blocker = self.resume_blocker(run_dir) if view.resumable and view.state in ("crashed", "failed") else None
        if blocker:  # what made it crash is still there: Resume would crash again the same way
            view = dataclasses.replace(view, resumable=False, note=f"Resume would fail the same way: {blocker}")
        key = (getattr(request, "session_hash", None) or "api", run_dir)
        stamp = view_stamp(view)
        fresh = self._shown.get(key) != stamp
        self._shown[key] = stamp
        live = self.runner.own_live()  # (a run of a train.pid this app did not write is named when Resume is pressed)
        return view_outputs(view, fresh, live, self.runner.label(live) if live is not None else None)

    def resume_blocker(self, run_dir: Path) -> str | None:
        """What a resume of ``run_dir`` would fail on before its first step (:func:`lorarl.app.preflight.preflight`
        of the recipe it resumes from: a missing adapter, data file or column), as ``key: line``; None when
        nothing. Cached per recipe file version (the Watch tab asks on each look at a crashed run)."""
        from lorarl.app.preflight import preflight

        try:
            recipe, overrides, _ = jobs.resume_source(run_dir, self.recipe_dirs, self.runs_dir)
            stamp = (run_dir, str(recipe), recipe.stat().st_mtime_ns, tuple(overrides))
            if stamp not in self._blockers:
                errors = preflight(recipe, overrides)[0]
                self._blockers[stamp] = "; ".join(f"{k}: {v}" for k, v in errors.items()) or None
        except (LorarlError, OSError) as e:
            return str(e)
        return self._blockers[stamp]

    def on_stop(self, run: str):
        try:
            return self.runner.stop(self._run_dir(run))
        except LorarlError as e:
            return _err(e)

    def on_resume(self, run: str):
        """Resume through the memory guard, planned from what the resume runs (:func:`lorarl.app.jobs.resume_source`:
        the launch's recipe and overrides, else RUN/recipe.yaml)."""
        try:
            run_dir = self._run_dir(run)
            label = self.runner.label(run_dir)
            recipe, overrides, _ = jobs.resume_source(run_dir, self.recipe_dirs, self.runs_dir)
            blocker = self.resume_blocker(run_dir)
            if blocker:
                return f"**not resumed:** it would fail before its first step: {blocker}; fix that, then launch again"
            code = resume_code(recipe, overrides, label)
            if not self._consented(f"resume:{label}", code):
                return (
                    f"**not resumed yet:** run {label} runs code from its folder when resumed: {code.describe()}; "
                    "read it, then press Resume again to run it"
                )
            work = Work(f"the resume of run {label}", run_dir, recipe, tuple(overrides), pin=False)
            run_dir, admission = self.memory.start(work, lambda _: self.runner.resume(run_dir))
        except LorarlError as e:
            return _err(e)
        note = f" ({admission.note})" if admission.note else ""
        shown = " ".join([str(recipe), *overrides])
        return f"resumed `{label}`: `lorarl train {shown} --out {run_dir} --resume`{note}"

    def _consented(self, press: str, code) -> bool:
        """Whether ``code`` (a :class:`~lorarl.chat.consent.RunCode`, or None) may run for button press ``press``:
        none, allowed already, or listed by the previous press of the same button (this press is then the consent);
        else it is remembered as listed, for the caller to show."""
        if not self.catalog.consent.allowed(code):
            if self._code_shown.get(press) != code.digest:
                self._code_shown[press] = code.digest
                return False
            self.catalog.consent.allow(code)
        self._code_shown.pop(press, None)
        return True

    # ---- Chat: votes -> retrain -------------------------------------------------------------------------------
    def votes_line(self) -> str:
        try:
            s = retrain.votes_summary(self.runs_dir)
        except LorarlError as e:
            return _err(e)
        return retrain.summary_line(s) if hasattr(retrain, "summary_line") else f"votes: {s}"

    def after_votes(self, events) -> None:
        """After each vote event (the chat's, :func:`lorarl.chat.handlers.wire`), refresh the votes line."""
        for event in events:
            event.then(self.votes_line, None, self.widgets.retrain.summary, **PRIVATE)

    def panes_note(self) -> str:
        """Which runs the panes offer (trained on the chat's base) and the runs left out, with why."""
        line = base_note(self.catalog.base_model)
        skipped = list(self.catalog.skipped)
        if skipped:
            line += (
                " Left out: " + "; ".join(skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
            )
        return line

    def on_chat_tab(self, start: str | None):
        choices = self.checkpoint_choices()
        ids = {c[1] for c in choices}
        start_dd = gr.Dropdown(choices=choices, value=start if start in ids else BASE_ID)
        return self.votes_line(), start_dd, self.panes_note()

    def retrain_handler(self, kind: str) -> Callable:
        def on_retrain(start: str):
            try:
                self.catalog.get(start or BASE_ID)  # a checkpoint the catalog lists, nothing else
                notes: list[str] = []

                def launch(recipe: Path, name: str, overrides: list[str]) -> Path:
                    run_dir, note = self._launch(recipe, name, overrides)
                    notes.append(note)
                    return run_dir

                run_dir = retrain.launch_retrain(
                    self.runner, kind, start or BASE_ID, base_model=self.catalog.base_model, launch=launch
                )
            except LorarlError as e:
                return _err(e), gr.skip(), gr.skip()
            name = Path(run_dir).name
            origin = (
                f"from `{start}`"
                if kind in retrain.POLICY_KINDS
                else f"(a fresh reward adapter on the base of `{start}`)"
            )
            msg = f"launched `{name}`: {kind} on the votes {origin}; watch it in the Watch tab"
            msg += f" ({notes[0]})" if notes and notes[0] else ""
            return msg, gr.Tabs(selected="watch"), gr.Dropdown(self.run_choices(), value=name)

        return on_retrain


def resume_code(recipe: Path, overrides: list[str], label: str):
    """The code a resume of run ``label`` would run (:func:`lorarl.chat.consent.run_code` of the recipe it resumes
    from, overrides applied), None when it names none."""
    import dataclasses

    from lorarl.chat.consent import run_code
    from lorarl.config import load_recipe

    return run_code(dataclasses.asdict(load_recipe(recipe, overrides, strict=False)), recipe, f"run {label}")


def build_and_wire(session, chat_handlers, runs_dir: Path, recipe_dirs, chat: Callable[[], Any]):
    """Build the tabs around the chat (``chat()`` builds its components) and wire the workbench's events; returns the
    chat's widgets (the caller wires them)."""
    wb = Workbench(session, runs_dir, recipe_dirs or [shipped_recipes_dir()])
    widgets, chat_widgets = build_workbench(
        wb.recipe_choices(),
        wb.run_choices(),
        wb.checkpoint_choices(),
        chat,
        export_pick=wb.export_choices()[1],
        base_model=str(wb.catalog.base_model),
        start_recipe=wb.start_recipe(),
    )
    wire_workbench(widgets, wb, chat_widgets, chat_handlers)
    widgets.workbench, wb.widgets = wb, widgets
    session.workbench = wb  # for tests and embedding
    return chat_widgets


def wire_workbench(w: WorkbenchWidgets, wb: Workbench, chat_widgets, chat_handlers) -> None:
    """Connect the tabs' events (all private)."""
    t, wt, r, x = w.train, w.watch, w.retrain, w.export
    from gradio.context import Context

    field_out = [t.model_error, *t.adapter_errors, *t.errors, t.plan, t.status]
    shown = [t.header, t.model, t.model_error, t.keys, *t.adapters, *t.adapter_errors, *t.slots, *t.errors]
    shown += [t.plan, t.status]
    t.recipe.change(wb.on_recipe, t.recipe, shown, **PRIVATE)
    Context.root_block.load(wb.on_recipe, t.recipe, shown, **PRIVATE)  # a first visit opens on the start recipe
    t.refresh.click(wb.on_recipes, t.recipe, t.recipe, **PRIVATE)
    check_in = [t.recipe, t.model, *t.adapters, t.keys, t.run_name, *t.slots]  # Check and Launch read the same
    t.check.click(wb.on_check, check_in, field_out, **PRIVATE)
    t.launch.click(wb.on_launch, check_in, [*field_out, w.tabs, wt.run], **PRIVATE)
    poll_out = [wt.state, wt.progress, wt.result, *wt.plots.values(), *wt.notes.values(), wt.warnings, wt.log]
    poll_out += [wt.completions]
    poll_out += [wt.stop, wt.resume]
    assert len(poll_out) == POLL_OUTPUTS
    wt.timer.tick(wb.on_poll, wt.run, poll_out, show_progress="hidden", **PRIVATE)
    wt.run.change(wb.on_poll, wt.run, poll_out, **PRIVATE)
    wt.refresh.click(wb.on_runs, wt.run, wt.run, **PRIVATE)
    w.watch_tab.select(wb.on_runs, wt.run, wt.run, **PRIVATE)
    wt.stop.click(wb.on_stop, wt.run, wt.status, **PRIVATE)
    wt.resume.click(wb.on_resume, wt.run, wt.status, **PRIVATE)
    # the chat tab: new runs and steps show in the panes; the votes summary and the starting checkpoints refresh
    pickers = chat_widgets.panes.pickers
    w.chat_tab.select(
        chat_handlers.on_refresh, pickers, [*pickers, chat_widgets.settings.reward, chat_widgets.status], **PRIVATE
    )
    w.chat_tab.select(wb.on_chat_tab, r.start, [r.summary, r.start, r.panes_note], **PRIVATE)
    for kind, button in (("dpo", r.dpo), ("kto", r.kto), ("reward_model", r.reward_model)):
        button.click(wb.retrain_handler(kind), r.start, [r.status, w.tabs, wt.run], **PRIVATE)
    x.refresh.click(wb.on_export_refresh, x.checkpoint, x.checkpoint, **PRIVATE)
    w.export_tab.select(wb.on_export_refresh, x.checkpoint, x.checkpoint, **PRIVATE)
    export_in = [x.checkpoint, x.fmt, x.name, x.force, x.minimum]
    x.export.click(wb.on_export, export_in, [x.status, x.summary, x.figures, x.export], **PRIVATE)
