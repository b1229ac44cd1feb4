"""What the workbench's pages say, as pure functions of a run folder's files and a recipe (issue 43): a finished
run's held-out result and total time, why an empty curve is empty, what Stop will do and what it did, what
``eval.every`` 0 means for each algorithm, the cost block (one figure per resource, a time estimate, a GPU
recipe's warning on a CPU), the completions table (the user's turn, identical rows folded), Check catching what
Launch would fail on. No model, no browser: seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.algos.loop import eval_due
from lorarl.app import live, results
from lorarl.app.cost import Cost, cost_markdown, recipe_costs
from lorarl.app.preflight import preflight
from lorarl.app.recipes import eval_every_label, fields_for, recipe_header
from lorarl.app.views import completion_rows, user_turn
from lorarl.app.watch import SERIES, RunWatch

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def _run(tmp_path: Path, rows: list[dict], recipe: dict | None = None, **files) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "recipe.yaml").write_text(json.dumps(recipe or {"algo": "grpo", "grpo": {"kl": {"coef": 0.0}}}))
    for name, data in files.items():
        (run / name.replace("__", ".")).write_text(json.dumps(data))
    return run


# ---- a finished run's result -----------------------------------------------------------------------------------
def test_a_finished_run_shows_its_heldout_result_training_figures_and_total_time(tmp_path):
    from lorarl.runstate import write_state

    rows = [{"step": s, "reward": 0.1 * s, "step_time": 10.0 + s, "kl": None} for s in (1, 2)]
    summary = {"reward_last10": 0.15, "accuracy_last10": 0.5, "wall_s": 95.4, "steps": 2, "steps_this_run": 2}
    run = _run(
        tmp_path,
        rows,
        eval_base__json={"n": 200, "accuracy": 0.225},
        eval_trained__json={"n": 200, "accuracy": 0.77},
        summary__json=summary,
    )
    write_state(run, "finished", 2, 2)
    view = RunWatch(run).poll()
    assert view.result == (
        "**Result** · held-out accuracy (greedy, 200 examples): base 22.5% → trained 77.0% · training batches, "
        "last 10 steps: reward 0.150, accuracy 50.0% · total time 1m35s (one process, model loading included)"
    )
    # the empty curves, each with why: no evaluation during training (GRPO, eval.every 0), KL off (kl.coef 0)
    assert view.empty["held-out accuracy"] == (
        "no held-out evaluation during training (eval.every is 0); the result line above has the run's held-out figures"
    )
    assert view.empty["KL"] == "not computed: grpo.kl.coef is 0 (the reference model never runs)"
    assert view.empty["entropy"] == "a grpo run does not log it (entropy)"
    assert set(view.empty) == set(SERIES) - {"reward", "step time (s)"}


def test_heldout_and_time_lines_from_what_a_run_has():
    rows = [{"step": 1, "eval/accuracy": 0.4, "step_time": 3.0, "time/evaluation": 2.0}, {"step": 2, "step_time": 5.0}]
    rows.append({"step": 3, "eval/accuracy": 0.625, "step_time": 4.0, "time/evaluation": 2.0})
    assert results.heldout_line({}, rows) == "held-out eval/accuracy: 40.0% at step 1 → 62.5% at step 3 (2 evaluations)"
    trained_only = {"eval.json": {"n": 50, "accuracy": 0.5}}
    assert results.heldout_line(trained_only, []).startswith("held-out accuracy (greedy, 50 examples): trained 50.0%")
    assert results.heldout_line({}, [{"step": 1, "reward": 1}]) is None
    # resumed (two processes): the steps and evaluations, 3 + 5 + 4 + 2 + 2 = 16 s; a row missing: no figure
    resumed = {"wall_s": 9.0, "steps": 3, "steps_this_run": 1}
    assert (
        results.time_line(resumed, rows, 3)
        == "total time 0m16s in steps and evaluations (resumed: loading not counted)"
    )
    assert results.time_line(resumed, rows[:2], 3) is None
    assert results.format_seconds(3725) == "1h02m" and results.format_seconds(75) == "1m15s"


def test_empty_reasons_follow_the_recipe():
    rows = [{"step": 1, "reward": 0.5}]
    dpo = {"algo": "dpo", "eval": {"every": 0}}
    assert results.empty_reason("held-out accuracy", SERIES["held-out accuracy"], dpo, rows, True) == (
        "evaluated at the last step only (eval.every is 0)"
    )
    every = {"algo": "grpo", "eval": {"every": 5}, "grpo": {"kl": {"coef": 0.04}}}
    assert results.empty_reason("held-out accuracy", ("eval/accuracy",), every, rows, False) == (
        "the first held-out evaluation comes at step 5 (eval.every 5)"
    )
    assert results.empty_reason("KL", ("kl",), every, [{"step": 1, "kl": None}], False) == (
        "kl is logged but never a number (not computed in this run)"
    )
    assert results.empty_reason("KL", ("kl",), every, [], False) == "no step logged yet"


# ---- eval.every: the label says what the loop does -------------------------------------------------------------
@pytest.mark.parametrize("algo", ["grpo", "ppo", "sft", "dpo", "reward_model", "online_dpo", "rejection_sampling"])
def test_the_eval_every_label_says_what_zero_does_in_the_loop(algo):
    from lorarl.algos import algorithm_class

    label = eval_every_label(algo)
    evaluates_at_end = eval_due(0, 10, 10, algorithm_class(algo).final_eval)  # what the run loop does with 0
    assert label.endswith(
        "(0: only at the last step)" if evaluates_at_end else "(0: no held-out evaluation during training)"
    )
    assert (algo in ("dpo", "reward_model", "online_dpo")) == evaluates_at_end


def test_the_quickstart_field_no_longer_promises_an_evaluation_at_the_end():
    (field,) = [f for f in fields_for(RECIPES / "grpo_arithmetic.yaml") if f.key == "eval.every"]
    assert field.label == "evaluate every N steps (0: no held-out evaluation during training)"


# ---- Stop: what it will do, what it did ---------------------------------------------------------------------------
def test_stop_forecast_and_outcome():
    gen = {"step": 3, "phase": "generation", "phase_started": 0.0}
    assert live.stop_forecast(gen, 2) == (
        "it was generating step 3: step 3 is abandoned; the run stops with a checkpoint of step 2; Resume runs step 3 "
        "again"
    )
    assert live.stop_forecast({"step": 1, "phase": "training"}, 0).startswith(
        "it was past generation in step 1 (training): step 1 finishes, a checkpoint of it is saved"
    )
    both = live.stop_forecast(None, 0)
    assert both.startswith("if step 1 is still generating, step 1 is abandoned; the run stops with nothing saved")
    assert "if it is past generation, step 1 finishes" in both
    # the loop's own lines (lorarl.algos.loop), as train.log holds them
    abandoned = "step 2: stop requested during generation: step abandoned; checkpoint of step 1; `--resume` continues"
    assert live.stop_outcome(["x", abandoned], 1) == (
        "Stop came while step 2 generated: the step was abandoned (checkpoint of step 1); Resume runs step 2 again"
    )
    saved = "step 1: stop requested: checkpoint saved; `lorarl train --resume` continues"
    assert live.stop_outcome([saved], 1).startswith("Stop came during step 1: it finished and a checkpoint of step 1")
    assert (
        live.stop_outcome([], 4) == "stopped after step 4"
        and live.stop_outcome([], 0) == "stopped before its first step"
    )


def test_inside_a_step():
    info = {"step": 3, "phase": "generation", "phase_started": 100.0, "tokens": 57, "max_tokens": 96}
    rows = [
        {"step": 1, "time/generation": 10.0},
        {"step": 2, "time/generation": 14.0},
        {"step": 3, "time/generation": 20},
    ]
    assert live.inside_step(info, rows, now=112.0) == "step 3: generation, 57/96 tokens, 12 s (14 s per step so far)"
    assert live.inside_step({"step": 1, "phase": None}, []) == "step 1: starting"
    training = {"step": 2, "phase": "training", "phase_started": 100.0, "micro_batch": 3, "micro_batches": 4}
    assert live.inside_step(training, [], now=105.0) == "step 2: training, micro-batch 3/4, 5 s"
    assert live.inside_step(None, rows) == ""


# ---- the cost block ---------------------------------------------------------------------------------------------
def test_cost_lines_of_the_shipped_recipes():
    quick = recipe_costs(recipe_header(RECIPES / "grpo_arithmetic.yaml"))
    assert quick == [Cost("cpu", "2 shared cores, as measured above", (13.0, 13.0), 5.2, True)]
    agent = recipe_costs(recipe_header(RECIPES / "agent_multiply_grpo.yaml"))
    assert agent[0].step_s == (180.0, 600.0) and agent[0].peak_gb == 8.7
    (gsm,) = recipe_costs(recipe_header(RECIPES / "grpo_gsm8k.yaml"))
    assert gsm.device == "cuda" and gsm.rss is False
    # every recipe's memory line agrees with its header's own Memory figure (one figure per resource)
    for name, gb in (("grpo_arithmetic", 5.2), ("agent_multiply_grpo", 8.7), ("ppo", 2.2), ("reward_model", 7.0)):
        (c,) = [c for c in recipe_costs(recipe_header(RECIPES / f"{name}.yaml")) if c.device == "cpu"]
        assert c.peak_gb == gb, name


def test_cost_block_names_one_figure_per_resource_and_warns_for_a_gpu_recipe_on_a_cpu():
    cpu = recipe_costs(recipe_header(RECIPES / "agent_multiply_grpo.yaml"))
    kw = dict(device="cpu", machine="CPU only (2 cores)", planner="plan: the planner's tensor peak 5.07 GB (...)")
    block = cost_markdown(cpu, steps=6, changed=["grpo.group_size"], model="smollm2-135m", **kw)
    assert "- memory: 8.7 GB peak RSS measured on cpu (2 busy cores, as measured above): the recipe's header" in block
    assert "5.07" not in block  # the planner's contradicting figure is not shown beside the measured one
    assert "- time: about 18m00s-1h00m for 6 steps (180-600 s/step measured on cpu" in block
    assert block.count("; measured at the recipe's own sizes: your grpo.group_size change the step's size") == 2
    gpu = cost_markdown(
        recipe_costs(recipe_header(RECIPES / "grpo_gsm8k.yaml")), steps=500, changed=[], model="Q", **kw
    )
    assert "⚠ **meant for a CUDA GPU** (24 GB, planned, not measured); this machine has none" in gpu
    assert "- memory: the planner's tensor peak 5.07 GB" in gpu and "no step time measured on cpu" in gpu


# ---- the completions table -------------------------------------------------------------------------------------
def test_completions_show_the_users_turn_and_fold_identical_rows():
    chatml = (
        "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nWhat is 25 + 25?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert user_turn(chatml) == "What is 25 + 25?"
    llama3 = (
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    )
    assert user_turn(llama3) == "Hi there" and user_turn("plain prompt ") == "plain prompt"
    rows = [{"step": 1, "prompt": chatml, "completion": "50", "reward": 1.0, "advantage": 0.5}] * 3
    rows += [{"step": 1, "prompt": chatml, "completion": "49", "reward": 0.0, "advantage": -1.0}]
    rows += [{"step": 2, "prompt": chatml, "completion": "50", "reward": 1.0, "advantage": 0.0}]
    assert completion_rows(rows) == [
        [2, 1.0, 0.0, 1, "What is 25 + 25?", "50"],
        [1, 0.0, -1.0, 1, "What is 25 + 25?", "49"],
        [1, 1.0, 0.5, 3, "What is 25 + 25?", "50"],
    ]


# ---- Check catches what Launch would fail on ---------------------------------------------------------------------
def test_preflight_names_missing_adapters_files_and_columns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipes' relative adapter paths resolve from here: none exist
    errors, _ = preflight(RECIPES / "ppo.yaml")
    assert errors == {
        "reward.adapter": "reward adapter runs/reward_model: no such folder (train one with `lorarl train "
        "recipes/reward_model.yaml`)"
    }
    errors, _ = preflight(RECIPES / "online_dpo.yaml")
    assert set(errors) == {"reward.adapter", "model.init_adapter"}
    assert preflight(RECIPES / "grpo_arithmetic.yaml") == ({}, [])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    errors, _ = preflight(RECIPES / "grpo_arithmetic.yaml", [f"data.source={prompts}"])
    assert errors["reward.functions"].startswith(
        "reward numeric_match reads the column 'answer', which the data has not"
    )
    errors, _ = preflight(RECIPES / "rloo_arithmetic.yaml", [f"data.source={prompts}"])  # RLOO samples too
    assert errors["reward.functions"].startswith("reward numeric_match reads the column 'answer'")
    errors, _ = preflight(RECIPES / "grpo_arithmetic.yaml", [f"data.source={tmp_path / 'gone.jsonl'}"])
    assert "gone.jsonl" in errors["data.source"]
    _, notes = preflight(RECIPES / "grpo_gsm8k.yaml")
    assert notes == ["data.source openai/gsm8k is read when the run starts (not checked here)"]
