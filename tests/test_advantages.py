"""Tests for lorarl.core.advantages against hand-computed values and plain reference loops."""

import math

import pytest
import torch

from lorarl.core.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    group_advantages,
    kl_penalized_reward,
    kl_shaped_rewards,
)

RTOL = 1e-5
ATOL = 1e-6


def close(actual, expected, rtol=RTOL, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------ group_advantages


def test_group_advantages_seed_example_population_std():
    # Seed (GRPO article): rewards [1.0, 0.8, 0.4, 0.2], mean 0.6, std 0.32 -> ~[+1.25, +0.63, -0.63, -1.25].
    # Exactly: population std sqrt(0.1) = 0.316228 -> +-0.4/0.316228 = 1.264911, +-0.2/0.316228 = 0.632456.
    r = torch.tensor([1.0, 0.8, 0.4, 0.2])
    out = group_advantages(r, group_size=4, eps=0.0)
    close(out.advantages, [1.264911, 0.632456, -0.632456, -1.264911])
    close(out.group_mean, [0.6])
    close(out.group_std, [math.sqrt(0.1)])
    assert out.zero_std.tolist() == [False]
    # default eps = 1e-4 sits in the denominator: 0.4 / (0.316228 + 1e-4)
    out = group_advantages(r, group_size=4)
    s = math.sqrt(0.1) + 1e-4
    close(out.advantages, [0.4 / s, 0.2 / s, -0.2 / s, -0.4 / s])


def test_group_advantages_unbiased_std():
    r = torch.tensor([1.0, 0.8, 0.4, 0.2])
    out = group_advantages(r, group_size=4, eps=0.0, unbiased_std=True)
    s = math.sqrt(0.4 / 3)  # sum of squared deviations 0.4, n - 1 = 3
    close(out.group_std, [s])
    close(out.advantages, [0.4 / s, 0.2 / s, -0.2 / s, -0.4 / s])


def test_group_advantages_several_groups_and_zero_std_group():
    # group 0: [0, 1] -> mean 0.5, std 0.5 ; group 1: [1, 1] zero std ; group 2: [3, 1] -> mean 2, std 1
    r = torch.tensor([0.0, 1.0, 1.0, 1.0, 3.0, 1.0])
    out = group_advantages(r, group_size=2, eps=0.0)
    close(out.advantages, [-1.0, 1.0, 0.0, 0.0, 1.0, -1.0])
    close(out.group_mean, [0.5, 1.0, 2.0])
    close(out.group_std, [0.5, 0.0, 1.0])
    assert out.zero_std.tolist() == [False, True, False]


def test_zero_std_group_gives_exact_zeros_even_with_rounding():
    # 0.1 * 3 summed in float is not exactly 0.3: the std is rounding noise, yet advantages must be exactly 0
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.3])
    for scaling in ("group", "batch", "none"):
        out = group_advantages(r, group_size=3, std_scaling=scaling)
        assert out.zero_std.tolist() == [True, False]
        assert (out.advantages[:3] == 0).all()


def test_group_advantages_batch_scaling():
    r = torch.tensor([0.0, 1.0, 1.0, 1.0, 3.0, 1.0])
    out = group_advantages(r, group_size=2, std_scaling="batch", eps=0.0)
    mu = 7.0 / 6.0
    batch_std = math.sqrt(sum((x - mu) ** 2 for x in r.tolist()) / 6)
    close(out.advantages, [-0.5 / batch_std, 0.5 / batch_std, 0.0, 0.0, 1.0 / batch_std, -1.0 / batch_std])
    close(out.group_std, [0.5, 0.0, 1.0])  # still the group std
    out_u = group_advantages(r, group_size=2, std_scaling="batch", eps=0.0, unbiased_std=True)
    batch_std_u = math.sqrt(sum((x - mu) ** 2 for x in r.tolist()) / 5)
    close(out_u.advantages[0], -0.5 / batch_std_u)


def test_group_advantages_none_scaling_only_centres():
    r = torch.tensor([1.0, 0.8, 0.4, 0.2, 5.0, 5.0, 5.0, 5.0])
    out = group_advantages(r, group_size=4, std_scaling="none")
    close(out.advantages, [0.4, 0.2, -0.2, -0.4, 0.0, 0.0, 0.0, 0.0])
    assert out.zero_std.tolist() == [False, True]


def test_group_advantages_nan_rewards_are_left_out():
    nan = float("nan")
    # group 0: [1, nan, 0, 2] -> valid 1, 0, 2: mean 1, population std sqrt(2/3)
    # group 1: [nan, nan, nan, nan] -> no signal ; group 2: [nan, 4, nan, nan] -> one valid reward, no signal
    r = torch.tensor([1.0, nan, 0.0, 2.0, nan, nan, nan, nan, nan, 4.0, nan, nan])
    out = group_advantages(r, group_size=4, eps=0.0)
    s = math.sqrt(2.0 / 3.0)
    close(out.advantages, [0.0, 0.0, -1.0 / s, 1.0 / s] + [0.0] * 8)
    assert torch.isfinite(out.advantages).all()
    close(out.group_mean, [1.0, 0.0, 4.0])
    close(out.group_std, [s, 0.0, 0.0])
    assert out.zero_std.tolist() == [False, True, True]
    for scaling in ("batch", "none"):
        o = group_advantages(r, group_size=4, std_scaling=scaling, unbiased_std=True)
        assert torch.isfinite(o.advantages).all()
        assert o.advantages[1].item() == 0.0 and (o.advantages[4:] == 0).all()
    # batch std over the valid rewards 1, 0, 2, 4 (mean 7/4)
    o = group_advantages(r, group_size=4, std_scaling="batch", eps=0.0)
    bs = math.sqrt(sum((x - 1.75) ** 2 for x in (1.0, 0.0, 2.0, 4.0)) / 4)
    close(o.advantages[:4], [0.0, 0.0, -1.0 / bs, 1.0 / bs])


def test_group_advantages_matches_reference_loop_on_random_data():
    g = torch.Generator().manual_seed(0)
    G, M = 5, 7
    r = torch.randn(G * M, generator=g, dtype=torch.float64)
    out = group_advantages(r, group_size=G, eps=1e-4, unbiased_std=True)
    for i in range(M):
        grp = r[i * G : (i + 1) * G].tolist()
        mu = sum(grp) / G
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1))
        for j, x in enumerate(grp):
            assert out.advantages[i * G + j].item() == pytest.approx((x - mu) / (sd + 1e-4), rel=1e-10)


@pytest.mark.parametrize(
    "n, group_size",
    [(6, 4), (4, 1), (4, 0)],
)
def test_group_advantages_rejects_bad_sizes(n, group_size):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(n), group_size=group_size)


def test_group_advantages_finite_rewards_past_float32_squares():
    """Rewards of 1e20 are finite in float32 but their squared deviations (1e40) are not: the group std came out inf
    and every advantage of the group 0 (the run trained on nothing, silently). Hand-computed: group [1e20, 0, 1e20, 0]
    has mean 5e19 and population std 5e19, so advantages [1, -1, 1, -1]; the other group is untouched."""
    r = torch.tensor([1e20, 0.0, 1e20, 0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float32)
    out = group_advantages(r, 4, eps=0.0)
    assert out.advantages.dtype == torch.float32
    s = math.sqrt(1.25)  # population std of [1, 2, 3, 4]
    expected = [1.0, -1.0, 1.0, -1.0, -1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]
    assert torch.allclose(out.advantages, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(out.group_std, torch.tensor([5e19, s]), rtol=1e-6)
    # batch scaling: batch mean 2.5e19 + 1.25, batch std ~ 4.33e19: the first group's advantages are +-5e19 / std
    batch = group_advantages(r, 4, std_scaling="batch", eps=0.0).advantages
    assert torch.isfinite(batch).all() and batch[0] == pytest.approx(5e19 / math.sqrt(0.1875e40), rel=1e-5)


def test_group_advantages_rejects_bad_scaling_and_shape():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), group_size=2, std_scaling="global")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2), group_size=2)


def test_group_advantages_does_not_modify_rewards():
    r = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    r0 = r.clone()
    group_advantages(r, group_size=2)
    torch.testing.assert_close(r, r0, equal_nan=True)


# ------------------------------------------------------------------ GAE


def test_gae_hand_computed_three_tokens():
    # gamma = 0.9, lam = 0.8, r = [0, 0, 1], V = [0.5, 0.6, 0.7], V after the last token = 0
    # delta_2 = 1 + 0.9*0 - 0.7 = 0.3
    # delta_1 = 0 + 0.9*0.7 - 0.6 = 0.03
    # delta_0 = 0 + 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.3 ; A_1 = 0.03 + 0.72*0.3 = 0.246 ; A_0 = 0.04 + 0.72*0.246 = 0.21712
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_gamma_lam_one_and_padding():
    # row 0 from the docstring (A = [0.5, 0.4, 0.3], returns all 1); row 1 has 2 valid tokens and NaN padding
    nan = float("nan")
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, nan]])
    v = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.5, nan]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    # row 1: delta_1 = 2 - 1.5 = 0.5 (V_2 = 0, terminal), delta_0 = 0 + 1.5 - 1 = 0.5 -> A = [1.0, 0.5, 0]
    close(adv, [[0.5, 0.4, 0.3], [1.0, 0.5, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_gae_lam_zero_is_one_step_td():
    r = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    adv, _ = gae(r, v, m, gamma=0.5, lam=0.0)
    close(adv, [[0.1 + 0.5 * 2 - 1, 0.2 + 0.5 * 3 - 2, 0.3 - 3, 0.0]])


def reference_gae(rewards, values, lengths, gamma, lam):
    """Plain double loop over rows and tokens, straight from the definition A_t = sum_l (gamma lam)^l delta_{t+l}."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = lengths[b]
        deltas = []
        for t in range(L):
            v_next = values[b][t + 1] if t + 1 < L else 0.0
            deltas.append(rewards[b][t] + gamma * v_next - values[b][t])
        for t in range(L):
            adv[b][t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(L - t))
            ret[b][t] = adv[b][t] + values[b][t]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.7, 1.0)])
def test_gae_matches_reference_loop_on_random_variable_lengths(gamma, lam):
    g = torch.Generator().manual_seed(1234)
    B, T = 6, 11
    lengths = [11, 1, 5, 0, 8, 3]
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    adv, ret = gae(r, v, m.float(), gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference_gae(r.tolist(), v.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_gae_is_pure_and_detached():
    r = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[0.3, 0.4]], requires_grad=True)
    m = torch.tensor([[1, 1]])
    r0, v0 = r.clone(), v.detach().clone()
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad
    torch.testing.assert_close(r, r0)
    torch.testing.assert_close(v.detach(), v0)


# ------------------------------------------------------------------ KL-shaped rewards


def test_kl_penalized_reward_seed_example():
    # Seed: R_RM = 0.8, D_KL = 0.05, beta = 6 -> R_total = 0.5
    assert kl_penalized_reward(0.8, 0.05, 6.0) == pytest.approx(0.5, rel=1e-12)
    out = kl_penalized_reward(torch.tensor([0.8, 1.0]), torch.tensor([0.05, 0.1]), 6.0)
    close(out, [0.5, 0.4])


def test_kl_shaped_rewards_hand_values():
    nan = float("nan")
    scores = torch.tensor([1.0, -2.0, 0.5])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, nan, nan], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, nan, nan], [-1.0, -2.0, -1.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, m, kl_coef=0.1)
    close(kl, [[0.5, -1.0, 0.0], [-0.2, 0.0, 0.0], [0.0, 1.0, 0.0]])
    close(
        rewards,
        [
            [-0.05, 0.1, 1.0],  # score on the last (3rd) token
            [0.02 - 2.0, 0.0, 0.0],  # single valid token gets KL term + score
            [0.0, -0.1 + 0.5, 0.0],
        ],
    )
    # the per-row sum equals the sequence-level penalised reward score - kl_coef * sum_t kl_t
    close(rewards.sum(1), kl_penalized_reward(scores, kl.sum(1), 0.1))


def test_kl_shaped_rewards_rejects_bad_shapes():
    with pytest.raises(ValueError):
        kl_shaped_rewards(torch.zeros(3), torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), 0.1)


# ------------------------------------------------------------------ KL controllers


def test_adaptive_kl_controller_updates():
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(9.0, n_steps=256)  # error clip(0.5) = 0.2 -> x 1.00512
    assert c.value == pytest.approx(0.2 * 1.00512, rel=1e-12)
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(6.6, n_steps=256)  # error 0.1 (inside the clip) -> x 1.00256
    assert c.value == pytest.approx(0.2 * 1.00256, rel=1e-12)
    c = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    c.update(0.0, n_steps=256)  # error clip(-1) = -0.2 -> x 0.99488
    assert c.value == pytest.approx(0.2 * 0.99488, rel=1e-12)
    c.update(torch.tensor(6.0), n_steps=256)  # on target: unchanged; tensors accepted
    assert c.value == pytest.approx(0.2 * 0.99488, rel=1e-12)


def test_kl_controllers_state_dict_round_trip():
    c = AdaptiveKLController(0.1, target=3.0, horizon=100)
    c.update(10.0, n_steps=10)
    d = AdaptiveKLController(0.5, target=3.0, horizon=100)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value == pytest.approx(0.1 * 1.02, rel=1e-12)
    f = FixedKLController(0.05)
    f.update(100.0, n_steps=1000)
    assert f.value == 0.05
    f2 = FixedKLController(0.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.05


def test_adaptive_kl_controller_rejects_bad_args():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=100)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)
