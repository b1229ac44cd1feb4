"""Tests for lorarl.core.losses against hand-computed values, torch.distributions and Monte-Carlo estimates."""

import functools
import math

import pytest
import torch

from lorarl.core.losses import (
    LOSS_REDUCTIONS,
    bradley_terry_loss,
    entropy_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_importance_weighted,
    ppo_clip_loss,
    reduce_loss,
    value_loss,
)

RTOL = 1e-5
ATOL = 1e-6


def close(actual, expected, rtol=RTOL, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------ PPO clip


def test_ppo_clip_seed_example():
    # Seed: log pi_old = -2.1, log pi = -1.8 -> ratio e^0.3 = 1.3499 ; eps 0.2, A = 0.2
    # unclipped 0.26997, clipped 1.2 * 0.2 = 0.24 -> objective min = 0.24, loss -0.24, no gradient
    logprobs = torch.tensor([[-1.8]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-2.1]], dtype=torch.float64)
    loss, stats = ppo_clip_loss(logprobs, old, torch.tensor([0.2], dtype=torch.float64), torch.ones(1, 1))
    assert math.exp(0.3) == pytest.approx(1.3499, abs=1e-4)
    close(loss, [[-0.24]])
    close(stats["ratio_mean"], math.exp(0.3))
    close(stats["clip_frac_high"], 1.0)
    close(stats["clip_frac_low"], 0.0)
    loss.sum().backward()
    assert logprobs.grad.item() == 0.0


@pytest.mark.parametrize(
    "log_ratio, adv, clipped, expected_loss",
    [
        # A > 0, ratio above the band: clipped at 1 + eps -> -(1.2 * 2)
        (math.log(1.5), 2.0, "high", -2.4),
        # A > 0, ratio below the band: unclipped (min picks ratio * A) -> -(0.5 * 2)
        (math.log(0.5), 2.0, None, -1.0),
        # A < 0, ratio above the band: unclipped (ratio * A is the smaller) -> -(1.5 * -2)
        (math.log(1.5), -2.0, None, 3.0),
        # A < 0, ratio below the band: clipped at 1 - eps -> -(0.8 * -2)
        (math.log(0.5), -2.0, "low", 1.6),
        # inside the band: unclipped whatever the sign
        (math.log(1.1), 2.0, None, -2.2),
        (math.log(0.9), -2.0, None, 1.8),
    ],
)
def test_ppo_clip_four_cases_values_and_gradients(log_ratio, adv, clipped, expected_loss):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logprobs = (old + log_ratio).clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logprobs, old, torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1))
    close(loss, [[expected_loss]])
    loss.sum().backward()
    ratio = math.exp(log_ratio)
    if clipped is None:
        # d(-ratio * A) / d logprobs = -ratio * A
        close(logprobs.grad, [[-ratio * adv]])
    else:
        assert logprobs.grad.item() == 0.0
    close(stats["clip_frac_high"], 1.0 if clipped == "high" else 0.0)
    close(stats["clip_frac_low"], 1.0 if clipped == "low" else 0.0)


def test_ppo_clip_higher_asymmetric_bounds():
    # DAPO clip-higher: eps_low 0.2, eps_high 0.28 ; ratio 1.25 with A > 0 is no longer clipped, 1.3 is
    old = torch.zeros(1, 3, dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.25, 1.3, 0.75]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, stats = ppo_clip_loss(logprobs, old, adv, torch.ones(1, 3), eps_low=0.2, eps_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8]])
    close(stats["clip_frac_high"], 1.0 / 3.0)
    close(stats["clip_frac_low"], 1.0 / 3.0)


def test_ppo_clip_broadcast_advantages_mask_and_stats():
    nan = float("nan")
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, nan, nan]], dtype=torch.float64)
    lr = torch.tensor([[0.0, math.log(1.5), math.log(0.5)], [math.log(0.7), 0.0, 0.0]], dtype=torch.float64)
    logprobs = (torch.nan_to_num(old, nan=0.0) + lr).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv_b = torch.tensor([1.0, -1.0], dtype=torch.float64)
    ratios = [1.0, 1.5, 0.5, 0.7]
    # row 0, A = +1: [-1, -1.2 (clipped high), -0.5] ; row 1, A = -1: ratio 0.7 < 0.8 -> clipped low: +0.8
    expected = [[-1.0, -1.2, -0.5], [0.8, 0.0, 0.0]]
    for adv in (adv_b, adv_b[:, None], adv_b[:, None].expand(2, 3)):
        loss, stats = ppo_clip_loss(logprobs, old, adv, mask)
        close(loss, expected)
        close(stats["clip_frac_high"], 0.25)
        close(stats["clip_frac_low"], 0.25)
        close(stats["ratio_mean"], sum(ratios) / 4)
        close(stats["approx_kl"], sum((r - 1) - math.log(r) for r in ratios) / 4)
        assert all(not s.requires_grad and s.dim() == 0 for s in stats.values())
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    close(logprobs.grad, [[-1.0, 0.0, -0.5], [0.0, 0.0, 0.0]])


# ------------------------------------------------------------------ value loss


def test_value_loss_mse_unclipped_half_convention():
    v = torch.tensor([[1.0, 2.0, 7.0]], requires_grad=True)
    ret = torch.tensor([[1.5, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(v, v.detach(), ret, mask)
    close(loss, [[0.125, 2.0, 0.0]])
    close(stats["clip_frac"], 0.0)
    loss.sum().backward()
    close(v.grad, [[-0.5, 2.0, 0.0]])  # d 0.5 (v - R)^2 / dv = v - R


def test_value_loss_clipped_hand_values():
    # c = 0.2
    # token 0: v 1.0, old 0.5, R 1.2 -> unclipped 0.02, v_clip 0.7 -> 0.125 : clipped active, grad 0
    # token 1: v 1.0, old 0.5, R 0.0 -> unclipped 0.5, v_clip 0.7 -> 0.245 : unclipped active, grad v - R = 1
    # token 2: v 0.6, old 0.5, R 2.0 -> inside the clip range, both equal 0.98, grad v - R = -1.4
    v = torch.tensor([[1.0, 1.0, 0.6]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    ret = torch.tensor([[1.2, 0.0, 2.0]], dtype=torch.float64)
    loss, stats = value_loss(v, old, ret, torch.ones(1, 3), clip_range=0.2)
    close(loss, [[0.125, 0.5, 0.98]])
    close(stats["clip_frac"], 1.0 / 3.0)
    loss.sum().backward()
    close(v.grad, [[0.0, 1.0, -1.4]])


def test_value_loss_huber():
    v = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.5, 3.0]], dtype=torch.float64)
    loss, _ = value_loss(v, v, ret, torch.ones(1, 2), kind="huber", huber_delta=1.0)
    close(loss, [[0.125, 2.5]])  # 0.5 * 0.25 ; 1 * (3 - 0.5)
    loss2, _ = value_loss(v, v, ret, torch.ones(1, 2), kind="huber", huber_delta=2.0)
    close(loss2, [[0.125, 4.0]])  # 2 * (3 - 1)
    # huber with clipping: v 1.0, old 0.0, c 0.5, R 4 -> l(-3) = 2.5 ; v_clip 0.5 -> l(-3.5) = 3.0
    loss3, stats = value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[4.0]]), torch.ones(1, 1), 0.5, "huber"
    )
    close(loss3, [[3.0]])
    close(stats["clip_frac"], 1.0)
    with pytest.raises(ValueError):
        value_loss(v, v, ret, torch.ones(1, 2), kind="l1")


# ------------------------------------------------------------------ KL estimators


def test_kl_estimators_hand_values():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    close(kl_k1(lp, ref), [0.5, 0.0])
    close(kl_k2(lp, ref), [0.125, 0.0])
    close(kl_k3(lp, ref), [math.exp(-0.5) + 0.5 - 1.0, 0.0])  # 0.1065307
    old = torch.tensor([-1.2, -2.0])
    close(kl_k3_importance_weighted(lp, ref, old), [math.exp(0.2) * (math.exp(-0.5) - 0.5), 0.0])


def test_k3_nonnegative_on_random_inputs_and_tiny_differences():
    g = torch.Generator().manual_seed(0)
    lp = -5 * torch.rand(10000, generator=g)
    ref = -5 * torch.rand(10000, generator=g)
    assert (kl_k3(lp, ref) >= 0).all()
    assert (kl_k2(lp, ref) >= 0).all()
    tiny = lp + 1e-7 * torch.randn(10000, generator=g)
    assert (kl_k3(lp, tiny) >= 0).all()
    # small d: k3 ~ d^2 / 2 without cancellation
    d = torch.tensor([1e-4], dtype=torch.float64)
    close(kl_k3(torch.zeros(1, dtype=torch.float64), d), [0.5e-8 + 1e-12 / 6], rtol=1e-8, atol=0.0)


def _categoricals():
    g = torch.Generator().manual_seed(7)
    logits_p = torch.randn(8, generator=g, dtype=torch.float64)
    logits_q = logits_p + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)  # reference, close to p
    logits_o = logits_p + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)  # old policy, a third one
    return logits_p, logits_q, logits_o, g


def test_k1_and_k3_monte_carlo_match_exact_kl_and_k3_has_lower_variance():
    logits_p, logits_q, _, g = _categoricals()
    p = torch.distributions.Categorical(logits=logits_p)
    q = torch.distributions.Categorical(logits=logits_q)
    exact = torch.distributions.kl_divergence(p, q).item()
    n = 200_000
    x = torch.multinomial(p.probs, n, replacement=True, generator=g)
    lp, lq = p.log_prob(x), q.log_prob(x)
    for est in (kl_k1(lp, lq), kl_k3(lp, lq)):
        se = est.std().item() / math.sqrt(n)
        assert abs(est.mean().item() - exact) < 4 * se
    assert kl_k3(lp, lq).var().item() < kl_k1(lp, lq).var().item()
    # exact expectations (sum over the 8 categories) equal the KL too -- k1 and k3 are unbiased
    allx = torch.arange(8)
    probs = p.probs
    close((probs * kl_k1(p.log_prob(allx), q.log_prob(allx))).sum(), exact, rtol=1e-10)
    close((probs * kl_k3(p.log_prob(allx), q.log_prob(allx))).sum(), exact, rtol=1e-10)


def test_importance_weighted_k3_matches_kl_with_samples_from_old_policy():
    logits_p, logits_q, logits_o, g = _categoricals()
    p = torch.distributions.Categorical(logits=logits_p)
    q = torch.distributions.Categorical(logits=logits_q)
    old = torch.distributions.Categorical(logits=logits_o)
    exact = torch.distributions.kl_divergence(p, q).item()
    n = 200_000
    x = torch.multinomial(old.probs, n, replacement=True, generator=g)
    est = kl_k3_importance_weighted(p.log_prob(x), q.log_prob(x), old.log_prob(x))
    se = est.std().item() / math.sqrt(n)
    assert abs(est.mean().item() - exact) < 4 * se
    # plain k3 on samples from old estimates a different quantity: it is off by many standard errors
    plain = kl_k3(p.log_prob(x), q.log_prob(x))
    assert abs(plain.mean().item() - exact) > 10 * plain.std().item() / math.sqrt(n)


def test_importance_weighted_k3_gradient_is_gradient_of_kl():
    # exact expectation over old: sum_x old(x) * rho(x) k3(x); its gradient w.r.t. the policy logits must equal the
    # gradient of KL(p || ref) -- only because rho is NOT detached.
    logits_p, logits_q, logits_o, _ = _categoricals()
    allx = torch.arange(8)
    lq = torch.log_softmax(logits_q, -1)
    lo = torch.log_softmax(logits_o, -1)
    w = logits_p.clone().requires_grad_(True)
    lp = torch.log_softmax(w, -1)
    torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=w), torch.distributions.Categorical(logits=logits_q)
    ).backward()
    grad_kl = w.grad.clone()
    w.grad = None
    expectation = (lo.exp() * kl_k3_importance_weighted(lp[allx], lq[allx], lo[allx])).sum()
    expectation.backward()
    close(w.grad, grad_kl, rtol=1e-10, atol=1e-12)
    # with rho detached the gradient is a different one (that of the reverse KL)
    w.grad = None
    lp = torch.log_softmax(w, -1)
    detached = (lo.exp() * torch.exp(lp - lo).detach() * kl_k3(lp, lq)).sum()
    detached.backward()
    assert (w.grad - grad_kl).abs().max() > 1e-3


# ------------------------------------------------------------------ entropy


def test_entropy_matches_torch_distributions():
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(2, 5, 17, generator=g, dtype=torch.float64)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    close(entropy_from_logits(logits), expected, rtol=1e-10, atol=1e-12)
    close(entropy_from_logits(torch.zeros(4)), math.log(4))
    close(entropy_from_logits(torch.tensor([0.0, 0.0, float("-inf")])), math.log(2))


def test_entropy_gradient_finite_with_banned_tokens_and_matches_distributions():
    logits = torch.tensor([[1.0, -0.5, float("-inf"), 2.0]], dtype=torch.float64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    g1 = logits.grad.clone()
    assert torch.isfinite(g1).all() and g1[0, 2] == 0
    logits2 = logits.detach().clone().requires_grad_(True)
    torch.distributions.Categorical(logits=logits2).entropy().sum().backward()
    close(g1, logits2.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ Bradley-Terry


def test_bradley_terry_values_and_gradient():
    rc = torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    loss = bradley_terry_loss(rc, rr)
    close(loss, [-math.log(sigmoid(1.0)), math.log(2.0), -math.log(sigmoid(-3.0))])  # 0.313262, 0.693147, 3.048587
    loss.sum().backward()
    expected = [-(1 - sigmoid(d)) for d in (1.0, 0.0, -3.0)]
    close(rc.grad, expected)
    close(rr.grad, [-e for e in expected])


def test_bradley_terry_margin_and_centering():
    rc = torch.tensor([1.0, 0.5], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.5], dtype=torch.float64)
    margin = torch.tensor([0.5, -1.0], dtype=torch.float64)
    loss = bradley_terry_loss(rc, rr, margin=margin, center_coef=0.01)
    # d = rc - rr - margin = [0.5, 1.0] ; center terms 0.01 * [1, 1]
    close(loss, [-math.log(sigmoid(0.5)) + 0.01, -math.log(sigmoid(1.0)) + 0.01])
    loss.sum().backward()
    close(rc.grad, [-(1 - sigmoid(0.5)) + 0.02 * 1.0, -(1 - sigmoid(1.0)) + 0.02 * 1.0])


# ------------------------------------------------------------------ reduce_loss


def test_reduce_loss_hand_values():
    per_token = torch.tensor([[1.0, 3.0], [5.0, float("nan")], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])  # the docstring's example: row 2 has no valid token
    kw = dict(total_rows=3, total_sequences=2, total_tokens=3, max_len=4)
    close(reduce_loss(per_token, mask, "seq_mean_token_mean", **kw), 3.5)  # (2 + 5) / 2
    close(reduce_loss(per_token, mask, "token_mean", **kw), 3.0)  # 9 / 3
    close(reduce_loss(per_token, mask, "seq_sum_norm", **kw), 0.75)  # 9 / (3 * 4): every row counts
    with pytest.raises(ValueError):
        reduce_loss(per_token, mask, "mean", **kw)
    with pytest.raises(ValueError):
        reduce_loss(per_token, mask, "token_mean", total_rows=3, total_sequences=2, total_tokens=0, max_len=4)
    with pytest.raises(ValueError):
        reduce_loss(per_token, mask, "seq_sum_norm", total_rows=0, total_sequences=2, total_tokens=3, max_len=4)


SPLIT_INVARIANT = sorted(set(LOSS_REDUCTIONS) - {"micro_batch_token_mean"})  # BNPO normalises per micro-batch


@pytest.mark.parametrize("mode", SPLIT_INVARIANT)
def test_reduce_loss_micro_batches_sum_to_full_batch_values_and_gradients(mode):
    g = torch.Generator().manual_seed(11)
    B, T, max_len = 7, 9, 12
    lengths = torch.tensor([9, 1, 4, 6, 2, 9, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # right padded
    features = torch.randn(B, T, 3, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, generator=g, dtype=torch.float64)
    kw = dict(total_rows=B, total_sequences=B, total_tokens=mask.sum(), max_len=max_len)

    w = w0.clone().requires_grad_(True)
    full = reduce_loss((features @ w) ** 2, mask, mode, **kw)
    full.backward()
    full_grad = w.grad.clone()

    for splits in ([3, 4], [1, 2, 4], [1] * 7):
        w = w0.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for rows in torch.split(torch.arange(B), splits):
            mb_mask = mask[rows]
            t_max = int(mb_mask.sum(1).max())  # micro-batches trimmed to their own longest row
            part = reduce_loss((features[rows, :t_max] @ w) ** 2, mb_mask[:, :t_max], mode, **kw)
            part.backward()  # gradient accumulation
            total = total + part.detach()
        torch.testing.assert_close(total, full.detach(), rtol=1e-10, atol=1e-6)
        torch.testing.assert_close(w.grad, full_grad, rtol=1e-10, atol=1e-6)


def test_reduce_loss_modes_differ_and_match_definitions():
    g = torch.Generator().manual_seed(5)
    per_token = torch.rand(4, 6, generator=g, dtype=torch.float64)
    lengths = [6, 2, 3, 1]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    rows = [per_token[i, :n].tolist() for i, n in enumerate(lengths)]
    kw = dict(total_rows=4, total_sequences=4, total_tokens=12, max_len=10)
    close(reduce_loss(per_token, mask, "seq_mean_token_mean", **kw), sum(sum(r) / len(r) for r in rows) / 4)
    close(reduce_loss(per_token, mask, "token_mean", **kw), sum(sum(r) for r in rows) / 12)
    close(reduce_loss(per_token, mask, "seq_sum_norm", **kw), sum(sum(r) for r in rows) / 40)
    close(reduce_loss(per_token, mask, "seq_mean_token_sum", **kw), sum(sum(r) for r in rows) / 4)  # LUSPO
    close(reduce_loss(per_token, mask, "micro_batch_token_mean", **kw), sum(sum(r) for r in rows) / 12)  # one mb


def test_micro_batch_token_mean_is_each_micro_batch_token_mean_weighted_by_rows():
    """BNPO (TRL's ``bnpo``): each micro-batch's own token mean, times its share of the batch's rows -- so, unlike
    the other reductions, the split changes the loss. Hand values: rows of 2 and 1 tokens in micro-batch 1, of 3
    and 1 in micro-batch 2 (2 rows each, of 4): ``(1 + 2 + 3) / 3 * 2/4 + (4 + 5 + 6 + 8) / 4 * 2/4 = 1 + 2.875``;
    as one micro-batch, the token mean ``29 / 7``."""
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 9.0, 9.0], [4.0, 5.0, 6.0], [8.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    kw = dict(total_rows=4, total_sequences=4, total_tokens=7, max_len=3)
    parts = [reduce_loss(per_token[r], mask[r], "micro_batch_token_mean", **kw) for r in (slice(0, 2), slice(2, 4))]
    close(sum(parts), 1.0 + 2.875)
    close(reduce_loss(per_token, mask, "micro_batch_token_mean", **kw), 29.0 / 7)


def test_losses_do_not_modify_arguments():
    lp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.1, float("nan")]])
    adv = torch.tensor([0.5])
    m = torch.tensor([[1.0, 0.0]])
    saved = [t.clone() for t in (lp, old, adv, m)]
    ppo_clip_loss(lp, old, adv, m)
    value_loss(lp, old, lp, m, clip_range=0.1)
    reduce_loss(lp, m, "token_mean", total_rows=1, total_sequences=1, total_tokens=1, max_len=2)
    for a, b in zip((lp, old, adv, m), saved, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_batch_totals_leave_out_rows_without_a_token():
    from lorarl.core.losses import batch_totals

    want = {"total_rows": 3, "total_sequences": 2, "total_tokens": 3}  # the masked row counts in total_rows only
    assert batch_totals(torch.tensor([[1, 1], [0, 0], [1, 0]])) == want
    nothing = {"total_rows": 2, "total_sequences": 1, "total_tokens": 1}  # a zero loss, no division by zero
    assert batch_totals(torch.zeros(2, 3)) == nothing


def test_a_masked_out_row_does_not_shrink_the_sequence_mean():
    """DAPO's overlong filtering masks truncated rows; the GRPO sequence mean is over the rows that remain, while
    Dr. GRPO's normaliser keeps every row (TRL's dr_grpo: rows x max_len, the same every step) (hand values), and
    micro-batches (one holding only the masked row) still sum to the batch loss."""
    from lorarl.core.losses import batch_totals

    loss = torch.tensor([[1.0, 3.0], [7.0, 7.0], [5.0, 0.0]])
    m = torch.tensor([[True, True], [False, False], [True, False]])  # row 1 truncated and masked
    kw = dict(**batch_totals(m), max_len=4)
    close = functools.partial(torch.testing.assert_close, rtol=0, atol=1e-6)
    close(reduce_loss(loss, m, "seq_mean_token_mean", **kw), torch.tensor((2.0 + 5.0) / 2))  # not / 3
    close(reduce_loss(loss, m, "token_mean", **kw), torch.tensor(9.0 / 3))
    close(reduce_loss(loss, m, "seq_sum_norm", **kw), torch.tensor(9.0 / (3 * 4)))  # not / (2 * 4)
    for mode, whole in (("seq_mean_token_mean", 3.5), ("seq_sum_norm", 0.75)):
        parts = sum(reduce_loss(loss[r], m[r], mode, **kw) for r in ([0], [1], [2]))
        close(parts, torch.tensor(whole))
