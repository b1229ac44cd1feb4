"""Every argument TRL 1.16's GRPOTrainer passes a reward function (issue 40, item 1) and the failure policy for
reward functions that fail on every row (issue 42, item 6).

* ``trainer_state`` (transformers' TrainerState: global_step, epoch, max_steps), ``log_metric`` (averaged per step,
  in metrics.jsonl), ``log_extra`` (a column of completions.jsonl) and ``environments`` (the rollout's environment
  instances, in row order, open while the reward runs) through the three doors: ``lorarl.trl.GRPOTrainer``, a YAML
  recipe run by ``lorarl train`` and ``lorarl.train``.
* A function that fails (or is not finite in float32) on every call of two steps in a row stops the run with one line
  naming it and its first error (exit 2); a run that ends with such a function having failed on all of its steps
  does not end as a success; pure tests of the rule and of the helpers against hand-computed values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import trl
import yaml
from peft import LoraConfig

from lorarl.algos.grpo_sampling import select_columns
from lorarl.cli import main as cli_main
from lorarl.errors import LorarlError
from lorarl.rewards.call_args import RewardLog, add_logged, new_trainer_state, pool_sums, set_steps_done
from lorarl.rewards.failures import FailureStreaks, check_failure_budget
from lorarl.runs import read_metrics
from lorarl.user_code import load_object

# reward functions in TRL's signature; each writes what it was handed to $REWARD_RECORD (one JSON line per call)
REWARDS = '''
import json
import os


def _record(**entry):
    with open(os.environ["REWARD_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


def curriculum(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """0, 1, 0, 1, ... ; logs the step it was told, two values of `half`, a `reward` metric and two columns."""
    _record(kind="state", global_step=trainer_state.global_step, max_steps=trainer_state.max_steps,
            epoch=trainer_state.epoch, num_train_epochs=trainer_state.num_train_epochs,
            cls=type(trainer_state).__name__, state_id=id(trainer_state), n=len(completions))
    values = [float(i % 2) for i in range(len(completions))]
    log_metric("curriculum/global_step", trainer_state.global_step)
    log_metric("half", 1.0)
    log_metric("half", 2.0)
    log_metric("reward", 99.0)  # a name lorarl logs itself: logged as log_metric/reward
    log_extra("parity", ["odd" if v else "even" for v in values])
    log_extra("reward", ["mine"] * len(completions))  # a column the table has: log_extra/reward
    return values


def side_logger(prompts, completions, log_metric, **kwargs):
    """Applies to no row (None: not a failure); logs one more value of `half`: the step's mean is (1 + 2 + 4) / 3."""
    log_metric("half", 4.0)
    return [None] * len(completions)


class Board:
    """TRL's environment_factory convention: the tool sets the reward the reward function reads."""

    def __init__(self):
        self.reward, self.closed, self.tag = 0.0, False, None

    def reset(self, **row):
        self.tag = row["tag"]
        self.reward = 0.0

    def mark(self, value: int) -> str:
        """Mark the board.

        Args:
            value: the mark
        """
        self.reward = float(value)
        return "marked"

    def close(self):
        self.closed = True


SEEN_ENVS = []  # every instance env_reward was handed, to see it closed later


def env_reward(environments, **kwargs):
    """TRL's documented environment reward."""
    _record(kind="env", ids=[id(e) for e in environments], rewards=[e.reward for e in environments],
            closed=[e.closed for e in environments], tags=[e.tag for e in environments], column=kwargs["tag"],
            earlier_closed=[e.closed for e in SEEN_ENVS])
    SEEN_ENVS.extend(environments)
    return [env.reward for env in environments]


class Broken(Board):
    """An environment whose get_reward reads what no tool ever set."""

    def get_reward(self):
        return self.score


def boom(prompts, completions, **kwargs):
    raise RuntimeError("reward service down")


def huge(prompts, completions, **kwargs):
    return [1e300] * len(completions)  # finite in Python, inf in float32


def fine(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
'''

ROWS = [{"prompt": f"Say {w}", "answer": "1", "tag": w} for w in ("alpha", "beta", "gamma", "delta")]
STEPS = 3


@pytest.fixture()
def rewards_file(tmp_path, monkeypatch):
    f = tmp_path / "trl_rewards.py"
    f.write_text(REWARDS)
    monkeypatch.setenv("REWARD_RECORD", str(tmp_path / "record.jsonl"))
    return f


def records(tmp_path: Path, kind: str) -> list[dict]:
    path = tmp_path / "record.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["kind"] == kind]


# ---- the three doors -------------------------------------------------------------------------------------------


def via_trl(model_dir, out, fns, *, steps=STEPS, env=None, max_completion_length=4):
    """lorarl.trl.GRPOTrainer with TRL's config: 2 prompts x 2 completions per step."""
    from lorarl.trl import GRPOTrainer

    args = trl.GRPOConfig(
        output_dir=str(out), bf16=False, max_steps=steps, num_generations=2, per_device_train_batch_size=4,
        max_completion_length=max_completion_length, learning_rate=1e-3, report_to="none", log_completions=True,
        num_completions_to_print=4, max_tool_calling_iterations=1, logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=fns,
        args=args,
        train_dataset=list(ROWS),
        eval_dataset=ROWS[:2],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        environment_factory=env,
    )
    trainer.train()
    return trainer


def recipe_dict(model_dir, *, steps=STEPS, max_new_tokens=4) -> dict:
    return {
        "algo": "grpo",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "generation": {"max_new_tokens": max_new_tokens},
        "train": {"steps": steps, "prompts_per_step": 2, "micro_batch_size": 4, "learning_rate": 1e-3},
        "grpo": {"group_size": 2},
        "health": {"parity_every": 0},
        "eval": {"n": 2, "batch_size": 2},
    }


def via_recipe(model_dir, out, names, *, steps=STEPS, env=None, max_new_tokens=4) -> int:
    """A YAML recipe naming the functions as file.py:function, run by `lorarl train` (its exit code)."""
    data = out.parent / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = recipe_dict(model_dir, steps=steps, max_new_tokens=max_new_tokens)
    recipe["data"] = {"source": str(data), "eval_source": str(data)}
    recipe["reward"] = {"functions": [{"name": n} for n in names]}
    if env:
        recipe["agent"] = {"environment": env, "max_turns": 2, "max_tokens_per_turn": 48}
    path = out.parent / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return cli_main(["train", str(path), "--out", str(out)])


def via_api(model_dir, out, fns, *, steps=STEPS, env=None, max_new_tokens=4):
    """lorarl.train with callables and a list of rows."""
    import lorarl

    recipe = recipe_dict(model_dir, steps=steps, max_new_tokens=max_new_tokens)
    agent = {"agent": {"max_turns": 2, "max_tokens_per_turn": 48}} if env else {}
    lorarl.train(
        recipe, out, reward_funcs=fns, train_dataset=list(ROWS), environment_factory=env,
        progress=False, **agent,
    )  # fmt: skip


def run_door(door, model_dir, out, rewards_file, names, env=None, **kw):
    """Run the functions ``names`` of ``rewards_file`` (and the environment class ``env``) through ``door``."""
    if door == "recipe":
        code = via_recipe(
            model_dir, out, [f"{rewards_file}:{n}" for n in names], env=env and f"{rewards_file}:{env}", **kw
        )
        if code:
            raise LorarlError(f"lorarl train exited {code}")
        return
    fns = [load_object(f"{rewards_file}:{n}", "reward") for n in names]
    env_cls = load_object(f"{rewards_file}:{env}", "agent.environment") if env else None
    if door == "trl":
        if "max_new_tokens" in kw:
            kw["max_completion_length"] = kw.pop("max_new_tokens")
        return via_trl(model_dir, out, fns, env=env_cls, **kw)
    else:
        via_api(model_dir, out, fns, env=env_cls, **kw)


DOORS = ["trl", "recipe", "api"]


# ---- trainer_state, log_metric, log_extra ----------------------------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
def test_trainer_state_log_metric_and_log_extra_reach_the_run(door, tiny_model_dir, rewards_file, tmp_path):
    out = tmp_path / "run"
    trainer = run_door(door, tiny_model_dir, out, rewards_file, ["curriculum", "side_logger"])
    seen = records(tmp_path, "state")
    # TRL's TrainerState, one object for the run; global_step = the steps done when the step's completions are
    # scored (TRL's value at that point); epoch = steps done x 2 prompts / 4 rows
    assert [s["global_step"] for s in seen] == [0, 1, 2]
    assert {s["max_steps"] for s in seen} == {STEPS} and {s["cls"] for s in seen} == {"TrainerState"}
    assert [s["epoch"] for s in seen] == [0.0, 0.5, 1.0] and {s["num_train_epochs"] for s in seen} == {1.5}
    assert len({s["state_id"] for s in seen}) == 1 and {s["n"] for s in seen} == {4}
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["curriculum/global_step"] == r["step"] - 1
        assert r["half"] == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3: every value of the step, both functions
        assert r["log_metric/reward"] == 99.0 and r["reward"] == 0.5  # lorarl's own reward is kept: [0, 1, 0, 1]
        assert r["reward_failures"] == 0 and r["rewards/side_logger/mean"] is None
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    for s in samples:
        assert s["parity"] == ("odd" if s["reward"] == 1.0 else "even")
        assert s["log_extra/reward"] == "mine"
    assert [s["parity"] for s in samples[:4]] == ["even", "odd", "even", "odd"]
    assert (out / "policy" / "adapter_model.safetensors").is_file()
    if door == "trl":  # TRL's trainer.evaluate() after train(): the state has every step done; the logged metrics
        assert trainer.state.log_history[0]["half"] == pytest.approx(7 / 3)  # TRL's log_history has them too
        metrics = trainer.evaluate()
        assert records(tmp_path, "state")[-1]["global_step"] == STEPS
        assert metrics["eval_curriculum/global_step"] == STEPS and metrics["eval_half"] == pytest.approx(7 / 3)


# ---- environments ----------------------------------------------------------------------------------------------


class ScriptedEngine:
    """Turn 1 of row ``i``: a call of the environment's tool ``mark(value=i)``; turn 2: an answer."""

    name = "scripted"

    def sample(self, shared, prompts, group_size, generation, *, max_new_tokens=None, record_logprobs=False, **kw):
        from lorarl.rollout.engines import Sampled

        tok = shared.tokenizer
        rows = [p for p in prompts for _ in range(group_size)]
        outs = []
        for i, p in enumerate(rows):
            turn = tok.decode(p).count("<tool_response>\n")
            text = f'<tool_call>{{"name": "mark", "arguments": {{"value": {i}}}}}</tool_call>' if turn == 0 else "ok"
            outs.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        width = max(len(o) for o in outs)
        ids = torch.full((len(outs), width), shared.pad_id, dtype=torch.long)
        for i, o in enumerate(outs):
            ids[i, : len(o)] = torch.as_tensor(o)
        return Sampled(ids, torch.zeros(ids.shape) if record_logprobs else None)


@pytest.mark.parametrize("door", DOORS)
def test_environments_are_the_rollouts_instances_in_row_order(
    door, tiny_model_dir, rewards_file, tmp_path, monkeypatch
):
    """TRL's documented environment reward ``[env.reward for env in environments]``: each row's own instance (the
    one its tool call went to: row i marked i), reset with its dataset row (its tag is the row's `tag` column), open
    while the reward runs and closed after; the reward's values are the step's rewards."""
    monkeypatch.setattr("lorarl.agents.loop.make_engine", lambda name: ScriptedEngine())
    monkeypatch.setattr("lorarl.algos.grpo.parity_due", lambda every, step: False)  # scripted ids: no sampler log-probs
    out = tmp_path / "run"
    run_door(door, tiny_model_dir, out, rewards_file, ["env_reward"], env="Board", steps=2, max_new_tokens=48)
    seen = records(tmp_path, "env")
    assert len(seen) == 2  # one scoring call per step (no evaluation during training)
    for call in seen:
        assert call["rewards"] == [0.0, 1.0, 2.0, 3.0]  # row i's instance is the one row i's call marked
        assert len(set(call["ids"])) == 4 and not any(call["closed"])  # four instances, open while scored
        assert call["tags"] == call["column"] and call["tags"][0] == call["tags"][1]  # reset with its own row
        assert call["tags"][1] != call["tags"][2]  # 2 prompts x 2 completions
    assert seen[0]["earlier_closed"] == [] and seen[1]["earlier_closed"] == [True] * 4  # step 1's closed after it
    rows = read_metrics(out)
    assert [r["rewards/env_reward/mean"] for r in rows] == [1.5, 1.5] and [r["reward"] for r in rows] == [1.5, 1.5]
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["reward"] for s in samples[:4]] == [0.0, 1.0, 2.0, 3.0]


def test_an_environment_reward_without_an_environment_is_refused_at_set_up(tiny_model_dir, rewards_file, tmp_path):
    with pytest.raises(LorarlError, match=r"env_reward takes environments .* but the recipe has no agent.environment"):
        via_api(tiny_model_dir, tmp_path / "run", [load_object(f"{rewards_file}:env_reward", "reward")])
    assert records(tmp_path, "env") == []


# ---- a reward that always fails (issue 42, item 6) ---------------------------------------------------------------


def crashed(out: Path) -> bool:
    return json.loads((out / "state.json").read_text())["state"] == "crashed"


@pytest.mark.parametrize("door", DOORS)
def test_one_always_failing_reward_of_two_stops_the_run_at_its_second_step(
    door, tiny_model_dir, rewards_file, tmp_path, capsys
):
    """Before: 2 of 4 calls failed, 50%, not above the default 0.5: the run trained on `fine` alone for all its steps
    and exited 0. Now: stopped at step 2, before it trains, with one line naming the function and its first error."""
    out = tmp_path / "run"
    line = (
        "reward boom failed on every call of 2 steps in a row (steps 1-2; reward.max_failed_steps=2): "
        "RuntimeError: reward service down"
    )
    with pytest.raises(LorarlError) as e:
        run_door(door, tiny_model_dir, out, rewards_file, ["fine", "boom"], steps=5)
    if door == "recipe":
        assert str(e.value) == "lorarl train exited 2" and f"lorarl: error: {line}\n" in capsys.readouterr().err
    else:
        assert str(e.value) == line
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1] and rows[0]["reward_failures"] == 1
    assert crashed(out) and not (out / "policy").exists()


@pytest.mark.parametrize("door", ["trl", "recipe"])
def test_a_one_step_run_whose_reward_failed_on_every_row_does_not_end_as_a_success(
    door, tiny_model_dir, rewards_file, tmp_path, capsys
):
    """Before: 1-2 steps ended before the failure fraction could fire: nothing trained, state finished, exit 0."""
    out = tmp_path / "run"
    line = "reward boom failed on every call of the run's 1 step(s): none of its values was trained on; first error: "
    with pytest.raises(LorarlError) as e:
        run_door(door, tiny_model_dir, out, rewards_file, ["boom"], steps=1)
    text = str(e.value) if door == "trl" else capsys.readouterr().err
    assert line + "RuntimeError: reward service down" in text
    assert read_metrics(out)[0]["trained_rows"] == 0
    assert crashed(out) and not (out / "policy").exists()


@pytest.mark.parametrize("door", ["trl", "recipe"])
def test_a_reward_past_float32_is_a_named_failure_not_nan_advantages(
    door, tiny_model_dir, rewards_file, tmp_path, capsys
):
    """1e300: finite in Python, inf in float32. Before: NaN advantages, reward_failures 0, and the run stopped only
    by the non-finite-gradient guard blaming the learning rate. Now its values are failed values of `huge`, left out
    (step 1 trains on `fine` with finite numbers), and the run stops at step 2 naming `huge`."""
    out = tmp_path / "run"
    with pytest.raises(LorarlError) as e:
        run_door(door, tiny_model_dir, out, rewards_file, ["fine", "huge"], steps=5)
    err = capsys.readouterr()
    text = str(e.value) if door == "trl" else err.err
    assert (
        "reward huge failed on every call of 2 steps in a row (steps 1-2; reward.max_failed_steps=2): 4 of 4 values "
        "failed (returned 1e+300, not a finite float32)"
    ) in text
    assert (
        "step 1: reward huge failed (4 of 4 values failed (returned 1e+300, not a finite float32)); its values "
        "are left out" in err.out
    )
    (row,) = read_metrics(out)
    assert row["reward_failed_values"] == 4 and row["skipped_updates"] == 0
    assert math.isfinite(row["reward"]) and row["trained_rows"] > 0 and math.isfinite(row["loss"])


def test_an_environment_whose_get_reward_always_fails_stops_the_run(
    tiny_model_dir, rewards_file, tmp_path, capsys, monkeypatch
):
    """The environment as the only reward source (TRL's environment_factory without reward_funcs): a get_reward that
    raises on every row is held to the same rule, under the class name TRL gives it. Before: NaN rewards, nothing
    trained, exit 0."""
    monkeypatch.setattr("lorarl.agents.loop.make_engine", lambda name: ScriptedEngine())
    monkeypatch.setattr("lorarl.algos.grpo.parity_due", lambda every, step: False)
    out = tmp_path / "run"
    assert via_recipe(tiny_model_dir, out, [], env=f"{rewards_file}:Broken", steps=4, max_new_tokens=48) == 2
    err = capsys.readouterr()
    assert (
        "lorarl: error: reward Broken failed on every call of 2 steps in a row (steps 1-2; reward.max_failed_steps=2): "
        "4 of 4 values failed (get_reward raised AttributeError: 'Broken' object has no attribute 'score')\n"
    ) in err.err
    assert "step 1: reward Broken failed (4 of 4 values failed (get_reward raised AttributeError" in err.out
    assert [r["step"] for r in read_metrics(out)] == [1] and crashed(out)


# ---- pure: the rule, the budget and the helpers ------------------------------------------------------------------


def test_failure_streaks_by_hand():
    s = FailureStreaks(limit=2)
    # step 1: a fails its call, b has values, c returns only None (does not apply: not a failure)
    s.record({"a": 0, "b": 4, "c": 0}, {"a": "RuntimeError: x"})
    s.end_step(1)
    assert s.streak == {"a": 1, "b": 0, "c": 0}
    # step 2, two calls (dynamic sampling): a has a value in the second -> the step is not a failure
    s.record({"a": 0, "b": 4, "c": 0}, {"a": "RuntimeError: y"})
    s.record({"a": 1, "b": 4, "c": 0}, {"a": "1 of 4 values failed (returned NaN)"})
    s.end_step(2)
    assert s.streak == {"a": 0, "b": 0, "c": 0}
    s.record({"a": 0, "b": 4, "c": 0}, {"a": "ValueError: first"})
    s.end_step(3)
    state = s.state_dict()
    s.record({"a": 0, "b": 4, "c": 0}, {"a": "ValueError: second"})
    with pytest.raises(LorarlError, match=r"^reward a failed on every call of 2 steps in a row \(steps 3-4; "
                       r"reward.max_failed_steps=2\): ValueError: first$"):  # fmt: skip
        s.end_step(4)
    again = FailureStreaks(limit=2)  # a resumed run continues the streak
    again.load_state_dict(json.loads(json.dumps(state)))  # (through the checkpoint's JSON)
    again.record({"a": 0, "b": 1}, {"a": "ValueError: again"})
    with pytest.raises(LorarlError, match=r"steps 3-4"):
        again.end_step(4)
    again.load_state_dict(None)  # a checkpoint from before the rule
    assert again.streak == {} and again.steps == 0
    again.check_finished()


def test_check_finished_fires_only_for_a_function_that_failed_on_every_step():
    s = FailureStreaks(limit=3)
    s.record({"a": 0, "b": 2}, {"a": "RuntimeError: x"})
    s.end_step(1)
    s.record({"a": 0, "b": 2}, {"a": "RuntimeError: y"})
    s.end_step(2)
    with pytest.raises(LorarlError, match=r"^reward a failed on every call of the run's 2 step\(s\): none of its "
                       r"values was trained on; first error: RuntimeError: x$"):  # fmt: skip
        s.check_finished()
    ok = FailureStreaks(limit=3)
    ok.record({"a": 2}, {})
    ok.end_step(1)
    ok.record({"a": 0}, {"a": "RuntimeError: x"})
    ok.end_step(2)
    ok.check_finished()  # it had values in step 1
    off = FailureStreaks(limit=0)  # reward.max_failed_steps: 0: neither rule
    for step in (1, 2, 3):
        off.record({"a": 0}, {"a": "RuntimeError: x"})
        off.end_step(step)
    off.check_finished()


def test_failure_budget_by_hand():
    check_failure_budget(["a", "b"], 3, [0, 3], [3, 0], [0, 0], 0.5)  # 3 calls: not judged yet
    with pytest.raises(LorarlError, match=r"^reward b failed in 3 of its 4 calls \(75% > reward.max_failure_fraction"):
        check_failure_budget(["a", "b"], 4, [0, 3], [4, 1], [0, 0], 0.5)
    check_failure_budget(["a", "b"], 4, [2, 2], [4, 4], [2, 2], 0.5)  # 50% each: not above 0.5
    with pytest.raises(LorarlError, match=r"^reward a: 3 of its 4 values failed \(75% >"):
        check_failure_budget(["a"], 4, [0], [4], [3], 0.5)


def test_trainer_state_steps_done_by_hand():
    state = new_trainer_state(max_steps=10, per_step=4, logging_steps=2, save_steps=5, eval_steps=3)
    assert type(state).__name__ == "TrainerState" and (state.global_step, state.epoch, state.max_steps) == (0, 0, 10)
    set_steps_done(state, 3, 16)
    assert (state.global_step, state.epoch, state.num_train_epochs) == (3, 0.75, 2.5)
    assert (state.train_batch_size, state.logging_steps, state.save_steps, state.eval_steps) == (4, 2, 5, 3)


def test_reward_log_checks_what_it_is_given():
    log = RewardLog(3)
    log.log_metric("m", 1)
    log.log_metric("m", torch.tensor(2.0))
    log.log_extra("c", [1.5, float("nan"), object])
    assert log.metric_sums() == {"m": (3.0, 2)}
    assert log.columns["c"][:2] == [1.5, None] and log.columns["c"][2] == str(object)
    log.log_extra("c", ["x", "y", "z"])  # the same column again: replaced
    assert log.columns == {"c": ["x", "y", "z"]}
    with pytest.raises(ValueError, match=r"^log_extra\('c'\): 2 values for 3 completions$"):
        log.log_extra("c", [1, 2])
    with pytest.raises(TypeError, match=r"log_metric\('m'\): value must be a number, got str"):
        log.log_metric("m", "high")
    with pytest.raises(TypeError, match=r"name must be a non-empty string"):
        log.log_metric(3, 1.0)


def test_a_misused_log_extra_fails_that_functions_call_with_its_line():
    from lorarl.config import RewardSpec
    from lorarl.rewards import RewardScorer

    scorer = RewardScorer([RewardSpec(name="format"), RewardSpec(name="format")])
    scorer.fns[1] = lambda prompts, completions, log_extra, **kw: log_extra("x", [1]) or [1.0] * len(completions)
    s = scorer(["p", "q"], ["a", "b"])
    assert s.failures == {"format_1": "ValueError: log_extra('x'): 1 values for 2 completions"}
    assert s.usable() == [2, 0] and scorer.call_failures == [0, 1]


def test_helpers_by_hand():
    assert pool_sums({"a": (1.0, 1)}, {"a": (5.0, 2), "b": (1.0, 1)}) == {"a": (6.0, 3), "b": (1.0, 1)}
    row = {"reward": 1.0}
    assert add_logged(row, {"reward": 2.0, "step": 3, "hint": "x"}, "p/") == ["reward", "step"]
    assert row == {"reward": 1.0, "p/reward": 2.0, "p/step": 3, "hint": "x"}
    assert select_columns([{"a": [1, 2]}, {"b": [3, 4]}], [[1], [0, 1]]) == {"a": [2, None, None], "b": [None, 3, 4]}
