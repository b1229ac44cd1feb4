"""Issue 34's workbench findings, each attack reproduced and refused with one line, nothing run or written outside
the allowed folders: code named by a run folder (a chat reward, a chat pane's tools, Resume and a crafted
launch.json) runs only after consent; a symlinked run name; a forged train.pid (never signalled); a name with a
trailing newline, a seed of 1e30, a vote on a forged answer, a message longer than the model reads, and a relative
``file.py:`` reward looked up in the working folder (tiny model, answers of 4 tokens)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import gradio as gr
import pytest
import torch
import yaml

from lorarl import runstate
from lorarl.app import jobs, paths
from lorarl.app.handlers import Workbench
from lorarl.chat import Catalog, ChatEngine, ChatSession
from lorarl.chat.handlers import Handlers
from lorarl.chat.inputs import check_seed
from lorarl.config import GenerationConfig, LoraSettings, ModelConfig, load_recipe, recipe_to_dict
from lorarl.errors import LorarlError
from lorarl.model import SharedBase

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "recipes"
QUICKSTART = SHIPPED / "grpo_arithmetic.yaml"
SHORT = GenerationConfig(temperature=0.0, top_p=1.0, max_new_tokens=4)
# a reward file that leaves a mark when it is imported: the mark is the proof that its code ran
REWARD_PY = "from pathlib import Path\nPath(__file__).with_name('{mark}').write_text('ran')\ndef mine(completions, **kw):\n    return [{value}] * len(completions)\n"
TOOL_PY = "from pathlib import Path\nPath(__file__).with_name('tool-ran').write_text('ran')\ndef shell(cmd: str) -> str:\n    '''Run.\n\n    Args:\n        cmd: what\n    '''\n    return cmd\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    """A runs folder of runs copied from elsewhere: ``copied`` (rules naming ``rew.py:mine``, the file beside its
    recipe), ``builtin`` (numeric_match only), ``tooly`` (a policy adapter and ``agent.tools: [tool.py:shell]``);
    and a decoy ``rew.py`` in a working folder (a relative reward must not be looked up there)."""
    root = tmp_path_factory.mktemp("sec")
    runs, cwd = root / "runs", root / "cwd"
    cwd.mkdir()
    shared = SharedBase.load(
        ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    )
    shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    base = {"algo": "grpo", "model": {"name": str(tiny_model_dir)}}
    for name, extra in (
        ("copied", {"reward": {"functions": [{"name": "rew.py:mine"}]}}),
        ("builtin", {"reward": {"functions": [{"name": "numeric_match"}]}}),
        ("tooly", {"agent": {"tools": ["tool.py:shell"], "max_turns": 2, "max_total_tokens": 200}}),
    ):
        (runs / name).mkdir(parents=True)
        (runs / name / "recipe.yaml").write_text(yaml.safe_dump({**base, **extra}))
    (runs / "copied" / "rew.py").write_text(REWARD_PY.format(mark="reward-ran", value=0.25))
    (cwd / "rew.py").write_text(REWARD_PY.format(mark="decoy-ran", value=-1.0))
    (runs / "tooly" / "tool.py").write_text(TOOL_PY)
    shared.save_adapter("policy", runs / "tooly" / "policy")
    engine = ChatEngine(shared, Catalog(runs, str(tiny_model_dir)))
    session = ChatSession(engine, runs / "preferences.jsonl", runs / "preferences_ties.jsonl")
    return types.SimpleNamespace(root=root, runs=runs, cwd=cwd, session=session)


def test_a_runs_reward_code_runs_in_the_chat_only_after_consent_and_from_beside_its_recipe(site, monkeypatch):
    monkeypatch.chdir(site.cwd)  # the working folder holds a decoy rew.py
    s, copied = site.session, site.runs / "copied"
    # /respond (the API) and Send (the page) refuse before generating anything; the file's code has not run
    with pytest.raises(LorarlError) as e:
        s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:copied")
    line = str(e.value)
    assert "\n" not in line and "reward rules:copied runs code from the run copied folder: `reward rew.py:mine`" in line
    handlers = Handlers(s)
    with pytest.raises(gr.Error, match="not run without your consent"):
        handlers._check(["base"], 0.0, 1.0, 4, 0, "rules:copied", "")
    assert not (copied / "reward-ran").exists() and not (site.cwd / "decoy-ran").exists()
    # shown first: choosing the reward says what it runs; built-in rewards need no consent
    assert "`reward rew.py:mine` (sha256 " in handlers.on_reward("rules:copied", 2, "base", "base", "base", "base")
    assert s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:builtin", {"answer": "4"})["rewards"] == [0.0]
    # allowed on the page: it runs, from the file beside the recipe (0.25), not the working folder's decoy (-1)
    said = handlers.on_allow_code("rules:copied", 2, "base", "base", "base", "base")
    assert said.startswith("allowed: reward rules:copied (run copied): `reward rew.py:mine`"), said
    assert s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:copied")["rewards"] == [0.25]
    assert (copied / "reward-ran").exists() and not (site.cwd / "decoy-ran").exists()
    # the file changed after consent: asked again
    (copied / "rew.py").write_text(REWARD_PY.format(mark="reward-ran", value=0.5))
    with pytest.raises(LorarlError, match="not run without your consent"):
        s.respond("What is 2 + 2?", ["base"], "", SHORT, "rules:copied")


def test_a_panes_tools_from_a_run_folder_are_imported_only_after_consent(site):
    s, tooly = site.session, site.runs / "tooly"
    with pytest.raises(LorarlError) as e:
        s.respond("Run it", ["tooly/policy"], "", SHORT)
    assert "pane tooly/policy runs code from the run tooly folder: `tool tool.py:shell`" in str(e.value)
    with pytest.raises(LorarlError, match="not run without your consent"):  # the engine's own door too
        s.engine.generate(["tooly/policy"], [[{"role": "user", "content": "hi"}]], SHORT)
    assert not (tooly / "tool-ran").exists()
    assert "pane tooly/policy (run tooly): `tool tool.py:shell`" in s.allow_code(["tooly/policy"], "none")
    assert len(s.respond("Run it", ["tooly/policy"], "", SHORT)["answers"]) == 1
    assert (tooly / "tool-ran").exists()


def _stopped_run(runs: Path, name: str, reward: str) -> Path:
    """A run stopped at step 1 whose saved recipe is the quickstart with ``reward`` as its one function."""
    run = runs / name
    run.mkdir(parents=True)
    recipe = load_recipe(QUICKSTART, [f"reward.functions=[{{name: '{reward}'}}]"], strict=False)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    runstate.write_state(run, "stopped", 1, 4)
    return run


def test_resume_lists_a_runs_code_and_runs_it_on_the_second_press_and_checks_launch_json(site, monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    wb = Workbench(site.session, runs, [SHIPPED])
    run = _stopped_run(runs, "stolen", "rew.py:mine")
    (run / "rew.py").write_text(REWARD_PY.format(mark="reward-ran", value=1.0))
    started: list[Path] = []
    monkeypatch.setattr(wb.runner, "resume", lambda r: started.append(Path(r)) or Path(r))
    first = wb.on_resume("stolen")
    assert first.startswith(
        "**not resumed yet:** run stolen runs code from its folder when resumed: `reward rew.py:mine`"
    )
    assert started == [] and not (run / jobs.LOG_FILE).exists()
    assert wb.on_resume("stolen").startswith("resumed `stolen`") and started == [run]
    # a crafted launch.json: its working folder and its overrides get Launch's checks
    built = _stopped_run(runs, "crafted", "numeric_match")
    info = {"recipe": str(QUICKSTART), "overrides": [], "cwd": str(tmp_path)}
    (built / jobs.LAUNCH_FILE).write_text(json.dumps(info))
    out = wb.on_resume("crafted")
    assert f"launch.json: launched in the working folder {tmp_path}, not this app's" in out and "\n" not in out
    (built / "recipe.yaml").unlink()  # (the launch's recipe is used while the run saved none)
    info.update(cwd=os.getcwd(), overrides=["agent.tools=[evil.py:f]"])
    (built / jobs.LAUNCH_FILE).write_text(json.dumps(info))
    assert "launch.json: override agent.tools=[evil.py:f]: agent settings name code" in wb.on_resume("crafted")
    assert started == [run]


def sleeper(new_session: bool) -> subprocess.Popen:
    """A live process (in its own process group, or in this one)."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "lorarl"]
    return subprocess.Popen(argv, start_new_session=new_session)


def pid_file(run: Path, pid: int, **extra) -> None:
    run.mkdir(parents=True, exist_ok=True)
    info = {"pid": pid, "host": socket.gethostname(), "argv": ["lorarl", "train"], **extra}
    (run / runstate.PID_FILE).write_text(json.dumps(info))


def fields(pid: int) -> dict:
    return {"proc_start": runstate.proc_start_ticks(pid), "pgid": os.getpgid(pid)}


def test_a_forged_train_pid_blocks_nothing_and_stop_never_signals_a_process_a_train_pid_names(tmp_path):
    runs = tmp_path / "runs"
    runner = jobs.JobRunner(runs, [SHIPPED])
    pid_file(runs / "forged", os.getpid())  # no proc_start: the app's own pid, as the review forged it
    assert runstate.live_pid(runs / "forged") is None and runner.live() is None
    runner._refuse_if_live()  # launches are not blocked
    with pytest.raises(LorarlError, match="run forged is not training; nothing to stop"):
        runner.stop("forged")
    pid_file(runs / "forged", os.getpid(), **fields(os.getpid()))  # this process, start time and group right
    assert runner.live() is None
    with pytest.raises(LorarlError, match=f"run forged: not stopped: its train.pid names pid {os.getpid()}, "):
        runner.stop("forged")
    mine, other = sleeper(new_session=False), sleeper(new_session=True)
    try:
        pid_file(runs / "forged", other.pid, **{**fields(other.pid), "proc_start": fields(other.pid)["proc_start"] + 1})
        assert runner.live() is None  # another start time: a reused pid, no run
        for proc in (mine, other):  # a process of the app's own group, one in its own: every field right
            pid_file(runs / "forged", proc.pid, **fields(proc.pid))
            with pytest.raises(LorarlError, match=f"not stopped: its train.pid names pid {proc.pid}, .* did not start"):
                runner.stop("forged")
        assert runner.live() == runs / "forged"  # (counted for the one-job rule until a press goes past it)
        assert mine.poll() is None and other.poll() is None  # nothing was signalled
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
    runstate.write_pid(tmp_path, pid=os.getpid())
    assert json.loads((tmp_path / runstate.PID_FILE).read_text())["pgid"] == os.getpgrp()


def test_a_symlinked_run_name_is_refused_and_launches_stay_free(tmp_path):
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    runs.mkdir()
    outside.mkdir()
    os.symlink(outside, runs / "link")
    os.symlink(tmp_path / "nowhere", runs / "dangling")
    runner = jobs.JobRunner(runs, [SHIPPED])
    with pytest.raises(LorarlError, match=f"run link: {runs / 'link'} is a symlink to {outside}; a run must be"):
        runner.launch(str(QUICKSTART), "link", [])
    with pytest.raises(LorarlError, match="is a symlink to .*nowhere, which does not exist; a run must be"):
        runner.launch(str(QUICKSTART), "dangling", [])
    assert list(outside.iterdir()) == [] and not (tmp_path / "nowhere").exists() and runner._procs == {}
    live = sleeper(new_session=True)
    try:  # a live train.pid behind a symlink out of the runs folder is no run of this folder: nothing blocked
        pid_file(outside, live.pid, **fields(live.pid))
        assert runner.live() is None
        with pytest.raises(LorarlError, match="resolves outside"):
            runner.stop("link")
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()


def test_lower_items_names_seeds_long_messages(site):
    for bad in ("run\n", "run\r", "\nrun"):
        with pytest.raises(LorarlError, match="must be a plain folder name"):
            paths.check_run_name(bad)
    assert paths.check_run_name("run-1.a_b") == "run-1.a_b"
    assert [check_seed(v) for v in (None, 7, 7.0, -1, "12", 2**63 - 1)] == [0, 7, 7, -1, 12, 2**63 - 1]
    for bad, why in ((1e30, "between -2\\*\\*63"), (2**63, "between"), (float("inf"), "whole"), (1.5, "whole")):
        with pytest.raises(LorarlError, match=f"seed must be .*{why}"):
            check_seed(bad)
    torch.manual_seed(check_seed(2**63 - 1))  # the bound is what torch takes
    # a message longer than the model reads is refused with a line, not cut to its last tokens
    max_pos = json.loads((Path(site.session.catalog.base_model) / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(LorarlError) as e:
        site.session.respond("hello " * (2 * max_pos), ["base"], "", SHORT)
    assert f"tokens; this model reads {max_pos}, {max_pos - 4} of them before 4 new ones" in str(e.value)


def test_a_vote_stores_the_answers_the_server_generated_not_what_the_browser_sends(site):
    s = site.session
    prefs = s.preferences
    prefs.unlink(missing_ok=True)
    handlers = Handlers(s)
    request = types.SimpleNamespace(session_hash="browser-1")
    settings = ("", 0.0, 1.0, 4, 0, "none", "")
    frames = list(
        handlers.on_send("What is 2 + 2?", 2, "base", "base", "base", "base", [], [], [], [], *settings, request)
    )
    answer = frames[-1][0][-1]["content"]
    forged = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "x" * 5_000_000}]
    vote = handlers.vote_handler("left")
    status, _ = vote(1, 2, {"system": "", "panes": ["base", "base"]}, forged, forged, [], [], request)
    assert "saved vote (pane 1 preferred)" in status
    record = json.loads(prefs.read_text())
    assert record["chosen"] == [{"role": "assistant", "content": answer}] and len(prefs.read_bytes()) < 2000
    assert record["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    with pytest.raises(gr.Error, match="already voted"):
        vote(1, 2, {}, forged, forged, [], [], request)
    with pytest.raises(gr.Error, match="have not answered yet"):  # another browser session answered nothing
        vote(1, 2, {}, forged, forged, [], [], types.SimpleNamespace(session_hash="browser-2"))
