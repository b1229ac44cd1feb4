"""GRPO scored by the reward adapter as well as by rules (``reward.source: both``): one base holds the policy and the
frozen reward adapter + head; both parts are logged every step and the total is their weighted sum; it trains."""

from __future__ import annotations

import pytest
import torch
from test_ppo import make_adapters

from lorarl.algos.grpo import GRPO
from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict
from lorarl.evaluate import evaluate
from lorarl.model import SharedBase
from lorarl.runs import read_metrics

NEWLINES = '''
def newlines(prompts, completions, completion_ids=None, **kw):
    """Fraction of the completion's tokens that are a newline (id 198)."""
    return [sum(1 for t in ids if t == 198) / max(len(ids), 1) for ids in completion_ids]
'''


def test_grpo_with_reward_source_both_trains_and_logs_both_parts(tiny_model_dir, tmp_path):
    rm_run, _ = make_adapters(tiny_model_dir, tmp_path / "rm_run")
    (tmp_path / "rules.py").write_text(NEWLINES)
    recipe = recipe_from_dict(
        {
            "algo": "grpo",
            "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
            "lora": {"r": 8, "alpha": 16},
            "data": {"train_size": 32, "eval_size": 4},
            "reward": {
                "source": "both",
                "adapter": str(rm_run),
                "model_weight": 0.5,
                "functions": [{"name": f"{tmp_path / 'rules.py'}:newlines", "weight": 2.0}],
            },
            "generation": {"max_new_tokens": 6, "temperature": 0.1},
            "train": {"steps": 3, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2},
            "grpo": {"group_size": 4},
            "eval": {"n": 4, "batch_size": 4},
        }
    )
    # one base: the policy and the frozen reward adapter (+ its score head) are roles on it
    shared = SharedBase.load(recipe.model)
    algo = GRPO(recipe, shared)
    assert sorted(shared.adapters) == ["policy", "reward"] and "reward" in shared.heads
    assert not any(p.requires_grad for p in shared.trainable_parameters("reward"))
    assert algo.roles == ["policy"]
    del algo, shared

    train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3
    for r in rows:
        assert r["rm_score"] is not None and r["rewards/newlines/mean"] is not None
        # total = model_weight * RM score + weight * rule reward (means of sums are sums of means)
        assert r["reward"] == pytest.approx(0.5 * r["rm_score"] + 2.0 * r["rewards/newlines/mean"], abs=1e-5)
    assert any(r["trained_rows"] > 0 and r["loss"] is not None for r in rows)  # the RM spreads every group
    # the policy moved; the reward adapter did not (it is not saved by the run)
    from safetensors.torch import load_file

    trained = load_file(str(tmp_path / "run" / "policy" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in trained.items())
    assert not (tmp_path / "run" / "reward").exists()
    # held-out evaluation scores the same two ways
    ev = evaluate(recipe, str(tmp_path / "run"), n=4)
    assert ev["rm_score"] is not None and ev["reward/newlines"] is not None
    assert ev["reward_mean"] == pytest.approx(0.5 * ev["rm_score"] + 2.0 * ev["reward/newlines"], abs=1e-5)
    assert torch.isfinite(torch.tensor(ev["reward_mean"]))
