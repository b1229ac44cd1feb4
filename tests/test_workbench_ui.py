"""The workbench's page logic without a browser: the memory rule (pause / refuse with figures, nothing on a CPU),
the chat's pause hook, and the Train / Watch / Export handlers' refusals (no path from the page leaves the folders;
a field the loader rejects shows its line next to the field and launches nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.app.memory import (
    DeviceFigures,
    MemoryGuard,
    Plan,
    Work,
    launch_refusal,
    pause_reason,
    planned,
    planned_peak,
    room_for_run,
)
from lorarl.errors import LorarlError

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "grpo_arithmetic.yaml"
GPU = DeviceFigures(
    total=int(80e9), chat_peak=int(12e9), chat_allocated=int(1e9), free=int(78e9), chat_reserved=int(1e9)
)


# ---- the memory rule ------------------------------------------------------------------------------------------
def test_pause_reason_boundary_and_figures():
    assert pause_reason("r", 70e9, 10e9, 80e9) is None  # exactly full: fits
    line = pause_reason("quick", 70e9, 10.1e9, 80e9)
    assert line is not None
    assert "run quick" in line and "70.00 GB" in line and "10.10 GB" in line and "80.00 GB" in line


def test_room_for_run_counts_the_chat_and_what_the_driver_says_is_free():
    # 80 GB, the chat 2 GB allocated / 3 GB reserved, 70 GB free (its CUDA context and another process hold the rest)
    fig = DeviceFigures(total=80, chat_peak=5, chat_allocated=2, free=70, chat_reserved=3)
    assert room_for_run(fig) == 71  # min(80 - 2, 70 + 3 - 2)
    assert room_for_run(DeviceFigures(total=80, chat_peak=5, chat_allocated=2)) == 78  # no driver figure
    assert room_for_run(DeviceFigures(total=80, chat_peak=5, chat_allocated=2, free=90, chat_reserved=2)) == 78


def test_launch_refusal_against_the_room():
    assert launch_refusal(79e9, 79e9, 80e9) is None
    line = launch_refusal(79.5e9, 79e9, 80e9)
    assert "79.50 GB" in line and "79.00 GB" in line and "80.00 GB" in line and line.startswith("not started")


def _guard(live, figures, peak, **kw):
    return MemoryGuard(lambda: live, figures=lambda: figures, planner=lambda path, ov, budget_gb: peak, **kw)


def test_guard_pauses_only_on_cuda_with_a_live_run_that_does_not_fit(tmp_path):
    run = tmp_path / "quick"
    run.mkdir()
    (run / "recipe.yaml").write_text("algo: grpo\n")
    assert _guard(run, GPU, 70e9).chat_pause().startswith("chat paused while run quick trains: its planned peak")
    small_chat = DeviceFigures(int(80e9), int(5e9), int(1e9), int(78e9), int(1e9))
    assert _guard(run, small_chat, 70e9).chat_pause() is None  # 75 <= 80
    assert _guard(None, GPU, 70e9).chat_pause() is None  # no run training
    assert _guard(run, None, 70e9).chat_pause() is None  # a CPU: never paused


@pytest.mark.parametrize("planner_result", [None, RuntimeError("no such model")])
def test_no_estimate_pauses_the_chat_with_the_measured_figures(tmp_path, planner_result):
    """The planner cannot tell: the chat is paused (never "no protection"), with why and the driver's free memory."""
    run = tmp_path / "quick"
    run.mkdir()
    (run / "recipe.yaml").write_text("algo: grpo\n")

    def planner(path, overrides, budget_gb):
        if isinstance(planner_result, Exception):
            raise planner_result
        return planner_result

    released = []
    guard = MemoryGuard(lambda: run, figures=lambda: GPU, planner=planner, release=lambda: released.append(1))
    line = guard.chat_pause()
    assert line.startswith("chat paused while run quick trains: the planner cannot estimate its peak")
    assert "78.00 GB of the GPU's 80.00 GB free" in line and released == [1]
    if planner_result is not None:
        assert "no such model" in line


def test_a_failed_estimate_is_not_cached_and_a_success_is_cached_per_recipe_version(tmp_path):
    run = tmp_path / "quick"
    run.mkdir()
    recipe = run / "recipe.yaml"
    calls = []

    def planner(path, overrides, budget_gb):
        calls.append((path, budget_gb))
        if len(calls) == 1:
            raise OSError("recipe.yaml half written")
        return Plan(70e9)

    guard = MemoryGuard(lambda: run, figures=lambda: GPU, planner=planner, release=lambda: None)
    assert "cannot estimate" in guard.chat_pause()  # before the run wrote its recipe: no call, paused
    assert calls == []
    recipe.write_text("algo: grpo\n")
    assert "half written" in guard.chat_pause()  # the planner failed once: paused, not cached
    assert "its planned peak 70.00 GB" in guard.chat_pause()  # tried again: 70 + 12 > 80
    guard.chat_pause()
    assert len(calls) == 2 and calls[-1] == (recipe, 80.0)  # cached; planned against the device total, as the run
    import os

    st = recipe.stat()
    os.utime(recipe, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: planned again
    guard.chat_pause()
    assert len(calls) == 3


class _Lock:
    """A lock that records whether it is held (the chat engine's lock in the guard)."""

    held = False

    def __enter__(self):
        self.held = True

    def __exit__(self, *exc):
        self.held = False


def test_start_refuses_a_run_that_does_not_fit_the_room_and_starts_nothing(tmp_path):
    events = []
    fig = DeviceFigures(total=int(24e9), chat_peak=int(3e9), chat_allocated=int(2e9), free=int(21e9), chat_reserved=3e9)
    guard = MemoryGuard(
        lambda: None,
        figures=lambda: events.append("measure") or fig,
        planner=lambda path, ov, budget_gb: events.append(("plan", round(budget_gb, 3))) or Plan(22.5e9),
        release=lambda: events.append("release"),
    )
    work = Work("the launch of run big", tmp_path / "big", QUICKSTART, ("train.steps=2",))
    with pytest.raises(LorarlError) as e:
        guard.start(work, lambda ov: events.append("go"))
    # room = min(24 - 2, 21 + 3 - 2) = 22 GB < 22.5 GB; measured after the chat's cache went back
    assert "22.50 GB > the 22.00 GB left beside the chat" in str(e.value) and "24.00 GB" in str(e.value)
    assert "go" not in events and events.index("release") < events.index(("plan", 22.0))


def test_start_pins_an_auto_micro_batch_for_the_room_and_plans_resumes_as_the_run_does(tmp_path):
    budgets = []
    lock = _Lock()

    def planner(path, ov, budget_gb):
        budgets.append(budget_gb)
        return Plan(30e9, micro_batch=3)

    guard = MemoryGuard(lambda: None, figures=lambda: GPU, planner=planner, release=lambda: None, lock=lock)
    seen = []
    started, adm = guard.start(
        Work("launch", tmp_path / "a", QUICKSTART, ("train.steps=2",)), lambda ov: seen.append((ov, lock.held)) or "a"
    )
    assert started == "a" and seen == [(["train.steps=2", "train.micro_batch_size=3"], True)]
    assert budgets == [78.0] and "micro-batch 3" in adm.note  # room: min(80 - 1, 78 free + 1 - 1)
    _, adm = guard.start(Work("resume", tmp_path / "a", QUICKSTART, pin=False), lambda ov: seen.append(ov))
    assert seen[-1] == [] and budgets[-1] == 80.0  # a resume keeps its recipe (bit-identical), planned on the total


def test_a_run_launched_here_is_planned_from_its_launch_before_its_recipe_exists(tmp_path):
    """A chat message sent before the child wrote RUN/recipe.yaml uses the peak planned at launch."""
    run = tmp_path / "quick"
    live = []
    guard = MemoryGuard(
        lambda: live[0] if live else None,
        figures=lambda: GPU,
        planner=lambda path, ov, budget_gb: Plan(70e9) if path == QUICKSTART else None,
        release=lambda: None,
    )
    guard.start(Work("launch", run, QUICKSTART), lambda ov: live.append(run))
    assert not (run / "recipe.yaml").exists()
    assert "its planned peak 70.00 GB" in guard.chat_pause()


def test_a_launch_the_planner_cannot_estimate_starts_with_chat_paused(tmp_path):
    run = tmp_path / "rm"
    live = []
    guard = MemoryGuard(
        lambda: live[0] if live else None,
        figures=lambda: GPU,
        planner=lambda path, ov, budget_gb: (_ for _ in ()).throw(LorarlError("the planner models grpo, not sft")),
        release=lambda: None,
    )
    _, adm = guard.start(Work("launch", run, QUICKSTART), lambda ov: live.append(run))
    assert "cannot estimate this run (the planner models grpo, not sft)" in adm.note
    assert "78.00 GB free for it beside the chat (measured)" in adm.note and "chat paused" in adm.note
    assert "cannot estimate its peak" in guard.chat_pause()


def test_an_export_in_this_process_is_refused_beside_a_run_and_pauses_the_chat(tmp_path):
    live = [tmp_path / "quick"]
    guard = MemoryGuard(lambda: live[0] if live else None, figures=lambda: GPU, planner=None, release=lambda: None)
    ran = []
    with pytest.raises(LorarlError, match="loads models in this app's process, beside run quick"):
        guard.start(Work("the export of quick/policy"), lambda ov: ran.append(1))
    assert ran == []
    live.clear()
    during = []

    def export(ov):
        during.append(guard.chat_pause())
        with pytest.raises(LorarlError, match="the export of quick/policy is running"):
            guard.start(Work("launch", tmp_path / "b", QUICKSTART), lambda ov: ran.append(2))
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        guard.start(Work("the export of quick/policy"), export)
    assert during == [
        "chat paused while the export of quick/policy runs in this app's process (it loads models beside the chat)"
    ]
    assert ran == [] and guard.chat_pause() is None  # a failed export leaves nothing busy


def test_cpu_starts_everything_as_given(tmp_path):
    guard = _guard(None, None, 1e15)
    out, adm = guard.start(Work("launch", tmp_path / "a", QUICKSTART, ("train.steps=2",)), lambda ov: ov)
    assert out == ["train.steps=2"] and adm.note == ""


def test_planned_picks_an_auto_micro_batch_and_refuses_what_it_does_not_model(tmp_path):
    auto = planned(QUICKSTART, ["train.micro_batch_size=auto"], 24.0)
    assert isinstance(auto.micro_batch, int) and auto.micro_batch >= 1 and auto.peak > 0
    assert planned(QUICKSTART, [], 24.0).micro_batch is None  # the recipe gives a number
    rm = planned(REPO / "recipes" / "reward_model.yaml", [], 24.0)  # the reward model's own step (no generation)
    assert rm.peak > 0 and rm.micro_batch is None
    rs = tmp_path / "rs.yaml"
    rs.write_text("algo: rejection_sampling\nrejection_sampling: {group_size: 4}\n")
    with pytest.raises(LorarlError, match="not rejection_sampling"):  # generation only: not modelled
        planned(rs, [], 24.0)


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
    wb = demo.lorarl_session.workbench
    wb.demo = demo
    return wb


SLOTS = 4 + 2 * 2  # on_recipe's outputs: header, model, its error, keys, 2 adapter dropdowns and their errors, slots
ERRORS = 1 + 2  # on_check / on_launch outputs: the model's error, the 2 adapters' errors, then the slots' errors


def _fields(wb, recipe=QUICKSTART) -> tuple[list[str], dict[str, str]]:
    """A recipe as the Train tab shows it: the field keys in slot order, and each slot's text."""
    from lorarl.app.layout import MAX_FIELDS

    out = wb.on_recipe(str(recipe))
    keys = out[3]
    slots = out[SLOTS : SLOTS + MAX_FIELDS]
    return keys, {k: slots[i].value for i, k in enumerate(keys)}


def _slot_values(keys: list[str], values: dict[str, str]) -> list[str]:
    from lorarl.app.layout import MAX_FIELDS

    return [values[k] for k in keys] + [""] * (MAX_FIELDS - len(keys))


def test_train_tab_shows_the_recipe_and_its_fields(wb):
    from lorarl.app.layout import MAX_FIELDS

    out = wb.on_recipe(str(QUICKSTART))
    assert "GRPO quickstart" in out[0] and "runs code" not in out[0]
    run = _fake_run(wb.runs_dir, "downloaded", str(wb.catalog.base_model))  # a run folder's recipe naming code
    text = (run / "recipe.yaml").read_text().replace("name: numeric_match", "name: rewards.py:mine")
    (run / "recipe.yaml").write_text(text)
    shown = wb.on_recipe(str(run / "recipe.yaml"))[0]
    assert shown.startswith("**runs code when launched:** `reward rewards.py:mine`"), shown[:200]
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
    slots = out[SLOTS : SLOTS + MAX_FIELDS]
    assert [slot.visible for slot in slots] == [True] * len(keys) + [False] * (MAX_FIELDS - len(keys))
    assert [a.visible for a in out[4:6]] == [False, False]  # the quickstart loads no reward or starting adapter
    # the cost block: one memory figure (the header's measured RSS on a CPU), a time from the measured s/step
    assert out[-2].startswith("**Cost on this machine** (CPU only")
    assert "- memory: 5.2 GB peak RSS measured on cpu" in out[-2] and "tensor peak" not in out[-2]
    assert "- time: about 8m40s for 40 steps (13 s/step measured on cpu" in out[-2]  # 40 x 13 s


def test_a_refused_field_shows_its_line_beside_it_and_launches_nothing(wb):
    keys, values = _fields(wb)
    values["grpo.group_size"] = "-3"
    out = wb.on_launch(str(QUICKSTART), "smollm2-135m", None, None, keys, "bad", *_slot_values(keys, values))
    errors = dict(zip(keys, out[ERRORS : ERRORS + len(keys)]))
    assert "grpo.group_size" in errors["grpo.group_size"] and errors["train.steps"] == ""
    assert "not launched" in out[-3]
    assert list(wb.runs_dir.iterdir()) == [] and wb.runner.live() is None


def test_check_says_ok_exactly_when_launch_would_start(wb):
    """Check runs Launch's checks (fields, files, the run name) and says ok; a refused field names itself."""
    keys, values = _fields(wb)
    slots = _slot_values(keys, values)

    def check(name: str, **changed) -> list:
        return wb.on_check(
            str(QUICKSTART), "smollm2-135m", None, None, keys, name, *_slot_values(keys, values | changed)
        )

    assert check("")[-1] == "**ok:** the fields and the files the run reads pass; give a run name to launch"
    assert check("fine")[-1].startswith(
        f"**ok:** ready to launch `fine` (`lorarl train grpo_arithmetic.yaml --out {wb.runs_dir}/fine`"
    )
    _fake_run(wb.runs_dir, "old", "smollm2-135m")
    for name, why in (
        ("exports", "run name 'exports' is taken"),
        ("../x", "plain folder name"),
        ("old", "already exists"),
    ):
        assert check(name)[-1].startswith("**not ready:**") and why in check(name)[-1], name
        launched = wb.on_launch(str(QUICKSTART), "smollm2-135m", None, None, keys, name, *slots)
        assert launched[-3].startswith("**not launched:**") and why in launched[-3]  # Launch refuses it the same way
    out = check("fine", **{"train.steps": "two"})
    errors = dict(zip(keys, out[ERRORS : ERRORS + len(keys)]))
    assert "train.steps must be int" in errors["train.steps"]
    assert out[-1].startswith("**not ready:** `train.steps`: ") and "must be int" in out[-1]  # named, not "in red"
    assert wb.runner.live() is None and sorted(p.name for p in wb.runs_dir.iterdir()) == ["old"]


def test_ppo_check_catches_the_missing_reward_adapter_and_the_page_offers_the_runs_ones(wb, tmp_path, monkeypatch):
    """PPO's reward adapter is a field (a dropdown of the recipe's value and the runs' reward adapters); Check and
    Launch catch a missing one before any process starts; a crashed run whose adapter is still missing cannot be
    resumed (it would crash the same way), and says why."""
    from lorarl.runstate import write_state

    monkeypatch.chdir(tmp_path)  # runs/reward_model (the recipe's relative value) does not exist here
    ppo = REPO / "recipes" / "ppo.yaml"
    out = wb.on_recipe(str(ppo))
    reward_dd, init_dd = out[4], out[5]
    assert reward_dd.visible is True and init_dd.visible is False and reward_dd.value == "runs/reward_model"
    assert reward_dd.choices == [("runs/reward_model (the recipe's)", "runs/reward_model")]
    keys, values = _fields(wb, ppo)
    slots = _slot_values(keys, values)
    checked = wb.on_check(str(ppo), "smollm2-135m", "runs/reward_model", None, keys, "p", *slots)
    assert "reward adapter runs/reward_model: no such folder" in checked[1]  # under the dropdown
    assert checked[-1].startswith("**not ready:** `reward.adapter`: reward adapter runs/reward_model: no such folder")
    launched = wb.on_launch(str(ppo), "smollm2-135m", "runs/reward_model", None, keys, "p", *slots)
    assert launched[-3].startswith("**not launched:** `reward.adapter`") and not (wb.runs_dir / "p").exists()
    # a reward-model run in the runs folder: offered, and Check passes with it
    rm = _fake_run(wb.runs_dir, "rm", "smollm2-135m")
    (rm / "reward").mkdir()
    (rm / "reward" / "adapter_config.json").write_text("{}")
    (rm / "reward" / "head.safetensors").write_bytes(b"")
    offered = wb.on_recipe(str(ppo))[4].choices
    assert ("run rm: its reward adapter", str(rm)) in offered
    ok = wb.on_check(str(ppo), "smollm2-135m", str(rm), None, keys, "p", *slots)
    assert ok[1] == "" and ok[-1].startswith("**ok:** ready to launch `p`"), ok[-1]
    refused = wb.on_check(str(ppo), "smollm2-135m", "/etc", None, keys, "p", *slots)
    assert "reward.adapter '/etc' is not one of the adapters offered" in refused[-1]
    # a PPO run that crashed on the missing adapter: Resume off, and the state line says why
    crashed = wb.runs_dir / "crashed"
    crashed.mkdir()
    (crashed / "recipe.yaml").write_text(ppo.read_text())
    write_state(crashed, "crashed", 0, 40, "LorarlError: reward adapter runs/reward_model: no such folder")
    out = wb.on_poll("crashed", None)
    assert out[-1].interactive is False
    assert "Resume would fail the same way: reward.adapter: reward adapter runs/reward_model: no such folder" in out[0]
    assert wb.on_resume("crashed").startswith("**not resumed:** it would fail before its first step: reward.adapter")


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
    out = wb.on_launch(recipe, model, None, None, keys, run_name, *_slot_values(keys, values))
    assert why in out[-3]
    assert list(wb.runs_dir.iterdir()) == [] and not (wb.runs_dir.parent / "escape").exists()


def test_launch_refused_when_the_run_would_not_fit_beside_the_chat(wb):
    keys, values = _fields(wb)
    gpu = DeviceFigures(total=int(24e9), chat_peak=int(2e9), chat_allocated=int(1e9))
    wb.memory = MemoryGuard(wb.runner.live, figures=lambda: gpu, planner=lambda path, ov, budget_gb: 23.5e9)
    out = wb.on_launch(str(QUICKSTART), "smollm2-135m", None, None, keys, "big", *_slot_values(keys, values))
    assert "23.50 GB > the 23.00 GB left beside the chat" in out[-3] and "24.00 GB" in out[-3]
    assert list(wb.runs_dir.iterdir()) == []


def _fake_run(runs: Path, name: str, model: str, adapter: bool = False) -> Path:
    """A stopped run folder (its recipe: the quickstart on ``model``), with a policy adapter folder if asked."""
    from lorarl.config import yaml_load
    from lorarl.runstate import write_state

    run = runs / name
    run.mkdir(parents=True)
    data = yaml_load(QUICKSTART.read_text())
    data["model"]["name"] = model
    import yaml

    (run / "recipe.yaml").write_text(yaml.safe_dump(data))
    write_state(run, "stopped", 1, 2)
    if adapter:
        (run / "policy").mkdir()
        (run / "policy" / "adapter_config.json").write_text("{}")
    return run


def _export(wb, checkpoint: str, fmt: str, name: str, force: bool = False, minimum=None) -> list:
    """The Export button's last update (its handler is a generator: a line saying what runs, then the result)."""
    return list(wb.on_export(checkpoint, fmt, name, force, minimum))[-1]


def _votes(runs: Path, n: int = 2) -> None:
    import json

    rows = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(n)]
    (runs / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_every_path_beside_the_chat_goes_through_the_memory_guard(wb, monkeypatch):
    """Resume, both retrains and the export are refused by the guard on a GPU without room: nothing starts."""
    from lorarl.app import exporting

    base = str(wb.catalog.base_model)
    _fake_run(wb.runs_dir, "old", base, adapter=True)
    _votes(wb.runs_dir)
    started = []
    monkeypatch.setattr(wb.runner, "launch", lambda *a, **k: started.append(("launch", a)))
    monkeypatch.setattr(wb.runner, "resume", lambda *a, **k: started.append(("resume", a)))
    monkeypatch.setattr(exporting, "export_with_gate", lambda *a, **k: started.append(("export", a)))
    gpu = DeviceFigures(total=int(24e9), chat_peak=int(2e9), chat_allocated=int(1e9))
    live = []
    planned_for = []

    def planner(path, ov, budget_gb):
        planned_for.append(Path(path).parent.name)
        return Plan(30e9)

    wb.memory = MemoryGuard(lambda: live[0] if live else None, figures=lambda: gpu, planner=planner, release=lambda: 0)
    assert "30.00 GB > the 23.00 GB left beside the chat" in wb.on_resume("old")
    for kind in ("dpo", "reward_model"):
        status = wb.retrain_handler(kind)("old/policy")[0]
        assert "30.00 GB > the 23.00 GB" in status, status
    assert planned_for == ["old", "recipes", "recipes"]  # the run's own recipe, then dpo.yaml and reward_model.yaml
    live.append(wb.runs_dir / "old")
    wb.catalog.scan()
    status = _export(wb, "old/policy", "merged", "x")[0]
    assert "loads models in this app's process, beside run old" in status
    assert started == []
    live.clear()

    def broken(*a, **k):
        raise ValueError("a failure outside the export's own errors")

    monkeypatch.setattr(exporting, "export_with_gate", broken)
    status = _export(wb, "old/policy", "merged", "x")[0]
    assert status == "**not exported:** ValueError: a failure outside the export's own errors"
    assert wb.memory.chat_pause() is None  # the failed export left nothing busy


def test_export_offers_replace_names_its_default_gives_a_verdict_and_runs_one_at_a_time(wb, monkeypatch):
    """The Export tab without a real export (exporting.export_with_gate replaced): the newest run's final adapter
    picked by default; an empty name says the default name it used; an existing export is refused until "replace"
    is ticked; the gate's minimum gives a verdict (and none set says so); a second export while one runs is refused
    with a line; the first update says what runs, with the button disabled."""
    import threading

    from lorarl.app import exporting

    base = str(wb.catalog.base_model)
    _fake_run(wb.runs_dir, "older", base, adapter=True)
    _fake_run(wb.runs_dir, "newer", base, adapter=True)
    wb.catalog.scan()
    assert wb.on_export_refresh(None).value == "newer/policy"  # the newest run's final adapter, not an empty pick
    calls, gate_open = [], threading.Event()

    def fake(run_dir, fmt, out_name, *, runs_dir, consent, checkpoint=None, gate=None, force=False):
        calls.append((Path(run_dir).name, out_name, gate, force))
        gate_open.wait(5)
        (runs_dir / "exports" / out_name).mkdir(parents=True, exist_ok=True)
        (runs_dir / "exports" / out_name / "config.json").write_text("{}")
        report = {"greedy_agreement": 0.97, "agreed": 62, "prompts": 64, "accuracy_trained": None, "threshold": gate,
                  "passed": None if gate is None else 0.97 >= gate}  # fmt: skip
        return {"out": str(runs_dir / "exports" / out_name), "gate": report, "summary": "greedy agreement 96.9%"}

    monkeypatch.setattr(exporting, "export_with_gate", fake)
    gate_open.set()
    status, summary, table, button = _export(wb, "newer/policy", "merged", "", minimum=0.95)
    assert status.endswith("newer-final-merged` (the default name: the name box was empty)"), status
    assert summary == "greedy agreement 96.9% — **passed**: greedy agreement 97.0% ≥ minimum 95%"
    assert ["verdict", "passed: greedy agreement 97.0% ≥ minimum 95%"] in table.value["data"]
    assert ["minimum greedy agreement", "0.95"] in table.value["data"] and button.interactive is True
    assert not any(r[0] in ("threshold", "passed") for r in table.value["data"])  # no "threshold None, passed None"
    assert ["accuracy_trained", "n/a"] in table.value["data"]  # a figure the gate has not: n/a, not None
    refused = _export(wb, "newer/policy", "merged", "newer-final-merged")[0]
    assert "already exists: tick “Replace an existing export of that name”" in refused and len(calls) == 1
    status, summary = _export(wb, "newer/policy", "merged", "newer-final-merged", force=True)[:2]
    assert calls[-1] == ("newer", "newer-final-merged", None, True)
    assert summary.endswith("reported, not gated: greedy agreement 97.0% (no minimum set)")
    # one at a time: while an export runs, its first update says so (button off) and a second one is refused
    gate_open.clear()
    first = wb.on_export("older/policy", "adapter", "a", False, None)
    running = next(first)
    assert running[0].startswith("exporting `older/policy` as adapter to `RUNS/exports/a`:")
    assert running[3].interactive is False
    worker = threading.Thread(target=lambda: list(first))
    worker.start()
    while len(calls) < 3:
        threading.Event().wait(0.01)
    second = _export(wb, "newer/policy", "merged", "b")[0]
    assert second.startswith("**not started:** the export of older/policy is running"), second
    gate_open.set()
    worker.join()
    assert len(calls) == 3


def test_the_reward_model_retrain_starts_a_fresh_adapter_and_says_so(wb, monkeypatch):
    base = str(wb.catalog.base_model)
    _fake_run(wb.runs_dir, "old", base, adapter=True)
    _votes(wb.runs_dir)
    wb.catalog.scan()
    launched = []

    def launch(recipe, name, overrides):
        launched.append((Path(recipe).name, overrides))
        (wb.runs_dir / name).mkdir(exist_ok=True)  # (holds the votes' copy already, as for the real launch)
        (wb.runs_dir / name / "train.log").touch()
        return wb.runs_dir / name

    monkeypatch.setattr(wb.runner, "launch", launch)
    status = wb.retrain_handler("reward_model")("old/policy")[0]
    assert "reward_model on the votes (a fresh reward adapter on the base of `old/policy`)" in status
    status = wb.retrain_handler("dpo")("old/policy")[0]
    assert "dpo on the votes from `old/policy`" in status
    (rm_recipe, rm_over), (dpo_recipe, dpo_over) = launched
    assert rm_recipe == "reward_model.yaml" and not any(o.startswith("model.init_adapter=") for o in rm_over)
    assert dpo_recipe == "dpo.yaml" and any(o.startswith("model.init_adapter=") for o in dpo_over)
    from lorarl.app.layout import RM_NOTE

    assert "trains a fresh reward adapter" in RM_NOTE and RM_NOTE in str(wb.demo.config)


def test_the_page_says_which_runs_the_panes_show(wb):
    base = str(wb.catalog.base_model)
    _fake_run(wb.runs_dir, "mine", base, adapter=True)
    _fake_run(wb.runs_dir, "other", "smollm2-135m", adapter=True)
    _, start, note = wb.on_chat_tab(None)
    assert f"Only runs trained on the chat's base model (`{base}`) show in the chat panes" in note
    assert "Left out: other (trained on smollm2-135m)" in note
    assert "mine/policy" in [c[1] for c in start.choices] and "other/policy" not in [c[1] for c in start.choices]
    assert f"(`{base}`) show in the chat panes" in str(wb.demo.config)  # the Train tab and the Chat tab say it too


def test_plan_line_on_cuda_budgets_the_room_beside_the_chat(wb, monkeypatch):
    """On CUDA the plan line measures against total minus the chat (what a launch is checked against)."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(name="FakeGPU", total_memory=int(80e9))
    )
    fig = DeviceFigures(total=int(80e9), chat_peak=int(40e9), chat_allocated=int(30e9))
    wb.memory = MemoryGuard(wb.runner.live, figures=lambda: fig, planner=None, release=lambda: None)
    line = wb.on_recipe(str(QUICKSTART))[-2]
    assert " of 50.0 GB on FakeGPU" in line, line


def test_watch_time_left_includes_evaluation(wb):
    """Step times 2 and 4 s (median 3), a 6 s evaluation at step 2, step 2 of 4 running: (3 + 6 / 2) x 2 = 12 s."""
    import json

    from lorarl.runstate import write_pid, write_state

    run = wb.runs_dir / "evals"
    run.mkdir()
    rows = [{"step": 1, "step_time": 2.0}, {"step": 2, "step_time": 4.0, "time/evaluation": 6.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_pid(run)  # this process: a live run
    write_state(run, "running", 2, 4)
    out = wb.on_poll("evals", None)
    assert out[1] == "step 2/4, 3.0 s/step, about 0m12s left", out[1]


def test_time_left_formulas():
    from lorarl.app.timeleft import eta_seconds, evaluation_per_step

    rows = [{"step": 5, "time/evaluation": 30.0}, {"step": 10, "time/evaluation": 30.0}, {"step": 12, "x": 1}]
    assert evaluation_per_step(rows, 10) == 6.0  # 60 s over 10 steps
    assert evaluation_per_step(rows, 7) == 30.0 / 7  # the evaluation of step 10 is not seen yet
    assert evaluation_per_step(rows, 0) == 0.0 and evaluation_per_step([], 5) == 0.0
    assert eta_seconds([2.0, 3.0, 10.0], 10, 20, 6.0) == 90.0
    assert eta_seconds([2.0], 20, 20, 6.0) == 0.0 and eta_seconds([], 1, 20, 6.0) is None


def test_watch_export_and_retrain_refuse_names_outside_the_folders(wb):
    assert "error" in wb.on_poll("../x", None)[0]
    assert "error" in wb.on_stop("/etc")
    assert "error" in wb.on_resume("..")
    status = _export(wb, "../../etc/policy", "merged", "x")[0]
    assert "unknown checkpoint" in status
    status = _export(wb, "base", "merged", "x")[0]
    assert "pick a run's checkpoint" in status
    assert "unknown checkpoint" in wb.retrain_handler("dpo")("elsewhere/policy")[0]
    assert list(wb.runs_dir.iterdir()) == []


def test_view_outputs_crash_lines_and_buttons():
    from lorarl.app.views import POLL_OUTPUTS, view_outputs
    from lorarl.app.watch import Progress, WatchView

    crashed = WatchView(
        run="r",
        state="crashed",
        error="boom",
        progress=Progress(step=3, last_step=10),
        series={"reward": [(1, 0.5), (2, 0.25)]},
        warnings=["step 2: health: no reward signal"],
        completions=[{"step": 2, "prompt": "p" * 500, "completion": "c", "reward": 1.0}],
        log_tail=["loading", "Traceback", "RuntimeError: boom"],
        crash_lines=["Traceback", "RuntimeError: boom"],
        resumable=True,
        empty={"KL": "not computed: grpo.kl.coef is 0 (the reference model never runs)"},
    )
    out = view_outputs(crashed, fresh=True, live_run=None)
    assert len(out) == POLL_OUTPUTS
    assert out[0] == "**r**: crashed — boom" and out[1] == "step 3/10" and out[2] == ""  # no result: not finished
    reward, kl = out[3], out[5]
    assert reward.value["data"] == [[1, 0.5], [2, 0.25]] and out[9] == "" and reward.x_lim == [0, 10]
    assert kl.value["data"] == [] and kl.value["datatypes"]["value"] == "quantitative"  # an empty, typed frame ...
    assert out[11] == "empty: not computed: grpo.kl.coef is 0 (the reference model never runs)"  # ... and why
    assert "health: no reward signal" in out[15]
    assert out[16].visible and out[16].value == "Traceback\nRuntimeError: boom" and "the run crashed" in out[16].label
    (row,) = out[17]
    assert row[0] == 2 and row[1] == 1.0 and row[3] == 1 and len(row[4]) == 160 and row[4].startswith("…")
    assert out[-2].interactive is False and out[-1].interactive is True  # stopped / crashed: Resume
    import dataclasses

    assert view_outputs(dataclasses.replace(crashed, resumable=False))[-1].interactive is False  # the backend says no
    busy = view_outputs(crashed, fresh=False, live_run=Path("elsewhere"))
    assert busy[-1].interactive is False  # another run trains: the one-job rule
    import gradio as gr

    assert busy[3:9] == [gr.skip()] * 6 and busy[17] == gr.skip()  # unchanged: the curves and table are not resent
    finished = WatchView(run="r", state="finished", error=None, progress=Progress(step=10, last_step=10))
    exiting = view_outputs(finished, live_run=Path("runs/r"))  # state written, its process not gone yet
    assert exiting[0].endswith("(its process is still exiting)")
    assert exiting[-2].interactive is False and exiting[-1].interactive is False
    running = WatchView(run="r", state="running", error=None, progress=Progress(step=1, last_step=10))
    assert view_outputs(running, live_run=Path("runs/r"))[-2].interactive is True
    # a pipeline's stage pipe/r trains: not this top-level run r (same folder name)
    other = view_outputs(finished, live_run=Path("runs/pipe/r"), live_label="pipe/r")
    assert not other[0].endswith("(its process is still exiting)")
