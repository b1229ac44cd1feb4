"""``lorarl bench judge``: its statistics against hand-computed values, and one tiny run of both parts."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.bench.judge import agreement, pearson, run, threshold_agreement


def test_statistics_by_hand():
    # x = [0, 1, 1, 0], y = [0.2, 0.8, 0.6, 0.4]: mx 0.5, my 0.5; sxy = 0.15+0.15+0.05+0.05 = 0.4;
    # sxx = 1; syy = 0.09+0.09+0.01+0.01 = 0.2 -> r = 0.4 / sqrt(0.2) = 0.894427
    assert pearson([0, 1, 1, 0], [0.2, 0.8, 0.6, 0.4]) == pytest.approx(0.894427, abs=1e-6)
    assert math.isnan(pearson([1, 1], [0, 1])) and math.isnan(pearson([1], [1]))
    assert threshold_agreement([0.9, 0.2, 0.5, 0.4], [1.0, 0.0, 0.0, 1.0]) == 0.5
    a = agreement(torch.tensor([0.9, float("nan"), 0.1, 0.7]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert a["rows"] == 4 and a["parse_failure_rate"] == 0.25 and a["threshold_agreement"] == pytest.approx(2 / 3)
    assert a["judge_mean"] == pytest.approx(1.7 / 3)
    assert a["pearson"] == pytest.approx(pearson([0.9, 0.1, 0.7], [1.0, 0.0, 0.0]))


def test_bench_judge_runs_both_parts_on_a_tiny_model(tiny_model_dir, tmp_path):
    small = ["train.prompts_per_step=2", "grpo.group_size=2", "generation.max_new_tokens=4", "train.report_to=[]"]
    res = run(tmp_path / "bench", model=str(tiny_model_dir), prompts_n=2, group=2, steps=1, overrides=small)
    agree = res["agreement"]
    assert agree["completions"] == 4
    assert set(agree["variants"]) == {
        "pointwise",
        "pointwise_prefixed",
        "pointwise_with_answer_prefixed",
        "group",
        "group_prefixed",
    }
    for v in agree["variants"].values():
        assert v["rows"] == 4 and 0.0 <= v["parse_failure_rate"] <= 1.0 and v["judge_seconds"] > 0
    cost = res["step_cost"]
    assert cost["rules"]["ratio_to_rules"] == 1.0
    assert cost["judge_group"]["step_seconds"] > 0 and cost["judge_pointwise"]["judge_failed_rows_last"] is not None
    assert (tmp_path / "bench" / "result.json").is_file() and (tmp_path / "bench" / "judge.jsonl").is_file()
