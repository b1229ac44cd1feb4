"""``bench rollout``'s figures and printed line (lorarl.bench.rollout_report) against hand-computed values."""

import pytest

from lorarl.bench.rollout_report import batch_row, format_row, kernel_text, per_step, ratio


def test_per_step_takes_the_median_or_best_difference_over_the_extra_steps():
    full = [{"wall": 0.5, "steps": 5}, {"wall": 0.7, "steps": 5}, {"wall": 0.6, "steps": 5}]
    one = [{"wall": 0.1}, {"wall": 0.2}, {"wall": 0.1}]
    assert per_step(full, one, "wall") == pytest.approx(1000 * (0.6 - 0.1) / 4)  # 125 ms
    assert per_step(full, one, "wall", min) == pytest.approx(1000 * (0.5 - 0.1) / 4)  # 100 ms
    assert per_step([{"wall": 0.3, "steps": 1}], [{"wall": 0.1}], "wall") == pytest.approx(200.0)  # s - 1 >= 1


def test_ratio_rounds_to_three_places_and_refuses_a_non_positive_divisor():
    assert ratio(3, 2) == 1.5 and ratio(1, 3) == 0.333
    assert ratio(1, 0) is None and ratio(1, -0.5) is None


def _res(kernel_ms=None):
    res = {
        "hf": {"ms_per_step": 10.0, "best_ms_per_step": 8.0, "cpu_ms_per_step": 12.0, "tokens_per_s": 100.0},
        "fast": {"ms_per_step": 4.0, "best_ms_per_step": 2.0, "cpu_ms_per_step": 6.0, "tokens_per_s": 250.0},
    }
    if kernel_ms is not None:
        res["fast_kernel"] = {"ms_per_step": kernel_ms}
    return res


def test_batch_row_ratios_against_the_bound_and_the_target():
    row = batch_row("m", 16, _res(2.5), 1_250_000, 1.25, None, 3.0)
    assert (row["speedup"], row["speedup_best"], row["cpu_speedup"]) == (2.5, 4.0, 2.0)  # 10/4, 8/2, 12/6
    assert (row["fast_over_bound"], row["hf_over_bound"]) == (3.2, 8.0)  # 4/1.25, 10/1.25
    assert (row["kernel_over_bound"], row["kernel_speedup"]) == (2.0, 1.6)  # 2.5/1.25, 4/2.5
    assert row["kernel_meets_target"] is True and row["target_over_bound"] == 3.0
    assert batch_row("m", 16, _res(2.5), 1_250_000, 1.25, None, 1.5)["kernel_meets_target"] is False  # 2.0 > 1.5
    assert "kernel_meets_target" not in batch_row("m", 16, _res(2.5), 1_250_000, 1.25, None, None)
    skipped = batch_row("m", 1, _res(), 1_250_000, 1.25, "no CUDA", 3.0)
    assert skipped["fast_kernel"] is None and skipped["fast_kernel_skipped"] == "no CUDA"
    assert "kernel_over_bound" not in skipped and "kernel_speedup" not in skipped


def test_the_printed_line():
    row = batch_row("m", 16, _res(2.5), 1_250_000, 1.25, None, 3.0)
    assert format_row(row) == (
        "  m              B=16  hf    10.00 ms/step     100.0 tok/s | fast     4.00 ms/step     250.0 tok/s"
        " | hf/fast 2.5 (best 4.0, cpu 2.0) | bound 1.250 ms (fast x3.2, hf x8.0) | cpu ms/step hf 12.0 fast 6.0"
        " | fast_kernel 2.50 ms/step, x2.0 the bound (target <= x3.0: met), fast/fast_kernel 1.6"
    )
    assert kernel_text(batch_row("m", 1, _res(), 1_250_000, 1.25, "no CUDA", None)) == "fast_kernel not run: no CUDA"
    missed = batch_row("m", 64, _res(10.0), 1_250_000, 1.25, None, 6.0)  # 10 / 1.25 = x8 > x6
    assert kernel_text(missed).endswith("x8.0 the bound (target <= x6.0: NOT met), fast/fast_kernel 0.4")
