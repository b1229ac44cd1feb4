"""Issue 42's run-folder findings, each reproduced through its real door and refused with one line: the Export tab
imports a run's tools only after consent (and a module-name reward is fingerprinted by the file it resolves to); a
symlink inside a run folder is never written through (Launch, Resume, every writer of a run); Stop signals only
the process the workbench started, and a forged train.pid blocks a launch once, saying what it names; a run whose
recipe.yaml is broken is left out of the workbench with a note (tiny model; an export gate of 4 prompts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from export_runs import make_run

from lorarl import runstate
from lorarl.app import exporting, jobs, retrain
from lorarl.app.handlers import Workbench
from lorarl.chat import Catalog, ChatEngine, ChatSession
from lorarl.chat.consent import CodeConsent, run_code
from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model import SharedBase
from lorarl.user_code import load_object

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "recipes"
QUICKSTART = SHIPPED / "grpo_arithmetic.yaml"
SHORT = GenerationConfig(temperature=0.0, top_p=1.0, max_new_tokens=4)
# a tool file that leaves a mark when it is imported: the mark is the proof that its code ran
TOOL_PY = (
    "from pathlib import Path\nPath(__file__).with_name('tool-ran').write_text('{tag}')\n"
    "def shell(cmd: str) -> str:\n    '''Run.\n\n    Args:\n        cmd: what\n    '''\n    return cmd\n"
)
MODULE_PY = "def fn(completions, **kw):\n    return [{value}] * len(completions)\n"


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    s = SharedBase.load(
        ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    )
    s.add_adapter("policy", LoraSettings(r=4, alpha=8))
    return s


def session_on(runs: Path, shared, model_dir: Path) -> ChatSession:
    engine = ChatEngine(shared, Catalog(runs, str(model_dir)))
    return ChatSession(engine, runs / "preferences.jsonl", runs / "preferences_ties.jsonl")


# ---- 1. code a run folder names: the Export door, and module names fingerprinted by their file --------------------
def test_the_export_tab_imports_a_runs_tools_only_after_consent(shared, tiny_model_dir, tmp_path, monkeypatch):
    from lorarl.export import runtimes

    monkeypatch.setitem(exporting.export_with_gate.__kwdefaults__, "gate_n", 4)  # the page's 64 prompts: 4 here
    monkeypatch.setattr(runtimes, "_free", lambda: None)  # (a full gc.collect per runtime: seconds in a test process)
    runs = tmp_path / "runs"
    run = make_run(runs / "tooly", tiny_model_dir, max_new_tokens=4)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["algo"] = "sft"
    recipe["agent"] = {"tools": ["tool.py:shell"], "max_turns": 1, "max_tokens_per_turn": 4, "max_total_tokens": 48}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (run / "tool.py").write_text(TOOL_PY.format(tag="v1"))
    wb = Workbench(session_on(runs, shared, tiny_model_dir), runs, [SHIPPED])
    mark, out = run / "tool-ran", runs / "exports" / "x1"

    status, summary, _ = wb.on_export("tooly/policy", "adapter", "x1")  # the page's button: listed, nothing run
    assert status.startswith("**not exported yet:** exporting `tooly/policy` runs code from its run's folder")
    assert "`tool tool.py:shell` (sha256 " in status and "press Export again" in status and "\n" not in status
    assert not mark.exists() and not out.exists() and summary == ""
    with pytest.raises(LorarlError) as e:  # the backend's door itself, with nothing allowed
        exporting.export_with_gate(run, "adapter", "x1", runs_dir=runs, consent=CodeConsent(), gate_n=1)
    assert "the export of tooly runs code from the run tooly folder: `tool tool.py:shell`" in str(e.value)
    assert not mark.exists() and not out.exists()

    status, summary, _ = wb.on_export("tooly/policy", "adapter", "x1")  # pressed again: the consent
    assert status.startswith("exported `tooly/policy` as adapter"), status
    assert mark.read_text() == "v1" and json.loads((out / "gate.json").read_text())["prompts"] == 4
    # the file changed after consent: listed again, and a load inside a door is checked at the import itself
    (run / "tool.py").write_text(TOOL_PY.format(tag="v2"))
    assert wb.on_export("tooly/policy", "adapter", "x2")[0].startswith("**not exported yet:**")
    from lorarl.user_code import guarded

    with pytest.raises(LorarlError, match="that you have not allowed \\(or a file of it changed since\\)"):
        with guarded(wb.catalog.consent.check_load):
            load_object("tool.py:shell", "agent.tools: tool", run / "recipe.yaml")
    assert mark.read_text() == "v1" and not (runs / "exports" / "x2").exists()


def test_a_module_name_reward_is_fingerprinted_by_the_file_it_imports(shared, tiny_model_dir, tmp_path, monkeypatch):
    runs, cwd = tmp_path / "runs", tmp_path / "cwd"
    (runs / "modrun").mkdir(parents=True)
    (cwd / "evilpkg").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    for name in ("evilmod", "evilpkg", "evilpkg.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (cwd / "evilmod.py").write_text(MODULE_PY.format(value=0.25))
    (cwd / "evilpkg" / "__init__.py").write_text("")
    (cwd / "evilpkg" / "mod.py").write_text(MODULE_PY.format(value=0.75))
    spec = {"algo": "grpo", "model": {"name": str(tiny_model_dir)}, "reward": {"functions": [{"name": "evilmod:fn"}]}}
    (runs / "modrun" / "recipe.yaml").write_text(yaml.safe_dump(spec))

    s = session_on(runs, shared, tiny_model_dir)
    with pytest.raises(LorarlError, match="not run without your consent"):
        s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:modrun")
    assert "evilmod" not in sys.modules
    assert "reward rules:modrun (run modrun): `reward evilmod:fn`" in s.allow_code(["base"], "rules:modrun")
    assert s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:modrun")["rewards"] == [0.25]
    (cwd / "evilmod.py").write_text(MODULE_PY.format(value=0.5))  # swapped after consent: asked again
    with pytest.raises(LorarlError, match="runs code from the run modrun folder: `reward evilmod:fn`"):
        s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:modrun")

    from lorarl.chat.consent import code_files

    # found as import finds them, without importing anything (not even a package's __init__)
    here = cwd.resolve()
    assert code_files("evilmod:fn", None) == [here / "evilmod.py"]
    assert code_files("evilpkg.mod:fn", None) == [here / "evilpkg" / "__init__.py", here / "evilpkg" / "mod.py"]
    assert "evilpkg" not in sys.modules
    digest = run_code({"reward": {"functions": [{"name": "evilpkg.mod:fn"}]}}, None, "run x").digest
    (cwd / "evilpkg" / "__init__.py").write_text("import os\n")
    assert run_code({"reward": {"functions": [{"name": "evilpkg.mod:fn"}]}}, None, "run x").digest != digest


# ---- 2. a symlink inside a run folder is never written through ---------------------------------------------------
def grpo_overrides(model_dir: Path) -> list[str]:
    return [f"model.name={model_dir}", "model.quantization=none", "model.dtype=float32", "train.steps=2"]


def test_a_symlinked_file_in_a_run_folder_is_never_written_through(tmp_path, tiny_model_dir, monkeypatch):
    runs, victim = tmp_path / "runs", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (runs / "x").mkdir(parents=True)
    os.symlink(victim, runs / "x" / jobs.LOG_FILE)
    runner = jobs.JobRunner(runs, [SHIPPED])
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(a) or pytest.fail("spawned"))
    with pytest.raises(LorarlError) as e:  # Launch: the folder reads as unstarted, the log would be opened "wb"
        runner.launch(str(QUICKSTART), "x", grpo_overrides(tiny_model_dir))
    assert str(e.value) == (
        f"{runs / 'x' / 'train.log'} is a symlink to {victim}; lorarl never writes through a link in a run folder: "
        "remove it (or pick another run folder)"
    )
    assert not (runs / "x" / jobs.LAUNCH_FILE).exists()
    stopped = runs / "s"  # Resume: the log would be appended to
    stopped.mkdir()
    (stopped / "recipe.yaml").write_text(QUICKSTART.read_text())
    runstate.write_state(stopped, "stopped", 1, 4)
    os.symlink(victim, stopped / jobs.LOG_FILE)
    with pytest.raises(LorarlError, match="train.log is a symlink to .*victim.txt; lorarl never writes through"):
        runner.resume("s")
    (stopped / jobs.LOG_FILE).unlink()  # the writer itself refuses a link planted after the folder was checked
    os.symlink(victim, stopped / jobs.LOG_FILE)
    with pytest.raises(LorarlError, match="is a symlink to"):
        runner._spawn(stopped, ["true"])
    assert victim.read_text() == "precious\n" and spawned == []


def _writers(run: Path, victim: Path):
    """(file or folder a link is planted at, the write lorarl does there) for every writer of a run folder."""
    from lorarl import runfiles
    from lorarl.checkpoint import save_checkpoint
    from lorarl.metrics import MetricsLogger, plot_metrics
    from lorarl.rewards.judge import JudgeReward

    judge = types.SimpleNamespace(log_path=run / "judge.jsonl", cfg=types.SimpleNamespace(log_rows=1, mode="x"))
    judge.calls = 1
    return [
        ("state.json", lambda: runstate.write_state(run, "running", 1, 2)),
        ("train.pid", lambda: runstate.write_pid(run)),
        ("completions.jsonl", lambda: runstate.CompletionsLog(run, resume_step=0).log(1, [{"prompt": "p"}])),
        ("metrics.jsonl", lambda: MetricsLogger(run, tensorboard=False, resume_step=0)),
        ("tb", lambda: MetricsLogger(run, tensorboard=True)),
        ("plot.png", lambda: plot_metrics(run)),
        ("eval.json", lambda: runfiles.write_atomic(run / "eval.json", "{}")),
        ("judge.jsonl", lambda: JudgeReward._log(judge, ["p"], ["a"], [[0]], [0.5], [None])),
        ("votes.jsonl", lambda: retrain.snapshot_votes(victim.parent / "votes-src.jsonl", run)),
        ("checkpoints", lambda: save_checkpoint(run, 1, None, [], {}, {}, {})),
        ("policy", lambda: SharedBase.save_adapter(None, "policy", run / "policy")),
        (jobs.LAUNCH_LOCK, lambda: jobs.launch_lock(run).__enter__()),
    ]


def test_every_writer_of_a_run_folder_refuses_a_link(tmp_path):
    from lorarl import runfiles
    from lorarl.chat.votes import append_jsonl

    run, victim, elsewhere = tmp_path / "run", tmp_path / "victim.txt", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (tmp_path / "votes-src.jsonl").write_text('{"prompt": "p"}\n')
    for name, write in _writers(run, victim):
        victim.write_text("precious\n")
        target = elsewhere if name in ("tb", "checkpoints", "policy") else victim
        os.symlink(target, run / name)
        with pytest.raises(LorarlError, match=f"{name} is a symlink to .*; lorarl never writes through a link"):
            write()
        assert victim.read_text() == "precious\n" and list(elsewhere.iterdir()) == [], name
        (run / name).unlink()
    os.symlink(victim, run / "preferences.jsonl")  # the chat's votes (RUNS/preferences.jsonl)
    with pytest.raises(LorarlError, match="is a symlink to"):
        append_jsonl(run / "preferences.jsonl", {"vote": 1})
    os.mkfifo(run / "fifo")  # not a file: refused, not waited on
    with pytest.raises(LorarlError, match="fifo is not a regular file"):
        runfiles.open_nofollow(run / "fifo", "a")
    # before a run starts (lorarl train, the Python API): a link anywhere lorarl writes is one line, exit 2
    os.symlink(victim, run / "checkpoints")
    from lorarl.api import prepare_run_dir
    from lorarl.config import Recipe

    with pytest.raises(LorarlError, match="checkpoints is a symlink to"):
        prepare_run_dir(Recipe(), run, resume=True)
    assert victim.read_text() == "precious\n"


# ---- 4. Stop signals only what the workbench started; a forged train.pid never blocks for good --------------------
def sleeper() -> subprocess.Popen:
    """A live process of this user in its own session, once its command line is its own (exec done)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "sleeper"], start_new_session=True)
    for _ in range(500):
        if b"sleeper" in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            break
        time.sleep(0.01)
    return proc


def forge_pid_file(run: Path, pid: int) -> None:
    """A train.pid as write_pid writes it -- every field right -- by someone who can write the runs folder."""
    run.mkdir(parents=True, exist_ok=True)
    info = {"pid": pid, "host": socket.gethostname(), "argv": ["lorarl", "train"]}
    info.update(proc_start=runstate.proc_start_ticks(pid), pgid=os.getpgid(pid))
    (run / runstate.PID_FILE).write_text(json.dumps(info))


def test_stop_signals_only_its_own_process_and_a_forged_pid_file_blocks_a_launch_once(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    forge_pid_file(runs / "forged", 1)  # PID 1 lives for ever: on main it blocked every launch and resume
    runner = jobs.JobRunner(runs, [SHIPPED])
    spawned = []
    monkeypatch.setattr(runner, "_spawn", lambda run, argv, **kw: spawned.append(run) or run)
    ours = os.stat("/proc/1").st_uid == os.getuid()  # another user's process is never counted at all
    if ours:
        with pytest.raises(LorarlError, match="^run forged: its train.pid names pid 1, `"):
            runner.launch(str(QUICKSTART), "fresh", [])
    assert runner.launch(str(QUICKSTART), "fresh", []) == runs / "fresh" and runner.live() is None
    assert spawned == [runs / "fresh"]

    victim, child = sleeper(), None
    try:
        forge_pid_file(runs / "forged", victim.pid)  # a live process of this user, start time and group right
        again = jobs.JobRunner(runs, [SHIPPED])  # another app's runner: Resume names it once, then goes ahead
        monkeypatch.setattr(again, "_spawn", lambda run, argv, **kw: spawned.append(run) or run)
        (runs / "fresh" / "recipe.yaml").write_text(QUICKSTART.read_text())
        runstate.write_state(runs / "fresh", "stopped", 1, 4)
        assert again.live() == runs / "forged"  # counted (the chat's memory rule) until pressed on
        with pytest.raises(LorarlError) as e:
            again.resume("fresh")
        line = str(e.value)
        assert line.startswith(f"run forged: its train.pid names pid {victim.pid}, `") and "\n" not in line
        assert line.endswith(
            "which this workbench did not start; one run at a time: if it trains that run, wait for it or stop it "
            "where it was started; if not, press the button again to go ahead"
        )
        assert again.resume("fresh") == runs / "fresh" and spawned == [runs / "fresh"] * 2 and again.live() is None
        with pytest.raises(LorarlError) as e:
            runner.stop("forged")
        assert str(e.value).startswith(f"run forged: not stopped: its train.pid names pid {victim.pid}, `")
        assert "which this workbench did not start (it signals only its own processes)" in str(e.value)
        # a run this runner started, whose train.pid was then rewritten to name the victim: its own child is stopped
        monkeypatch.undo()
        mine = runs / "mine"
        mine.mkdir()
        runner._spawn(mine, [sys.executable, "-c", "import time; time.sleep(60)"])
        child = runner._procs[mine]
        runstate.write_state(mine, "running", 1, 4)  # it has started training (not loading)
        forge_pid_file(mine, victim.pid)
        assert runner.stop("mine").startswith("asked run mine to stop")
        assert child.wait(timeout=10) == -signal.SIGTERM and victim.poll() is None
    finally:
        for p in (victim, child):
            if p is not None:
                p.kill()
                p.wait()


# ---- 9. one bad run folder does not stop the workbench -------------------------------------------------------------
def test_a_run_with_a_broken_recipe_is_left_out_with_a_note(shared, tiny_model_dir, tmp_path, capsys):
    from lorarl.chat.app import build_app

    runs = tmp_path / "runs"
    base = {"algo": "grpo", "model": {"name": str(tiny_model_dir)}}
    bad = {
        "weight": {"reward": {"functions": [{"name": "numeric_match", "weight": "abc"}]}},
        "kwargs": {"reward": {"functions": [{"name": "numeric_match", "kwargs": 5}]}},
        "functions": {"reward": {"functions": 5}, "agent": {"tools": 5}},
    }
    good = {"reward": {"functions": [{"name": "numeric_match"}]}}
    for name, extra in {"good": good, **bad}.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "recipe.yaml").write_text(yaml.safe_dump({**base, **extra}))
        shared.save_adapter("policy", runs / name / "policy")
    shared.save_adapter("policy", runs / "deep" / "policy")
    (runs / "deep" / "recipe.yaml").write_text("a: " + "[" * 500 + "]" * 500 + "\n")  # (RecursionError on main)
    demo = build_app(runs, shared=shared, workbench=True, recipe_dirs=[SHIPPED])
    catalog = demo.lorarl_session.catalog
    assert {e for e in catalog.entries if e.endswith("/policy")} == {f"{n}/policy" for n in ("good", *bad, "deep")}
    notes = {
        "weight": "reward.functions[0].weight must be a number, got 'abc'",
        "kwargs": "reward.functions[0].kwargs must be a mapping, got int",
        "functions": "reward.functions must be a list, got int",
    }
    assert "deep's reward functions and tools (its recipe.yaml could not be read)" in catalog.skipped
    err = capsys.readouterr().err
    for name, why in notes.items():
        line = f"{name}'s reward functions (recipe.yaml: {why})"
        assert line in catalog.skipped and f"lorarl chat: left out {line}" in err and line in catalog.summary()
    assert "rules:good" in catalog.scorers and len(catalog.scorers) == 1
    assert catalog.tools_code("functions") is None  # (a pane of that run: no code, no crash)
