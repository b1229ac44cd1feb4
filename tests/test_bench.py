"""Benchmarks: each path runs end to end on the tiny model (fresh worker processes) and reports numbers; the pieces
that let them measure the real step (phase peaks, separate-model placement) behave as documented."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.bench import GRPO_SETTINGS, run_bench
from lorarl.bench.grpo_vs_trl import engine_summary, format_table, trl_dataset
from lorarl.bench.memory import PhasePeaks, tensor_bytes
from lorarl.phases import phase


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_engine_summary_leaves_out_the_warm_up_step():
    s = engine_summary([10.0, 2.0, 4.0, 3.0], [16, 32, 32, 32], [0.0, 0.5, None, 1.0], peak=2_000_000_000)
    assert s["median_s_per_step"] == 3.0
    assert s["completion_tokens_per_s"] == pytest.approx(96 / 9, rel=1e-3)
    assert s["peak_memory_gb"] == 2.0
    assert s["mean_reward"] == 0.5
    assert s["median_cpu_s_per_step"] is None
    assert engine_summary([5.0, 1.0, 3.0], [1, 1, 1], [0.0], 1, [9.0, 2.0, 4.0])["median_cpu_s_per_step"] == 3.0


def test_grpo_table_shows_both_engines_and_ratios():
    e = {"median_s_per_step": 2.0, "completion_tokens_per_s": 100.0, "peak_memory_gb": 1.0, "mean_reward": 0.25}
    table = format_table({"steps": 5, "engines": {"lorarl": e, "trl": dict(e, median_s_per_step=4.0)}})
    assert "| median s / step (after warm-up) | 2.00 | 4.00 | 0.50 |" in table
    assert "| median CPU s / step (all threads) | - | - | - |" in table


def test_trl_sees_the_prompts_of_lorarls_steps_in_order():
    from lorarl.algos.base import batch_indices
    from lorarl.tasks.arithmetic import make_problems

    s = GRPO_SETTINGS
    rows = make_problems("train", s["train_size"], seed=s["data_seed"], template=s["prompt_template"])
    ds = trl_dataset(2)
    want = batch_indices(len(rows), s["prompts_per_step"], s["seed"], 1) + batch_indices(
        len(rows), s["prompts_per_step"], s["seed"], 2
    )
    assert [r["answer"] for r in ds] == [rows[i]["answer"] for i in want]


def test_phase_peaks_on_cpu_nest_and_add_what_was_alive_before():
    meter = PhasePeaks("cpu", persistent=lambda: 1000)
    with meter.measure():
        with phase("outer"):
            a = torch.ones(250_000)  # 1 MB
            with phase("inner"):
                b = torch.ones(500_000)  # 2 MB, freed inside
                del b
        with phase("after"):
            c = torch.ones(10)
        del a, c
    assert meter.peaks["inner"] == pytest.approx(1000 + 3_000_000, rel=0.01)
    assert meter.peaks["outer"] == meter.peaks["inner"]  # the outer phase holds the inner one's peak
    assert meter.peaks["after"] < 1000 + 1_100_000  # the 2 MB were freed before
    assert meter.step_peak == meter.peaks["outer"]
    assert set(meter.seconds) == {"outer", "inner", "after"}


def test_separate_models_run_each_role_on_its_own_copy(tiny_model_dir):
    from lorarl.bench.placement import SeparateModels
    from lorarl.config import LoraSettings, ModelConfig

    cfg = ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32")
    sep = SeparateModels.load(cfg, ["policy", "reference", "critic"])
    sep.add_adapter("policy", LoraSettings(r=4))
    sep.add_adapter("critic", LoraSettings(r=4))
    assert sep.copies["policy"].adapters == ["policy"] and sep.copies["reference"].adapters == []
    assert sep.has_adapter("critic") and not sep.has_adapter("reward")
    ids, att = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    with sep.role("critic", train=False):
        assert sep.module is sep.copies["critic"].module  # every forward reaches the role's copy
        assert sep.values(ids, att, 1).shape == (1, 3)
    with sep.role("reference"):
        assert sep.module is sep.copies["reference"].module
    one = tensor_bytes([sep.copies["reference"]])
    assert tensor_bytes(sep.bases) > 3 * one  # three copies of the weights (+ two adapters and a head)


# grpo-vs-trl end to end on the tiny model (both engines' worker processes, every figure a number, lorarl's side the
# real run loop): tests/test_bench_gpu.py's smoke runs it as its grpo-vs-trl part and checks it there.


def test_ppo_memory_on_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_BENCH_THREADS", "1")  # a shared 2-core machine: no thread oversubscription
    res = run_bench("ppo-memory", model=str(tiny_model_dir), out=str(tmp_path), ppo_prompts=4, ppo_max_new_tokens=4)
    assert _is_number(res["rss_step_ratio"]) and _is_number(res["peak_rss_ratio"])
    assert 0 < res["memory_ratio"] < 1  # one base instead of four
    shared, separate = res["variants"]["shared"], res["variants"]["separate"]
    for v in (shared, separate):
        for key in ("step_memory_gb", "tensor_peak_gb", "peak_rss_gb", "step_s"):
            assert _is_number(v[key]), (v["variant"], key)
        assert {"generation", "scoring", "training", "critic_training"} <= set(v["phase_peaks_gb"])
    assert shared["model_copies"] == 1 and separate["model_copies"] == 4
    # the same PPO step ran on both placements: the same samples, scores and losses
    for key in ("completions/mean_length", "reward", "loss/policy_avg", "loss/value_avg"):
        assert shared[key] == pytest.approx(separate[key], rel=1e-4, abs=1e-6), key
    assert separate["model_tensors_gb"] > 3 * shared["model_tensors_gb"]
    assert (tmp_path / "result.json").is_file() and res["machine"]["cpus"] >= 1


class FakeCuda:
    """The few torch.cuda calls PhasePeaks makes, over a counter of allocated bytes (no GPU needed)."""

    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def install(self, monkeypatch) -> None:
        calls = {
            "synchronize": lambda device=None: None,
            "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.now),
            "max_memory_allocated": lambda device=None: self.peak,
            "memory_allocated": lambda device=None: self.now,
            "max_memory_reserved": lambda device=None: self.peak,
            "memory_reserved": lambda device=None: self.now,
            "mem_get_info": lambda device=None: (0, self.now),
        }
        for name, fn in calls.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_phase_peaks_on_cuda_fold_each_boundary_into_the_open_phases(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    fake.alloc(100)  # weights
    meter = PhasePeaks("cuda")
    with meter.measure():
        with phase("training"):
            fake.alloc(50)
            fake.alloc(-50)
            with phase("optimizer"):
                fake.alloc(20)
                fake.alloc(-20)
            fake.alloc(30)
            fake.alloc(-30)
        with phase("training"):  # a second minibatch: its own peak is lower
            fake.alloc(10)
            fake.alloc(-10)
        fake.alloc(500)  # between phases: only the step's peak sees it
        fake.alloc(-500)
    assert meter.peaks == {"training": 150, "optimizer": 120}
    assert meter.step_peak == 600
    assert meter.first_allocated == {"training": 100, "optimizer": 100}
    assert meter.extra["training"]["device_used_now"] == 100
