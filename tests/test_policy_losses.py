"""TRL 1.16's GRPO loss types beside grpo / dapo / dr_grpo (lorarl.core.policy_losses, the two new reductions of
lorarl.core.losses, lorarl.algos.grpo_losses): hand-computed values, then each loss type against TRL's own
``GRPOTrainer._compute_loss`` on identical tensors (called on a lightweight object, tests/test_gspo_tis.py's
``_trl_loss``): the loss, its gradient and TRL's metrics."""

from __future__ import annotations

import math

import pytest
import torch
from test_gspo_tis import _trl_loss

from lorarl.algos.grpo import reduce_grpo_loss
from lorarl.algos.grpo_losses import grpo_token_loss
from lorarl.config import GRPOConfig, recipe_from_dict
from lorarl.config.algorithms import GRPOKLConfig
from lorarl.core.losses import batch_totals, tis_weights
from lorarl.core.policy_losses import cispo_loss, importance_log_ratio, sapo_loss, vespo_loss, vespo_weights
from lorarl.errors import RecipeError
from lorarl.trl.fields import GRPO_LOSS_TYPES

D = torch.float64


# ---- by hand ----------------------------------------------------------------------------------------------------


def test_cispo_keeps_the_gradient_of_a_token_past_the_cap():
    """rho = 0.5 / 0.05 = 10 > eps_max 5, A = 1: loss -5 log 0.5 = 3.46574 with gradient -5 (PPO's clip would give
    the token no gradient); a second token at rho = 1, A = 1: loss -log 0.25, gradient -1."""
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=D, requires_grad=True)
    old = torch.tensor([[math.log(0.05), math.log(0.25)]], dtype=D)
    loss, stats = cispo_loss(lp, old, torch.tensor([1.0], dtype=D), torch.ones(1, 2), eps_max=5.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-5 * math.log(0.5), -math.log(0.25)]], dtype=D))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-5.0, -1.0]], dtype=D))
    assert float(stats["cispo_clip_ratio"]) == 0.5 and float(stats["ratio_mean"]) == pytest.approx(5.5)


def test_sapo_gate_is_the_policy_gradient_at_ratio_one_and_fades_away_from_it():
    """At rho = 1: loss -(4 / tau) * 0.5 * A, gradient -A (tau = 1 for A = 2 > 0). At rho = 2, A = -1 (tau = 1.05):
    loss (4 / 1.05) sigmoid(1.05), gradient 4 s (1 - s) * 2 * 1 with s = sigmoid(1.05)."""
    lp = torch.tensor([[0.0], [math.log(2.0)]], dtype=D, requires_grad=True)
    loss, _ = sapo_loss(lp, torch.zeros(2, 1, dtype=D), torch.tensor([2.0, -1.0], dtype=D), torch.ones(2, 1))
    s = 1 / (1 + math.exp(-1.05))
    torch.testing.assert_close(loss.detach(), torch.tensor([[-4.0], [4 / 1.05 * s]], dtype=D))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0], [4 * s * (1 - s) * 2.0]], dtype=D))


def test_vespo_gamma_weight_by_hand():
    """phi(w) = e^lam w^k e^(-lam w): w = 0.5 with A >= 0 (k 2, lam 3) -> e^3 / 4 e^-1.5 = 1.12042; w = 1 -> 1; with
    A < 0 (k 3, lam 2) and w = 2: e^2 * 8 * e^-4 = 1.08268; a TIS weight 0.5 on a w = 1 row -> phi(0.5)."""
    log_ratio = torch.tensor([[math.log(0.5), 0.0], [0.0, 0.0], [math.log(2.0), 0.0]], dtype=D)
    mask = torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    phi = vespo_weights(torch.tensor([1.0, 0.0, -1.0], dtype=D), log_ratio, mask)
    want = [math.exp(3 - 1.5) / 4, 1.0, math.exp(2 - 4) * 8]
    assert phi.tolist() == pytest.approx(want, rel=1e-12)
    assert want[0] == pytest.approx(1.12042, abs=1e-5) and want[2] == pytest.approx(1.08268, abs=1e-5)
    is_w = torch.tensor([[0.5, 1.0]], dtype=D)
    with_is = vespo_weights(torch.tensor([1.0], dtype=D), torch.zeros(1, 2, dtype=D), torch.ones(1, 2), is_w)
    assert float(with_is) == pytest.approx(want[0], rel=1e-12)
    lp = torch.tensor([[math.log(0.5)]], dtype=D, requires_grad=True)
    loss, stats = vespo_loss(lp, lp.detach(), torch.tensor([1.0], dtype=D), torch.ones(1, 1))
    assert float(loss.detach()) == pytest.approx(-math.log(0.5)) and float(stats["phi_seq_mean"]) == 1.0


def test_sequence_level_ratio_is_the_geometric_mean_on_the_mask():
    lr = importance_log_ratio(
        torch.tensor([[0.3, -0.1, 9.0]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), level="sequence"
    )
    torch.testing.assert_close(lr, torch.tensor([[0.1, 0.1, 0.0]]))


# ---- against TRL's GRPOTrainer._compute_loss ----------------------------------------------------------------------


def _moved_batch(seed: int, scale: float, B: int = 6, T: int = 5):
    """Log-probs moved ``scale`` from the old ones (ratios far from 1: clipped, gated, down-weighted)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    lp0 = old + scale * torch.randn(B, T, generator=g, dtype=D)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    sampler = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1, 4, 2, 5])[:B, None]
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, 0.0], dtype=D)[:B]
    return old, lp0, ref, sampler, mask, adv


# TRL loss_type -> (grpo.policy_loss, grpo.loss_reduction): the mapping lorarl.trl writes, checked here against
# TRL's own loss (tests/test_trl_dropin.py checks the door writes it)
TRL_TYPES = GRPO_LOSS_TYPES


def _trl_defaults() -> dict:
    """TRL's GRPOConfig defaults of sapo's and vespo's fields (what its trainer reads from ``args``)."""
    import dataclasses

    import trl

    names = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg")
    return {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig) if f.name in (*names, "vespo_lambda_neg")}


def test_lorarl_defaults_are_trls():
    cfg = GRPOConfig()
    assert _trl_defaults() == {k: getattr(cfg, k) for k in _trl_defaults()}
    assert len(_trl_defaults()) == 6


def _ours(lp, old, adv, mask, cfg, **kw):
    per_token, stats = grpo_token_loss(lp, old, adv, mask, cfg, entropy=torch.zeros_like(lp), **kw)
    return reduce_grpo_loss(per_token, torch.zeros_like(lp), mask, cfg, **batch_totals(mask), max_len=5), stats


@pytest.mark.parametrize(
    "trl_type, level, beta, extra",
    [
        ("bnpo", "token", 0.0, {}),
        ("bnpo", "token", 0.05, {}),
        ("luspo", "sequence", 0.0, {}),
        ("luspo", "token", 0.04, {}),
        ("cispo", "token", 0.0, {"eps_high": 1.3}),
        ("cispo", "token", 0.04, {"eps_high": 5.0}),
        ("cispo", "sequence", 0.0, {"eps_high": 1.05}),
        ("sapo", "token", 0.0, {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}),
        ("sapo", "token", 0.04, {"sapo_temperature_pos": 3.0, "sapo_temperature_neg": 0.5}),
        ("sapo", "sequence", 0.0, {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 1.05}),
        ("vespo", "token", 0.0, {}),
        ("vespo", "token", 0.04, {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.5, "vespo_lambda_neg": 3.5}),
    ],
)  # fmt: skip
def test_loss_type_equals_trls_compute_loss(trl_type, level, beta, extra):
    old, lp0, ref, _, mask, adv = _moved_batch(seed=len(trl_type) + int(beta * 100), scale=0.4)
    policy_loss, reduction = TRL_TYPES[trl_type]
    eps_high = extra.pop("eps_high", 0.28)
    cfg = GRPOConfig(
        importance_sampling_level=level,
        policy_loss=policy_loss,
        loss_reduction=reduction,
        clip_eps_low=0.2,
        clip_eps_high=eps_high,
        cispo_eps_max=eps_high,
        kl=GRPOKLConfig(coef=beta),
        **extra,
    )
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours, stats = _ours(lp_a, old, adv, mask, cfg, ref_logprobs=ref if beta else None)
    theirs, metrics = _trl_loss(
        lp_b, old, adv, mask, level=level, eps_low=0.2, eps_high=eps_high, beta=beta, ref=ref if beta else None,
        loss_type=trl_type, args={**_trl_defaults(), **extra},
    )  # fmt: skip
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)
    assert lp_a.grad.abs().sum() > 0
    if trl_type == "cispo":
        s, n = stats["cispo_clip_ratio"]
        assert s / n == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
        assert (0 < s < n) == (eps_high < 5)  # with a low cap the batch clips some tokens (sequences), not all
    if trl_type == "vespo":
        s, n = stats["phi_seq_mean"]
        c = cfg
        phi = vespo_weights(
            adv, lp0 - old, mask, None, c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg
        )
        assert s / n == pytest.approx(float(phi.mean()), rel=1e-12)  # every row has a loss token here
        assert metrics["vespo/phi_seq_mean"][0] == pytest.approx(float(phi.mean()), rel=1e-6)
        assert float(phi.max() - phi.min()) > 0.1  # the rows' weights differ: the batch exercises the gamma


def test_bnpo_over_two_micro_batches_equals_trls_with_gradient_accumulation():
    """TRL's bnpo: each micro-batch's own token mean / the accumulation steps; lorarl's micro_batch_token_mean
    weights each micro-batch by its rows / the batch's rows: equal for micro-batches of one size (3 + 3 rows)."""
    old, lp0, _, _, mask, adv = _moved_batch(seed=21, scale=0.3)
    cfg = GRPOConfig(loss_reduction="micro_batch_token_mean", clip_eps_high=0.28)
    totals = dict(**batch_totals(mask), max_len=5)
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours = theirs = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        per_token, _ = grpo_token_loss(lp_a[rows], old[rows], adv[rows], mask[rows], cfg)
        ours = ours + reduce_grpo_loss(per_token, torch.zeros_like(per_token), mask[rows], cfg, **totals)
        trl, _ = _trl_loss(
            lp_b[rows], old[rows], adv[rows], mask[rows], level="token", eps_low=0.2, eps_high=0.28,
            loss_type="bnpo", accum=2,
        )  # fmt: skip
        theirs = theirs + trl
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("trl_type", ["cispo", "sapo", "vespo"])
def test_with_the_sampler_correction_equals_trls_importance_sampling(trl_type):
    """TIS: TRL multiplies the cispo / sapo loss by its token_truncate IS ratio, and folds it into VESPO's sequence
    weight instead; lorarl's grpo.tis does the same with its weights (equal to TRL's ratio, tests/test_gspo_tis.py)."""
    old, lp0, _, sampler, mask, adv = _moved_batch(seed=5, scale=0.3)
    policy_loss, reduction = TRL_TYPES[trl_type]
    cfg = GRPOConfig(policy_loss=policy_loss, loss_reduction=reduction, cispo_eps_max=1.5)
    w = tis_weights(old, sampler, mask, 2.0)
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours, _ = _ours(lp_a, old, adv, mask, cfg, sampler_logprobs=sampler, tis_cap=2.0)
    theirs, _ = _trl_loss(
        lp_b, old, adv, mask, level="token", eps_low=0.2, eps_high=1.5, is_ratio=w.clone(), loss_type=trl_type,
        args=_trl_defaults(),
    )  # fmt: skip
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)
    without, _ = _ours(lp0.clone(), old, adv, mask, cfg)
    assert abs(float(without) - float(ours.detach())) > 1e-3  # the correction changed the loss


# ---- recipe keys ------------------------------------------------------------------------------------------------


def _grpo_recipe(**grpo):
    return recipe_from_dict({"algo": "grpo", "grpo": grpo})


def test_recipe_keys_load_and_refuse_what_has_no_meaning():
    r = _grpo_recipe(policy_loss="sapo", sapo_temperature_neg=2.0, loss_reduction="seq_mean_token_sum")
    assert r.grpo.policy_loss == "sapo" and r.grpo.sapo_temperature_neg == 2.0
    _grpo_recipe(importance_sampling_level="sequence", loss_reduction="seq_mean_token_sum")  # LUSPO's setup
    bad = [
        ({"policy_loss": "ppo"}, "grpo.policy_loss must be one of 'clip' | 'cispo' | 'sapo' | 'vespo', got 'ppo'"),
        (
            {"policy_loss": "vespo", "importance_sampling_level": "sequence"},
            "must be token with grpo.policy_loss vespo",
        ),
        (
            {"importance_sampling_level": "sequence", "loss_reduction": "micro_batch_token_mean"},
            "sequence (GSPO) needs",
        ),
        ({"cispo_eps_max": 0}, "grpo.cispo_eps_max must be > 0"),
        ({"sapo_temperature_pos": 0}, "grpo.sapo_temperature_pos must be > 0"),
    ]
    for keys, line in bad:
        with pytest.raises(RecipeError, match=line.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
            _grpo_recipe(**keys)
