"""``lorarl bench gpu --part step``: the figures' helpers against hand values, the 24 GB budget applied on CUDA only,
and :func:`check_step_record`, the checks tests/test_bench_gpu.py runs on the smoke mode's ``step.json`` (the smoke
run itself happens once, there: every part in one go)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorarl.bench import step
from lorarl.bench.gpu import STEP_FULL
from lorarl.bench.step import (
    apply_budget,
    cb_memory_percent,
    memory_fraction,
    phase_split,
    row_ratios,
    scoring_seconds,
    tokens_per_s,
)

GB = 10**9


def test_budget_fraction_and_continuous_batching_share():
    assert memory_fraction(24 * GB, 80 * GB) == 0.3  # an H100 held to 24 GB
    assert memory_fraction(24 * GB, 141 * GB) == pytest.approx(24 / 141)  # an H200
    assert memory_fraction(24 * GB, 24 * GB) is None and memory_fraction(24 * GB, 16 * GB) is None  # nothing to hold
    # continuous batching: TRL's 0.5 of the free memory on a 24 GB card; here 0.5 x (24 - 6) GB of 72 GB free = 0.125
    assert cb_memory_percent(24 * GB, 6 * GB, 72 * GB) == 0.125
    assert cb_memory_percent(24 * GB, 6 * GB, 10 * GB) == 0.5  # never above TRL's own share
    assert cb_memory_percent(24 * GB, 30 * GB, 50 * GB) == 0.0  # weights past the budget: no cache


def test_budget_is_set_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * GB}))
    assert apply_budget("cpu", 24) is None and calls == []
    assert apply_budget("cuda", 24) == 0.3 and calls == [(0.3, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 24 * GB}))
    assert apply_budget("cuda", 24) is None and len(calls) == 1  # a 24 GB card: left as it is


def test_phase_split_tokens_and_ratios():
    assert phase_split(10.0, 6.0, 1.5) == {"generation_s": 6.0, "scoring_s": 1.5, "training_s": 2.5, "step_s": 10.0}
    assert scoring_seconds({"generation": 3.0, "scoring": 0.25, "rewards": 0.5, "training": 9.0}) == 0.75
    assert tokens_per_s(64, 256.0, 8.0) == 2048.0
    lo = {"step_s": 3.0, "peak_gb": 12.0}
    peers = {"trl": {"step_s": 12.0, "peak_gb": 20.0}, "trl-cb": {"step_s": 10.0, "peak_gb": 24.0}}
    r = row_ratios(lo, peers)
    assert r["peer"] == "trl-cb" and r["time_ratio"] == 0.3 and r["memory_ratio"] == 0.5  # the fastest TRL
    assert r["ratios_by_peer"]["trl"] == {"time_ratio": 0.25, "memory_ratio": 0.6}
    r = row_ratios(lo, {"trl": peers["trl"], "trl-cb": {"error": "OutOfMemoryError"}})
    assert r["peer"] == "trl" and r["time_ratio"] == 0.25 and set(r["ratios_by_peer"]) == {"trl"}
    assert row_ratios({"error": "x"}, peers)["time_ratio"] is None
    assert row_ratios(lo, {"trl": {"error": "x"}}) == {
        "peer": None,
        "time_ratio": None,
        "memory_ratio": None,
        "ratios_by_peer": {},
    }


def test_worker_specs_name_each_engine():
    s = STEP_FULL
    grpo = step.worker_spec(s, "cuda", "llama-3.1-8b", 1024, "lorarl-grpo")
    cb = step.worker_spec(s, "cuda", "llama-3.1-8b", 1024, "trl-cb")
    assert grpo["kind"] == "lorarl" and grpo["algo"] == "grpo" and grpo["engine"] == "fast"
    assert cb["kind"] == "trl" and cb["continuous_batching"] is True
    for spec in (grpo, cb):
        assert (spec["prompts"], spec["group_size"], spec["prompt_len"], spec["new_tokens"]) == (8, 8, 128, 1024)
        assert spec["budget_gb"] == 24 and spec["quantization"] == "nf4" and spec["lora_r"] == 16


def test_the_plan_of_the_8b_rows_at_1024_tokens(tmp_path, capsys):
    """The planner's view of the step part's Llama-3.1-8B rows at 1024 new tokens on 24 GB (what each GPU row
    records beside its measured peak): GRPO frees the fast engine's cache after each rollout and decodes 64 rows
    at once (21.2 GB with context and slack); PPO's no-grad scoring of 64 rows at once would need 30.0 GB, so it
    decodes and scores 32 at a time (19.7 GB)."""
    settings = STEP_FULL | {"models": ["llama-3.1-8b"], "new_tokens": [1024]}
    grpo, ppo = step.plan_rows(settings, tmp_path)
    assert (grpo["algo"], grpo["generation_batch"], grpo["keep_cache"]) == ("grpo", 64, False)
    assert grpo["peak_total_gb"] == grpo["one_batch_total_gb"] == pytest.approx(21.2, abs=0.05)
    assert (ppo["algo"], ppo["generation_batch"], ppo["keep_cache"]) == ("ppo", 32, False)
    assert ppo["one_batch_total_gb"] == pytest.approx(30.0, abs=0.05) and ppo["one_batch_total_gb"] > 24
    assert ppo["peak_total_gb"] == pytest.approx(19.7, abs=0.05) and ppo["peak_phase"] == "scoring"
    assert step.main(["plan", "--quick"]) == 0  # the command the docs name: one JSON line per lorarl row
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["model"], r["algo"], r["new_tokens"]) for r in lines] == [
        ("qwen2.5-1.5b", "grpo", 256),
        ("qwen2.5-1.5b", "ppo", 256),
    ]


def check_step_record(rec: dict) -> None:
    """The smoke mode's ``step.json`` (tiny NF4 model, 2 prompts x 2, 4 new tokens, 2 steps, on this CPU)."""
    res = rec["result"]
    rows = res["rows"]
    assert [(r["model"], r["algo"], r["new_tokens"], r["rows"]) for r in rows] == [
        ("tiny:nf4", "grpo", 4, 4),
        ("tiny:nf4", "ppo", 4, 4),
    ]
    for r in rows:
        lo = r["lorarl"]
        assert "error" not in lo, lo
        assert set(r["trl"]) == {"trl", "trl-cb"} and r["peer"] in r["trl"]
        for name, e in [("lorarl", lo), *r["trl"].items()]:
            assert "error" not in e, (name, e)
            assert e["memory_fraction"] is None, name  # the budget is applied on CUDA only
            assert e["nf4_projections"] == 14, name  # 2 layers x 7 projections, on both sides
            assert 0 < e["mean_completion_len"] <= 4 and e["peak_gb"] > 0, name
            assert min(e["generation_s"], e["step_s"]) > 0 and e["training_s"] >= 0, name  # phases inside the step
        peer = r["trl"][r["peer"]]
        assert peer["step_s"] == min(v["step_s"] for v in r["trl"].values())  # against TRL's fastest
        assert r["time_ratio"] == pytest.approx(lo["step_s"] / peer["step_s"], rel=1e-3)
        assert r["memory_ratio"] == pytest.approx(lo["peak_gb"] / peer["peak_gb"], rel=1e-3)
        assert r["trl"]["trl-cb"]["continuous_batching"] is True and r["trl"]["trl"]["continuous_batching"] is False
        assert math.isfinite(r["time_ratio"]) and math.isfinite(r["memory_ratio"])
        plan = lo["plan"]  # the planner's view on a 24 GB card: micro-batch 2 as written, the 4 rows in one batch
        assert (plan["micro_batch"], plan["generation_batch"], plan["keep_cache"]) == (2, 4, True), plan
        assert 0 < plan["peak_gb"] < plan["peak_total_gb"] == plan["one_batch_total_gb"], plan
    assert "critic_training" in rows[1]["lorarl"]["phase_seconds"]  # the PPO step trained its critic too
    assert rows[1]["lorarl"]["scoring_s"] > 0  # ... and scored with the reward adapter, reference and critic
    assert res["budget_gb"] == 24 and "Unsloth is not a column" in res["unsloth"]
    assert any("GRPO 4 rows x 4 new tokens" in h and "time ratio" in h for h in rec["headline"])
    assert any("(planned " in h and "generation batch 4, keep_cache true)" in h for h in rec["headline"])
    assert rec["headline"][-1] == res["unsloth"]


def test_quick_plan_keeps_every_engine_and_the_flag_is_wired(tmp_path, monkeypatch):
    from lorarl.bench.gpu import full_settings, quick_settings
    from lorarl.cli import main as cli_main

    full, quick = full_settings(), quick_settings()
    assert quick["step"]["trl_variants"] == full["step"]["trl_variants"] == ["trl", "trl-cb"]
    assert (quick["step"]["models"], quick["step"]["new_tokens"]) == (["qwen2.5-1.5b"], [256])
    assert quick["step"]["budget_gb"] == 24 and quick["step"]["prompts"] * quick["step"]["group_size"] == 64
    assert set(quick["rollout"]["shapes"]) < set(full["rollout"]["shapes"])
    assert quick["rollout"]["batches"] == full["rollout"]["batches"]  # every batch size, fewer repeats
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "gpu", "--quick", "--part", "step", "--out", str(tmp_path)]) == 2  # no GPU: refused
