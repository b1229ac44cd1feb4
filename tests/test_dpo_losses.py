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
    PairLogps,
    combined_loss,
    hinge_loss,
    ipo_loss,
    preference_loss,
    sft_term,
    sigmoid_loss,
    simpo_loss,
)


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


def hand_pair(chosen=0.0, rejected=0.0, ref_chosen=-2.0, ref_rejected=1.0, c_tok=4.0, r_tok=2.0):
    """ratio_w = chosen - ref_chosen, ratio_l = rejected - ref_rejected (defaults: 2 and -1)."""
    return PairLogps(t(chosen), t(rejected), t(c_tok), t(r_tok), t(ref_chosen), t(ref_rejected))


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed values (the docstrings' examples)
# ---------------------------------------------------------------------------------------------------------------


def test_sigmoid_by_hand():
    loss, rc, rr = sigmoid_loss(hand_pair(), beta=0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-12)  # 0.20141
    assert float(loss) == pytest.approx(0.201413, abs=1e-6)
    assert (float(rc), float(rr)) == (1.0, -0.5)
    smoothed, _, _ = sigmoid_loss(hand_pair(), beta=0.5, label_smoothing=0.1)
    assert float(smoothed) == pytest.approx(0.9 * 0.2014133 + 0.1 * 1.7014133, abs=1e-6)  # 0.35141


def test_hinge_by_hand():
    assert float(hinge_loss(hand_pair(), beta=0.1)[0]) == pytest.approx(0.7, abs=1e-12)
    assert float(hinge_loss(hand_pair(), beta=0.5)[0]) == 0.0  # past the margin: no loss, no gradient


def test_ipo_by_hand():
    # ratio_w / 4 - ratio_l / 2 = 0.5 + 0.5 = 1
    assert float(ipo_loss(hand_pair(), beta=0.5)[0]) == pytest.approx(0.0, abs=1e-12)  # 1 - 1 / (2 * 0.5)
    assert float(ipo_loss(hand_pair(), beta=1.0)[0]) == pytest.approx(0.25, abs=1e-12)  # (1 - 0.5)^2
    _, rc, rr = ipo_loss(hand_pair(), beta=1.0)
    assert (float(rc), float(rr)) == (2.0, -1.0)  # logged unnormalised, as TRL logs them


def test_simpo_by_hand_needs_no_reference():
    pair = PairLogps(t(-4.0), t(-6.0), t(4.0), t(2.0))  # no reference fields at all
    loss, rc, rr = simpo_loss(pair, beta=2.0, gamma=0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-3.5)), abs=1e-12)  # 0.02975
    assert float(loss) == pytest.approx(0.029750, abs=1e-6)
    assert (float(rc), float(rr)) == (-2.0, -6.0)
    with pytest.raises(ValueError, match="reference"):
        sigmoid_loss(pair, beta=0.1)


def test_gradients_push_chosen_up_and_rejected_down():
    for name in ("sigmoid", "hinge", "ipo", "simpo"):
        c, r = t(-3.0).requires_grad_(), t(-2.0).requires_grad_()
        pair = PairLogps(c, r, t(3.0), t(3.0), t(-3.0), t(-2.0))
        loss, _, _ = preference_loss(name)(pair, beta=0.1)
        loss.sum().backward()
        assert c.grad < 0 < r.grad, name  # minimising raises log pi(chosen), lowers log pi(rejected)


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="sigmoid"):
        preference_loss("kto")
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "hinge", "ipo", "simpo"}


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


def trl_dpo(per_token, mask, ref, loss_type: str | list[str], beta: float, loss_weights: list[float] | None = None):
    """TRL 1.16's DPOTrainer._compute_loss on a minimal trainer: the model returns ``per_token`` as its
    per-position log-probs (zero outside the completion, as TRL's fused head gives for label -100); the reference
    sums are TRL's precomputed ``ref_chosen_logps`` / ``ref_rejected_logps``."""
    from trl.trainer.dpo_trainer import DPOTrainer

    two_b, T = per_token.shape
    P = 3  # prompt tokens before the completion in TRL's joined sequence
    completion_mask = torch.cat([torch.zeros(two_b, P), mask], dim=1).long()  # [2B, P + T]
    shifted = torch.cat([torch.zeros(two_b, P - 1), per_token], dim=1)  # aligned with completion_mask[:, 1:]

    def model(**kwargs):
        zeros = torch.zeros_like(shifted)
        return SimpleNamespace(log_probs=shifted, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model.training = True
    trainer = SimpleNamespace(
        model=model,
        accelerator=_Accelerator(),
        ld_alpha=None,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type] if isinstance(loss_type, str) else list(loss_type),
        loss_weights=loss_weights or [1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(two_b, P + T, dtype=torch.long),
        "attention_mask": torch.ones(two_b, P + T, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref[: two_b // 2],
        "ref_rejected_logps": ref[two_b // 2 :],
    }
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


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
    loss, rc, rr = preference_loss(loss_type)(pair, beta=beta)
    assert float(loss.mean()) == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
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
    loss, rc, rr = simpo_loss(pair, beta=beta, label_smoothing=eps, gamma=gamma)
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
    loss, rc, rr = sigmoid_loss(pair, beta=0.3, label_smoothing=eps)
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
    loss, rc, rr = combined_loss(one, (("sigmoid", 1.0), ("sft", 0.5)), beta=0.5)
    assert float(loss) == pytest.approx(0.20141 + 0.5 * 0.5, abs=1e-5)
    assert (float(rc), float(rr)) == pytest.approx((1.0, -0.5))  # the preference loss's implicit rewards


def test_combined_loss_over_micro_batches_is_the_batch_loss():
    """Each micro-batch passes its batch's pair and chosen-token counts: the shares add up to the whole batch's
    loss, so gradient accumulation is exact with the batch-wide token mean of the sft term."""
    per_token, mask, ref = random_batch(B=6, seed=5)
    pair = lorarl_pair(per_token, mask, ref)
    losses = (("sigmoid", 1.0), ("sft", 0.3))
    whole, _, _ = combined_loss(pair, losses, beta=0.2)
    n, t_w = 6, float(pair.chosen_tokens.sum())
    shares = 0.0
    for part in (slice(0, 2), slice(2, 6)):
        sub = PairLogps(
            *(
                getattr(pair, f)[part]
                for f in ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "ref_chosen", "ref_rejected")
            )
        )
        loss, _, _ = combined_loss(sub, losses, beta=0.2, batch_pairs=n, batch_chosen_tokens=t_w)
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
    loss, rc, rr = combined_loss(lorarl_pair(per_token, mask, ref), losses, beta=0.3)
    assert float(loss.mean()) == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    ours = implicit_reward_metrics(rc, rr)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert ours[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
