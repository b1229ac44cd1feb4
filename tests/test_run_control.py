"""Run control (lorarl.runstate and the run loop): train.pid and live_pid, state.json's transitions, stop on SIGTERM
with a checkpoint then a bit-identical resume, crashed states, completions.jsonl (GRPO, PPO, multi-turn) and its
truncation on resume, and a real `python -m lorarl.cli train` stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorarl import runstate
from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict
from lorarl.errors import LorarlError
from lorarl.runs import read_metrics

LONGER = '''
def longer(prompts, completions, **kwargs):
    """The completion's length in characters, capped at 40, over 40."""
    return [min(len(c if isinstance(c, str) else c[-1]["content"]), 40) / 40.0 for c in completions]
'''
TIMING = ("time/", "step_time", "step_cpu_s", "tokens_per_s", "peak_mem_gb")


def tiny(model_dir, tmp_path, **sections) -> dict:
    (tmp_path / "longer.py").write_text(LONGER)
    data = {
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 32, "eval_size": 4},
        "reward": {"functions": [{"name": f"{tmp_path / 'longer.py'}:longer"}]},
        "generation": {"max_new_tokens": 6, "temperature": 1.0},
        "train": {"steps": 3, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2, "seed": 5,
                  "report_to": []},
        "grpo": {"group_size": 4, "kl": {"coef": 0.05}},
        "health": {"parity_every": 0},
        "eval": {"n": 2, "batch_size": 2},
    }  # fmt: skip
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def lorarl_sleeper(seconds: float = 30, new_session: bool = False) -> subprocess.Popen:
    """A live process whose command line names lorarl (as a `lorarl train` one does); ``new_session``: in its own
    process group, as the workbench starts a run."""
    code = "import signal, sys, time; time.sleep(float(sys.argv[1]))"
    return subprocess.Popen([sys.executable, "-c", code, str(seconds), "lorarl"], start_new_session=new_session)


def write_pid_file(run_dir: Path, pid: int, host: str | None = None, proc_start: int | None | str = "real") -> None:
    """A train.pid as :func:`runstate.write_pid` writes it (the process's real start time and group), with
    ``proc_start`` another start time, or None: an older writer's (or a forged) file without one."""
    info = {"pid": pid, "host": host or socket.gethostname(), "started": runstate.now_iso(), "argv": ["lorarl"]}
    if proc_start == "real":
        info.update(proc_start=runstate.proc_start_ticks(pid), pgid=os.getpgid(pid))
    elif proc_start is not None:
        info["proc_start"] = proc_start
    (run_dir / runstate.PID_FILE).write_text(json.dumps(info))


# --- runstate on its own ------------------------------------------------------------------------------------------


def test_live_pid_is_alive_lorarl_processes_on_this_host_only(tmp_path):
    assert runstate.live_pid(tmp_path) is None  # no file
    runstate.write_pid(tmp_path, argv=["lorarl", "train"])
    info = json.loads((tmp_path / "train.pid").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and info["argv"] == ["lorarl", "train"]
    assert runstate.live_pid(tmp_path) == os.getpid()  # this process (pytest's command line need not say lorarl)
    runstate.clear_pid(tmp_path)
    assert not (tmp_path / "train.pid").exists()

    live = lorarl_sleeper()
    plain = subprocess.Popen(["sleep", "30"])  # alive, but not lorarl: a reused pid
    zombie = subprocess.Popen([sys.executable, "-c", "pass", "lorarl"])
    try:
        write_pid_file(tmp_path, live.pid)
        assert runstate.live_pid(tmp_path) == live.pid
        write_pid_file(tmp_path, live.pid, host="another-host")
        assert runstate.live_pid(tmp_path) is None
        write_pid_file(tmp_path, live.pid, proc_start=None)  # no start time: never live by its name (issue 34)
        assert runstate.live_pid(tmp_path) is None
        write_pid_file(tmp_path, os.getpid(), proc_start=None)  # a forged file naming this process
        assert runstate.live_pid(tmp_path) is None and runstate.request_stop(tmp_path) is False
        deadline = time.time() + 10
        while "Z" not in Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.time() < deadline
            time.sleep(0.05)
        write_pid_file(tmp_path, zombie.pid)  # exited, not yet reaped
        assert runstate.live_pid(tmp_path) is None
        zombie.wait()
        assert runstate.live_pid(tmp_path) is None  # gone
    finally:
        for p in (live, plain, zombie):
            p.kill()
            p.wait()


def test_train_pid_names_the_process_by_its_start_time_so_a_reused_pid_is_not_live(tmp_path):
    runstate.write_pid(tmp_path, argv=["lorarl", "train"])
    info = json.loads((tmp_path / "train.pid").read_text())
    field22 = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert info["proc_start"] == field22 == runstate.proc_start_ticks(os.getpid())
    runstate.clear_pid(tmp_path)

    live = lorarl_sleeper()  # "lorarl" in its command line, as the chat app's own process has
    plain = subprocess.Popen(["sleep", "30"])
    try:
        start = runstate.proc_start_ticks(live.pid)
        assert isinstance(start, int) and start > 0
        # a stale file: the pid is now another process (its start time differs) -> not live, and Stop signals nothing
        write_pid_file(tmp_path, live.pid, proc_start=start - 1)
        assert runstate.live_pid(tmp_path) is None
        assert runstate.request_stop(tmp_path) is False and live.poll() is None
        runstate.check_not_live(tmp_path)  # a second trainer is not refused because of it
        write_pid_file(tmp_path, live.pid, proc_start=start)
        assert runstate.live_pid(tmp_path) == live.pid
        # with a start time, the start time decides (a process whose command line does not say lorarl is the one)
        write_pid_file(tmp_path, plain.pid)  # its start time and process group, as write_pid records them
        assert runstate.live_pid(tmp_path) == plain.pid
        assert runstate.request_stop(tmp_path) is True and plain.wait(timeout=10) == -signal.SIGTERM
        assert runstate.live_pid(tmp_path) is None  # gone
    finally:
        for p in (live, plain):
            p.kill()
            p.wait()


def test_read_state_new_running_and_killed(tmp_path):
    assert runstate.read_state(tmp_path) == {"state": "new"}
    live = lorarl_sleeper()
    try:
        write_pid_file(tmp_path, live.pid)
        runstate.write_state(tmp_path, "running", 2, 10)
        got = runstate.read_state(tmp_path)
        assert (got["state"], got["step"], got["last_step"], got["error"]) == ("running", 2, 10, None)
        with pytest.raises(LorarlError, match=f"pid {live.pid}"):
            runstate.check_not_live(tmp_path)
        live.kill()  # killed without a word: the file still says running
        live.wait()
        got = runstate.read_state(tmp_path)
        assert got["state"] == "crashed" and got["error"] == runstate.KILLED and got["step"] == 2
        assert json.loads((tmp_path / "state.json").read_text())["state"] == "running"  # reading changes nothing
    finally:
        live.kill()
        live.wait()
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(LorarlError, match="state.json: not valid JSON"):
        runstate.read_state(tmp_path)


def test_request_stop_sends_sigterm_to_the_live_run_only(tmp_path):
    assert runstate.request_stop(tmp_path) is False  # nobody trains it
    live = lorarl_sleeper()
    try:
        write_pid_file(tmp_path, live.pid)
        assert runstate.request_stop(tmp_path) is True
        assert live.wait(timeout=10) == -signal.SIGTERM
        assert runstate.request_stop(tmp_path) is False  # it is gone now
    finally:
        live.kill()
        live.wait()


def test_stop_request_catches_sigterm_and_restores_the_previous_handler():
    def previous(signum, frame):
        raise AssertionError("the previous handler must not run while a StopRequest is installed")

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with runstate.StopRequest() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 5
            while not stop.requested and time.time() < deadline:
                time.sleep(0.01)
            assert stop.requested and stop.signal == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


def test_completions_log_starts_over_or_keeps_the_steps_up_to_the_resume_step(tmp_path):
    log = runstate.CompletionsLog(tmp_path)
    log.log(1, [{"prompt": "p", "completion": "é", "reward": 1.0}])
    log.log(2, [{"prompt": "q", "completion": "c", "reward": None}, {"prompt": "r", "completion": "d", "reward": 0}])
    log.close()
    path = tmp_path / "completions.jsonl"
    with path.open("a") as f:
        f.write('{"step": 3, "prompt": "half-writ')  # killed mid-line
    runstate.CompletionsLog(tmp_path, resume_step=1).close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "prompt": "p", "completion": "é", "reward": 1.0}
    ]
    runstate.CompletionsLog(tmp_path).close()  # a fresh run starts the file over
    assert not path.exists()


# --- the run loop -----------------------------------------------------------------------------------------------


def stop_after(monkeypatch, cls, stop_step: int, run_dir: Path, seen: list) -> None:
    """Patch ``cls.step`` to record ``run_dir``'s state during each step and SIGTERM this process at the end of step
    ``stop_step`` (as `lorarl.runstate.request_stop` does from another process)."""
    real = cls.step

    def step(self, batch):
        seen.append((batch.step, runstate.read_state(run_dir)["state"]))
        row = real(self, batch)
        if batch.step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    monkeypatch.setattr(cls, "step", step)


def adapters(run_dir: Path) -> dict:
    return load_file(str(run_dir / "policy" / "adapter_model.safetensors"))


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_sigterm_stops_with_a_checkpoint_and_resume_is_bit_identical(tiny_model_dir, tmp_path, monkeypatch):
    from lorarl.algos.grpo import GRPO

    recipe = recipe_from_dict(tiny(tiny_model_dir, tmp_path))  # save_every 0: only the stop writes a checkpoint
    train(recipe, tmp_path / "straight")
    assert runstate.read_state(tmp_path / "straight")["state"] == "finished"

    out = tmp_path / "split"
    seen: list = []
    stop_after(monkeypatch, GRPO, 1, out, seen)
    handler = signal.getsignal(signal.SIGTERM)
    assert runstate.read_state(out)["state"] == "new"
    stopped = train(recipe, out)
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop put the previous handler back
    assert stopped["stopped"] is True and stopped["step"] == 1 and stopped["steps_this_run"] == 1
    assert stopped["checkpoint"] == str(out / "checkpoints" / "step-000001")
    assert (out / "checkpoints" / "step-000001" / "COMPLETE").is_file()
    assert not (out / "policy").exists() and not (out / "plot.png").exists()  # unfinished: no final adapters
    assert not (out / "train.pid").exists()
    state = runstate.read_state(out)
    assert (state["state"], state["step"], state["last_step"], state["error"]) == ("stopped", 1, 3, None)

    # a row the stopped process logged after its checkpoint (as a kill between log and save leaves) is dropped
    with (out / "completions.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "prompt": "stale", "completion": "stale", "reward": 0.0}) + "\n")
    resumed = train(recipe, out, resume=True)
    assert "stopped" not in resumed and resumed["steps_this_run"] == 2
    assert [s for _, s in seen] == ["running", "running", "running"]  # steps 1 (first run), 2, 3 (resumed)
    assert runstate.read_state(out)["state"] == "finished" and runstate.read_state(out)["step"] == 3

    a, b = adapters(tmp_path / "straight"), adapters(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)  # it trained
    ra, rb = read_metrics(tmp_path / "straight"), read_metrics(out)
    assert [r["step"] for r in rb] == [1, 2, 3]
    assert without_timings(ra) == without_timings(rb)
    ca = (tmp_path / "straight" / "completions.jsonl").read_text()
    assert ca == (out / "completions.jsonl").read_text() and "stale" not in ca


def test_sigterm_after_the_steps_stop_check_still_saves_that_step(tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM between the end of step 1's stop check and the start of step 2: the loop stops at its next check,
    with a checkpoint of step 1 (save_every 0: the stop is the only checkpoint); resume runs steps 2 and 3 only."""
    import lorarl.algos.loop as loop_module

    real = loop_module.write_state

    def write_state(run_dir, state, step, last_step, error=None):
        out = real(run_dir, state, step, last_step, error)
        if state == "running" and step == 1:  # the last thing a step does, after its `stopping` was computed
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(loop_module, "write_state", write_state)
    recipe = recipe_from_dict(tiny(tiny_model_dir, tmp_path))
    out = tmp_path / "run"
    stopped = train(recipe, out)
    assert stopped["stopped"] is True and stopped["step"] == 1 and stopped["steps_this_run"] == 1
    assert stopped["checkpoint"] == str(out / "checkpoints" / "step-000001")
    assert (out / "checkpoints" / "step-000001" / "COMPLETE").is_file()
    assert runstate.read_state(out)["state"] == "stopped" and runstate.read_state(out)["step"] == 1
    monkeypatch.setattr(loop_module, "write_state", real)
    resumed = train(recipe, out, resume=True)
    assert resumed["steps_this_run"] == 2 and [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_grpo_completions_rows_hold_the_group_and_its_advantages(tiny_model_dir, tmp_path):
    recipe = recipe_from_dict(tiny(tiny_model_dir, tmp_path, train={"steps": 2, "log_completions": 4}))
    train(recipe, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    assert all(set(r) == {"step", "prompt", "completion", "reward", "advantage"} for r in rows)
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]  # the first 4 rows: group 1 (group_size 4), one prompt
        assert len({r["prompt"] for r in group}) == 1
        assert group[0]["prompt"].startswith("<|im_start|>") and "<|im_start|>assistant" in group[0]["prompt"]
        r = torch.tensor([g["reward"] for g in group], dtype=torch.float64)
        assert torch.allclose(r, torch.tensor([min(len(g["completion"]), 40) / 40 for g in group], dtype=r.dtype))
        mu, sigma = r.mean(), r.std(unbiased=False)  # GRPO: (r - mu) / (sigma + 1e-4), 0 for a zero-spread group
        want = torch.zeros_like(r) if sigma == 0 else (r - mu) / (sigma + 1e-4)
        got = torch.tensor([g["advantage"] for g in group], dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-5), (got, want)
    off = recipe_from_dict(tiny(tiny_model_dir, tmp_path, train={"steps": 1, "log_completions": 0}))
    train(off, tmp_path / "off")
    assert not (tmp_path / "off" / "completions.jsonl").exists()


def test_ppo_completions_rows(tiny_model_dir, tmp_path):
    data = tiny(tiny_model_dir, tmp_path, train={"steps": 1, "log_completions": 3, "prompts_per_step": 4})
    data["algo"] = "ppo"
    data.pop("grpo")
    data["ppo"] = {"epochs": 1, "minibatch_size": 4}
    train(recipe_from_dict(data), tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {r["step"] for r in rows} == {1}
    for r in rows:
        assert set(r) == {"step", "prompt", "completion", "reward", "advantage", "score_used"}
        assert r["reward"] == pytest.approx(min(len(r["completion"]), 40) / 40)
        assert r["score_used"] == pytest.approx(r["reward"])  # no normalisation / clipping in this recipe
        assert isinstance(r["advantage"], float)
    assert len({r["prompt"] for r in rows}) == 3  # PPO: one completion per prompt


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_multi_turn_completions_show_the_tool_messages(tiny_model_dir, tmp_path, monkeypatch, algo):
    from test_agents_loop import CALL, ScriptedEngine, _agent_recipe

    from lorarl.config import recipe_to_dict

    engine = ScriptedEngine(lambda turn, text, i: CALL if turn == 0 else "It is 5535.")
    monkeypatch.setattr("lorarl.agents.loop.make_engine", lambda name: engine)
    data = recipe_to_dict(_agent_recipe(tiny_model_dir, tmp_path, algo))
    data["train"].update(log_completions=2, report_to=[])
    train(recipe_from_dict(data), tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["completion"].startswith(CALL)  # turn 1, the tool's answer, turn 2
        assert "<tool_response>" in r["completion"] and "5535" in r["completion"]
        assert r["completion"].rstrip().endswith("It is 5535.<|im_end|>")
        assert r["reward"] is not None


def test_an_exception_leaves_state_crashed_with_its_line(tiny_model_dir, tmp_path, monkeypatch):
    from lorarl.algos.grpo import GRPO

    real = GRPO.step

    def step(self, batch):
        if batch.step == 2:
            raise RuntimeError("the reward server went away\n  (details on the next line)")
        return real(self, batch)

    monkeypatch.setattr(GRPO, "step", step)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="reward server went away"):
        train(recipe_from_dict(tiny(tiny_model_dir, tmp_path)), out)
    state = runstate.read_state(out)
    assert state["state"] == "crashed" and state["step"] == 1 and state["last_step"] == 3
    assert state["error"] == "RuntimeError: the reward server went away"
    assert not (out / "train.pid").exists()
    monkeypatch.setattr(GRPO, "step", lambda self, batch: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is no stop request: it interrupts at once
        train(recipe_from_dict(tiny(tiny_model_dir, tmp_path)), tmp_path / "ctrl-c")
    assert runstate.read_state(tmp_path / "ctrl-c")["error"] == "KeyboardInterrupt"
    # a bad adapter in the recipe: the crash comes from the set-up, before any step
    bad = recipe_from_dict(tiny(tiny_model_dir, tmp_path, model={"init_adapter": str(tmp_path / "nope")}))
    with pytest.raises(LorarlError):
        train(bad, tmp_path / "bad")
    state = runstate.read_state(tmp_path / "bad")
    assert state["state"] == "crashed" and state["step"] == 0 and "nope" in state["error"]


def test_a_stopped_pipeline_stage_stays_unfinished_and_resume_finishes_it(tiny_model_dir, tmp_path, monkeypatch):
    from test_pipeline import write_pipeline

    from lorarl.algos.grpo import GRPO
    from lorarl.pipeline import load_pipeline, run_pipeline

    path = write_pipeline(tmp_path, tiny_model_dir, "- name: rl\n  algo: grpo\n  train: {steps: 2}\n")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        stop_after(m, GRPO, 1, out / "01-rl", [])
        result = run_pipeline(load_pipeline(path, out), out)
    assert (
        result["stopped"] is True and result["run_dir"] == str(out / "01-rl") and result["rows"][-1]["stage"] == "base"
    )
    assert not (out / "01-rl" / "stage.json").exists() and runstate.read_state(out / "01-rl")["state"] == "stopped"
    again = run_pipeline(load_pipeline(path, out), out, resume=True)
    assert "stopped" not in again and [r["stage"] for r in again["rows"]] == ["base", "rl"]
    assert (out / "01-rl" / "stage.json").is_file() and runstate.read_state(out / "01-rl")["state"] == "finished"
    assert [r["step"] for r in read_metrics(out / "01-rl")] == [1, 2]


def test_a_live_run_refuses_a_second_trainer(tiny_model_dir, tmp_path):
    live = lorarl_sleeper()
    out = tmp_path / "run"
    out.mkdir()
    try:
        write_pid_file(out, live.pid)
        with pytest.raises(LorarlError, match=f"training in this folder now \\(pid {live.pid}\\)"):
            train(recipe_from_dict(tiny(tiny_model_dir, tmp_path)), out, resume=True)
        assert not (out / "recipe.yaml").exists()  # refused before writing anything
    finally:
        live.kill()
        live.wait()


# --- a real process ---------------------------------------------------------------------------------------------


def test_cli_train_stops_on_sigterm_with_exit_0_and_a_checkpoint(tiny_model_dir, tmp_path):
    import yaml

    data = tiny(tiny_model_dir, tmp_path, train={"steps": 200})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lorarl.cli", "train", str(recipe), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while runstate.read_state(out).get("step", 0) < 1:  # running, one step done
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no step within 120 s"
        time.sleep(0.05)
    assert runstate.live_pid(out) == proc.pid and runstate.read_state(out)["state"] == "running"
    assert runstate.request_stop(out) is True
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] is True and 1 <= summary["step"] < 200
    step = summary["step"]
    assert (out / "checkpoints" / f"step-{step:06d}" / "COMPLETE").is_file()
    state = runstate.read_state(out)
    assert (state["state"], state["step"], state["last_step"]) == ("stopped", step, 200)
    assert not (out / "train.pid").exists() and not (out / "policy").exists()
    # the SIGTERM lands after a step, or while the next one generates (that step abandoned: tests/test_stop_generation.py)
    abandoned = f"step {step + 1}: stop requested during generation: step abandoned; checkpoint of step {step};"
    assert "stop requested: checkpoint saved" in stdout or abandoned in stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))

    # resumed, then killed without a word: the state file still says running; read_state says crashed
    proc = subprocess.Popen([*cmd, "--resume"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while runstate.read_state(out).get("step", 0) < step + 1:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no resumed step within 120 s"
        time.sleep(0.05)
    assert runstate.read_state(out)["state"] == "running"
    proc.kill()
    proc.communicate()
    assert json.loads((out / "state.json").read_text())["state"] == "running"
    state = runstate.read_state(out)
    assert state["state"] == "crashed" and state["error"] == runstate.KILLED and state["step"] > step
    assert runstate.live_pid(out) is None and runstate.request_stop(out) is False
