"""Training through a sampler / trainer mismatch: the parity tolerance by precision; tis.mode auto engages TIS
(instead of stopping) on a low-precision base with a gap up to 5x the tolerance, and only there; always / off;
PPO too. The mismatch is made by shifting the sampler's recorded log-probs (the sampled tokens are unchanged)."""

from __future__ import annotations

import pytest

from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict
from lorarl.errors import LorarlError
from lorarl.health import PARITY_TOLERANCE, parity_tolerance
from lorarl.runs import read_metrics

REWARDS = """
def first_token_even(prompts, completions, completion_ids, **kw):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]
"""


def _recipe(model_dir, tmp_path, dtype="bfloat16", **sections):
    (tmp_path / "tis_rewards.py").write_text(REWARDS)
    data = {
        "model": {"name": str(model_dir), "quantization": "none", "dtype": dtype, "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 32, "eval_size": 8},
        "reward": {"functions": [{"name": f"{tmp_path / 'tis_rewards.py'}:first_token_even"}]},
        "generation": {"max_new_tokens": 4},
        "train": {"steps": 3, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2},
        "grpo": {"group_size": 4},
        "eval": {"n": 4, "batch_size": 4},
        "health": {"parity_every": 2},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return recipe_from_dict(data)


@pytest.fixture()
def shifted_sampler(monkeypatch):
    """The HF engine records log-probs ``shift`` nats below what it drew with (set ``box[0]``)."""
    from lorarl.rollout import engines

    box = [0.25]
    real = engines.HFEngine.sample

    def sample(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out.sampler_logprobs is not None:
            out.sampler_logprobs = out.sampler_logprobs - box[0]
        return out

    monkeypatch.setattr(engines.HFEngine, "sample", sample)
    return box


def test_parity_tolerance_by_precision():
    def tol(device, **model):
        return parity_tolerance(recipe_from_dict({"model": model}), device)

    assert tol("cpu") == PARITY_TOLERANCE["float32"] == 1e-3  # auto on CPU: fp32, no quantization
    assert tol("cuda") == PARITY_TOLERANCE["nf4"]  # auto on CUDA: NF4 in bf16
    assert tol("cuda", quantization="none") == PARITY_TOLERANCE["bfloat16"] == 0.1
    assert tol("cpu", dtype="float16") == PARITY_TOLERANCE["float16"]
    assert tol("cuda", dtype="float32", quantization="none") == 1e-3
    assert parity_tolerance(recipe_from_dict({"health": {"parity_tolerance": 0.2}}), "cuda") == 0.2


def test_auto_tis_trains_through_a_low_precision_mismatch(tiny_model_dir, tmp_path, shifted_sampler):
    recipe = _recipe(tiny_model_dir, tmp_path)
    summary = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3  # not stopped
    first = rows[0]
    assert 0.1 < first["sampling/sampling_logp_difference/mean"] <= 0.5
    assert first["health/parity_tolerance"] == PARITY_TOLERANCE["bfloat16"] == 0.1
    assert all(r["sampling/tis_active"] == 1.0 for r in rows)  # engaged at step 1, kept after
    assert any(r["trained_rows"] for r in rows)
    for r in rows:
        if r["trained_rows"]:
            # w = min(exp(old - sampler), 2) with old - sampler = 0.25 + bf16 noise: exp(0.25) = 1.284
            assert 1.2 < r["sampling/importance_sampling_ratio/mean"] < 1.4
            assert r["sampling/importance_sampling_ratio/min"] <= r["sampling/importance_sampling_ratio/max"] <= 2.0
    assert any(w.startswith("parity corrected") for w in summary["warnings"])


def test_auto_tis_keeps_stopping_on_fp32_and_on_large_gaps(tiny_model_dir, tmp_path, shifted_sampler):
    with pytest.raises(LorarlError, match="step 1: generator / trainer parity failed"):
        train(_recipe(tiny_model_dir, tmp_path, dtype="float32"), tmp_path / "fp32")
    shifted_sampler[0] = 1.0  # 10x the bf16 tolerance: a bug, not rounding
    with pytest.raises(LorarlError, match="step 1: generator / trainer parity failed"):
        train(_recipe(tiny_model_dir, tmp_path), tmp_path / "large")


def test_tis_off_stops_and_always_corrects_from_step_one(tiny_model_dir, tmp_path, shifted_sampler):
    with pytest.raises(LorarlError, match=r"parity failed.*grpo.tis.mode"):
        train(_recipe(tiny_model_dir, tmp_path, grpo={"tis": {"mode": "off"}}), tmp_path / "off")
    shifted_sampler[0] = 0.0
    recipe = _recipe(tiny_model_dir, tmp_path, dtype="float32", grpo={"tis": {"mode": "always"}})
    train(recipe, tmp_path / "always")
    rows = read_metrics(tmp_path / "always")
    assert all(r["sampling/tis_active"] == 1.0 for r in rows)
    trained = [r for r in rows if r["trained_rows"]]
    assert trained
    for r in trained:  # fp32 sampler and trainer agree: every weight is 1 up to rounding
        assert r["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
        assert r["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)


def _ppo_recipe(model_dir, tmp_path, **health):
    (tmp_path / "tis_rewards.py").write_text(REWARDS)
    return recipe_from_dict(
        {
            "algo": "ppo",
            "model": {"name": str(model_dir), "quantization": "none", "dtype": "bfloat16"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"train_size": 32, "eval_size": 8},
            "reward": {"source": "rules", "functions": [{"name": f"{tmp_path / 'tis_rewards.py'}:first_token_even"}]},
            "generation": {"max_new_tokens": 4},
            "ppo": {"epochs": 1, "minibatch_size": 8, "kl": {"coef": 0.0}, "critic": {"lora": {"r": 4}}},
            "train": {"steps": 2, "prompts_per_step": 8, "micro_batch_size": 8, "learning_rate": 1e-3},
            "eval": {"n": 4, "batch_size": 4},
            "health": {"parity_every": 1, **health},
        }
    )


def test_ppo_trains_through_a_mismatch_with_tis(tiny_model_dir, tmp_path, shifted_sampler):
    train(_ppo_recipe(tiny_model_dir, tmp_path), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(r["sampling/tis_active"] == 1.0 for r in rows)
    assert all(1.2 < r["sampling/importance_sampling_ratio/mean"] < 1.4 for r in rows)
    recipe = _ppo_recipe(tiny_model_dir, tmp_path)
    recipe.ppo.tis.mode = "off"
    with pytest.raises(LorarlError, match="step 1: generator / trainer parity failed"):
        train(recipe, tmp_path / "off")
