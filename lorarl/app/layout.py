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

MAX_FIELDS = 12  # text-box slots for one recipe's common fields (the model has its own dropdown)
POLL_S = 2.0  # the Watch tab's polling period
PLOTS = tuple(SERIES)  # the Watch tab's curves: one per series label of a WatchView
COMPLETION_COLUMNS = ["step", "reward", "advantage", "prompt", "completion"]
EXPORT_FORMATS = ["merged", "adapter", "gguf"]
CSS = """
.field-error {color: #c0392b; min-height: 0; font-size: 0.9em}
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
    stop: Any
    resume: Any
    plots: dict[str, Any]
    warnings: Any
    crash: Any
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


def _train_tab(recipes: list[tuple[str, str]], base_model: str) -> TrainTab:
    gr.Markdown(
        "Pick a recipe (shipped `recipes/` or a run's own), change the common fields and launch: the run is "
        "`lorarl train RECIPE --out RUNS/NAME` in a subprocess, one at a time. " + base_note(base_model)
    )
    with gr.Row():
        recipe = gr.Dropdown(recipes, value=None, label="Recipe", elem_id="wb-recipe", scale=4)
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-recipe-refresh")
    header = gr.Markdown("", elem_id="wb-recipe-header")
    model = gr.Dropdown([], label="model  (model.name)", elem_id="wb-model", interactive=True, visible=False)
    model_error = gr.Markdown("", elem_classes=["field-error"], elem_id="wb-model-error")
    slots, errors = [], []
    with gr.Row():
        for i in range(MAX_FIELDS):
            with gr.Column(min_width=180):
                slots.append(gr.Textbox(label=f"field {i}", visible=False, elem_id=f"wb-field-{i}", max_lines=1))
                errors.append(gr.Markdown("", elem_classes=["field-error"], elem_id=f"wb-field-error-{i}"))
    with gr.Row():
        run_name = gr.Textbox(label="Run name (a folder in the runs directory)", elem_id="wb-run-name", scale=3)
        check = gr.Button("Check", scale=1, elem_id="wb-check")
        launch = gr.Button("Launch", variant="primary", scale=1, elem_id="wb-launch")
    plan = gr.Markdown("", elem_id="wb-plan")
    status = gr.Markdown("", elem_id="wb-train-status")
    return TrainTab(
        recipe, refresh, header, model, model_error, gr.State([]), slots, errors, run_name, check, launch, plan, status
    )


def _watch_tab(runs: list[tuple[str, str]]) -> WatchTab:
    with gr.Row():
        run = gr.Dropdown(runs, value=runs[0][1] if runs else None, label="Run", elem_id="wb-run", scale=4)
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-run-refresh")
        stop = gr.Button("Stop", scale=0, elem_id="wb-stop", variant="stop")
        resume = gr.Button("Resume", scale=0, elem_id="wb-resume")
    with gr.Row():
        state = gr.Markdown("", elem_id="wb-state")
        progress = gr.Markdown("", elem_id="wb-progress")
    status = gr.Markdown("", elem_id="wb-watch-status")
    crash = gr.Textbox(label="Last lines of train.log", visible=False, lines=10, elem_id="wb-crash", interactive=False)
    warnings = gr.Markdown("", elem_id="wb-warnings")
    plots = {}
    for row in (PLOTS[:3], PLOTS[3:]):
        with gr.Row():
            for i, label in enumerate(row, start=len(plots)):
                plots[label] = gr.LinePlot(
                    None, x="step", y="value", title=label, height=220, elem_id=f"wb-plot-{i}", min_width=240
                )
    completions = gr.Dataframe(
        headers=COMPLETION_COLUMNS,
        label="Recent completions",
        interactive=False,
        wrap=True,
        column_widths=["6%", "8%", "9%", "37%", "40%"],
        elem_id="wb-completions",
        max_height=400,
    )
    timer = gr.Timer(POLL_S)
    return WatchTab(run, refresh, timer, state, progress, stop, resume, plots, warnings, crash, completions, status)


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


def _export_tab(checkpoints: list[tuple[str, str]]) -> ExportTab:
    gr.Markdown(
        "Export a run's adapter as a merged model, the adapter itself or a GGUF file into `RUNS/exports/NAME`; the "
        "fidelity gate compares the export, run by its own runtime, with the model as it trained."
    )
    with gr.Row():
        checkpoint = gr.Dropdown(checkpoints, value=None, label="Run / checkpoint", elem_id="wb-export-pick", scale=4)
        refresh = gr.Button("Refresh", scale=0, elem_id="wb-export-refresh")
    with gr.Row():
        fmt = gr.Radio(EXPORT_FORMATS, value="merged", label="Format", elem_id="wb-export-format")
        name = gr.Textbox(label="Export name (a folder in RUNS/exports)", elem_id="wb-export-name")
        export = gr.Button("Export", variant="primary", elem_id="wb-export")
    status = gr.Markdown("", elem_id="wb-export-status")
    summary = gr.Markdown("", elem_id="wb-gate-summary")
    figures = gr.Dataframe(
        headers=["figure", "value"], label="Fidelity gate", interactive=False, elem_id="wb-gate", visible=False
    )
    return ExportTab(checkpoint, refresh, fmt, name, export, figures, summary, status)


def build_workbench(
    recipes: list[tuple[str, str]],
    runs: list[tuple[str, str]],
    checkpoints: list[tuple[str, str]],
    chat: Callable[[], Any],
    base_model: str = "the chat's base",
) -> tuple[WorkbenchWidgets, Any]:
    """The four tabs in the current ``gr.Blocks``; ``chat()`` builds the chat's own components inside the Chat tab
    (returns them). ``runs``: (label, name) of the runs; ``checkpoints``: (label, id) of the base and the runs'
    adapters; ``base_model``: the chat's base (named where the page says which runs the panes show). Returns
    ``(widgets, chat's)``."""
    with gr.Tabs(selected="train", elem_id="wb-tabs") as tabs:
        with gr.Tab("Train", id="train", elem_id="tab-train"):
            train = _train_tab(recipes, base_model)
        with gr.Tab("Watch", id="watch", elem_id="tab-watch") as watch_tab:
            watch = _watch_tab(runs)
        with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_tab:
            chat_widgets = chat()
            retrain = retrain_row(checkpoints, base_model)
        with gr.Tab("Export", id="export", elem_id="tab-export") as export_tab:
            export = _export_tab([c for c in checkpoints if c[1] != "base"])
    widgets = WorkbenchWidgets(tabs, watch_tab, chat_tab, export_tab, train, watch, retrain, export)
    return widgets, chat_widgets
