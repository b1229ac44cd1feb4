"""Benchmarks: each path runs end to end on the tiny model (fresh worker processes) and reports numbers."""

from __future__ import annotations

import math

import pytest

from lorarl.bench import GRPO_SETTINGS, _engine_summary, _trl_dataset, format_grpo_table, run_bench


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_engine_summary_leaves_out_the_warm_up_step():
    s = _engine_summary([10.0, 2.0, 4.0, 3.0], [16, 32, 32, 32], [0.0, 0.5, None, 1.0], peak=2_000_000_000)
    assert s["median_s_per_step"] == 3.0
    assert s["completion_tokens_per_s"] == pytest.approx(96 / 9, rel=1e-3)
    assert s["peak_memory_gb"] == 2.0
    assert s["mean_reward"] == 0.5


def test_grpo_table_shows_both_engines_and_ratios():
    e = {"median_s_per_step": 2.0, "completion_tokens_per_s": 100.0, "peak_memory_gb": 1.0, "mean_reward": 0.25}
    table = format_grpo_table({"steps": 5, "engines": {"lorarl": e, "trl": dict(e, median_s_per_step=4.0)}})
    assert "| median s / step (after warm-up) | 2.00 | 4.00 | 0.50 |" in table


def test_trl_sees_the_prompts_of_lorarls_steps_in_order():
    from lorarl.algos.grpo import batch_indices
    from lorarl.tasks.arithmetic import make_problems

    s = GRPO_SETTINGS
    rows = make_problems("train", s["train_size"], seed=s["data_seed"], template=s["prompt_template"])
    ds = _trl_dataset(2)
    want = batch_indices(len(rows), s["prompts_per_step"], s["seed"], 1) + batch_indices(
        len(rows), s["prompts_per_step"], s["seed"], 2
    )
    assert [r["answer"] for r in ds] == [rows[i]["answer"] for i in want]


def test_ppo_memory_on_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_BENCH_THREADS", "1")  # a shared 2-core machine: no thread oversubscription
    res = run_bench("ppo-memory", model=str(tiny_model_dir), out=str(tmp_path), ppo_prompts=4, ppo_max_new_tokens=4)
    assert _is_number(res["rss_step_ratio"]) and _is_number(res["peak_rss_ratio"])
    assert 0 < res["memory_ratio"] < 1  # one base instead of four
    for v in ("shared", "separate"):
        for key in ("step_memory_gb", "tensor_peak_gb", "peak_rss_gb", "step_s"):
            assert _is_number(res["variants"][v][key]), (v, key)
    assert res["variants"]["separate"]["model_copies"] == 4
    assert (tmp_path / "result.json").is_file()


def test_grpo_vs_trl_on_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_BENCH_THREADS", "1")
    res = run_bench("grpo-vs-trl", steps=1, model=str(tiny_model_dir), out=str(tmp_path))
    assert _is_number(res["time_ratio"]) and _is_number(res["memory_ratio"])
    for engine in ("lorarl", "trl"):
        e = res["engines"][engine]
        for key in ("median_s_per_step", "completion_tokens_per_s", "peak_memory_gb"):
            assert _is_number(e[key]), (engine, key)
        assert e["steps"] == 1
    assert res["machine"]["cpus"] >= 1
