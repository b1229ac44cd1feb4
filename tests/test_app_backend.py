"""The workbench backend (lorarl.app): recipes and fields checked by the real loader, paths kept inside their
folders, real `lorarl train` subprocesses launched / watched / stopped / resumed under the one-job rule, DPO and
reward-model retrains on a votes file, and exports with the fidelity gate's figures -- all on the tiny model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lorarl.app import exporting, jobs, paths, recipes, retrain, watch
from lorarl.chat.consent import CodeConsent
from lorarl.chat.votes import append_jsonl, preference_record, ties_path
from lorarl.config import load_recipe
from lorarl.errors import LorarlError
from lorarl.runs import latest_checkpoint, read_metrics
from lorarl.runstate import KILLED, live_pid

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "recipes"
QUICKSTART = SHIPPED / "grpo_arithmetic.yaml"
STEPS = 60


def tiny(model_dir: Path, *extra: str) -> list[str]:
    """Overrides that make a shipped recipe a few-second run on the tiny random-init model."""
    return [
        f"model.name={model_dir}",
        "model.quantization=none",
        "model.dtype=float32",
        "train.report_to=[]",
        "eval.n=4",
        "eval.batch_size=4",
        *extra,
    ]


def grpo_overrides(model_dir: Path) -> list[str]:
    return tiny(
        model_dir,
        f"train.steps={STEPS}",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "grpo.group_size=2",
        "generation.max_new_tokens=4",
        "data.train_size=16",
        "data.eval_size=4",
    )


def wait_for(cond, timeout: float = 180.0, every: float = 0.1):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def wait_done(runner: jobs.JobRunner, run: Path) -> int:
    wait_for(lambda: runner.returncode(run) is not None and runner.live() is None)
    return runner.returncode(run)


def log_summary(run: Path) -> dict:
    """The last line `lorarl train` prints: its JSON summary."""
    return json.loads((run / jobs.LOG_FILE).read_text().strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------
# Paths: nothing from the page reaches outside the folders
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def folders(tmp_path):
    rdir, runs, outside = tmp_path / "recipes", tmp_path / "runs", tmp_path / "outside"
    for d in (rdir, runs, outside / "run"):
        d.mkdir(parents=True)
    (rdir / "mine.yaml").write_text(QUICKSTART.read_text())
    (rdir / "pipe.yaml").write_text("stages: []\n")
    (outside / "secret.yaml").write_text(QUICKSTART.read_text())
    (rdir / "evil.yaml").symlink_to(outside / "secret.yaml")
    (runs / "done").mkdir()
    (runs / "done" / "recipe.yaml").write_text(QUICKSTART.read_text())
    (runs / "done" / "notes.yaml").write_text(QUICKSTART.read_text())
    (runs / "linked").symlink_to(outside / "run")
    return rdir, runs, outside


def test_recipe_and_run_paths_stay_inside_their_folders(folders):
    rdir, runs, outside = folders
    ok = paths.checked_recipe("mine.yaml", [rdir], runs)
    assert ok == rdir / "mine.yaml"
    assert paths.checked_recipe(str((rdir / "mine.yaml").resolve()), [rdir], runs).name == "mine.yaml"
    assert paths.checked_recipe("done/recipe.yaml", [rdir], runs) == runs / "done" / "recipe.yaml"
    refused = {
        "../outside/secret.yaml": "'..' is not allowed",
        str(outside / "secret.yaml"): "outside",
        "/etc/passwd": "outside",
        "evil.yaml": "resolves outside",  # a symlink leaving the recipe folder
        "done/notes.yaml": "only RUN/recipe.yaml",
        "missing.yaml": "no such file",
    }
    for given, why in refused.items():
        with pytest.raises(LorarlError, match=why):
            paths.checked_recipe(given, [rdir], runs)
    assert paths.checked_run("done", runs) == runs / "done"
    for given, why in {
        "../outside": "'..'",
        "done/sub": "directly inside",
        str(outside / "run"): "outside",
        "linked": "resolves outside",
        ".hidden": "plain folder name",
        "nope": "no such run",
    }.items():
        with pytest.raises(LorarlError, match=why):
            paths.checked_run(given, runs)
    for bad in ("", "a b", "../x", "a/b", ".x", "x/"):
        with pytest.raises(LorarlError, match="plain folder name"):
            paths.check_name(bad)
    assert paths.export_folder("e1", runs) == runs / "exports" / "e1"
    with pytest.raises(LorarlError, match="export name"):
        paths.export_folder("../e1", runs)


def test_launch_refuses_bad_paths_names_and_values_without_starting_anything(folders, tiny_model_dir):
    rdir, runs, outside = folders
    runner = jobs.JobRunner(runs, [rdir])
    before = sorted(p.name for p in runs.iterdir()) + [jobs.LAUNCH_LOCK]  # (the lock a launch takes stays)
    cases = [
        (("evil.yaml", "r1", []), "resolves outside"),
        ((str(outside / "secret.yaml"), "r1", []), "outside"),
        (("../outside/secret.yaml", "r1", []), r"'\.\.'"),
        (("mine.yaml", "../escape", []), "plain folder name"),
        (("mine.yaml", "a/b", []), "plain folder name"),
        (("mine.yaml", "exports", tiny(tiny_model_dir)), "holds the page's exports"),
        (("mine.yaml", "done", tiny(tiny_model_dir)), "already exists"),
        (("mine.yaml", "r1", ["train.learning_rate=abc"]), "train.learning_rate must be float, got 'abc'"),
        (("mine.yaml", "r1", ["train.steps=-1"]), "train.steps must be >= 1"),
        (("mine.yaml", "r1", ["agent.tools=[os:system]"]), "name code"),
        (("mine.yaml", "r1", ['reward.functions=[{name: "os:system"}]']), "only the weights"),
    ]
    for args, why in cases:
        with pytest.raises(LorarlError, match=why):
            runner.launch(*args)
    assert sorted(p.name for p in runs.iterdir()) == sorted(before) and runner.live() is None


# ---------------------------------------------------------------------------------------------------------------
# Recipes, fields, validation, the planner's line
# ---------------------------------------------------------------------------------------------------------------


def test_list_recipes_and_header(folders):
    rdir, runs, _ = folders
    shipped = recipes.list_recipes([SHIPPED], runs)
    names = [Path(c.path).name for c in shipped]
    assert "grpo_arithmetic.yaml" in names and "dpo.yaml" in names and "reward_model.yaml" in names
    assert not any(n.startswith("pipeline_") for n in names)  # `lorarl train` refuses pipelines
    assert all(Path(c.path).is_absolute() for c in shipped)
    assert str(runs.resolve() / "done" / "recipe.yaml") in {str(Path(c.path).resolve()) for c in shipped}
    mine = [Path(c.path).name for c in recipes.list_recipes([rdir], runs)]
    assert "mine.yaml" in mine and "pipe.yaml" not in mine
    header = recipes.recipe_header(QUICKSTART)
    assert header.startswith("GRPO quickstart") and "lorarl train recipes/grpo_arithmetic.yaml" in header
    assert "algo:" not in header and not any(line.startswith("#") for line in header.splitlines())


def test_what_a_recipe_runs_is_listed_before_a_launch(tmp_path):
    """A recipe found in a run folder may come from anywhere: the code it would run is named on the page."""
    assert recipes.code_entries(QUICKSTART) == []  # built-ins only
    own = tmp_path / "own.yaml"
    own.write_text(
        "algo: grpo\nmodel: {name: some/model, trust_remote_code: true}\n"
        "reward: {functions: [{name: numeric_match}, {name: 'rewards.py:mine'}]}\n"
        "agent: {tools: [calculator, 'tools.py:shell'], environment: 'envs.py:World'}\n"
    )
    assert recipes.code_entries(own) == [
        "reward rewards.py:mine",
        "tool tools.py:shell",
        "environment envs.py:World",
        "the model's own code (model.trust_remote_code, some/model)",
    ]


def two_rewards_recipe(folder: Path) -> Path:
    text = QUICKSTART.read_text().replace(
        "    - name: numeric_match\n      weight: 1.0\n",
        "    - name: numeric_match\n      weight: 1.0\n    - name: length_penalty\n      weight: 0.1\n"
        "      kwargs: {max_tokens: 12}\n",
    )
    path = folder / "two.yaml"
    path.write_text(text)
    return path


def test_fields_values_and_validation_by_the_loader(tmp_path):
    path = two_rewards_recipe(tmp_path)
    keys = [f.key for f in recipes.fields_for(path)]
    assert keys == [
        "model.name",
        "train.steps",
        "train.learning_rate",
        "grpo.group_size",
        "generation.max_new_tokens",
        "reward.functions.0.weight",
        "reward.functions.1.weight",
        "eval.every",
    ]
    rm_keys = [f.key for f in recipes.fields_for(SHIPPED / "reward_model.yaml")]
    assert rm_keys == ["model.name", "train.steps", "train.learning_rate", "eval.every"]
    assert "grpo.group_size" not in [f.key for f in recipes.fields_for(SHIPPED / "dpo.yaml")]
    values = recipes.field_values(path)
    assert values == {
        "model.name": "smollm2-135m",
        "train.steps": 40,
        "train.learning_rate": 3e-4,
        "grpo.group_size": 8,
        "generation.max_new_tokens": 16,
        "reward.functions.0.weight": 1.0,
        "reward.functions.1.weight": 0.1,
        "eval.every": 0,
    }
    # unchanged values: nothing to override
    assert recipes.validate(path, {k: str(v) for k, v in values.items()}) == ([], {})
    # a number widget's 40.0 for an int field is 40; 3e-4 typed is the recipe's 0.0003
    assert recipes.validate(path, {"train.steps": 40.0, "train.learning_rate": "3e-4"}) == ([], {})
    assert recipes.validate(path, {"train.steps": 5.0}) == (["train.steps=5"], {})
    # bad values: each field gets the loader's own line, and nothing launches
    overrides, errors = recipes.validate(
        path, {"train.learning_rate": "abc", "train.steps": "-1", "reward.functions.1.weight": "x", "eval.every": "2"}
    )
    assert overrides == []
    assert errors == {
        "train.learning_rate": f"{path}: train.learning_rate must be float, got 'abc'",
        "train.steps": f"{path}: train.steps must be >= 1",
        "reward.functions.1.weight": f"{path}: reward.functions[1].weight must be float, got 'x'",
    }
    _, errors = recipes.validate(path, {"grpo.group_size": 1})
    assert errors == {
        "grpo.group_size": f"{path}: grpo.group_size must be >= 2 (advantages are relative within a group)"
    }
    _, errors = recipes.validate(path, {"ppo.epochs": 2})
    assert errors == {"": "not a field of this recipe: ppo.epochs"}
    # good values: overrides the loader reads back as typed, the other reward keeps its kwargs
    overrides, errors = recipes.validate(
        path, {"train.learning_rate": "1e-3", "train.steps": 5, "reward.functions.1.weight": "0.5", "model.name": "a b"}
    )
    assert errors == {}
    r = load_recipe(path, overrides)
    assert (r.train.learning_rate, r.train.steps, r.model.name) == (1e-3, 5, "a b")
    assert [(f.name, f.weight, f.kwargs) for f in r.reward.functions] == [
        ("numeric_match", 1.0, {}),
        ("length_penalty", 0.5, {"max_tokens": 12}),
    ]


def test_plan_line_on_this_machine(tmp_path):
    import torch

    line = recipes.plan_line(QUICKSTART)
    assert line.startswith("plan: ")
    if torch.cuda.is_available():
        assert "GB on" in line and ("fits" in line or "DOES NOT FIT" in line)
        return
    assert "CPU: host memory" in line and "smollm2-135m" in line

    def peak(text: str) -> float:
        return float(text.split("tensor peak ")[1].split(" GB")[0])

    # the planner's own figure moves with the recipe: 4x the completion length costs more
    assert peak(recipes.plan_line(QUICKSTART, ["generation.max_new_tokens=64"])) > peak(line)
    assert "tensor peak" in recipes.plan_line(SHIPPED / "reward_model.yaml")  # the planner models its step
    assert "tensor peak" in recipes.plan_line(SHIPPED / "online_dpo.yaml")  # as a GRPO step of its 4 samples per prompt
    rs = tmp_path / "rs.yaml"
    rs.write_text(
        "algo: rejection_sampling\nmodel: {name: smollm2-135m}\nreward:\n  functions: [{name: numeric_match}]\n"
    )
    assert "no estimate for a rejection_sampling recipe" in recipes.plan_line(rs)
    assert "train.steps must be >= 1" in recipes.plan_line(QUICKSTART, ["train.steps=0"])


# ---------------------------------------------------------------------------------------------------------------
# RunWatch on files written by hand: only new complete lines, resets, state, ETA
# ---------------------------------------------------------------------------------------------------------------


def _row(step: int, **kw) -> str:
    return json.dumps({"step": step, "reward": step / 10, "kl": 0.01 * step, "step_time": float(step), **kw}) + "\n"


def test_runwatch_reads_only_new_complete_lines(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "recipe.yaml").write_text("algo: grpo\ntrain: {steps: 10}\n")
    metrics = run / "metrics.jsonl"
    metrics.write_text(_row(1) + _row(2) + _row(3)[:15])  # step 3 half-written
    w = watch.RunWatch(run)
    v = w.poll()
    assert v.series["reward"] == [(1, 0.1), (2, 0.2)] and v.new_rows == 2
    assert v.series_keys == {"reward": "reward", "KL": "kl", "step time (s)": "step_time"}
    with metrics.open("a") as f:
        f.write(_row(3)[15:] + _row(4, **{"eval/accuracy": 0.5}))
    v = w.poll()
    assert [s for s, _ in v.series["reward"]] == [1, 2, 3, 4] and v.new_rows == 2
    assert v.series["held-out accuracy"] == [(4, 0.5)]
    assert w.poll().new_rows == 0
    # state: no state.json and no process -> new; progress from the rows and recipe.yaml
    assert v.state == "new" and (v.progress.step, v.progress.last_step) == (4, 10) and v.progress.eta_s is None
    # a running state with a live pid (this process) -> ETA = median step time x steps left
    from lorarl.runstate import write_pid

    write_pid(run)  # (with its start time: a file without one names no live run)
    (run / "state.json").write_text(json.dumps({"state": "running", "step": 4, "last_step": 10}))
    v = w.poll()
    assert v.state == "running" and v.progress.eta_s == pytest.approx(2.5 * 6)
    assert v.progress.text == "step 4/10, 2.5 s/step, about 0m15s left"
    # a resume truncates metrics.jsonl (a new file): read again from the start, steps re-logged replace old ones
    tmp = run / "m.tmp"
    tmp.write_text(_row(1) + _row(2, reward=9.0))
    os.replace(tmp, metrics)
    v = w.poll()
    assert v.series["reward"] == [(1, 0.1), (2, 9.0)]
    # ... or rewritten in place (MetricsLogger), and grown past the old offset again before this poll
    with metrics.open("a") as f:
        f.write(_row(3) + _row(4))
    assert [s for s, _ in w.poll().series["reward"]] == [1, 2, 3, 4]
    metrics.write_text(_row(1) + _row(2, reward=9.0) + _row(3, reward=7.0, note="x" * 50) + _row(4, reward=8.0))
    assert w.poll().series["reward"] == [(1, 0.1), (2, 9.0), (3, 7.0), (4, 8.0)]
    # train.log: progress-bar redraws collapse to their last, health lines are kept in order
    (run / "train.log").write_text(
        "loading\nbar 1/10\rbar 2/10\rbar 3/10\nstep 3: health: reward spread is zero\nstep 4: health: kl high\n"
    )
    (run / "train.pid").unlink()  # the process died while "running"
    v = w.poll()
    assert v.warnings == ["step 3: health: reward spread is zero", "step 4: health: kl high"]
    assert v.state == "crashed" and v.error == KILLED
    assert v.crash_lines == ["loading", "bar 3/10", "step 3: health: reward spread is zero", "step 4: health: kl high"]
    # completions: the last 20 rows
    (run / "completions.jsonl").write_text(
        "".join(json.dumps({"step": i, "completion": str(i)}) + "\n" for i in range(25))
    )
    assert [c["step"] for c in w.poll().completions] == list(range(5, 25))


def test_failed_state_and_list_runs(tmp_path):
    runs = tmp_path / "runs"
    for name in ("terminal", "failed", "exports", "empty"):
        (runs / name).mkdir(parents=True)
    (runs / "terminal" / "recipe.yaml").write_text("algo: ppo\ntrain: {steps: 7}\n")
    (runs / "terminal" / "metrics.jsonl").write_text(_row(1) + _row(2))
    (runs / "terminal" / "policy").mkdir()
    (runs / "terminal" / "policy" / "adapter_config.json").write_text("{}")
    (runs / "failed" / "train.log").write_text("$ lorarl train x\nlorarl: error: data.source x.jsonl: no such file\n")
    os.utime(runs / "terminal" / "metrics.jsonl", (1, 1))
    os.utime(runs / "terminal" / "recipe.yaml", (1, 1))
    listed = watch.list_runs(runs)
    assert [r.name for r in listed] == ["failed", "terminal"]  # newest first; exports/ and empty folders left out
    failed, terminal = listed
    assert (failed.state, failed.step, failed.algo) == ("failed", None, None)
    assert (terminal.state, terminal.step, terminal.last_step, terminal.algo) == ("finished", 2, 7, "ppo")
    assert watch.run_choices(runs) == [(failed.label, "failed"), ("terminal · ppo · finished step 2/7", "terminal")]
    v = watch.RunWatch(runs / "failed").poll()
    assert (
        v.state == "failed"
        and v.error == "data.source x.jsonl: no such file"
        and v.crash_lines[-1].startswith("lorarl")
    )


# ---------------------------------------------------------------------------------------------------------------
# Real `lorarl train` subprocesses on the tiny model
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model_dir):
    """Launch a GRPO run of the quickstart recipe, watch it grow, stop it, check the one-job rule, resume it."""
    runs = tmp_path_factory.mktemp("workbench") / "runs"
    runs.mkdir()
    runner = jobs.JobRunner(runs, [SHIPPED])
    run = runner.launch(str(QUICKSTART), "g1", grpo_overrides(tiny_model_dir))
    w = watch.RunWatch(run)
    seen = []
    wait_for(lambda: seen.append(len(w.poll().series.get("reward", []))) or seen[-1] > 0)
    pid = live_pid(run)
    own_session = os.getsid(pid) == pid != os.getsid(0)  # closing the app (its session) leaves the run alone
    refused = {}
    for what, call in {
        "launch": lambda: runner.launch(str(QUICKSTART), "g2", grpo_overrides(tiny_model_dir)),
        "resume": lambda: runner.resume("g1"),
        # a runner that did not start it (another app, or a run from a terminal): it reads g1's train.pid
        "other runner": lambda: jobs.JobRunner(runs, [SHIPPED]).launch(str(QUICKSTART), "g3", []),
    }.items():
        with pytest.raises(LorarlError) as e:
            call()
        refused[what] = str(e.value)
    stop_message = runner.stop("g1")
    first_exit = wait_done(runner, run)
    stopped = w.poll()
    stopped_checkpoint = latest_checkpoint(run)
    runner.resume(run)
    second_exit = wait_done(runner, run)
    finished = w.poll()
    return dict(
        runner=runner,
        own_session=own_session,
        runs=runs,
        run=run,
        seen=seen,
        refused=refused,
        stop_message=stop_message,
        exits=(first_exit, second_exit),
        stopped=stopped,
        stopped_checkpoint=stopped_checkpoint,
        finished=finished,
    )


def test_launch_watch_stop_resume(grpo_run):
    run, stopped, finished = grpo_run["run"], grpo_run["stopped"], grpo_run["finished"]
    log = (run / jobs.LOG_FILE).read_text()
    assert log.splitlines()[0].split("$ ", 1)[1].split()[1:5] == ["-m", "lorarl.cli", "train", str(QUICKSTART)]
    assert grpo_run["exits"] == (0, 0) and grpo_run["own_session"]
    # the curves grew while it trained: the first poll with rows saw fewer than all of them
    assert 0 < grpo_run["seen"][-1] < STEPS and grpo_run["seen"] == sorted(grpo_run["seen"])
    # one job at a time: both refusals name the live run
    assert "run g1 is training now" in grpo_run["refused"]["launch"]
    assert "run g1 is training now" in grpo_run["refused"]["resume"]
    other = grpo_run["refused"]["other runner"]  # another app: it did not start g1, it names what g1's train.pid names
    assert other.startswith("run g1: its train.pid names pid ") and "which this workbench did not start" in other
    assert not (grpo_run["runs"] / "g2").exists() and not (grpo_run["runs"] / "g3").exists()
    # stopped after a step, with a checkpoint of that step
    k = stopped.progress.step
    assert "asked run g1 to stop" in grpo_run["stop_message"]
    assert stopped.state == "stopped" and 1 <= k < STEPS and stopped.progress.last_step == STEPS
    assert grpo_run["stopped_checkpoint"].name == f"step-{k:06d}"
    assert [s for s, _ in stopped.series["reward"]] == list(range(1, k + 1))
    # resumed to the end: every step once, the curve exactly what metrics.jsonl holds
    rows = read_metrics(run)
    assert finished.state == "finished" and finished.progress.step == STEPS
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert finished.series["reward"] == [(r["step"], r["reward"]) for r in rows]
    assert finished.series["completion length"] == [(r["step"], r["completions/mean_length"]) for r in rows]
    assert finished.series["step time (s)"] == [(r["step"], r["step_time"]) for r in rows]
    # the loop's real health warning (a random tiny model never answers: zero reward spread), read from train.log
    assert finished.warnings and all(": health: " in w for w in finished.warnings)
    assert any("health: no signal" in w for w in finished.warnings)
    assert len(finished.completions) == 20 and finished.completions[-1]["step"] == STEPS
    assert {"prompt", "completion", "reward"} <= set(finished.completions[-1])
    assert (run / "policy" / "adapter_config.json").is_file()
    runner = grpo_run["runner"]
    with pytest.raises(LorarlError, match="has finished"):
        runner.resume("g1")
    with pytest.raises(LorarlError, match="not training"):
        runner.stop("g1")
    assert [r.name for r in watch.list_runs(grpo_run["runs"])] == ["g1"]


def test_a_run_that_fails_shows_its_error_line(grpo_run, tiny_model_dir):
    runner = grpo_run["runner"]
    run = runner.launch(str(QUICKSTART), "bad-data", grpo_overrides(tiny_model_dir) + ["data.source=missing.jsonl"])
    assert wait_done(runner, run) == 2
    v = watch.RunWatch(run).poll()
    # the loop had started (state.json says running), so the exception's line makes it "crashed"
    assert v.state == "crashed" and "missing.jsonl" in v.error, (v.state, v.error)
    assert v.crash_lines[-1].startswith("lorarl: error:") and "missing.jsonl" in v.crash_lines[-1]


def _history(q: str, a: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def test_retrain_dpo_and_reward_model_on_votes(grpo_run, tiny_model_dir):
    runner, runs = grpo_run["runner"], grpo_run["runs"]
    votes = runs / "preferences.jsonl"
    with pytest.raises(LorarlError, match="nothing to train on"):
        retrain.launch_retrain(runner, "dpo", "base", run_name="no-votes")
    assert not (runs / "no-votes").exists()  # a refusal leaves no folder behind
    for i in range(5):
        q = f"What is {i} + 2?"
        record, _ = preference_record(
            "", _history(q, str(i + 2)), _history(q, f"banana {i}"), "g1/policy", "base", "left"
        )
        append_jsonl(votes, record)
    tie, _ = preference_record("", _history("hi", "a"), _history("hi", "b"), "g1/policy", "base", "tie")
    append_jsonl(ties_path(votes), tie)
    same, _ = preference_record("", _history("hi", "a"), _history("hi", "a"), "g1/policy", "base", "left")
    append_jsonl(votes, same)
    s = retrain.votes_summary(runs)
    assert (s.rows, s.usable, s.ties, s.unusable) == (6, 5, 1, 1)
    assert s.text == f"5 usable preference pair(s) in {votes} (1 tie(s) left out, 1 unusable row(s) left out)"
    for bad, why in {
        "../g1/policy": "chat's checkpoint ids",
        "g1/step-000999": "no policy adapter",
        "g1": "give base",
    }.items():
        with pytest.raises(LorarlError, match=why):
            retrain.retrain_overrides("dpo", votes, bad, runs_dir=runs, recipe_dirs=[SHIPPED])
    recipe, overrides = retrain.retrain_overrides("dpo", votes, "g1/policy", runs_dir=runs, recipe_dirs=[SHIPPED])
    assert recipe == SHIPPED / "dpo.yaml"
    assert "dpo.batch_size=5" in overrides and "train.steps=1" in overrides  # 5 pairs x 1 epoch / 5 a step
    assert f"model.name={json.dumps(str(tiny_model_dir))}" in overrides  # the base g1 trained on

    extra = tiny(tiny_model_dir, "generation.max_new_tokens=4")
    dpo = retrain.launch_retrain(runner, "dpo", "g1/policy", run_name="dpo-votes", extra_overrides=extra)
    assert wait_done(runner, dpo) == 0
    summary = log_summary(dpo)
    assert summary["train_pairs"] == 5 and summary["skipped_pairs"]["identical"] == 1 and summary["ties_beside"] == 1
    saved = load_recipe(dpo / "recipe.yaml", strict=False)
    assert saved.model.init_adapter == str((grpo_run["run"] / "policy").resolve())
    # trained on a copy of the votes as they were at launch (a vote cast later changes no resume)
    snapshot = dpo / "votes.jsonl"
    assert saved.data.source == str(snapshot.resolve()) and saved.data.eval_source is None
    assert (
        snapshot.read_text() == votes.read_text()
        and (dpo / "votes_ties.jsonl").read_text() == ties_path(votes).read_text()
    )
    assert (dpo / "policy" / "adapter_config.json").is_file()

    rm = retrain.launch_retrain(
        runner,
        "reward_model",
        "base",
        base_model=str(tiny_model_dir),
        run_name="rm-votes",
        extra_overrides=tiny(tiny_model_dir),
    )
    assert wait_done(runner, rm) == 0
    summary = log_summary(rm)
    # the identical pair is left out and counted, as DPO's loader does
    assert summary["train_pairs"] == 5 and summary["skipped_pairs"] == 1
    assert summary["steps"] == 2  # 5 usable pairs x 2 epochs / 5 a step
    assert (rm / "reward" / "adapter_config.json").is_file() and watch.RunWatch(rm).poll().state == "finished"
    append_jsonl(votes, record)  # a later vote
    assert snapshot.read_text() != votes.read_text()
    with pytest.raises(LorarlError, match="already exists"):  # nothing overwritten
        retrain.launch_retrain(runner, "dpo", "g1/policy", run_name="dpo-votes", extra_overrides=extra)
    assert len(snapshot.read_text().splitlines()) == 6

    def refuse(recipe, name, overrides):
        raise LorarlError("a run is live")

    with pytest.raises(LorarlError, match="a run is live"):  # a refused launch leaves no folder behind
        retrain.launch_retrain(runner, "dpo", "g1/policy", run_name="refused", launch=refuse)
    assert not (runs / "refused").exists()


def test_export_with_gate_figures(grpo_run):
    runs = grpo_run["runs"]
    result = exporting.export_with_gate(
        "g1", "adapter", "g1-adapter", runs_dir=runs, consent=CodeConsent(), gate_n=4, gate=1.0
    )
    out = runs / "exports" / "g1-adapter"
    assert result["out"] == str(out) and (out / "adapter_config.json").is_file()
    written = json.loads((out / "gate.json").read_text())
    assert result["gate"]["greedy_agreement"] == written["greedy_agreement"] == 1.0
    assert result["gate"]["prompts"] == written["prompts"] == 4 and result["gate"]["passed"] is True
    assert result["gate"]["logprob_max_abs_delta"] == written["logprob_max_abs_delta"] < 1e-4
    assert result["summary"].startswith("greedy agreement 100.0% (4/4) for adapter")
    assert result["step"] == STEPS and "gate.json" in result["files"]
    with pytest.raises(LorarlError, match="already exists"):
        exporting.export_with_gate("g1", "adapter", "g1-adapter", runs_dir=runs, consent=CodeConsent(), gate_n=4)
    for args, why in {
        ("g1", "verl", "x"): "must be one of merged, adapter, gguf",
        ("g1", "merged", "../x"): "export name",
        ("../g1", "merged", "x"): "'..'",
        ("/tmp", "merged", "x"): "outside",
    }.items():
        with pytest.raises(LorarlError, match=why):
            exporting.export_with_gate(*args, runs_dir=runs, consent=CodeConsent(), gate_n=4)
    assert sorted(p.name for p in (runs / "exports").iterdir()) == ["g1-adapter"]


# ---------------------------------------------------------------------------------------------------------------
# Review fixes: unreadable folders, pipeline stages, health rows, judge / remote weights, dead-end launches,
# relative recipe paths on resume, export failures, the loopback rule, the shipped recipes always offered
# ---------------------------------------------------------------------------------------------------------------


def test_one_unreadable_run_folder_hides_nothing_else(tmp_path):
    runs = tmp_path / "runs"
    for name in ("good", "broken"):
        (runs / name).mkdir(parents=True)
    (runs / "good" / "metrics.jsonl").write_text(_row(1))
    (runs / "broken" / "state.json").write_text("{not json")
    listed = {r.name: r for r in watch.list_runs(runs)}
    assert set(listed) == {"good", "broken"}
    assert listed["broken"].state == "unreadable" and listed["good"].state == "new"
    v = watch.RunWatch(runs / "broken").poll()  # the Watch tab shows why instead of failing
    assert v.state == "unreadable" and "state.json: not valid JSON" in v.error and not v.resumable
    with pytest.raises(LorarlError, match="state.json: not valid JSON"):
        jobs.JobRunner(runs, [SHIPPED]).resume("broken")
    # train.pid removed between the listing of a folder's files and their stat (a run ending): skipped
    assert watch._mtime([runs / "good" / "metrics.jsonl", runs / "good" / "train.pid"]) > 0


def test_health_warnings_come_from_the_metrics_rows_too(tmp_path):
    run = tmp_path / "terminal"  # a run from a terminal: no train.log
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        _row(1) + _row(2, **{"health/warning": "no signal: all rewards equal | adapter not learning: x"}) + _row(3)
    )
    want = ["step 2: health: no signal: all rewards equal", "step 2: health: adapter not learning: x"]
    w = watch.RunWatch(run)
    assert w.poll().warnings == want
    # the same warning in train.log (a run launched from the page) is shown once, in step order
    (run / "train.log").write_text("step 1: health: kl high\nstep 2: health: no signal: all rewards equal\n")
    assert w.poll().warnings == ["step 1: health: kl high", *want]


def test_pipeline_stages_count_for_the_one_job_rule_and_show_in_watch(tmp_path):
    from test_run_control import lorarl_sleeper

    from lorarl import runstate

    runs = tmp_path / "runs"
    stage = runs / "pipe" / "01-rl"
    stage.mkdir(parents=True)
    (runs / "pipe" / "pipeline.yaml").write_text("stages: []\n")
    (stage / "recipe.yaml").write_text("algo: grpo\ntrain: {steps: 9}\n")
    (runs / "notpipe" / "sub").mkdir(parents=True)
    live = lorarl_sleeper(new_session=True)  # a run has its own process group; Stop checks it
    try:
        info = {"pid": live.pid, "host": os.uname().nodename, "proc_start": runstate.proc_start_ticks(live.pid)}
        info["pgid"] = live.pid
        (stage / "train.pid").write_text(json.dumps(info))
        runstate.write_state(stage, "running", 3, 9)
        runner = jobs.JobRunner(runs, [SHIPPED])
        assert runner.live() == stage  # (a pipeline from a terminal: named once, then a second press goes ahead)
        with pytest.raises(LorarlError, match=f"run pipe/01-rl: its train.pid names pid {live.pid}, "):
            runner.launch(str(QUICKSTART), "other", [])
        listed = watch.list_runs(runs)
        assert [(r.name, r.state, r.step, r.last_step) for r in listed] == [("pipe/01-rl", "running", 3, 9)]
        assert paths.checked_run("pipe/01-rl", runs) == stage
        with pytest.raises(LorarlError, match="stage of a pipeline"):
            paths.checked_run("notpipe/sub", runs)
        assert watch.RunWatch(stage, "pipe/01-rl").poll().run == "pipe/01-rl"
        with pytest.raises(LorarlError, match="not stopped: .* which this workbench did not start"):
            runner.stop("pipe/01-rl")  # it signals only the processes it started
        assert live.poll() is None
        live.kill()
        live.wait()
        runstate.write_state(stage, "stopped", 3, 9)
        with pytest.raises(LorarlError, match="stage of pipeline pipe; resume the pipeline"):
            runner.resume("pipe/01-rl")
        assert not watch.RunWatch(stage).poll().resumable
    finally:
        live.kill()
        live.wait()


def remote_recipe(folder: Path) -> Path:
    text = QUICKSTART.read_text().replace(
        "    - name: numeric_match\n      weight: 1.0\n",
        "    - name: numeric_match\n      weight: 1.0\n    - name: remote\n      weight: 0.5\n"
        "      remote: {url: 'http://127.0.0.1:9/score', retries: 0}\n",
    )
    path = folder / "remote.yaml"
    path.write_text(text)
    return path


def test_a_remote_rewards_weight_may_change_its_settings_may_not(tmp_path):
    path = remote_recipe(tmp_path)
    overrides, errors = recipes.validate(path, {"reward.functions.1.weight": "0.25"})
    assert errors == {} and len(overrides) == 1
    jobs.check_overrides(path, overrides)  # the remote section rides along unchanged: allowed
    r = load_recipe(path, overrides)
    assert [(f.name, f.weight) for f in r.reward.functions] == [("numeric_match", 1.0), ("remote", 0.25)]
    assert r.reward.functions[1].remote.url == "http://127.0.0.1:9/score"
    moved = overrides[0].replace("127.0.0.1:9", "evil.example:80")
    with pytest.raises(LorarlError, match="only the weights"):
        jobs.check_overrides(path, [moved])


def test_resume_source_prefers_the_launch_recipe_unless_it_changed(tmp_path):
    rdir, runs = tmp_path / "recipes", tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    rdir.mkdir()
    recipe = rdir / "mine.yaml"
    recipe.write_text(QUICKSTART.read_text())
    run = runs / "r"
    jobs.write_launch(run, recipe, ["train.steps=5"])
    # launched, no recipe.yaml yet (stopped while loading): the launch's recipe and overrides
    assert jobs.resume_source(run, [rdir], runs) == (recipe, ["train.steps=5"], Path.cwd())
    import yaml

    from lorarl.config import recipe_to_dict

    saved = yaml.safe_dump(recipe_to_dict(load_recipe(recipe, ["train.steps=5"])), sort_keys=False)
    (run / "recipe.yaml").write_text(saved)  # as the run loop writes it
    assert jobs.resume_source(run, [rdir], runs)[:2] == (recipe, ["train.steps=5"])
    edited = QUICKSTART.read_text().replace("learning_rate: 3.0e-4", "learning_rate: 1.0e-4")
    assert edited != QUICKSTART.read_text()
    recipe.write_text(edited)  # edited since the launch: the run's own copy is the recipe it trains
    assert jobs.resume_source(run, [rdir], runs)[:2] == (run / "recipe.yaml", [])
    jobs.write_launch(run, tmp_path / "elsewhere.yaml", [])  # a launch record naming a file outside the folders
    assert jobs.resume_source(run, [rdir], runs)[:2] == (run / "recipe.yaml", [])


def test_stop_right_after_launch_then_relaunch_and_resume_with_relative_paths(tmp_path, tiny_model_dir):
    """A user recipe reading prompts.jsonl beside it: Stop before training leaves a folder Launch may reuse and
    Resume may start; a stopped run resumes with the path still found beside the original recipe."""
    rdir, runs = tmp_path / "mine", tmp_path / "runs"
    rdir.mkdir()
    runs.mkdir()
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    (rdir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = QUICKSTART.read_text().replace(
        "  source: arithmetic\n", "  source: prompts.jsonl\n  eval_source: prompts.jsonl\n"
    )
    (rdir / "rel.yaml").write_text(text)
    overrides = [o for o in grpo_overrides(tiny_model_dir) if not o.startswith("data.")] + ["train.steps=12"]
    runner = jobs.JobRunner(runs, [rdir])
    run = runner.launch(str(rdir / "rel.yaml"), "rel", overrides)
    message = runner.stop("rel")  # the process is still importing: terminated, nothing to save
    assert "had not started training yet" in message and runner.returncode(run) is not None
    state = json.loads((run / "state.json").read_text())
    assert (state["state"], state["step"], state["last_step"]) == ("stopped", 0, 12)
    assert watch.RunWatch(run).poll().resumable
    # the name is not a dead end: Launch may reuse it (the folder holds no run yet), with a fresh train.log
    assert jobs.is_unstarted(run)
    run = runner.launch(str(rdir / "rel.yaml"), "rel", overrides)
    assert (run / jobs.LOG_FILE).read_text().count("$ ") == 1
    wait_for(lambda: (read_metrics(run) or [{}])[-1].get("step", 0) >= 1)
    assert "asked run rel to stop" in runner.stop("rel")
    assert wait_done(runner, run) == 0
    k = watch.RunWatch(run).poll().progress.step
    assert watch.RunWatch(run).poll().state == "stopped" and 1 <= k < 12
    saved = load_recipe(run / "recipe.yaml", strict=False)
    assert saved.data.source == "prompts.jsonl"  # relative: not found beside RUN/recipe.yaml
    runner.resume("rel")
    assert wait_done(runner, run) == 0, (run / jobs.LOG_FILE).read_text()[-2000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    assert f"train {rdir / 'rel.yaml'} --out {run} --resume" in (run / jobs.LOG_FILE).read_text()


def test_two_apps_launching_at_the_same_moment_start_one_run(tmp_path, tiny_model_dir):
    """Two runners on one runs folder (two app processes, say) launching at once: the launch lock and the pid the
    launcher writes the moment its child starts let exactly one through; the other is refused naming it."""
    import threading

    runs = tmp_path / "runs"
    runs.mkdir()
    runners = {"a1": jobs.JobRunner(runs, [SHIPPED]), "a2": jobs.JobRunner(runs, [SHIPPED])}
    gate, results = threading.Barrier(2), {}

    def go(name: str) -> None:
        gate.wait()
        try:
            results[name] = runners[name].launch(str(QUICKSTART), name, grpo_overrides(tiny_model_dir))
        except LorarlError as e:
            results[name] = e

    threads = [threading.Thread(target=go, args=(n,)) for n in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    started = [n for n, r in results.items() if isinstance(r, Path)]
    refused = [n for n, r in results.items() if isinstance(r, LorarlError)]
    assert len(started) == 1 and len(refused) == 1, results
    assert str(results[refused[0]]).startswith(f"run {started[0]}: its train.pid names pid ")
    assert not (runs / refused[0]).exists()
    run, runner = results[started[0]], runners[started[0]]
    assert live_pid(run) == runner._procs[run].pid  # live before the child has loaded anything
    assert "had not started training yet" in runner.stop(started[0])
    assert runner.returncode(run) is not None and live_pid(run) is None and not (run / "train.pid").exists()
    assert jobs.is_unstarted(run)  # the name may be launched again


def test_a_run_killed_while_loading_shows_as_failed_with_its_log(tmp_path, tiny_model_dir):
    """Killed before it wrote any state (the OOM killer while the model loads, say): no error line, no state.json,
    yet Watch says failed, why it cannot tell more, and shows the log's last lines; the name may be launched again."""
    import signal

    runs = tmp_path / "runs"
    runs.mkdir()
    runner = jobs.JobRunner(runs, [SHIPPED])
    run = runner.launch(str(QUICKSTART), "killed", grpo_overrides(tiny_model_dir))
    os.kill(runner._procs[run].pid, signal.SIGKILL)
    assert wait_done(runner, run) == -signal.SIGKILL
    v = watch.RunWatch(run).poll()
    assert v.state == "failed" and v.error == watch.ENDED_EARLY and v.crash_lines
    assert v.crash_lines[0].split("$ ", 1)[1].split()[1:4] == ["-m", "lorarl.cli", "train"]
    assert jobs.is_unstarted(run)


def test_an_export_that_fails_unexpectedly_gives_one_line(tmp_path, monkeypatch):
    import lorarl.export

    runs = tmp_path / "runs"
    (runs / "r").mkdir(parents=True)

    def broken(*args, **kwargs):
        raise RuntimeError("convert_hf_to_gguf.py exited with 1\nTraceback ...")

    monkeypatch.setattr(lorarl.export, "export", broken)
    monkeypatch.setattr(exporting, "export_code", lambda *a, **k: None)  # (r holds no adapter: nothing to list)
    with pytest.raises(LorarlError, match=r"^export of r as gguf failed: RuntimeError: convert_hf_to_gguf.py exited"):
        exporting.export_with_gate("r", "gguf", "out", runs_dir=runs, consent=CodeConsent())


def test_the_workbench_serves_on_loopback_only(tmp_path, capsys):
    from lorarl.chat.app import check_host, launch
    from lorarl.cli import main

    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_host(host, workbench=True)
    for host in ("0.0.0.0", "::", "192.168.1.5", "my-box.local"):
        with pytest.raises(LorarlError, match="pass --chat-only"):
            check_host(host, workbench=True)
        check_host(host, workbench=False)  # the chat alone may (with a warning)
    with pytest.raises(LorarlError, match="share link"):
        check_host("127.0.0.1", workbench=True, share=True)
    # refused before anything loads: a model that does not exist is never looked at
    with pytest.raises(LorarlError, match="--host 0.0.0.0"):
        launch(tmp_path, host="0.0.0.0", model=str(tmp_path / "no-model"), workbench=True)
    assert main(["chat", "--runs", str(tmp_path), "--host", "0.0.0.0", "--model", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lorarl: error: --host 0.0.0.0: the workbench")


def test_user_recipe_folders_add_to_the_shipped_ones(tmp_path, tiny_model_dir):
    from lorarl.chat.app import build_app
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "own.yaml").write_text(QUICKSTART.read_text())
    assert paths.recipe_folders([mine, SHIPPED]) == [SHIPPED.resolve(), mine.resolve()]
    runs = tmp_path / "runs"
    runs.mkdir()
    cfg = ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    demo = build_app(runs, shared=SharedBase.load(cfg), workbench=True, recipe_dirs=[mine])
    wb = demo.lorarl_session.workbench
    assert wb.recipe_dirs == [SHIPPED.resolve(), mine.resolve()]
    offered = {Path(path).name for _, path in wb.recipe_choices()}
    assert {"own.yaml", "grpo_arithmetic.yaml", "dpo.yaml"} <= offered
    assert retrain._recipe_file("dpo", wb.runner.recipe_dirs) == SHIPPED.resolve() / "dpo.yaml"
