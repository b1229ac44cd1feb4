"""Health checks (lorarl.health), evaluation during training with the best adapters kept, and `lorarl doctor`."""

from __future__ import annotations

import json

import pytest
import torch

from lorarl.errors import LorarlError
from lorarl.health import HealthMonitor, logprob_gap, parity_due, parity_failure
from lorarl.runs import find_adapter, named_checkpoint, read_metrics

REWARDS = """
def first_token_even(prompts, completions, completion_ids, **kw):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]

def constant(prompts, completions, **kw):
    return [1.0] * len(completions)
"""


def _recipe(model_dir, tmp_path, reward="first_token_even", **sections):
    from lorarl.config import recipe_from_dict

    (tmp_path / "health_rewards.py").write_text(REWARDS)
    data = {
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 32, "eval_size": 8},
        "reward": {"functions": [{"name": f"{tmp_path / 'health_rewards.py'}:{reward}"}]},
        "generation": {"max_new_tokens": 4},
        "train": {"steps": 4, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2},
        "grpo": {"group_size": 4},
        "eval": {"n": 4, "batch_size": 4},
        "health": {"parity_every": 1},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return recipe_from_dict(data)


# ------------------------------------------------------------------ pure pieces


def test_parity_schedule_and_gap_by_hand():
    assert [s for s in range(1, 11) if parity_due(4, s)] == [1, 4, 8]
    assert not any(parity_due(0, s) for s in range(1, 5))
    gap = logprob_gap(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.1, -2.0, -9.0]]), torch.tensor([[1, 1, 0]]))
    assert gap == pytest.approx({"mean_abs": 0.05, "max_abs": 0.1, "tokens": 2})
    assert parity_failure(0.01, 0.3, 0.05) is None
    assert "stale or different adapter" in parity_failure(0.2, 1.0, 0.05)


def test_monitor_warns_once_when_the_adapter_does_not_move():
    w = [torch.zeros(3)]
    mon = HealthMonitor(learning_after=2, start_weights=[x.clone() for x in w])
    assert mon.check(1, {"trained_rows": 4, "grad_norm": 0.0}, w) == []
    warn = mon.check(2, {"trained_rows": 4, "grad_norm": 0.0}, w)
    assert len(warn) == 1 and warn[0].startswith("adapter not learning") and "learning_rate" in warn[0]
    assert mon.check(3, {"trained_rows": 4, "grad_norm": 0.0}, w) == []  # said once
    moved = HealthMonitor(learning_after=1, start_weights=[torch.zeros(3)])
    row = {"trained_rows": 4}
    assert moved.check(1, row, [torch.ones(3)]) == [] and row["health/adapter_delta"] == pytest.approx(3**0.5)


def test_monitor_no_signal_drift_and_reward_hacking_alarms():
    mon = HealthMonitor(learning_after=0, no_signal_steps=3, alarm_window=3, length_drift=2.0)
    w = []
    for s in range(1, 3):
        assert mon.check(s, {"frac_reward_zero_std": 1.0, "completions/mean_length": 10.0}, w) == []
    assert "no signal" in mon.check(3, {"frac_reward_zero_std": 0.95, "completions/mean_length": 10.0}, w)[0]
    for s in (4, 5):
        mon.check(s, {"completions/mean_length": 10.0}, w)
    assert "length drift" in mon.check(6, {"completions/mean_length": 25.0}, w)[0]
    # reward up, held-out accuracy down over three evaluations
    out = []
    for s, (reward, acc) in enumerate([(0.2, 0.6), (0.5, 0.5), (0.9, 0.3)], start=7):
        out += mon.check(s, {"reward": reward, "eval/accuracy": acc}, w)
    assert len(out) == 1 and out[0].startswith("reward hacking?") and "0.600 -> 0.300" in out[0]


# ------------------------------------------------------------------ in a run


def test_parity_is_checked_and_logged_on_the_tiny_model(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train

    train(_recipe(tiny_model_dir, tmp_path), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows]
    assert len(gaps) == 4 and max(gaps) < 1e-5 and all(r["health/parity_tokens"] > 0 for r in rows)


def test_a_stale_generator_adapter_stops_the_run_at_step_one(tiny_model_dir, tmp_path, monkeypatch):
    """The failure other tools ship: the generator samples with an adapter that is not the one being trained.
    Here it samples with the adapters off while the policy starts from a trained adapter."""
    from lorarl.algos.loop import train
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase
    from lorarl.rollout import engines

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("policy", LoraSettings(r=4, alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.copy_(torch.randn_like(p) * 0.5)
    init = sb.save_adapter("policy", tmp_path / "init")
    real = engines.HFEngine.sample

    def stale(self, shared, *args, **kwargs):
        with shared.role("base"):  # the wrong weights
            return real(self, shared, *args, **kwargs)

    monkeypatch.setattr(engines.HFEngine, "sample", stale)
    recipe = _recipe(tiny_model_dir, tmp_path, model={"init_adapter": str(init)})
    with pytest.raises(LorarlError, match=r"step 1: generator / trainer parity failed"):
        train(recipe, tmp_path / "run")


def test_no_signal_is_warned_in_the_metrics(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train

    recipe = _recipe(tiny_model_dir, tmp_path, reward="constant", health={"no_signal_steps": 3, "parity_every": 0})
    summary = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [bool(r.get("health/warning")) for r in rows] == [False, False, True, False]
    assert "no signal" in rows[2]["health/warning"] and any(w.startswith("no signal") for w in summary["warnings"])


def test_evaluation_during_training_keeps_the_best_adapter(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train

    recipe = _recipe(
        tiny_model_dir,
        tmp_path,
        train={"steps": 5, "keep_best": "eval/reward"},
        eval={"every": 2},
        health={"parity_every": 0},
    )
    summary = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    evals = {r["step"]: r["eval/reward"] for r in rows if "eval/reward" in r}
    assert sorted(evals) == [2, 4, 5]  # every 2 steps and the last
    best_step = max(evals, key=lambda s: (evals[s], -s))
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert best == {"metric": "eval/reward", "value": pytest.approx(evals[best_step]), "step": best_step}
    assert (tmp_path / "run" / "best" / "policy" / "adapter_config.json").is_file()
    assert summary["best"]["step"] == best_step
    assert find_adapter(named_checkpoint(tmp_path / "run", "best")) == tmp_path / "run" / "best" / "policy"
    from lorarl.export import locate

    best_source = locate(tmp_path / "run", checkpoint="best")  # lorarl export RUN --checkpoint best
    assert best_source.step == best_step and best_source.metrics["step"] == best_step


def test_doctor_reports_a_run_and_ends_with_json(tiny_model_dir, tmp_path, capsys):
    from lorarl.algos.loop import train
    from lorarl.cli import main

    train(_recipe(tiny_model_dir, tmp_path, reward="constant", health={"no_signal_steps": 2}), tmp_path / "run")
    assert main(["doctor", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["steps"] == 4 and report["algo"] == "grpo" and report["parity_checks"] == 4
    assert report["reward"] == {"start": 1.0, "end": 1.0, "change": 0.0}
    assert "the training reward did not move" in report["findings"]
    assert any(f.startswith("health warning: no signal") for f in report["findings"])
    assert main(["doctor", str(tmp_path)]) == 2  # not a run directory: one line, exit 2
    with pytest.raises(LorarlError, match="no best checkpoint .train.keep_best"):
        named_checkpoint(tmp_path / "run", "best")
