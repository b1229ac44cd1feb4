"""The workbench's callbacks and :func:`build_and_wire`, which builds the tabs (:mod:`lorarl.app.layout`) around the
chat and connects their events. No training code here: a launch, a stop, a resume, a retrain and an export are calls
into the backend (:mod:`lorarl.app.jobs`, :mod:`.watch`, :mod:`.recipes`, :mod:`.retrain`, :mod:`.exporting`),
and a run is ``lorarl train`` in its own process, so closing the browser never stops or loses it.

Every value the browser sends that names something on disk is a dropdown value, checked again here or in the
backend to be one of the configured folders' entries; every event is private (not in the client API).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from lorarl import runstate
from lorarl.app import exporting, jobs, recipes, retrain, watch
from lorarl.app.layout import MAX_FIELDS, PLOTS, WorkbenchWidgets, base_note, build_workbench
from lorarl.app.memory import MemoryGuard, Work
from lorarl.app.paths import check_run_name, checked_run, shipped_recipes_dir
from lorarl.chat.catalog import BASE_ID, Catalog
from lorarl.errors import LorarlError

PRIVATE = {"api_visibility": "private"}
MODEL_KEY = "model.name"


def _err(e: Exception) -> str:
    return f"**error:** {e}"


def model_choices(catalog: Catalog, current: str | None) -> list[str]:
    """What the model dropdown offers: the chat's base (the runs' model), the embedded models, and the recipe's own
    ``model.name`` (no free path from the browser)."""
    from lorarl.model.registry import EMBEDDED

    out = [catalog.base_model, *EMBEDDED]
    if current:
        out.append(str(current))
    return list(dict.fromkeys(out))


class Workbench:
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
        self._lock = threading.Lock()

    # ---- choices ----------------------------------------------------------------------------------------------
    def recipe_choices(self) -> list[tuple[str, str]]:
        return [(c.label, str(c.path)) for c in recipes.list_recipes(self.recipe_dirs, self.runs_dir)]

    def run_choices(self) -> list[tuple[str, str]]:
        """(label, name) of every run folder, newest first (its state is shown beside the dropdown)."""
        return [(f"{r.name} · {r.algo or '?'}", r.name) for r in watch.list_runs(self.runs_dir)]

    def checkpoint_choices(self) -> list[tuple[str, str]]:
        """The base and every run's adapters (final and saved steps), as the chat's catalog lists them."""
        entries = self.catalog.scan().entries
        return [(label, cid) for label, cid in self.catalog.choices() if entries[cid].kind in ("base", "adapter")]

    def _recipe(self, path: str) -> Path:
        if not path:
            raise LorarlError("pick a recipe first")
        return recipes.check_recipe(path, self.recipe_dirs, self.runs_dir)

    # ---- Train ------------------------------------------------------------------------------------------------
    def on_recipes(self, current: str | None):
        choices = self.recipe_choices()
        return gr.Dropdown(choices=choices, value=current if current in {c[1] for c in choices} else None)

    def on_recipe(self, path: str):
        """Show a recipe: its header, the model dropdown, one slot per common field, the planner's line."""
        try:
            recipe = self._recipe(path)
            fields, values = recipes.fields_for(recipe), recipes.field_values(recipe)
            header = recipes.recipe_header(recipe)
            code = recipes.code_entries(recipe)
        except LorarlError as e:
            return [gr.skip()] * 4 + [gr.skip()] * (2 * MAX_FIELDS) + [_err(e), ""]
        others = [f for f in fields if f.key != MODEL_KEY][:MAX_FIELDS]
        model = values.get(MODEL_KEY)
        slots = [
            gr.Textbox(label=f"{f.label}  ({f.key})", value=str(values[f.key]), visible=True)
            if i < len(others)
            else gr.Textbox(visible=False, value="")
            for i, f in enumerate(others + [None] * (MAX_FIELDS - len(others)))
        ]
        md = "```text\n" + header + "\n```" if header else "_(no comment header)_"
        if code:  # a recipe from a run folder may come from anywhere: what it runs is shown before a launch
            md = "**runs code when launched:** " + "; ".join(f"`{c}`" for c in code) + "\n\n" + md
        model_dd = gr.Dropdown(choices=model_choices(self.catalog, model), value=model, visible=MODEL_KEY in values)
        return [
            md,
            model_dd,
            "",
            [f.key for f in others],
            *slots,
            *[""] * MAX_FIELDS,
            self.plan_line(recipe),
            "",
        ]

    def _values(self, recipe: Path, model: str | None, keys: list[str], slot_values) -> dict[str, Any]:
        values = {k: v for k, v in zip(keys, slot_values)}
        if model is not None and MODEL_KEY in recipes.field_values(recipe):
            if model not in model_choices(self.catalog, recipes.field_values(recipe)[MODEL_KEY]):
                raise LorarlError(f"model.name {model!r} is not one of the models offered")
            values[MODEL_KEY] = model
        return values

    def _checked(self, path: str, model: str | None, keys: list[str], slot_values):
        """``(recipe, overrides, errors, line)``: ``errors`` = the model's and every slot's error line; ``line`` the
        planner's line, or what to fix (``overrides`` None when a field is refused)."""
        recipe = self._recipe(path)
        overrides, errors = recipes.validate(recipe, self._values(recipe, model, keys, slot_values))
        slot_errs = [errors.get(k, "") for k in keys] + [""] * (MAX_FIELDS - len(keys))
        outputs = [errors.get(MODEL_KEY, ""), *slot_errs]
        if errors:
            general = errors.get("", "")
            return recipe, None, outputs, "fix the fields marked in red" + (f": {general}" if general else "")
        return recipe, overrides, outputs, self.plan_line(recipe, overrides)

    def plan_line(self, recipe: Path, overrides: list[str] | None = None) -> str:
        """The planner's line; on CUDA its budget is the room a launch would get beside the chat
        (:func:`lorarl.app.memory.room_for_run`), the figure the launch is checked against."""
        return recipes.plan_line(recipe, overrides, budget_gb=self.memory.room_gb())

    # ---- the one door: every run, resume, retrain and export starts through the memory guard -----------------------
    def _launch(self, recipe: Path, name: str, overrides: list[str]) -> tuple[Path, str]:
        """Launch a new run through :meth:`MemoryGuard.start`; ``(run folder, the guard's note)``."""
        work = Work(f"the launch of run {name}", self.runs_dir / name, Path(recipe), tuple(overrides), pin=True)
        run_dir, admission = self.memory.start(work, lambda ov: self.runner.launch(recipe, name, ov))
        return run_dir, admission.note

    def on_check(self, path, model, keys, *slot_values):
        try:
            _, _, outputs, plan = self._checked(path, model, keys, slot_values)
        except LorarlError as e:
            return [gr.skip()] * (1 + MAX_FIELDS) + [gr.skip(), _err(e)]
        return [*outputs, plan, ""]

    def on_launch(self, path, model, keys, run_name, *slot_values):
        """Validate, check the memory rule, launch; then show the run in Watch."""
        skip_watch = [gr.skip(), gr.skip()]
        try:
            recipe, overrides, outputs, plan = self._checked(path, model, keys, slot_values)
        except LorarlError as e:
            return [gr.skip()] * (1 + MAX_FIELDS) + [gr.skip(), _err(e), *skip_watch]
        if overrides is None:
            return [*outputs, plan, "**not launched:** a field was refused", *skip_watch]
        try:
            name = (run_name or "").strip()
            check_run_name(name)
            run_dir, note = self._launch(recipe, name, overrides)
        except LorarlError as e:
            return [*outputs, plan, f"**not launched:** {e}", *skip_watch]
        shown = " ".join(overrides) or "(none)"
        status = f"launched `{Path(run_dir).name}`: `lorarl train {recipe.name} --out {run_dir}` overrides: `{shown}`"
        status += f" ({note})" if note else ""
        return [*outputs, plan, status, gr.Tabs(selected="watch"), gr.Dropdown(self.run_choices(), value=run_dir.name)]

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
        key = (getattr(request, "session_hash", None) or "api", run_dir)
        stamp = view_stamp(view)
        fresh = self._shown.get(key) != stamp
        self._shown[key] = stamp
        live = self.runner.own_live()  # (a run of a train.pid this app did not write is named when Resume is pressed)
        return view_outputs(view, fresh, live, self.runner.label(live) if live is not None else None)

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
        return f"resumed `{label}`: `lorarl train {shown} --out RUN --resume`{note}"

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

    # ---- Export -----------------------------------------------------------------------------------------------
    def on_export_refresh(self, current: str | None):
        choices = [c for c in self.checkpoint_choices() if c[1] != BASE_ID]
        ids = {c[1] for c in choices}
        return gr.Dropdown(choices=choices, value=current if current in ids else None)

    def on_export(self, checkpoint_id: str, fmt: str, name: str):
        """Export the picked checkpoint and show the fidelity gate's figures."""
        try:
            if not checkpoint_id or checkpoint_id == BASE_ID:
                raise LorarlError("pick a run's checkpoint to export")
            entry = self.catalog.get(checkpoint_id)
            if entry.run is None or entry.kind != "adapter":
                raise LorarlError(f"{checkpoint_id}: only a run's adapter checkpoints export from here")
            step = checkpoint_id.split("/", 1)[1] if entry.step is not None else None
            out_name = (name or "").strip() or f"{entry.run}-{step or 'final'}-{fmt}"
            code = exporting.export_code(self.runs_dir / entry.run, self.runs_dir, step, strict=False)
            if not self._consented(f"export:{checkpoint_id}", code):
                line = f"**not exported yet:** exporting `{checkpoint_id}` runs code from its run's folder in this "
                line += f"app: {code.describe()}; read it, then press Export again to run it"
                return line, "", gr.skip()
            result, _ = self.memory.start(
                Work(f"the export of {checkpoint_id}", None),
                lambda _: exporting.export_with_gate(
                    self.runs_dir / entry.run,
                    fmt,
                    out_name,
                    runs_dir=self.runs_dir,
                    consent=self.catalog.consent,
                    checkpoint=step,
                ),
            )
        except LorarlError as e:
            return _err(e), "", gr.skip()
        except Exception as e:  # noqa: BLE001 - a failure outside the export's own (the catalog, the guard): one line
            return _err(runstate.error_line(e)), "", gr.skip()
        summary, rows = gate_view(result)
        status = f"exported `{entry.id}` as {fmt} to `{result.get('out')}`"
        return status, summary, gr.Dataframe(value=rows, visible=bool(rows))


def resume_code(recipe: Path, overrides: list[str], label: str):
    """The code a resume of run ``label`` would run (:func:`lorarl.chat.consent.run_code` of the recipe it resumes
    from, overrides applied), None when it names none."""
    import dataclasses

    from lorarl.chat.consent import run_code
    from lorarl.config import load_recipe

    return run_code(dataclasses.asdict(load_recipe(recipe, overrides, strict=False)), recipe, f"run {label}")


def gate_view(result: dict) -> tuple[str, list[list[str]]]:
    """The export result's gate as (summary line, table rows of its figures)."""
    gate = result.get("gate")
    line = result.get("summary") or result.get("summary_line") or ""
    if not gate:
        return (line or "no fidelity gate for this format"), []
    if not line:
        from lorarl.export.gate import summary_line

        line = summary_line(gate)
    rows = []
    for key, value in gate.items():
        if isinstance(value, (dict, list)):
            continue
        rows.append([key, f"{value:.4g}" if isinstance(value, float) else str(value)])
    return line, rows


POLL_OUTPUTS = 7 + len(PLOTS)  # state, progress, the curves, warnings, crash lines, completions, Stop, Resume


def view_stamp(view: watch.WatchView) -> tuple:
    """What the curves and completions table show: changes when a row or a completion was added or replaced."""
    last = {k: v[-1] if v else None for k, v in view.series.items()}
    comp = view.completions[-1] if view.completions else None
    return (
        view.run,
        tuple(sorted((k, len(v)) for k, v in view.series.items())),
        str(last),
        len(view.completions),
        str(comp),
    )


def _frame(points: list[tuple[int, float]]):
    """A curve's points as the line plot's frame; typed even when empty (an untyped empty frame would make the plot's
    axes nominal for good)."""
    import pandas as pd

    steps = pd.Series([p[0] for p in points], dtype="int64")
    return pd.DataFrame({"step": steps, "value": pd.Series([p[1] for p in points], dtype="float64")})


def _clip(text: Any, n: int = 300, end: bool = False) -> str:
    """``text`` cut to ``n`` characters: its beginning, or with ``end`` its end (a prompt's question comes last,
    after the chat template's system turn)."""
    text = "" if text is None else str(text)
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1) :] if end else text[: n - 1] + "…"


def completion_rows(completions: list[dict]) -> list[list]:
    """The completions table, newest first: step, reward, advantage, prompt, completion (texts clipped)."""
    rows = []
    for c in reversed(completions):
        adv = c.get("advantage")
        rows.append(
            [
                c.get("step"),
                c.get("reward"),
                "" if adv is None else adv,
                _clip(c.get("prompt"), 160, end=True),
                _clip(c.get("completion")),
            ]
        )
    return rows


def state_markdown(view: watch.WatchView) -> str:
    """The run's state in one line (with its error line when it crashed or failed)."""
    text = f"**{view.run}**: {view.state}"
    if view.error:
        text += f" — {view.error}"
    return text


def view_outputs(
    view: watch.WatchView, fresh: bool = True, live_run: Path | None = None, live_label: str | None = None
) -> list:
    """A :class:`~lorarl.app.watch.WatchView` as the Watch tab's outputs (the order of :data:`POLL_OUTPUTS`);
    ``fresh`` False: the curves and the table are left as the browser has them. ``live_run``: the run a process is
    training now (any run: Resume waits until no process is left, as the one-job rule does), ``live_label`` how the
    page names it (``NAME`` or ``PIPELINE/STAGE``; default the folder's name). Resume is enabled when
    ``view.resumable`` and no process trains."""
    plots = [_frame(view.series.get(label, [])) if fresh else gr.skip() for label in PLOTS]
    warnings = "\n".join(f"- ⚠ {_clip(w, 400)}" for w in view.warnings[-10:]) if view.warnings else ""
    crash = gr.Textbox(value="\n".join(view.crash_lines), visible=bool(view.crash_lines))
    table = completion_rows(view.completions) if fresh else gr.skip()
    mine = live_run is not None and (live_label or Path(live_run).name) == view.run
    state = state_markdown(view)
    if mine and view.state == "new":
        state += " (its process is starting)"
    elif mine and view.state not in ("running", "starting"):
        state += " (its process is still exiting)"
    return [
        state,
        view.progress.text,
        *plots,
        warnings,
        crash,
        table,
        gr.Button(interactive=view.state in ("running", "starting") or (mine and view.state == "new")),
        gr.Button(interactive=live_run is None and view.resumable),
    ]


def build_and_wire(session, chat_handlers, runs_dir: Path, recipe_dirs, chat: Callable[[], Any]):
    """Build the tabs around the chat (``chat()`` builds its components) and wire the workbench's events; returns the
    chat's widgets (the caller wires them)."""
    wb = Workbench(session, runs_dir, recipe_dirs or [shipped_recipes_dir()])
    widgets, chat_widgets = build_workbench(
        wb.recipe_choices(), wb.run_choices(), wb.checkpoint_choices(), chat, base_model=str(wb.catalog.base_model)
    )
    wire_workbench(widgets, wb, chat_widgets, chat_handlers)
    widgets.workbench = wb
    session.workbench = wb  # for tests and embedding
    return chat_widgets


def wire_workbench(w: WorkbenchWidgets, wb: Workbench, chat_widgets, chat_handlers) -> None:
    """Connect the tabs' events (all private)."""
    t, wt, r, x = w.train, w.watch, w.retrain, w.export
    field_out = [t.model_error, *t.errors, t.plan, t.status]
    shown = [t.header, t.model, t.model_error, t.keys, *t.slots, *t.errors, t.plan, t.status]
    t.recipe.change(wb.on_recipe, t.recipe, shown, **PRIVATE)
    t.refresh.click(wb.on_recipes, t.recipe, t.recipe, **PRIVATE)
    t.check.click(wb.on_check, [t.recipe, t.model, t.keys, *t.slots], field_out, **PRIVATE)
    launch_in = [t.recipe, t.model, t.keys, t.run_name, *t.slots]
    t.launch.click(wb.on_launch, launch_in, [*field_out, w.tabs, wt.run], **PRIVATE)
    poll_out = [wt.state, wt.progress, *wt.plots.values(), wt.warnings, wt.crash, wt.completions, wt.stop, wt.resume]
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
    x.export.click(wb.on_export, [x.checkpoint, x.fmt, x.name], [x.status, x.summary, x.figures], **PRIVATE)
