"""Tests for lorarl.core.ops: masked statistics against hand-computed values."""

import math

import pytest
import torch

from lorarl.core.ops import masked_mean, masked_sum, masked_var, masked_whiten

RTOL = 1e-5
ATOL = 1e-6


def close(actual, expected, rtol=RTOL, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
M = torch.tensor([[True, True, True, False], [True, False, False, False]])


@pytest.mark.parametrize("mask", [M, M.float(), M.long()])
def test_masked_sum_and_mean_hand_values(mask):
    close(masked_sum(X, mask), 16.0)
    close(masked_sum(X, mask, dim=-1), [6.0, 10.0])
    close(masked_sum(X, mask, dim=0), [11.0, 2.0, 3.0, 0.0])
    close(masked_mean(X, mask), 4.0)
    close(masked_mean(X, mask, dim=-1), [2.0, 10.0])
    close(masked_mean(X, mask, dim=0), [5.5, 2.0, 3.0, 0.0])  # empty column -> 0


def test_masked_mean_empty_mask_is_zero_not_nan():
    empty = torch.zeros_like(M)
    out = masked_mean(X, empty)
    assert torch.isfinite(out) and out.item() == 0.0
    rows = masked_mean(X, torch.tensor([[True, False, False, False], [False] * 4]), dim=-1)
    close(rows, [1.0, 0.0])
    assert masked_sum(X, empty).item() == 0.0


def test_masked_ops_ignore_nan_and_inf_padding_values_and_gradients():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("-inf")]], requires_grad=True)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(x, m), 7.0)
    close(masked_mean(x, m), 7.0 / 3.0)
    var = masked_var(x, m)
    close(var, ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    w = masked_whiten(x, m)
    assert torch.isfinite(w).all()
    (masked_mean(x, m) + var + w.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~m.bool()] == 0).all()


def test_masked_mean_gradient_is_mask_over_count():
    x = X.clone().requires_grad_(True)
    masked_mean(x, M).backward()
    close(x.grad, M.float() / 4.0)


def test_masked_var_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    close(masked_var(x, m), 1.0)
    close(masked_var(x, m, unbiased=False), 2.0 / 3.0)
    # 2-D, mask over everything masked: valid entries 1, 2, 3, 10 -> mean 4, squared deviations 9+4+1+36 = 50
    close(masked_var(X, M), 50.0 / 3.0)
    close(masked_var(X, M, unbiased=False), 50.0 / 4.0)


def test_masked_var_matches_torch_var_on_random_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64)
    m = torch.rand(5, 7, generator=g) > 0.4
    vals = x[m]
    close(masked_var(x, m), vals.var(unbiased=True), rtol=1e-10, atol=1e-12)
    close(masked_var(x, m, unbiased=False), vals.var(unbiased=False), rtol=1e-10, atol=1e-12)


def test_masked_var_degenerate_cases_are_zero():
    x = torch.tensor([5.0, 7.0])
    assert masked_var(x, torch.tensor([1, 0])).item() == 0.0  # n = 1, unbiased
    assert masked_var(x, torch.tensor([1, 0]), unbiased=False).item() == 0.0
    assert masked_var(x, torch.tensor([0, 0])).item() == 0.0  # empty


def test_masked_whiten_hand_values():
    x = torch.tensor([1.0, 3.0, 99.0])
    m = torch.tensor([True, True, False])
    # mean 2, unbiased var 2 -> (x - 2) / sqrt(2)
    close(masked_whiten(x, m, eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])
    close(masked_whiten(x, m, shift_mean=False, eps=0.0), [2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0])
    # eps enters under the square root
    close(masked_whiten(x, m, eps=2.0), [-0.5, 0.5, 0.0])


def test_masked_whiten_statistics_on_random_data():
    g = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    m = torch.rand(6, 9, generator=g) > 0.3
    w = masked_whiten(x, m, eps=0.0)
    close(masked_mean(w, m), 0.0, atol=1e-12)
    close(masked_var(w, m), 1.0, rtol=1e-10)
    assert (w[~m] == 0).all()
    ws = masked_whiten(x, m, shift_mean=False, eps=0.0)
    close(masked_mean(ws, m), masked_mean(x, m), rtol=1e-10)


def test_pure_functions_do_not_modify_arguments():
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    x0, m0 = x.clone(), m.clone()
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        fn(x, m)
    torch.testing.assert_close(x, x0, equal_nan=True)
    torch.testing.assert_close(m, m0)


def test_nan_std_by_hand():
    from lorarl.core.stats import nan_std

    # [1, 3, nan]: mean 2, sum of squares 2, n - 1 = 1 -> sqrt(2)
    assert nan_std(torch.tensor([1.0, 3.0, float("nan")])) == pytest.approx(2**0.5, abs=1e-12)
    # [0, 0, 1, 1]: mean 0.5, sum of squares 1, n - 1 = 3 -> sqrt(1/3)
    assert nan_std(torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx((1 / 3) ** 0.5, abs=1e-12)
    assert nan_std(torch.tensor([5.0, float("nan")])) == 0.0 and nan_std(torch.tensor([])) == 0.0
