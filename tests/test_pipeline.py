"""Pipelines: the recipe format and its wiring (init adapters, the kept set, stage references, overrides, one
evaluation recipe); bad input named in one line before anything runs; a tiny SFT -> rejection sampling -> SFT ->
GRPO pipeline end to end, its summary table, and a resume that only redoes what was not finished (bit-identical)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import yaml

from lorarl.cli import main
from lorarl.errors import DataError, LorarlError
from lorarl.pipeline import load_pipeline, run_pipeline
from lorarl.pipeline.report import minutes, percent
from lorarl.runs import read_metrics

ALWAYS = "def one(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n"


def write_pipeline(folder, tiny_model_dir, stages: str, extra: str = "") -> str:
    (folder / "always.py").write_text(ALWAYS)
    text = textwrap.dedent(
        f"""
        defaults:
          model: {{name: {tiny_model_dir}, quantization: none, dtype: float32, gradient_checkpointing: false}}
          lora: {{r: 8, alpha: 16}}
          data: {{train_size: 32, eval_size: 8, arithmetic: {{operations: ["-"]}}}}
          generation: {{max_new_tokens: 6}}
          reward: {{functions: [{{name: numeric_match}}]}}
          train: {{learning_rate: 1.0e-2, micro_batch_size: 8}}
          eval: {{n: 4, batch_size: 4}}
        """
    )
    path = folder / "pipe.yaml"
    path.write_text(text + extra + "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  "))
    return str(path)


FOUR_STAGES = """
- name: cold_start
  algo: sft
  sft: {batch_size: 8}
  train: {steps: 2}
- name: rs
  algo: rejection_sampling
  reward: {functions: [{name: "ALWAYS:one"}]}
  rejection_sampling: {group_size: 4, min_reward: 1.0, drop_truncated: false, max_per_prompt: 2}
  train: {steps: 2, prompts_per_step: 4}
- name: rs_sft
  algo: sft
  train: {steps: 2}
- name: rl
  algo: grpo
  grpo: {group_size: 4, kl: {coef: 0.1}}
  train: {steps: 2, prompts_per_step: 2, save_every: 1, keep_last: 5}
"""


def four_stages(tmp_path) -> str:
    return FOUR_STAGES.replace("ALWAYS", str(tmp_path / "always.py"))


def test_wiring_of_stages(tiny_model_dir, tmp_path):
    (tmp_path / "grpo.yaml").write_text("algo: grpo\ngrpo: {group_size: 4}\ntrain: {steps: 3}\n")
    stages = four_stages(tmp_path) + textwrap.dedent(
        """
        - name: rm
          algo: reward_model
          data: {source: "pkg:prefs_arith_train.jsonl", eval_source: "pkg:prefs_arith_eval.jsonl"}
        - name: from_file
          recipe: grpo.yaml
          overrides: [train.prompts_per_step=3]
          reward: {source: both, adapter: "stage:rm"}
        - name: fresh
          algo: sft
          model: {init_adapter: null}
          data: {source: "stage:rs"}
        """
    )
    path = write_pipeline(tmp_path, tiny_model_dir, stages, "evaluation: {n: 3}\n")
    out = tmp_path / "out"
    pipe = load_pipeline(
        path, out, ["from_file.train.steps=7", "defaults.train.seed=5", "evaluation.eval.batch_size=2"]
    )
    by = {s.name: s for s in pipe.stages}
    assert [s.run_dir.name for s in pipe.stages] == [
        "01-cold_start",
        "02-rs",
        "03-rs_sft",
        "04-rl",
        "05-rm",
        "06-from_file",
        "07-fresh",
    ]
    init = {s.name: s.recipe.model.init_adapter for s in pipe.stages}
    assert init["cold_start"] is None  # nothing before it: a fresh adapter on the base
    assert init["rs"] == str(out / "01-cold_start" / "policy")  # samples with the policy so far
    assert init["rs_sft"] == str(out / "01-cold_start" / "policy")  # rejection sampling trains no policy
    assert init["rl"] == str(out / "03-rs_sft" / "policy")
    assert init["from_file"] == str(out / "04-rl" / "policy")  # the reward model stage trains no policy
    assert init["fresh"] is None  # model.init_adapter: null in the stage wins
    assert by["rs_sft"].recipe.data.source == str(out / "02-rs" / "dataset" / "train.jsonl")
    assert by["fresh"].recipe.data.source == str(out / "02-rs" / "dataset" / "train.jsonl")
    assert by["rl"].recipe.data.source == "arithmetic"
    assert by["from_file"].recipe.reward.adapter == str(out / "05-rm" / "reward")
    assert by["from_file"].recipe.train.steps == 7 and by["from_file"].recipe.train.prompts_per_step == 3
    assert by["from_file"].recipe.train.learning_rate == 1e-2  # defaults under the recipe file
    assert all(s.recipe.train.seed == 5 for s in pipe.stages)
    assert by["rm"].recipe.reward_model is not None and by["rm"].recipe.grpo is None
    # one evaluation recipe: the last stage that trains a policy (fresh), starting point = adapters off
    assert pipe.evaluation.data.source == str(out / "02-rs" / "dataset" / "train.jsonl")
    assert pipe.evaluation.model.init_adapter is None and pipe.eval_n == 3 and pipe.evaluation.eval.batch_size == 2


@pytest.mark.parametrize(
    ("stages", "overrides", "message"),
    [
        (
            "- name: rl\n  algo: grpo\n  model: {init_adapter: /nope/policy}\n",
            [],
            r"stage 1 \(rl\): model.init_adapter /nope/policy: no such adapter folder",
        ),
        (
            "- name: rl\n  algo: grpo\n  reward: {source: both, adapter: /nope/rm}\n",
            [],
            r"stage 1 \(rl\): reward.adapter: reward adapter /nope/rm: no such folder",
        ),
        ("- name: rl\n  algo: grpo\n  model: {init_adapter: 'stage:sft'}\n", [], "no earlier stage named 'sft'"),
        (
            "- name: rs\n  algo: rejection_sampling\n- name: rl\n  algo: grpo\n  model: {init_adapter: 'stage:rs'}\n",
            [],
            r"stage rs \(rejection_sampling\) leaves no policy to use",
        ),
        ("- name: a\n  algo: sft\n- name: a\n  algo: sft\n", [], "the name 'a' is used twice"),
        ("- name: A b\n  algo: sft\n", [], "needs a name of lowercase letters"),
        ("- name: a\n  algo: orpo\n", [], "stages\\[0\\].algo must be one of"),
        ("- name: a\n  algo: dpo\n", [], r"a DPO recipe evaluates on held-out prompts only with dpo.task_source"),
        ("- name: a\n  algo: kto\n", [], r"a KTO recipe evaluates on held-out prompts only with kto.task_source"),
        ("- name: a\n  algo: sft\n  sft: {batch_sise: 4}\n", [], r"unknown key sft.batch_sise \(did you mean"),
        ("- name: a\n  algo: sft\n", ["b.train.steps=3"], "must start with a stage name"),
        ("- name: a\n  recipe: missing.yaml\n", [], "recipe file .*missing.yaml not found"),
    ],
)
def test_bad_pipelines_are_named_before_anything_runs(tiny_model_dir, tmp_path, stages, overrides, message):
    path = write_pipeline(tmp_path, tiny_model_dir, stages)
    with pytest.raises(LorarlError, match=message) as err:
        load_pipeline(path, tmp_path / "out", overrides)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_pipeline_cli_bad_input_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys):
    path = write_pipeline(tmp_path, tiny_model_dir, "- name: rl\n  algo: grpo\n  model: {init_adapter: /nope}\n")
    assert main(["pipeline", path, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("lorarl: error: ")
    assert main(["train", path, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err
        == f"lorarl: error: {path} is a pipeline recipe (it has stages:): run it with `lorarl pipeline {path} --out DIR`"
    )
    (tmp_path / "x.yaml").write_text("stages: []\n")
    assert main(["pipeline", str(tmp_path / "x.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "stages must be a non-empty list" in capsys.readouterr().err


def test_a_stage_that_keeps_nothing_stops_the_pipeline_with_one_line(tiny_model_dir, tmp_path):
    stages = "- name: sft\n  algo: sft\n  train: {steps: 1}\n- name: rs\n  algo: rejection_sampling\n"
    stages += "  rejection_sampling: {group_size: 2}\n  train: {steps: 1, prompts_per_step: 2}\n"
    pipe = load_pipeline(write_pipeline(tmp_path, tiny_model_dir, stages), tmp_path / "out")
    with pytest.raises(DataError, match=r"nothing passed the verifier .* 4 completions sampled for 2 prompts"):
        run_pipeline(pipe, tmp_path / "out")
    assert (tmp_path / "out" / "01-sft" / "stage.json").is_file()  # the finished stage stays finished
    assert not (tmp_path / "out" / "02-rs" / "stage.json").exists()
    assert not list((tmp_path / "out" / "02-rs").glob("*dataset*"))


def test_tiny_pipeline_end_to_end_and_resume(tiny_model_dir, tmp_path, monkeypatch):
    path = write_pipeline(tmp_path, tiny_model_dir, four_stages(tmp_path))
    out = tmp_path / "out"
    result = run_pipeline(load_pipeline(path, out), out)
    rows = result["rows"]
    assert [r["stage"] for r in rows] == ["base", "cold_start", "rs", "rs_sft", "rl"]
    assert [r["accuracy"] is None for r in rows] == [False, False, True, False, False]
    assert rows[1]["notes"].startswith("2 steps on 32 examples (0.5 epochs), loss ")
    assert rows[2]["notes"] == "kept 16 of 32 samples (50.0%), 8 of 8 prompts"
    assert rows[-1]["pipeline_wall_s"] >= sum(r["stage_wall_s"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == rows and (out / "summary.md").read_text().count("\n") == 7
    # each stage is a run directory; the wiring is in its recipe.yaml
    rs_sft = yaml.safe_load((out / "03-rs_sft" / "recipe.yaml").read_text())
    assert rs_sft["data"]["source"] == str(out / "02-rs" / "dataset" / "train.jsonl")
    assert rs_sft["model"]["init_adapter"] == str(out / "01-cold_start" / "policy")
    assert read_metrics(out / "03-rs_sft")[0]["completion_tokens"] > 0
    # the RL stage starts from the previous adapter, which is also its frozen reference: KL 0 at its first step
    assert read_metrics(out / "04-rl")[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    # the same pipeline again needs --resume or --force
    with pytest.raises(LorarlError, match="not empty; pass --resume"):
        run_pipeline(load_pipeline(path, out), out)

    # an interrupted last stage: its step-2 checkpoint, final adapter and marker gone
    import shutil

    from safetensors.torch import load_file

    final = load_file(str(out / "04-rl" / "policy" / "adapter_model.safetensors"))
    for p in ("stage.json", "policy", "checkpoints/step-000002"):
        target = out / "04-rl" / p
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    (out / "evals" / "04-rl.json").unlink()
    trained, evaluated = [], []
    import lorarl.algos.loop as loop
    import lorarl.evaluate as ev

    real_train, real_eval = loop.train, ev.evaluate
    monkeypatch.setattr(loop, "train", lambda r, d, **k: trained.append(d) or real_train(r, d, **k))
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: evaluated.append(a[1]) or real_eval(*a, **k))
    again = run_pipeline(load_pipeline(path, out), out, resume=True)
    assert trained == [out / "04-rl"] and evaluated == [str(out / "04-rl" / "policy")]
    assert [r["step"] for r in read_metrics(out / "04-rl")] == [1, 2]
    resumed = load_file(str(out / "04-rl" / "policy" / "adapter_model.safetensors"))
    assert final.keys() == resumed.keys() and all(torch.equal(final[k], resumed[k]) for k in final)
    assert [r["stage"] for r in again["rows"]] == [r["stage"] for r in rows]


def test_report_formatting_by_hand():
    assert minutes(754.2) == "12:34" and minutes(59.6) == "1:00"
    assert percent(0.355) == "35.5%" and percent(None) == "-" and percent(float("nan")) == "-"


def test_defaults_from_a_recipe_file_and_the_shipped_pipelines_load(tiny_model_dir, tmp_path):
    (tmp_path / "base.yaml").write_text(
        f"algo: grpo\nmodel: {{name: {tiny_model_dir}}}\ndata: {{train_size: 40}}\ngrpo: {{group_size: 3}}\n"
    )
    (tmp_path / "p.yaml").write_text(
        "defaults: {recipe: base.yaml, data: {eval_size: 9}}\n"
        "stages:\n  - {name: s, algo: sft}\n  - {name: g, algo: grpo, train: {steps: 2}}\n"
    )
    pipe = load_pipeline(tmp_path / "p.yaml", tmp_path / "out")
    s, g = pipe.stages
    assert s.recipe.model.name == g.recipe.model.name == str(tiny_model_dir)
    assert s.recipe.data.train_size == 40 and s.recipe.data.eval_size == 9 and s.recipe.grpo is None  # filtered
    assert g.recipe.grpo.group_size == 3 and g.recipe.train.steps == 2
    # the shipped pipelines: the same evaluation recipe (prompt, reward, n) for every row; stages wired
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    r1 = load_pipeline(recipes / "pipeline_r1_subtraction.yaml", tmp_path / "r1")
    rs = load_pipeline(recipes / "pipeline_rs_subtraction.yaml", tmp_path / "rs")
    assert [x.algo for x in r1.stages] == ["sft", "grpo"]
    assert [x.algo for x in rs.stages] == ["rejection_sampling", "sft", "grpo"]
    assert r1.stages[1].recipe.model.init_adapter == str(tmp_path / "r1" / "01-cold_start" / "policy")
    assert rs.stages[1].recipe.data.source == str(tmp_path / "rs" / "01-rs" / "dataset" / "train.jsonl")
    for pipe in (r1, rs):
        ev = pipe.evaluation
        assert ev.data.arithmetic.prompt_template == "What is {a} {op} {b}?" and ev.data.arithmetic.operations == ["-"]
        assert pipe.eval_n == 200 and ev.model.init_adapter is None
    assert r1.stages[1].recipe.train.steps == rs.stages[2].recipe.train.steps  # the same RL budget
