"""The preference losses (lorarl.core.preference_losses): each against hand-computed values, and against TRL's own
code on identical tensors -- ``DPOTrainer._compute_loss`` (TRL 1.16: the loss lives inside that method, so it is
called on a minimal trainer object whose model returns the given per-token log-probs) for sigmoid, hinge and ipo
and the logged reward metrics; ``CPOTrainer.cpo_loss`` (TRL's SimPO and its label-smoothed sigmoid) for simpo and
for sigmoid with label smoothing."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lorarl.algos.dpo_scoring import implicit_reward_metrics
from lorarl.core.preference_losses import (
    PREFERENCE_LOSSES,
    LossSettings,
    PairLogps,
    combined_loss,
    hinge_loss,
    ipo_loss,
    preference_loss,
    sft_term,
    sigmoid_loss,
    simpo_loss,
)

S = LossSettings
# TRL 1.16's DPOTrainer loss types, `sft` apart (its _compute_loss's error message lists them)
TRL_DPO_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sigmoid_norm",
)  # fmt: skip


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


def hand_pair(chosen=0.0, rejected=0.0, ref_chosen=-2.0, ref_rejected=1.0, c_tok=4.0, r_tok=2.0):
    """ratio_w = chosen - ref_chosen, ratio_l = rejected - ref_rejected (defaults: 2 and -1)."""
    return PairLogps(t(chosen), t(rejected), t(c_tok), t(r_tok), t(ref_chosen), t(ref_rejected))


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed values (the docstrings' examples)
# ---------------------------------------------------------------------------------------------------------------


def test_sigmoid_by_hand():
    loss, rc, rr = sigmoid_loss(hand_pair(), S(beta=0.5))
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-12)  # 0.20141
    assert float(loss) == pytest.approx(0.201413, abs=1e-6)
    assert (float(rc), float(rr)) == (1.0, -0.5)
    smoothed, _, _ = sigmoid_loss(hand_pair(), S(beta=0.5, label_smoothing=0.1))
    assert float(smoothed) == pytest.approx(0.9 * 0.2014133 + 0.1 * 1.7014133, abs=1e-6)  # 0.35141


def test_hinge_by_hand():
    assert float(hinge_loss(hand_pair(), S(beta=0.1))[0]) == pytest.approx(0.7, abs=1e-12)
    assert float(hinge_loss(hand_pair(), S(beta=0.5))[0]) == 0.0  # past the margin: no loss, no gradient


def test_ipo_by_hand():
    # ratio_w / 4 - ratio_l / 2 = 0.5 + 0.5 = 1
    assert float(ipo_loss(hand_pair(), S(beta=0.5))[0]) == pytest.approx(0.0, abs=1e-12)  # 1 - 1 / (2 * 0.5)
    assert float(ipo_loss(hand_pair(), S(beta=1.0))[0]) == pytest.approx(0.25, abs=1e-12)  # (1 - 0.5)^2
    _, rc, rr = ipo_loss(hand_pair(), S(beta=1.0))
    assert (float(rc), float(rr)) == (2.0, -1.0)  # logged unnormalised, as TRL logs them


def test_simpo_by_hand_needs_no_reference():
    pair = PairLogps(t(-4.0), t(-6.0), t(4.0), t(2.0))  # no reference fields at all
    loss, rc, rr = simpo_loss(pair, S(beta=2.0, simpo_gamma=0.5))
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-3.5)), abs=1e-12)  # 0.02975
    assert float(loss) == pytest.approx(0.029750, abs=1e-6)
    assert (float(rc), float(rr)) == (-2.0, -6.0)
    with pytest.raises(ValueError, match="reference"):
        sigmoid_loss(pair, S(beta=0.1))


def test_gradients_push_chosen_up_and_rejected_down():
    # apo_down lowers both likelihoods (the rejected one more); DiscoPOP's blend rises with the margin near 0 (its
    # non-convex region: d loss / dz = 0.784 at z = 0 with tau 0.05, by hand from its formula)
    for name in sorted(set(PREFERENCE_LOSSES) - {"apo_down", "discopop"}):
        c, r = t(-3.0).requires_grad_(), t(-2.0).requires_grad_()
        pair = PairLogps(c, r, t(3.0), t(3.0), t(-3.0), t(-2.0))
        loss, _, _ = preference_loss(name)(pair, S(beta=0.1, label_smoothing=0.01 if name == "exo_pair" else 0.0))
        loss.sum().backward()
        assert c.grad < 0 < r.grad, name  # minimising raises log pi(chosen), lowers log pi(rejected)


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="sigmoid"):
        preference_loss("kto")
    assert set(PREFERENCE_LOSSES) == set(TRL_DPO_TYPES) | {"simpo"}  # TRL 1.16's DPOTrainer's, sft apart, and SimPO


def test_implicit_reward_metrics_by_hand():
    m = implicit_reward_metrics(t(1.0, 0.0, 2.0), t(0.0, 0.0, 3.0))
    assert m == {
        "rewards/chosen": 1.0,
        "rewards/rejected": 1.0,
        "rewards/accuracies": pytest.approx(1 / 3),  # the tie counts as wrong
        "rewards/margins": 0.0,
    }


# ---------------------------------------------------------------------------------------------------------------
# Against TRL's own code
# ---------------------------------------------------------------------------------------------------------------


def random_batch(B=5, T=7, seed=0):
    """Per-token log-probs of B chosen and B rejected responses with different lengths, and reference sums."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (2 * B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [2B, T]
    per_token = -torch.rand(2 * B, T, generator=g, dtype=torch.float64) * 3 * mask
    ref = per_token.sum(1) + torch.randn(2 * B, generator=g, dtype=torch.float64)
    return per_token, mask, ref


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(m):
        return m


def trl_dpo(
    per_token,
    mask,
    ref,
    loss_type: str | list[str],
    beta: float,
    loss_weights: list[float] | None = None,
    *,
    ref_per_token=None,
    log_sum_sq=None,
    **options,
):
    """TRL 1.16's DPOTrainer._compute_loss on a minimal trainer: the model returns ``per_token`` as its
    per-position log-probs (zero outside the completion, as TRL's fused head gives for label -100); the reference
    sums are TRL's precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` -- or, with ``ref_per_token``, a
    reference model's per-position log-probs that TRL sums itself (LD-DPO weighs them). ``log_sum_sq``: the fused
    head's ``log_sum_sq_probs`` per position (WPO). ``options``: the trainer's ``label_smoothing``,
    ``f_divergence_type``, ``f_alpha_divergence_coef``, ``use_weighting``, ``ld_alpha``, ``discopop_tau``."""
    from trl.trainer.dpo_trainer import DPOTrainer

    two_b, T = per_token.shape
    P = 3  # prompt tokens before the completion in TRL's joined sequence
    completion_mask = torch.cat([torch.zeros(two_b, P), mask], dim=1).long()  # [2B, P + T]

    def shifted(x):  # aligned with completion_mask[:, 1:]
        return torch.cat([torch.zeros(two_b, P - 1, dtype=x.dtype), x], dim=1)

    def forward(values, lss=None):
        def model(**kwargs):
            zeros = torch.zeros_like(values)
            out = SimpleNamespace(log_probs=values, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
            if lss is not None:
                out.log_sum_sq_probs = lss
            return out

        model.training, model.is_gradient_checkpointing = True, False
        model._modules = {}  # accelerate's is_peft_model looks for submodules
        return model

    model = forward(shifted(per_token), None if log_sum_sq is None else shifted(log_sum_sq))
    trainer = SimpleNamespace(
        model=model,
        ref_model=None if ref_per_token is None else forward(shifted(ref_per_token)),
        accelerator=_Accelerator(),
        ld_alpha=options.get("ld_alpha"),
        precompute_ref_logps=ref_per_token is None,
        aux_loss_enabled=False,
        f_divergence_type=options.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=options.get("f_alpha_divergence_coef", 0.5),
        loss_types=[loss_type] if isinstance(loss_type, str) else list(loss_type),
        loss_weights=loss_weights or [1.0] * (1 if isinstance(loss_type, str) else len(loss_type)),
        beta=beta,
        label_smoothing=options.get("label_smoothing", 0.0),
        use_weighting=options.get("use_weighting", False),
        args=SimpleNamespace(discopop_tau=options.get("discopop_tau", 0.05), gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(two_b, P + T, dtype=torch.long),
        "attention_mask": torch.ones(two_b, P + T, dtype=torch.long),
        "completion_mask": completion_mask,
    }
    if ref_per_token is None:
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref[: two_b // 2], ref[two_b // 2 :]
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def lorarl_pair(per_token, mask, ref) -> PairLogps:
    B = per_token.shape[0] // 2
    sums, counts = per_token.sum(1), mask.sum(1)
    return PairLogps(sums[:B], sums[B:], counts[:B], counts[B:], ref[:B], ref[B:])


@pytest.mark.parametrize(
    "loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("hinge", 0.3), ("ipo", 0.2), ("ipo", 1.5)]
)
def test_matches_trl_dpo_trainer(loss_type, beta):
    per_token, mask, ref = random_batch(seed=len(loss_type) * 100 + int(beta * 10))
    want_loss, want = trl_dpo(per_token, mask, ref, loss_type, beta)
    pair = lorarl_pair(per_token, mask, ref)
    loss, rc, rr = preference_loss(loss_type)(pair, S(beta=beta))
    assert float(loss.mean()) == pytest.approx(float(want_loss), rel=1e-6, abs=1e-9)
    ours = implicit_reward_metrics(rc, rr)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert ours[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert float(pair.chosen.mean()) == pytest.approx(want["logps/chosen"], rel=1e-6)
    assert float(pair.rejected.mean()) == pytest.approx(want["logps/rejected"], rel=1e-6)


def trl_cpo(chosen, rejected, loss_type: str, beta: float, label_smoothing: float, gamma: float = 0.5):
    """TRL's CPOTrainer.cpo_loss (its SimPO, and the label-smoothed sigmoid) on a minimal trainer object."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = SimpleNamespace(
        alpha=0.0,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        accelerator=_Accelerator(),
    )
    return CPOTrainer.cpo_loss(trainer, chosen, rejected)


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (1.0, 0.3, 0.2)])
def test_simpo_matches_trl_cpo_trainer(beta, gamma, eps):
    per_token, mask, _ = random_batch(seed=int(beta * 10 + gamma * 100))
    pair = lorarl_pair(per_token, mask, torch.zeros(per_token.shape[0], dtype=torch.float64))
    pair.ref_chosen = pair.ref_rejected = None
    # TRL's CPO computes SimPO on per-token AVERAGE log-probs (get_batch_logps(average_log_prob=True))
    want_loss, want_rc, want_rr = trl_cpo(
        pair.chosen / pair.chosen_tokens, pair.rejected / pair.rejected_tokens, "simpo", beta, eps, gamma
    )
    loss, rc, rr = simpo_loss(pair, S(beta=beta, label_smoothing=eps, simpo_gamma=gamma))
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rc, want_rc, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rr, want_rr, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothed_sigmoid_matches_trl_cpo_sigmoid_on_log_ratios(eps):
    """Conservative DPO: TRL's CPO sigmoid is the same smoothed logistic loss on (chosen - rejected); fed the
    log-ratios, it is lorarl's sigmoid with label smoothing."""
    per_token, mask, ref = random_batch(seed=7)
    pair = lorarl_pair(per_token, mask, ref)
    w, lo = pair.logratios()
    want_loss, want_rc, want_rr = trl_cpo(w, lo, "sigmoid", 0.3, eps)
    loss, rc, rr = sigmoid_loss(pair, S(beta=0.3, label_smoothing=eps))
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rc, want_rc, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rr, want_rr, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# TRL 1.x's weighted loss lists: [sigmoid, sft] (RPO / MPO's NLL term on the chosen responses)
# ---------------------------------------------------------------------------------------------------------------


def test_sft_term_and_combined_loss_by_hand():
    pair = PairLogps(t(-2.0, -6.0), t(-1.0, -1.0), t(4.0, 4.0), t(2.0, 2.0), t(0.0, 0.0), t(0.0, 0.0))
    s = sft_term(pair, batch_pairs=2, batch_chosen_tokens=8.0)
    assert s.tolist() == pytest.approx([0.5, 1.5]) and float(s.mean()) == pytest.approx(8.0 / 8.0)
    # sigmoid weight 1 + sft weight 0.5, ratio_w = 2, ratio_l = -1, beta 0.5, log pi(y_w) = -2 over 4 tokens
    one = PairLogps(t(-2.0), t(0.0), t(4.0), t(2.0), t(-4.0), t(1.0))
    loss, rc, rr = combined_loss(one, (("sigmoid", 1.0), ("sft", 0.5)), S(beta=0.5))
    assert float(loss) == pytest.approx(0.20141 + 0.5 * 0.5, abs=1e-5)
    assert (float(rc), float(rr)) == pytest.approx((1.0, -0.5))  # the preference loss's implicit rewards


def test_combined_loss_over_micro_batches_is_the_batch_loss():
    """Each micro-batch passes its batch's pair and chosen-token counts: the shares add up to the whole batch's
    loss, so gradient accumulation is exact with the batch-wide token mean of the sft term."""
    per_token, mask, ref = random_batch(B=6, seed=5)
    pair = lorarl_pair(per_token, mask, ref)
    losses = (("sigmoid", 1.0), ("sft", 0.3))
    whole, _, _ = combined_loss(pair, losses, S(beta=0.2))
    n, t_w = 6, float(pair.chosen_tokens.sum())
    shares = 0.0
    for part in (slice(0, 2), slice(2, 6)):
        sub = PairLogps(
            *(
                getattr(pair, f)[part]
                for f in ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "ref_chosen", "ref_rejected")
            )
        )
        loss, _, _ = combined_loss(sub, losses, S(beta=0.2), batch_pairs=n, batch_chosen_tokens=t_w)
        shares += float(loss.sum()) / n
    assert shares == pytest.approx(float(whole.mean()), rel=1e-12)


@pytest.mark.parametrize(
    "losses",
    [
        (("sigmoid", 1.0), ("sft", 1.0)),
        (("sigmoid", 0.8), ("sft", 0.35)),
        (("hinge", 1.0), ("sft", 0.5)),
        (("ipo", 0.5), ("sft", 2.0)),
    ],
)
def test_weighted_lists_match_trl_dpo_trainer(losses):
    per_token, mask, ref = random_batch(seed=11)
    names, weights = [n for n, _ in losses], [w for _, w in losses]
    want_loss, want = trl_dpo(per_token, mask, ref, names, 0.3, loss_weights=weights)
    loss, rc, rr = combined_loss(lorarl_pair(per_token, mask, ref), losses, S(beta=0.3))
    assert float(loss.mean()) == pytest.approx(float(want_loss), rel=1e-6, abs=1e-9)
    ours = implicit_reward_metrics(rc, rr)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert ours[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


# ---------------------------------------------------------------------------------------------------------------
# TRL 1.16's other loss types (lorarl.core.preference_losses / preference_ratio_losses)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, settings, value",
    [
        ("robust", S(beta=0.5, label_smoothing=0.1), (0.9 * 0.2014133 - 0.1 * 1.7014133) / 0.8),
        ("exo_pair", S(beta=0.5, label_smoothing=0.1), 0.031139),
        (
            "discopop",
            S(beta=0.1),
            0.5 * (1 - math.tanh(3)) * math.log(1 + math.exp(-0.3)) + 0.5 * (1 + math.tanh(3)) * math.exp(-0.3),
        ),
        ("sigmoid_norm", S(beta=1.0), math.log(1 + math.exp(-1.0))),
        ("nca_pair", S(beta=0.5), 1.206931),
        ("bco_pair", S(beta=0.5), math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(-0.5))),
        ("sppo_hard", S(beta=0.5), 1.0),
        ("apo_zero", S(beta=0.5), 1 - 1 / (1 + math.exp(-1.0)) + 1 / (1 + math.exp(0.5))),
        ("apo_down", S(beta=0.5), 1 / (1 + math.exp(-1.0)) + 1 - 1 / (1 + math.exp(-1.5))),
    ],
)
def test_new_losses_by_hand(name, settings, value):
    """The docstrings' examples: ratio_w = 2 over 4 tokens, ratio_l = -1 over 2 tokens; the rewards beta * ratio."""
    loss, rc, rr = preference_loss(name)(hand_pair(), settings)
    assert float(loss) == pytest.approx(value, abs=1e-6)
    assert (float(rc), float(rr)) == pytest.approx((2 * settings.beta, -settings.beta))


def test_aot_sorts_the_margins_across_the_batch():
    """aot: d = (3, 1) (policy chosen - rejected), d_ref = (0, 2) -> sorted (1, 3) - (0, 2) = (1, 1): -log sigmoid(1)
    each, though pair 1's own margin gain is 1 - 2 = -1. aot_unpaired: ratio_w = (2, -1), ratio_l = (0, 1) ->
    sorted (-1, 2) - (0, 1) = (-1, 1)."""
    pair = PairLogps(t(3.0, 1.0), t(0.0, 0.0), t(1.0, 1.0), t(1.0, 1.0), t(0.0, 2.0), t(0.0, 0.0))
    loss, _, _ = preference_loss("aot")(pair, S(beta=1.0))
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-1.0))] * 2)
    pair = PairLogps(t(2.0, -1.0), t(0.0, 1.0), t(1.0, 1.0), t(1.0, 1.0), t(0.0, 0.0), t(0.0, 0.0))
    loss, _, _ = preference_loss("aot_unpaired")(pair, S(beta=1.0))
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(1.0)), math.log(1 + math.exp(-1.0))])


@pytest.mark.parametrize(
    "loss_type, beta, options",
    [
        ("exo_pair", 0.1, {"label_smoothing": 1e-3}),
        ("exo_pair", 0.5, {"label_smoothing": 0.2}),
        ("nca_pair", 0.3, {}),
        ("robust", 0.1, {}),
        ("robust", 0.4, {"label_smoothing": 0.1}),
        ("robust", 0.2, {"label_smoothing": 0.35}),
        ("bco_pair", 0.2, {}),
        ("sppo_hard", 0.5, {}),
        ("aot", 0.3, {}),
        ("aot", 0.3, {"label_smoothing": 0.15}),
        ("aot_unpaired", 0.2, {"label_smoothing": 0.1}),
        ("apo_zero", 0.4, {}),
        ("apo_down", 0.4, {}),
        ("discopop", 0.1, {}),
        ("discopop", 0.6, {"discopop_tau": 0.3}),
        ("sigmoid_norm", 0.8, {}),
    ],
)
def test_new_losses_match_trl_dpo_trainer(loss_type, beta, options):
    """Loss, its gradient w.r.t. every token's log-prob, and the logged metrics, against TRL's _compute_loss."""
    per_token, mask, ref = random_batch(B=6, seed=len(loss_type) * 10 + int(beta * 10))
    ours_in, trl_in = per_token.clone().requires_grad_(True), per_token.clone().requires_grad_(True)
    want_loss, want = trl_dpo(trl_in, mask, ref, loss_type, beta, **options)
    settings = S(
        beta=beta,
        label_smoothing=options.get("label_smoothing", 0.0),
        discopop_tau=options.get("discopop_tau", 0.05),
    )
    pair = lorarl_pair(ours_in, mask, ref)
    loss, rc, rr = preference_loss(loss_type)(pair, settings)
    # TRL's exo_pair builds log(eps) and log(1 - eps) as float32 tensors (torch.tensor(label_smoothing)): its loss
    # and its gradient carry their float32 rounding (~1e-7 relative), lorarl's are float64 throughout
    rel = 1e-6 if loss_type == "exo_pair" else 1e-9
    assert float(loss.mean().detach()) == pytest.approx(float(want_loss.detach()), rel=rel, abs=1e-12)
    loss.mean().backward()
    want_loss.backward()
    torch.testing.assert_close(ours_in.grad, trl_in.grad, rtol=rel, atol=1e-12)
    assert ours_in.grad.abs().sum() > 0
    ours = implicit_reward_metrics(rc, rr)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert ours[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_new_losses_in_weighted_lists_match_trl_dpo_trainer():
    """TRL 1.x's lists with the new types (and sft), e.g. MPO-like [bco_pair, sigmoid_norm, sft]."""
    per_token, mask, ref = random_batch(B=5, seed=23)
    losses = (("bco_pair", 0.8), ("sigmoid_norm", 0.2), ("sft", 1.0))
    want_loss, _ = trl_dpo(per_token, mask, ref, [n for n, _ in losses], 0.25, loss_weights=[w for _, w in losses])
    loss, _, _ = combined_loss(lorarl_pair(per_token, mask, ref), losses, S(beta=0.25))
    assert float(loss.mean()) == pytest.approx(float(want_loss), rel=1e-9)
