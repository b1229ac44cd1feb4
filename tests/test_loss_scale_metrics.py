"""The loss scaler in the metrics: on an fp16 base every algorithm's step logs ``loss_scale`` (the scale of its last
update's backward) and ``loss_scale_overflows`` (backward passes that overflowed in fp16 that step, each redone at
half the scale); PPO logs its critic's scale as ``critic_loss_scale``; an fp32 base logs neither (the tiny Llama
loaded in fp16 on the CPU, as tests/test_loss_scaling.py runs fp16, its scalers started at 2^24 so that they
overflow)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorarl.config import recipe_from_dict
from lorarl.model import SharedBase
from lorarl.update import NonFiniteGuard, StepResult

START = 2.0**24  # every scaler starts here: the first backward passes overflow fp16 (max 65504)

REWARD = """
def odd_tokens(prompts, completions, completion_ids, **kwargs):
    return [sum(t % 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]
"""


def test_guard_metrics_by_hand():
    guard = NonFiniteGuard()
    guard.check(StepResult(1.0, 1.0, False, 1), step=1)  # no scaler: nothing to log
    assert guard.loss_scale_metrics() == {}
    guard.check(StepResult(1.0, 1.0, False, 1, loss_scale=2.0**14, overflows=2), step=2, who="policy")
    guard.check(StepResult(1.0, 1.0, False, 1, loss_scale=2.0**13, overflows=1), step=2, who="policy")
    guard.check(StepResult(1.0, float("inf"), True, 1, overflow=True, loss_scale=2.0**15), step=2, who="critic")
    # the last policy update's scale; the critic's own; 2 + 1 redone passes + 1 skipped overflowing pass
    assert guard.loss_scale_metrics() == {
        "loss_scale": 2.0**13,
        "critic_loss_scale": 2.0**15,
        "loss_scale_overflows": 4,
    }
    assert guard.loss_scale_metrics()["loss_scale_overflows"] == 0  # counted per step (per call)


def _recipe(algo: str, model_dir, tmp_path, dtype: str = "float16"):
    pairs = [{"prompt": f"Review {i}:", "chosen": " good great", "rejected": " bad awful"} for i in range(8)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp_path / "rewards.py").write_text(REWARD)
    d = {
        "algo": algo,
        "model": {"name": str(model_dir), "quantization": "none", "dtype": dtype},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_size": 8, "eval_size": 4},
        "generation": {"max_new_tokens": 4, "temperature": 1.0},
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "learning_rate": 1e-2, "seed": 0},
        "eval": {"n": 4, "batch_size": 4},
    }
    rules = {"functions": [{"name": f"{tmp_path / 'rewards.py'}:odd_tokens"}]}
    pair_data = {"source": str(tmp_path / "pairs.jsonl"), "eval_source": str(tmp_path / "pairs.jsonl")}
    d.update(
        {
            "grpo": {"reward": rules, "grpo": {"group_size": 4}},
            "ppo": {
                "reward": {"source": "rules", **rules},
                "ppo": {"epochs": 1, "minibatch_size": 4, "critic": {"lora": {"r": 8, "alpha": 16}}},
            },
            "sft": {"sft": {"batch_size": 2}},
            "reward_model": {"data": pair_data, "reward_model": {"epochs": 1, "batch_size": 4}},
            "dpo": {"data": pair_data, "dpo": {"batch_size": 4, "task_source": "arithmetic"}},
        }[algo]
    )
    if algo in ("reward_model", "sft"):
        del d["generation"]
    return recipe_from_dict(d)


def _algo(recipe):
    from lorarl.algos import make_algorithm

    return make_algorithm(recipe, SharedBase.load(recipe.model))


def _start_at(scaler, scale: float) -> None:
    scaler.scale(torch.ones(()))  # the scale tensor is made on first use
    scaler.update(new_scale=scale)


def _halvings(scale: float) -> int:
    return round(math.log2(START / scale))


@pytest.mark.parametrize("algo", ["grpo", "ppo", "sft", "reward_model", "dpo"])
def test_an_fp16_step_logs_its_loss_scale_and_overflows(algo, tiny_model_dir, tmp_path):
    a = _algo(_recipe(algo, tiny_model_dir, tmp_path))
    roles = {"loss_scale": a.role if algo == "reward_model" else a.policy}
    if algo == "ppo":
        roles["critic_loss_scale"] = a.critic
    for role in roles.values():
        _start_at(role.scaler, START)
    torch.manual_seed(0)
    row = a.step(a.batch(1))
    assert row["skipped_updates"] == 0 and row.get("trained_rows", 1) > 0, row
    for key, role in roles.items():
        assert row[key] == role.scaler.get_scale() < START  # the scale the update ran at, after halving
    # every overflow halved a scale once (no growth within 2000 clean steps): the count is the halvings
    assert row["loss_scale_overflows"] == sum(_halvings(role.scaler.get_scale()) for role in roles.values()) >= 1
    row2 = a.step(a.batch(2))
    assert row2["loss_scale_overflows"] == sum(_halvings(r.scaler.get_scale()) for r in roles.values()) - sum(
        _halvings(row[k]) for k in roles
    )


def test_an_fp32_step_logs_no_loss_scale(tiny_model_dir, tmp_path):
    a = _algo(_recipe("sft", tiny_model_dir, tmp_path, dtype="float32"))
    row = a.step(a.batch(1))
    assert a.policy.scaler is None and "loss_scale" not in row and "loss_scale_overflows" not in row
