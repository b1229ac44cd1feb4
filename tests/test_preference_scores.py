"""TRL 1.16 DPOTrainer's options beside the loss type (lorarl.core.preference_scores): f-DPO's divergences
(``f_divergence_type`` with its alpha), WPO's weights (``use_weighting``) and LD-DPO's length desensitisation
(``ld_alpha``) -- hand-computed values, then against TRL's own ``DPOTrainer._compute_loss`` on identical per-token
log-probs (tests/test_dpo_losses.py's ``trl_dpo``: loss, gradient and logged metrics)."""

from __future__ import annotations

import math

import pytest
import torch
from test_dpo_losses import hand_pair, implicit_reward_metrics, random_batch, trl_dpo

from lorarl.core.preference_losses import LossSettings, PairLogps, combined_loss, preference_loss
from lorarl.core.preference_scores import (
    F_DIVERGENCES,
    ld_token_weights,
    log_sum_sq_probs,
    pair_scores,
    wpo_weights,
)

D = torch.float64
S = LossSettings


# ---- by hand ----------------------------------------------------------------------------------------------------


def test_f_divergence_scores_by_hand():
    """Log-ratios (2, -1): forward KL 1 - e^-r, JS log 2 + log sigmoid(r), alpha (0.5) (u^-0.5 - 1) / -0.5."""
    pair = hand_pair()
    want = {
        "reverse_kl": (2.0, -1.0),
        "forward_kl": (1 - math.exp(-2), 1 - math.exp(1)),
        "js_divergence": (math.log(2) - math.log1p(math.exp(-2)), math.log(2) - math.log1p(math.exp(1))),
        "alpha_divergence": ((math.exp(-1.0) - 1) / -0.5, (math.exp(0.5) - 1) / -0.5),
    }
    assert set(F_DIVERGENCES) == set(want)
    for name, (w, lo) in want.items():
        s_w, s_l = pair_scores(pair, S(f_divergence=name))
        assert (float(s_w), float(s_l)) == pytest.approx((w, lo), rel=1e-12), name
    assert (0.86466, -1.71828) == pytest.approx(want["forward_kl"], abs=1e-5)
    # alpha = 1 is the reverse KL (the limit), alpha = 0.5 TRL's default = the f-DPO paper's (1 - u^-a) / a
    assert [float(x) for x in pair_scores(pair, S(f_divergence="alpha_divergence", f_alpha_divergence_coef=1.0))] == [
        2.0,
        -1.0,
    ]
    assert want["alpha_divergence"][0] == pytest.approx((1 - math.exp(-0.5 * 2)) / 0.5)


def test_sigmoid_on_forward_kl_scores_by_hand():
    """beta 0.5: h = (1 - e^-2) - (1 - e) = e - e^-2 = 2.58294 -> -log sigmoid(1.29147) = 0.24343; the logged rewards
    stay beta x the log-ratios (1, -0.5), as TRL logs them whatever the divergence."""
    loss, rc, rr = preference_loss("sigmoid")(hand_pair(), S(beta=0.5, f_divergence="forward_kl"))
    h = math.e - math.exp(-2)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-0.5 * h)), rel=1e-12)
    assert float(loss) == pytest.approx(0.24284, abs=1e-5)
    assert (float(rc), float(rr)) == (1.0, -0.5)


def test_ld_token_weights_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    w = ld_token_weights(mask, torch.tensor([2, 2, 3]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[1, 1, 0.5, 0], [1, 1, 0, 0], [1, 1, 1, 0.5]]))


def test_log_sum_sq_probs_and_wpo_weights_by_hand():
    assert float(log_sum_sq_probs(torch.log_softmax(torch.zeros(4), -1))) == pytest.approx(math.log(4 / 16))
    # p = (0.5, 0.25, 0.25, 0) with a -inf logit: sum p^2 = 0.375
    logp = torch.log(torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=D))
    assert float(log_sum_sq_probs(logp)) == pytest.approx(math.log(0.375), rel=1e-12)
    w = wpo_weights(
        torch.tensor([[-1.0, -2.0, 7.0]], dtype=D),
        torch.tensor([[-0.5, -1.0, 0.0]], dtype=D),
        torch.tensor([[1, 1, 0]]),
    )
    assert float(w) == pytest.approx(math.exp(-0.75), rel=1e-12)  # 0.47237; the padded position is not read


# ---- against TRL's DPOTrainer._compute_loss -----------------------------------------------------------------------


def _per_token_pair(per_token, mask, ref, *, ld_alpha=None, ref_per_token=None, log_sum_sq=None) -> PairLogps:
    """A PairLogps from per-token log-probs [2B, T] (chosen rows first) as lorarl.algos.dpo_scoring builds it:
    LD-DPO's weighted sums (policy and reference alike) with the plain chosen sums kept for sft, WPO's pair weights."""
    B = per_token.shape[0] // 2
    lengths = mask.sum(1)
    shared = torch.minimum(lengths[:B], lengths[B:]).repeat(2)
    dtype = per_token.dtype
    w = ld_token_weights(mask, shared, ld_alpha, dtype) if ld_alpha is not None else mask.to(dtype)
    sums = (per_token * w).sum(1)
    refs = ref if ref_per_token is None else (ref_per_token * w).sum(1)
    weights = None
    if log_sum_sq is not None:
        wr = wpo_weights(per_token, log_sum_sq, mask)
        weights = wr[:B] * wr[B:]
    return PairLogps(
        sums[:B], sums[B:], lengths[:B].to(sums.dtype), lengths[B:].to(sums.dtype), refs[:B], refs[B:],
        weights=weights, chosen_full=per_token[:B].sum(1) if ld_alpha is not None else None,
    )  # fmt: skip


def _compare(losses, beta, options, *, ld=False, wpo=False, seed=0, rel=1e-9, dtype=D):
    """``dtype`` float32 for the alpha divergence: TRL's clamp table has fp16 / bf16 / fp32 only (its log-probs'
    dtypes)."""
    per_token, mask, ref = (x.to(dtype) for x in random_batch(B=5, seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    ref_pt = (per_token - 0.5 * torch.rand(per_token.shape, generator=g, dtype=dtype)) * mask if ld else None
    lss = (per_token - 1 - torch.rand(per_token.shape, generator=g, dtype=dtype)) * mask if wpo else None
    ours_in, trl_in = per_token.clone().requires_grad_(True), per_token.clone().requires_grad_(True)
    names = [n for n, _ in losses]
    want_loss, want = trl_dpo(
        trl_in, mask, ref, names, beta, [w for _, w in losses], ref_per_token=ref_pt, log_sum_sq=lss,
        use_weighting=wpo, **options,
    )  # fmt: skip
    pair = _per_token_pair(ours_in, mask, ref, ld_alpha=options.get("ld_alpha"), ref_per_token=ref_pt, log_sum_sq=lss)
    settings = S(
        beta=beta,
        label_smoothing=options.get("label_smoothing", 0.0),
        f_divergence=options.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=options.get("f_alpha_divergence_coef", 0.5),
    )
    loss, rc, rr = combined_loss(pair, tuple(losses), settings)
    assert float(loss.mean().detach()) == pytest.approx(float(want_loss.detach()), rel=rel, abs=1e-12)
    loss.mean().backward()
    want_loss.backward()
    # on the responses' tokens (TRL's leaf also gets a gradient at the padding it sums, a value the fused head zeroes)
    torch.testing.assert_close(ours_in.grad * mask, trl_in.grad * mask, rtol=rel, atol=1e-12)
    assert ours_in.grad.abs().sum() > 0
    ours = implicit_reward_metrics(rc, rr)
    metric_rel = max(rel, 1e-6)  # TRL's logged metrics pass through float32 .item() values
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert ours[key] == pytest.approx(want[key], rel=metric_rel, abs=1e-9), key
    for side in ("chosen", "rejected"):  # TRL logs the (LD-weighted) summed log-probs
        assert float(getattr(pair, side).detach().mean()) == pytest.approx(want[f"logps/{side}"], rel=metric_rel)
    return pair


F_CASES = [
    ("sigmoid", "forward_kl", {}),
    ("sigmoid", "js_divergence", {}),
    ("sigmoid", "alpha_divergence", {"f_alpha_divergence_coef": 0.5}),
    ("sigmoid", "alpha_divergence", {"f_alpha_divergence_coef": 0.3}),
    ("sigmoid", "alpha_divergence", {"f_alpha_divergence_coef": 1.0}),
    ("hinge", "forward_kl", {}),
    ("ipo", "js_divergence", {}),
    ("robust", "alpha_divergence", {"label_smoothing": 0.2, "f_alpha_divergence_coef": 0.7}),
    ("discopop", "forward_kl", {}),
    ("sigmoid_norm", "js_divergence", {}),
]


@pytest.mark.parametrize("loss_type, divergence, options", F_CASES)
def test_f_divergences_match_trl(loss_type, divergence, options):
    fp32 = dict(dtype=torch.float32, rel=1e-5) if divergence == "alpha_divergence" else {}
    seed = len(loss_type) + len(divergence)
    _compare([(loss_type, 1.0)], 0.3, {"f_divergence_type": divergence, **options}, seed=seed, **fp32)


def test_f_divergence_on_exo_pair_and_with_sft_matches_trl():
    # exo_pair: TRL's log(eps) constants are float32 (tests/test_dpo_losses.py), so 1e-6
    _compare([("exo_pair", 1.0)], 0.3, {"f_divergence_type": "forward_kl", "label_smoothing": 0.01}, seed=3, rel=1e-6)
    _compare([("sigmoid", 1.0), ("sft", 0.5)], 0.2, {"f_divergence_type": "js_divergence"}, seed=4)


@pytest.mark.parametrize(
    "losses",
    [
        [("sigmoid", 1.0)],
        [("ipo", 1.0)],
        [("apo_zero", 1.0)],
        [("nca_pair", 0.7), ("sigmoid_norm", 0.4)],
    ],
)
def test_wpo_weights_match_trl(losses):
    pair = _compare(losses, 0.2, {}, wpo=True, seed=len(losses) * 7)
    assert pair.weights is not None and float(pair.weights.max() - pair.weights.min()) > 0.05  # pairs differ


@pytest.mark.parametrize(
    "losses, alpha",
    [
        ([("sigmoid", 1.0)], 0.5),
        ([("sigmoid", 1.0)], 0.0),
        ([("sigmoid", 1.0)], 1.0),
        ([("ipo", 1.0)], 0.3),
        ([("aot", 1.0)], 0.6),
        ([("sigmoid", 1.0), ("sft", 0.5)], 0.4),  # sft's NLL reads the plain (unweighted) log-probs, as TRL's
    ],
)
def test_ld_alpha_matches_trl(losses, alpha):
    pair = _compare(losses, 0.25, {"ld_alpha": alpha}, ld=True, seed=int(alpha * 10) + len(losses))
    if alpha < 1:  # the weighting changed the sums of the pairs whose responses differ in length
        assert not torch.equal(pair.chosen.detach(), pair.chosen_full.detach())


def test_ld_and_wpo_together_with_a_divergence_match_trl():
    _compare([("sigmoid", 1.0)], 0.3, {"ld_alpha": 0.5, "f_divergence_type": "forward_kl"}, ld=True, wpo=True, seed=9)
