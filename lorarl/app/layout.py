"""The workbench's Gradio layout: the tabs Train, Watch, Chat (the existing chat, built by the caller) and Export,
plus the vote -> retrain row under the chat. Builds components only (call inside a ``gr.Blocks``);
:mod:`lorarl.app.handlers` wires their events.

Nothing on the page takes a path: recipes, runs, checkpoints and the model are dropdowns of what the configured
folders hold; the only free texts are a run / export name (a plain folder name, checked by :mod:`lorarl.app.paths`)
and the fields' values (checked by the recipe loader).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from lorarl.app.watch import SERIES
from lorarl.export.gate import WARN_BELOW

MAX_FIELDS = 12  # text-box slots for one recipe's common fields (the model has its own dropdown)
ADAPTER_KEYS = ("reward.adapter", "model.init_adapter")  # adapters a recipe loads: dropdowns of the runs' adapters
ADAPTER_LABELS = ("reward adapter  (reward.adapter)", "starting adapter  (model.init_adapter)")
START_HERE = ("grpo_arithmetic.yaml", "★ start here")  # the recipe the Train tab opens on, and its mark
POLL_S = 2.0  # the Watch tab's polling period
PLOTS = tuple(SERIES)  # the Watch tab's curves: one per series label of a WatchView
COMPLETION_COLUMNS = ["step", "reward", "advantage", "count", "user turn", "completion"]
LOG_LABEL = "train.log (last lines)"
EXPORT_FORMATS = ["merged", "adapter", "gguf"]
GATE_MINIMUM = WARN_BELOW  # the Export tab's default minimum greedy agreement (below it `lorarl export` warns)
CSS = """
.field-error {color: #c0392b; min-height: 0; font-size: 0.9em}
.field-error * {color: #c0392b !important}
.plot-note {font-size: 0.85em; min-height: 0; margin-top: -0.5em}
#wb-recipe-header pre, #wb-recipe-header code {white-space: pre-wrap !important; overflow-wrap: anywhere}
#wb-completions thead .header, #wb-gate thead .header {word-break: keep-all !important; overflow-wrap: normal !important}
.plot-note * {color: #6b7280 !important}
#wb-train-status, #wb-watch-status, #wb-retrain-status, #wb-export-status {min-height: 1.5em}
"""


@dataclass
class TrainTab:
    recipe: Any
    refresh: Any
    header: Any
    model: Any
    model_error: Any
    keys: Any  # gr.State: the field key shown in each slot, in slot order
    adapters: list[Any]  # one dropdown per ADAPTER_KEYS entry (shown when the recipe loads that adapter)
    adapter_errors: list[Any]
    slots: list[Any]
    errors: list[Any]
    run_name: Any
    check: Any
    launch: Any
    plan: Any
    status: Any


@dataclass
class WatchTab:
    run: Any
    refresh: Any
    timer: Any
    state: Any
    progress: Any
    result: Any  # a finished run's held-out result, training figures and total time
    stop: Any
    resume: Any
    plots: dict[str, Any]
    notes: dict[str, Any]  # under each curve: why it is empty (empty when it has points)
    warnings: Any
    log: Any  # the last lines of RUN/train.log (a crashed run's included)
    completions: Any
    status: Any


@dataclass
class RetrainRow:
    panes_note: Any  # which runs the panes offer (the chat's base) and which were left out
    summary: Any
    start: Any
    dpo: Any
    reward_model: Any
    status: Any
    kto: Any = None  # KTO on the votes: pairs unpaired + the single-answer 👍 / 👎


@dataclass
class ExportTab:
    checkpoint: Any
    refresh: Any
    fmt: Any
    name: Any
    force: Any  # replace an existing export of that name
    minimum: Any  # the fidelity gate's minimum greedy agreement (empty: report only)
    export: Any
    figures: Any
    summary: Any
    status: Any


@dataclass
class WorkbenchWidgets:
    tabs: Any
    watch_tab: Any
    chat_tab: Any
    export_tab: Any
    train: TrainTab
    watch: WatchTab
    retrain: RetrainRow
    export: ExportTab


def base_note(base_model: str) -> str:
    """The line saying which runs the chat panes can show: those trained on the chat's base."""
    return (
        f"Only runs trained on the chat's base model (`{base_model}`) show in the chat panes; a run on another "
        "model trains and shows in Watch, but chatting with it needs `lorarl chat` started on that model."
    )


RM_NOTE = (
    "**DPO on votes** starts the policy from the checkpoint picked here; **KTO on votes** too, on every pairwise "
    "vote (a 👍 and a 👎 row each) and every single-answer 👍 / 👎 (two rows are enough). **Reward model on votes** "
    "trains a fresh "
    "reward adapter (the reward model is its own role: nothing of the picked policy carries over) on the base that "
    "checkpoint was trained on."
)


def _train_tab(recipes: list[tuple[str, str]], base_model: str, start: str | None) -> TrainTab:
    gr.Markdown(
        "Pick a recipe (shipped `recipes/` or a run's own; the one marked ★ is the place to start: a few minutes on "
        "a CPU), change the common fields and launch: the run is `lorarl train RECIPE --out RUNS/NAME` in a "
        "subprocess, one at a time. " + base_note(base_model)
    )
    with gr.Row():
        recipe = gr.Dropdown(recipes, value=start, label="Recipe", elem_id="wb-recipe", scale=4, min_width=300)
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-recipe-refresh")
    header = gr.Markdown("", elem_id="wb-recipe-header")
    model = gr.Dropdown([], label="model  (model.name)", elem_id="wb-model", interactive=True, visible=False)
    model_error = gr.Markdown("", elem_classes=["field-error"], elem_id="wb-model-error")
    adapters, adapter_errors = [], []
    with gr.Row():
        for i, label in enumerate(ADAPTER_LABELS):
            with gr.Column(min_width=300):
                adapters.append(gr.Dropdown([], label=label, elem_id=f"wb-adapter-{i}", visible=False))
                adapter_errors.append(gr.Markdown("", elem_classes=["field-error"], elem_id=f"wb-adapter-error-{i}"))
    slots, errors = [], []
    with gr.Row():
        for i in range(MAX_FIELDS):
            with gr.Column(min_width=260):
                slots.append(gr.Textbox(label=f"field {i}", visible=False, elem_id=f"wb-field-{i}", max_lines=1))
                errors.append(gr.Markdown("", elem_classes=["field-error"], elem_id=f"wb-field-error-{i}"))
    with gr.Row():
        run_name = gr.Textbox(label="Run name (a folder in the runs directory)", elem_id="wb-run-name", scale=3)
        check = gr.Button("Check", scale=1, elem_id="wb-check")
        launch = gr.Button("Launch", variant="primary", scale=1, elem_id="wb-launch")
    status = gr.Markdown("", elem_id="wb-train-status")
    plan = gr.Markdown("", elem_id="wb-plan")
    keys = gr.State([])
    return TrainTab(
        recipe, refresh, header, model, model_error, keys, adapters, adapter_errors, slots, errors, run_name, check,
        launch, plan, status,
    )  # fmt: skip


def _watch_tab(runs: list[tuple[str, str]]) -> WatchTab:
    with gr.Row():
        run = gr.Dropdown(
            runs, value=runs[0][1] if runs else None, label="Run", elem_id="wb-run", scale=4, min_width=320
        )
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-run-refresh")
        stop = gr.Button("Stop", scale=0, elem_id="wb-stop", variant="stop")
        resume = gr.Button("Resume", scale=0, elem_id="wb-resume")
    with gr.Row():
        state = gr.Markdown("", elem_id="wb-state")
        progress = gr.Markdown("", elem_id="wb-progress")
    result = gr.Markdown("", elem_id="wb-result")
    status = gr.Markdown("", elem_id="wb-watch-status")
    warnings = gr.Markdown("", elem_id="wb-warnings")
    plots, notes = {}, {}
    for row in (PLOTS[:3], PLOTS[3:]):
        with gr.Row():
            for i, label in enumerate(row, start=len(plots)):
                with gr.Column(min_width=240):
                    plots[label] = gr.LinePlot(
                        None, x="step", y="value", title=label, height=220, elem_id=f"wb-plot-{i}", min_width=240
                    )
                    notes[label] = gr.Markdown("", elem_id=f"wb-plot-note-{i}", elem_classes=["plot-note"])
    completions = gr.Dataframe(
        headers=COMPLETION_COLUMNS,
        label="Recent completions (the user's turn; identical rows of a step folded, with their count)",
        interactive=False,
        wrap=True,
        column_widths=["64px", "80px", "104px", "72px", "26%", "32%"],  # whole header words at 900 px too
        elem_id="wb-completions",
        max_height=400,
    )
    log = gr.Textbox(label=LOG_LABEL, visible=False, lines=8, max_lines=8, elem_id="wb-log", interactive=False)
    timer = gr.Timer(POLL_S)
    return WatchTab(
        run, refresh, timer, state, progress, result, stop, resume, plots, notes, warnings, log, completions, status
    )


def retrain_row(checkpoints: list[tuple[str, str]], base_model: str) -> RetrainRow:
    """Under the chat: the votes saved so far become a training run (DPO or a reward model), from a checkpoint."""
    panes_note = gr.Markdown(base_note(base_model), elem_id="wb-panes-note")
    with gr.Accordion("Retrain from the votes", open=True):
        gr.Markdown(RM_NOTE, elem_id="wb-retrain-note")
        summary = gr.Markdown("", elem_id="wb-votes")
        with gr.Row():
            start = gr.Dropdown(checkpoints, value="base", label="Starting checkpoint", elem_id="wb-start", scale=3)
            dpo = gr.Button("DPO on votes", elem_id="wb-dpo", scale=1)
            kto = gr.Button("KTO on votes", elem_id="wb-kto", scale=1)
            reward_model = gr.Button("Reward model on votes", elem_id="wb-rm", scale=1)
        status = gr.Markdown("", elem_id="wb-retrain-status")
    return RetrainRow(panes_note, summary, start, dpo, reward_model, status, kto)


def _export_tab(checkpoints: list[tuple[str, str]], pick: str | None) -> ExportTab:
    gr.Markdown(
        "Export a run's adapter as a merged model, the adapter itself or a GGUF file into `RUNS/exports/NAME`; the "
        "fidelity gate compares the export, run by its own runtime, with the model as it trained, and gives its "
        "verdict against the minimum agreement below."
    )
    with gr.Row():
        checkpoint = gr.Dropdown(checkpoints, value=pick, label="Run / checkpoint", elem_id="wb-export-pick", scale=4)
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-export-refresh")
    with gr.Row():
        fmt = gr.Radio(EXPORT_FORMATS, value="merged", label="Format", elem_id="wb-export-format", min_width=260)
        name = gr.Textbox(
            label="Export name (a folder in RUNS/exports)",
            placeholder="empty: RUN-final-FORMAT (or RUN-step-N-FORMAT)",
            elem_id="wb-export-name",
            min_width=260,
        )
        minimum = gr.Number(
            value=GATE_MINIMUM,
            label="Minimum greedy agreement (0-1; empty: report only)",
            elem_id="wb-export-minimum",
            min_width=200,
        )
    with gr.Row():
        force = gr.Checkbox(False, label="Replace an existing export of that name", elem_id="wb-export-force")
        export = gr.Button("Export", variant="primary", elem_id="wb-export")
    status = gr.Markdown("", elem_id="wb-export-status")
    summary = gr.Markdown("", elem_id="wb-gate-summary")
    figures = gr.Dataframe(
        headers=["figure", "value"], label="Fidelity gate", interactive=False, elem_id="wb-gate", visible=False
    )
    return ExportTab(checkpoint, refresh, fmt, name, force, minimum, export, figures, summary, status)


def build_workbench(
    recipes: list[tuple[str, str]],
    runs: list[tuple[str, str]],
    checkpoints: list[tuple[str, str]],
    chat: Callable[[], Any],
    base_model: str = "the chat's base",
    start_recipe: str | None = None,
    export_pick: str | None = None,
) -> tuple[WorkbenchWidgets, Any]:
    """The four tabs in the current ``gr.Blocks``; ``chat()`` builds the chat's own components inside the Chat tab
    (returns them). ``runs``: (label, name) of the runs; ``checkpoints``: (label, id) of the base and the runs'
    adapters; ``base_model``: the chat's base (named where the page says which runs the panes show);
    ``start_recipe``: the recipe the Train tab opens on; ``export_pick``: the checkpoint the Export tab starts on.
    Returns ``(widgets, chat's)``."""
    with gr.Tabs(selected="train", elem_id="wb-tabs") as tabs:
        with gr.Tab("Train", id="train", elem_id="tab-train"):
            train = _train_tab(recipes, base_model, start_recipe)
        with gr.Tab("Watch", id="watch", elem_id="tab-watch") as watch_tab:
            watch = _watch_tab(runs)
        with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_tab:
            chat_widgets = chat()
            retrain = retrain_row(checkpoints, base_model)
        with gr.Tab("Export", id="export", elem_id="tab-export") as export_tab:
            export = _export_tab([c for c in checkpoints if c[1] != "base"], export_pick)
    widgets = WorkbenchWidgets(tabs, watch_tab, chat_tab, export_tab, train, watch, retrain, export)
    return widgets, chat_widgets
