"""RLOO (``algo: rloo``, TRL's RLOOTrainer) on the tiny model through every door: it learns a learnable reward with
TRL's metrics logged; a YAML recipe through ``lorarl train`` / ``plan`` / ``eval``; ``lorarl.train`` with a Python
reward; ``lorarl.trl.RLOOTrainer`` with TRL's RLOOConfig; resume is bit-identical; the recipe's checks; the planner
plans its step as the GRPO step of its memory and the measured peaks agree; the workbench's Train tab offers it.
The math against TRL's own code is tests/test_rloo_losses.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_grpo import TARGET_REWARD, peaky_model_dir  # noqa: F401  (the learnable reward and its model fixture)

from lorarl.algos.loop import train
from lorarl.api import load_recipe
from lorarl.cli import main
from lorarl.config import recipe_from_dict
from lorarl.errors import RecipeError
from lorarl.runs import read_metrics

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "rloo_arithmetic.yaml"


def rloo_recipe(model_dir, reward_file, **sections):
    d = {
        "algo": "rloo",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_size": 64, "eval_size": 8},
        "reward": {"functions": [{"name": f"{reward_file}:in_target", "kwargs": {"model_dir": str(model_dir)}}]},
        "generation": {"max_new_tokens": 3, "temperature": 1.0},
        "train": {"steps": 3, "prompts_per_step": 4, "micro_batch_size": 16, "learning_rate": 1e-2, "seed": 0},
        "rloo": {"group_size": 4},
        "eval": {"n": 4, "batch_size": 4},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    d["train"]["report_to"] = []
    return recipe_from_dict(d)


@pytest.fixture()
def reward_file(tmp_path):
    f = tmp_path / "tiny_rewards.py"
    f.write_text(TARGET_REWARD)
    return f


def test_rloo_learns_with_trls_metrics(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    """The learnable reward rises; step 1's KL is 0 (the policy is the reference: LoRA B = 0) and later not; TRL's
    metric names are logged."""
    recipe = rloo_recipe(
        peaky_model_dir, reward_file, train={"steps": 20}, rloo={"kl": {"coef": 0.05}, "normalize_advantages": True}
    )
    out = tmp_path / "run"
    summary = train(recipe, out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert first < 0.25 and last > first + 0.2, (first, last)  # ~10% of tokens are in the target set at the start
    need = {
        "reward",
        "reward_std",
        "rewards/in_target/mean",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "loss",
        "grad_norm",
        "learning_rate",
    }
    assert need <= set(rows[0]), need - set(rows[0])
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy (adapters on, B = 0) = reference (adapters off)
    assert any(abs(r["kl"]) > 1e-3 for r in rows[5:])  # the policy moved away from the reference
    # num_iterations 1: the ratio is exactly 1, nothing clips
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in rows if r["clip_ratio/region_mean"] is not None)
    assert summary["reward_last10"] > first
    assert (out / "policy" / "adapter_model.safetensors").is_file() and (out / "plot.png").is_file()


def test_yaml_recipe_through_train_plan_and_eval(peaky_model_dir, reward_file, tmp_path, capsys):  # noqa: F811
    """A YAML recipe (the form recipes/ ships) through the CLI: `lorarl plan` plans an RLOO step as the GRPO step of
    its memory, `lorarl train` trains it, `lorarl eval` evaluates the trained policy."""
    import yaml

    from lorarl.config import recipe_to_dict

    path = tmp_path / "rloo.yaml"
    path.write_text(yaml.safe_dump(recipe_to_dict(rloo_recipe(peaky_model_dir, reward_file, train={"steps": 2}))))
    assert main(["plan", str(path), "--model-config", "llama-3.1-8b"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["settings"]["algo"] == "grpo" and plan["settings"]["group_size"] == 4
    assert plan["settings"]["kl_coef"] == 0.05  # TRL's default beta: the reference pass is planned
    assert plan["settings"]["num_iterations"] == 2  # the policy's old log-probs are scored too (the KL's)
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    capsys.readouterr()
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "run"), "--n", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == 4 and "accuracy" in out and "reward/in_target" in out


def test_python_api_with_a_callable_reward(peaky_model_dir, tmp_path):  # noqa: F811
    """lorarl.train: a Python reward function with TRL's signature scores the step's completions through GRPO's
    scorer, with TRL's arguments (trainer_state, log_metric); the logged per-function mean is that function over
    them, and the logged advantages are their leave-one-out ones."""
    import lorarl

    seen_steps = []

    def chars(completions):
        return [float(len(c[-1]["content"] if isinstance(c, list) else c)) for c in completions]

    def count_chars(completions, trainer_state, log_metric, **kwargs):
        seen_steps.append(trainer_state.global_step)
        log_metric("chars/calls", 1.0)
        return chars(completions)

    run = lorarl.train(
        {
            "algo": "rloo",
            "model": {"name": str(peaky_model_dir), "quantization": "none", "dtype": "float32"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"train_size": 16, "eval_size": 4},
            "generation": {"max_new_tokens": 4},
            "train": {"steps": 1, "prompts_per_step": 2, "log_completions": 8, "report_to": []},
            "rloo": {"group_size": 4, "kl": {"coef": 0.0}},
        },
        tmp_path / "run",
        reward_funcs=[count_chars],
        progress=False,
    )
    row = run.metrics[0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    by_hand = chars([s["completion"] for s in samples])
    assert len(samples) == 8 and row["rewards/count_chars/mean"] == pytest.approx(sum(by_hand) / 8)
    assert row["kl"] is None  # kl.coef 0: the reference never ran
    assert seen_steps == [0] and row["chars/calls"] == 1.0  # TRL's: step 1 scores before any step is done
    # the logged advantages are the leave-one-out ones of the logged rewards (2 groups of 4)
    r = torch.tensor(by_hand)
    loo = r - (r.reshape(2, 4).sum(1, keepdim=True) - r.reshape(2, 4)).reshape(8) / 3
    assert [s["advantage"] for s in samples] == pytest.approx(loo.tolist(), abs=1e-5)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's default
def test_trl_rloo_trainer_maps_its_config_and_trains(tiny_model_dir, tmp_path):
    """from lorarl.trl import RLOOTrainer, RLOOConfig: TRL's RLOOConfig fields land in the recipe (beta in the reward,
    TRL's num_generations default 2 ...), one step trains, evaluate() and save_model() as TRL's."""
    import trl
    from peft import LoraConfig

    from lorarl.trl import RLOOConfig, RLOOTrainer
    from lorarl.trl.fields import Refused

    assert RLOOConfig is trl.RLOOConfig  # TRL's own config class
    args = RLOOConfig(
        output_dir=str(tmp_path / "run"),
        bf16=False,
        max_steps=1,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=6,
        learning_rate=1e-2,
        beta=0.1,
        epsilon=0.1,
        epsilon_high=0.3,
        normalize_advantages=True,
        reward_clip_range=(0.0, 5.0),
        mask_truncated_completions=True,
        num_iterations=2,
        report_to="none",
    )

    def reward_len(completions, **kwargs):
        return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]

    trainer = RLOOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=[{"prompt": "Say hi"}] * 4,
        eval_dataset=[{"prompt": "What is 1 + 1?", "answer": "2"}] * 2,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    r = load_recipe(trainer.recipe)
    assert r.algo == "rloo" and r.train.prompts_per_step == 2 and r.train.micro_batch_size == 8
    assert (r.rloo.group_size, r.rloo.num_iterations, r.rloo.kl.coef) == (4, 2, 0.1)
    assert (r.rloo.clip_eps_low, r.rloo.clip_eps_high) == (0.1, 0.3)
    assert r.rloo.normalize_advantages and r.rloo.mask_truncated and r.rloo.reward_clip_range == [0.0, 5.0]
    assert r.generation.max_new_tokens == 6 and r.train.learning_rate == 1e-2
    out = trainer.train()
    row = trainer.state.log_history[0]
    assert out.global_step == 1 and {"reward", "kl", "rewards/reward_len/mean"} <= set(row)
    metrics = trainer.evaluate()
    assert metrics and all(k.startswith("eval_") for k in metrics)
    trainer.save_model(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "adapter_config.json").read_text())["r"] == 4

    defaults = load_recipe(RLOOTrainer(str(tiny_model_dir), reward_funcs=reward_len, train_dataset=[{}] * 4).recipe)
    assert defaults.rloo.group_size == 2 and defaults.rloo.kl.coef == 0.05  # TRL's RLOO defaults
    assert defaults.train.prompts_per_step == 4 and defaults.train.learning_rate == 1e-6  # 8 completions a step
    assert defaults.rloo.clip_eps_high == 0.2 and not defaults.rloo.normalize_advantages
    args = RLOOConfig(output_dir=str(tmp_path / "x"), bf16=False, sync_ref_model=True, ref_model_sync_steps=8)
    with pytest.raises(Refused, match=r"^RLOOConfig.sync_ref_model=True: lorarl's reference refresh copies"):
        RLOOTrainer(str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=[{}] * 4)
    args.ref_model_mixup_alpha = 1.0
    synced = RLOOTrainer(str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=[{}] * 4).recipe
    assert load_recipe(synced).rloo.kl.ref_refresh_every == 8


def test_resume_is_bit_identical(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    """With everything a checkpoint must carry: LoRA dropout (the RNG), two updates per rollout (recorded old
    log-probs), the KL penalty against a reference adapter refreshed every 2 steps, a cosine schedule."""
    recipe = rloo_recipe(
        peaky_model_dir,
        reward_file,
        lora={"dropout": 0.1},
        train={"steps": 4, "save_every": 2, "lr_scheduler": "cosine", "warmup_steps": 1, "prompts_per_step": 2},
        rloo={"num_iterations": 2, "kl": {"coef": 0.1, "ref_refresh_every": 2}},
    )
    train(recipe, tmp_path / "full")
    train(recipe, tmp_path / "cut", max_steps=3)  # checkpoints at steps 2 and 3 (the refreshed reference in both)
    train(recipe, tmp_path / "cut", resume=True)
    want = load_file(str(tmp_path / "full" / "policy" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "cut" / "policy" / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for key in ("reward", "kl", "loss", "grad_norm", "clip_ratio/region_mean"):
        assert [r[key] for r in full] == [r[key] for r in cut], key
    assert any(r["kl"] for r in full[1:]) and any(r["clip_ratio/region_mean"] for r in full)  # both exercised


def test_a_constant_reward_has_no_signal_whatever_the_kl(peaky_model_dir, tmp_path):  # noqa: F811
    """frac_reward_zero_std reads the rewards before the KL penalty (TRL's RLOO reads them after, where the KL term
    gives every group a spread): a constant reward is 'no signal' and the health check says so."""
    f = tmp_path / "flat.py"
    f.write_text("def flat(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    recipe = rloo_recipe(
        peaky_model_dir,
        tmp_path,
        reward={"functions": [{"name": f"{f}:flat"}]},
        rloo={"kl": {"coef": 0.1}},
        health={"no_signal_steps": 2},
    )
    summary = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert all(r["frac_reward_zero_std"] == 1.0 for r in rows)
    assert any(w.startswith("no signal") for w in summary["warnings"])


def test_recipe_checks():
    for section, bad, key in [
        ({"group_size": 1}, "must be >= 2", "rloo.group_size"),
        ({"num_iterations": 0}, "must be >= 1", "rloo.num_iterations"),
        ({"clip_eps_low": 0}, "must be > 0", "rloo.clip_eps_low"),
        ({"reward_clip_range": [1.0, 0.0]}, "min <= max", "rloo.reward_clip_range"),
        ({"reward_clip_range": [1.0]}, "[min, max]", "rloo.reward_clip_range"),
        ({"kl": {"coef": -0.1}}, "must be >= 0", "rloo.kl.coef"),
        ({"kl": {"estimator": "k3"}}, "estimator", "rloo.kl"),
    ]:
        with pytest.raises(RecipeError, match=key.replace(".", r"\.")) as e:
            recipe_from_dict({"algo": "rloo", "rloo": section})
        assert bad in str(e.value), (section, str(e.value))
    with pytest.raises(RecipeError, match="section grpo does not apply to algo rloo"):
        recipe_from_dict({"algo": "rloo", "grpo": {"group_size": 4}})
    with pytest.raises(RecipeError, match="generation.top_p must be 1.0"):  # training samples follow the log-probs
        recipe_from_dict({"algo": "rloo", "generation": {"top_p": 0.9}})
    r = recipe_from_dict({"algo": "rloo", "rloo": {"clip_eps_low": 0.1}})
    assert r.rloo.clip_eps_high == 0.1 and r.grpo is None  # epsilon_high None -> epsilon, as TRL


def test_the_planners_rloo_step_is_measured_as_grpos(tmp_path):
    """The planner plans an RLOO step as the GRPO step of its memory (lorarl.plan.recipes.rloo_as_grpo). A real RLOO
    step and a real GRPO step of the same shape (lorarl.bench.plan_validation on the tiny model, the KL on: RLOO
    scores the old and the reference log-probs) have the same measured phase peaks, so the GRPO terms' validation
    (docs/planner_validation.md) holds for RLOO: every phase's predicted / measured within 1% of GRPO's. (One
    worker in this process, as ``python -m lorarl.bench.plan_validation ... --algos rloo,grpo`` runs it per model.)"""
    from lorarl.bench.plan_validation import parse_args, worker

    argv = ["--device", "cpu", "--models", "tiny", "--quantization", "none", "--algos", "rloo,grpo", "--worker", "tiny"]
    runs = worker(parse_args(argv + ["--prompt-len", "16", "--max-new-tokens", "16"]))["runs"]  # in this process
    assert runs["rloo"]["estimate"]["settings"]["num_iterations"] == 2  # old log-probs scored: the KL's
    assert set(runs["rloo"]["phases"]) == set(runs["grpo"]["phases"]) >= {"generation", "scoring", "training"}
    for phase, row in runs["rloo"]["phases"].items():
        theirs = runs["grpo"]["phases"][phase]
        assert row["predicted"] == theirs["predicted"], phase
        assert row["measured"] == pytest.approx(theirs["measured"], rel=0.01), phase
        assert math.isfinite(row["ratio"]) and row["ratio"] == pytest.approx(theirs["ratio"], rel=0.01), phase


def test_the_workbench_train_tab_offers_the_rloo_recipe(tmp_path):
    from lorarl.app import recipes

    names = [c.label.split()[0] for c in recipes.list_recipes([REPO / "recipes"], tmp_path)]
    assert "rloo_arithmetic.yaml" in names
    assert recipes.recipe_header(QUICKSTART).startswith("RLOO quickstart")
    keys = [f.key for f in recipes.fields_for(QUICKSTART)]
    assert "rloo.group_size" in keys and "grpo.group_size" not in keys
    assert recipes.field_values(QUICKSTART)["rloo.group_size"] == 8
    _, errors = recipes.validate(QUICKSTART, {"rloo.group_size": 1})
    assert errors == {
        "rloo.group_size": f"{QUICKSTART}: rloo.group_size must be >= 2 (the baseline is the other completions')"
    }
    assert recipes.validate(QUICKSTART, {"rloo.group_size": 4}) == (["rloo.group_size=4"], {})
    assert "tensor peak" in recipes.plan_line(QUICKSTART)  # the planner models its step
