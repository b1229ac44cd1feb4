"""The workbench's page logic without a browser: the memory rule (pause / refuse with figures, nothing on a CPU),
the chat's pause hook, and the Train / Watch / Export handlers' refusals (no path from the page leaves the folders;
a field the loader rejects shows its line next to the field and launches nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.app.memory import DeviceFigures, MemoryGuard, launch_refusal, pause_reason, planned_peak
from lorarl.errors import LorarlError

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "grpo_arithmetic.yaml"


# ---- the memory rule ------------------------------------------------------------------------------------------
def test_pause_reason_boundary_and_figures():
    assert pause_reason("r", 70e9, 10e9, 80e9) is None  # exactly full: fits
    line = pause_reason("quick", 70e9, 10.1e9, 80e9)
    assert line is not None
    assert "run quick" in line and "70.00 GB" in line and "10.10 GB" in line and "80.00 GB" in line


def test_launch_refusal_counts_the_chat_model():
    assert launch_refusal(79e9, 1e9, 80e9) is None
    line = launch_refusal(79.5e9, 1e9, 80e9)
    assert "79.50 GB" in line and "1.00 GB" in line and "80.00 GB" in line and line.startswith("not launched")


def _guard(live, figures, peak):
    return MemoryGuard(lambda: live, figures=lambda: figures, planner=lambda path, overrides, budget_gb: peak)


def test_guard_pauses_only_on_cuda_with_a_live_run_that_does_not_fit(tmp_path):
    run = tmp_path / "quick"
    gpu = DeviceFigures(total=int(80e9), chat_peak=int(12e9), chat_allocated=int(1e9))
    assert _guard(run, gpu, 70e9).chat_pause() is not None  # 70 + 12 > 80
    assert _guard(run, DeviceFigures(int(80e9), int(5e9), int(1e9)), 70e9).chat_pause() is None  # 75 <= 80
    assert _guard(None, gpu, 70e9).chat_pause() is None  # no run training
    assert _guard(run, None, 70e9).chat_pause() is None  # a CPU: never paused
    assert _guard(run, gpu, None).chat_pause() is None  # the planner cannot tell: no pause on a guess
    assert _guard(None, gpu, 79.5e9).launch_check(QUICKSTART, []) is not None  # 79.5 + 1 > 80
    assert _guard(None, None, 79.5e9).launch_check(QUICKSTART, []) is None


def test_planned_peak_grows_with_the_group_size():
    small = planned_peak(QUICKSTART, ["grpo.group_size=4"])
    big = planned_peak(QUICKSTART, ["grpo.group_size=16"])
    assert 0 < small < big


def test_chat_pause_hook_answers_instead_of_generating(tiny_model_dir, tmp_path):
    from lorarl.chat.app import make_session
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    session, _ = make_session(tmp_path / "runs", shared=shared)
    session.pause = lambda: "chat paused while run quick trains: 70.00 GB + 12.00 GB > 80.00 GB"
    with pytest.raises(LorarlError, match="chat paused while run quick trains"):
        session.respond("hi", ["base"])
    session.pause = lambda: None
    out = session.respond("hi", ["base"], generation=None)
    assert len(out["answers"]) == 1


# ---- the page's handlers (no browser) ---------------------------------------------------------------------------
@pytest.fixture()
def wb(tiny_model_dir, tmp_path):
    """The workbench's handlers over an empty runs folder, the tiny model as the chat's base."""
    from lorarl.chat.app import build_app
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    cfg = ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    runs = tmp_path / "runs"
    runs.mkdir()
    demo = build_app(runs, shared=SharedBase.load(cfg), workbench=True, recipe_dirs=[REPO / "recipes"])
    return demo.lorarl_session.workbench


def _fields(wb) -> tuple[list[str], dict[str, str]]:
    """The quickstart as the Train tab shows it: the field keys in slot order, and each slot's text."""
    from lorarl.app.layout import MAX_FIELDS

    out = wb.on_recipe(str(QUICKSTART))
    keys = out[3]
    slots = out[4 : 4 + MAX_FIELDS]
    return keys, {k: slots[i].value for i, k in enumerate(keys)}


def _slot_values(keys: list[str], values: dict[str, str]) -> list[str]:
    from lorarl.app.layout import MAX_FIELDS

    return [values[k] for k in keys] + [""] * (MAX_FIELDS - len(keys))


def test_train_tab_shows_the_recipe_and_its_fields(wb):
    from lorarl.app.layout import MAX_FIELDS

    out = wb.on_recipe(str(QUICKSTART))
    assert "GRPO quickstart" in out[0]
    assert out[1].value == "smollm2-135m" and str(wb.catalog.base_model) in [c[1] for c in out[1].choices]
    keys, values = _fields(wb)
    assert keys == [
        "train.steps",
        "train.learning_rate",
        "grpo.group_size",
        "generation.max_new_tokens",
        "reward.functions.0.weight",
        "eval.every",
    ]
    assert values["train.steps"] == "40" and values["grpo.group_size"] == "8"
    assert [slot.visible for slot in out[4 : 4 + MAX_FIELDS]] == [True] * len(keys) + [False] * (MAX_FIELDS - len(keys))
    assert out[-2].startswith("plan: ")


def test_a_refused_field_shows_its_line_beside_it_and_launches_nothing(wb):
    keys, values = _fields(wb)
    values["grpo.group_size"] = "-3"
    out = wb.on_launch(str(QUICKSTART), "smollm2-135m", keys, "bad", *_slot_values(keys, values))
    errors = dict(zip(keys, out[1 : 1 + len(keys)]))
    assert "grpo.group_size" in errors["grpo.group_size"] and errors["train.steps"] == ""
    assert "not launched" in out[-3]
    assert list(wb.runs_dir.iterdir()) == [] and wb.runner.live() is None


@pytest.mark.parametrize(
    "recipe, model, run_name, why",
    [
        ("/etc/passwd", "smollm2-135m", "x", "outside"),
        ("../recipes/grpo_arithmetic.yaml", "smollm2-135m", "x", "'..' is not allowed"),
        (str(QUICKSTART), "/etc", "x", "not one of the models offered"),
        (str(QUICKSTART), "smollm2-135m", "../escape", "plain folder name"),
        (str(QUICKSTART), "smollm2-135m", "", "plain folder name"),
    ],
)
def test_launch_refuses_paths_from_the_page(wb, recipe, model, run_name, why):
    keys, values = _fields(wb)
    out = wb.on_launch(recipe, model, keys, run_name, *_slot_values(keys, values))
    assert why in out[-3]
    assert list(wb.runs_dir.iterdir()) == [] and not (wb.runs_dir.parent / "escape").exists()


def test_launch_refused_when_the_run_would_not_fit_beside_the_chat(wb):
    keys, values = _fields(wb)
    gpu = DeviceFigures(total=int(24e9), chat_peak=int(2e9), chat_allocated=int(1e9))
    wb.memory = MemoryGuard(wb.runner.live, figures=lambda: gpu, planner=lambda path, overrides, budget_gb: 23.5e9)
    out = wb.on_launch(str(QUICKSTART), "smollm2-135m", keys, "big", *_slot_values(keys, values))
    assert "23.50 GB" in out[-3] and "1.00 GB" in out[-3] and "24.00 GB" in out[-3]
    assert list(wb.runs_dir.iterdir()) == []


def test_watch_export_and_retrain_refuse_names_outside_the_folders(wb):
    assert "error" in wb.on_poll("../x", None)[0]
    assert "error" in wb.on_stop("/etc")
    assert "error" in wb.on_resume("..")
    status = wb.on_export("../../etc/policy", "merged", "x")[0]
    assert "unknown checkpoint" in status
    status = wb.on_export("base", "merged", "x")[0]
    assert "pick a run's checkpoint" in status
    assert "unknown checkpoint" in wb.retrain_handler("dpo")("elsewhere/policy")[0]
    assert list(wb.runs_dir.iterdir()) == []


def test_view_outputs_crash_lines_and_buttons():
    from lorarl.app.handlers import POLL_OUTPUTS, view_outputs
    from lorarl.app.watch import Progress, WatchView

    crashed = WatchView(
        run="r",
        state="crashed",
        error="boom",
        progress=Progress(step=3, last_step=10),
        series={"reward": [(1, 0.5), (2, 0.25)]},
        warnings=["step 2: health: no reward signal"],
        completions=[{"step": 2, "prompt": "p" * 500, "completion": "c", "reward": 1.0}],
        crash_lines=["Traceback", "RuntimeError: boom"],
    )
    out = view_outputs(crashed, fresh=True, live_run=None)
    assert len(out) == POLL_OUTPUTS
    assert out[0] == "**r**: crashed — boom" and out[1] == "step 3/10"
    reward = out[2]
    assert reward["step"].tolist() == [1, 2] and reward["value"].tolist() == [0.5, 0.25]
    assert out[3].empty and str(out[3]["value"].dtype) == "float64"  # no KL logged: an empty, typed frame
    assert "health: no reward signal" in out[8]
    assert out[9].visible and out[9].value == "Traceback\nRuntimeError: boom"
    (row,) = out[10]
    assert row[0] == 2 and row[1] == 1.0 and len(row[3]) == 160 and row[3].startswith("…")
    assert out[-2].interactive is False and out[-1].interactive is True  # stopped / crashed: Resume
    busy = view_outputs(crashed, fresh=False, live_run=Path("elsewhere"))
    assert busy[-1].interactive is False  # another run trains: the one-job rule
    import gradio as gr

    assert busy[2:8] == [gr.skip()] * 6 and busy[10] == gr.skip()  # unchanged: the curves and table are not resent
    finished = WatchView(run="r", state="finished", error=None, progress=Progress(step=10, last_step=10))
    exiting = view_outputs(finished, live_run=Path("runs/r"))  # state written, its process not gone yet
    assert exiting[0].endswith("(its process is still exiting)")
    assert exiting[-2].interactive is False and exiting[-1].interactive is False
    running = WatchView(run="r", state="running", error=None, progress=Progress(step=1, last_step=10))
    assert view_outputs(running, live_run=Path("runs/r"))[-2].interactive is True
