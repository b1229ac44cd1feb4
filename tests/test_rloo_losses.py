"""RLOO's math (lorarl.core.rloo, lorarl.algos.rloo.rloo_advantages): the leave-one-out baseline, the KL folded
into the reward and the sequence-level clipped loss by hand, then against TRL 1.16's own RLOOTrainer code called on
the same tensors (``_generate_and_score_completions`` for the rewards / advantages / ``kl``, ``_compute_loss`` for the
loss, its gradient and its clip metrics), each on a stub object holding exactly the attributes TRL reads."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from test_gspo_tis import _Accelerator as OneProcess

from lorarl.algos.rloo import rloo_advantages
from lorarl.config.algorithms import RLOOConfig, RLOOKLConfig
from lorarl.core.rloo import leave_one_out_advantages, rloo_sequence_loss, sequence_kl, shaped_rewards

D = torch.float64
NAN = float("nan")


# ---- by hand ----------------------------------------------------------------------------------------------------


def test_leave_one_out_by_hand():
    # G = 4, rewards [1, 0, 0, 1]: each baseline is the mean of the other three
    loo = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D), 4)
    torch.testing.assert_close(loo.baselines, torch.tensor([1 / 3, 2 / 3, 2 / 3, 1 / 3], dtype=D))
    torch.testing.assert_close(loo.advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=D))
    # = G / (G - 1) x (r - group mean): 4/3 x 0.5
    assert loo.advantages[0].item() == pytest.approx(4 / 3 * 0.5)
    assert loo.zero_std.tolist() == [False]


def test_a_group_of_two_is_each_others_baseline():
    loo = leave_one_out_advantages(torch.tensor([3.0, 1.0, -2.0, 0.5], dtype=D), 2)
    torch.testing.assert_close(loo.baselines, torch.tensor([1.0, 3.0, 0.5, -2.0], dtype=D))
    torch.testing.assert_close(loo.advantages, torch.tensor([2.0, -2.0, -2.5, 2.5], dtype=D))


def test_equal_rewards_give_exactly_zero_and_are_flagged():
    loo = leave_one_out_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 1.0]), 3)
    assert loo.advantages[:3].tolist() == [0.0, 0.0, 0.0]  # exactly 0, not rounding noise
    assert loo.zero_std.tolist() == [True, False]
    # group 2: [1, 0, 1] -> baselines [0.5, 1, 0.5] -> [0.5, -1, 0.5]
    torch.testing.assert_close(loo.advantages[3:], torch.tensor([0.5, -1.0, 0.5]))


def test_missing_rewards_are_left_out_of_the_baseline():
    # [1, nan, 0, 0]: the baseline of each valid row averages the other VALID rows (3 valid -> 2 others)
    loo = leave_one_out_advantages(torch.tensor([1.0, NAN, 0.0, 0.0, NAN, 2.0, NAN, NAN], dtype=D), 4)
    torch.testing.assert_close(loo.advantages[:4], torch.tensor([1.0, 0.0, -0.5, -0.5], dtype=D))
    assert torch.isnan(loo.baselines[1]) and loo.baselines[0].item() == 0.0
    # the second group has one valid reward: no baseline, advantage 0 (TRL: 0/0, zeroed); and it is "zero spread"
    assert loo.advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0] and loo.zero_std.tolist() == [False, True]


def test_normalized_over_the_defined_advantages():
    # raw advantages [2/3, -2/3, -2/3, 2/3, 0, 0, 0, 0] (second group all equal); normalised over all 8 (all defined):
    # mean 0, unbiased std sqrt(4 * 4/9 / 7)
    loo = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0], dtype=D), 4, normalize=True)
    std = math.sqrt(4 * (4 / 9) / 7)
    want = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], dtype=D) / (std + 1e-4)
    torch.testing.assert_close(loo.advantages, want)
    # rows with no baseline (NaN reward) stay 0 and are not in the mean: [3, 1] -> [2, -2] -> mean 0, std 2*sqrt(2)
    loo = leave_one_out_advantages(torch.tensor([3.0, 1.0, NAN, NAN], dtype=D), 2, normalize=True)
    s = math.sqrt(8)
    torch.testing.assert_close(loo.advantages, torch.tensor([2 / (s + 1e-4), -2 / (s + 1e-4), 0.0, 0.0], dtype=D))


def test_refuses_what_is_not_a_batch_of_groups():
    for rewards, g, msg in [
        (torch.zeros(4, 1), 2, "1-D"),
        (torch.zeros(4), 1, ">= 2"),
        (torch.zeros(5), 2, "multiple"),
    ]:
        with pytest.raises(ValueError, match=msg):
            leave_one_out_advantages(rewards, g)


def test_kl_is_summed_over_the_sequence_and_folded_into_the_reward():
    old = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, -0.5, -0.5]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # row 0's third entry is padding: never read
    kl = sequence_kl(old, ref, mask)
    torch.testing.assert_close(kl, torch.tensor([0.5 - 1.0, 1.5], dtype=D))  # k1, summed; negative is possible
    r = shaped_rewards(torch.tensor([2.0, -3.0], dtype=D), kl, beta=0.1, clip_range=[-1.0, 1.0])
    torch.testing.assert_close(r, torch.tensor([1.0 + 0.05, -1.0 - 0.15], dtype=D))  # clipped, then penalised
    assert torch.isnan(shaped_rewards(torch.tensor([NAN]), torch.tensor([1.0]), beta=0.1)).all()
    torch.testing.assert_close(shaped_rewards(torch.tensor([1.0, 2.0]), kl.float(), beta=0.0), torch.tensor([1.0, 2.0]))


def test_sequence_ratio_is_the_product_of_token_ratios_and_clipped_per_sequence():
    old = torch.zeros(2, 3, dtype=D)
    lp = torch.tensor([[0.1, 0.2, 7.0], [0.05, -0.02, 0.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    loss, stats = rloo_sequence_loss(lp, old, torch.tensor([1.0, -2.0], dtype=D), mask, 0.2, 0.2)
    rho0, rho1 = math.exp(0.3), math.exp(0.03)
    assert rho0 > 1.2  # clipped: A > 0 and rho > 1 + eps
    torch.testing.assert_close(loss, torch.tensor([-1.2, 2.0 * rho1], dtype=D))
    (loss.sum() / 2).backward()  # the step's mean over its 2 rows
    # row 0 clipped: no gradient; row 1 unclipped: d(-rho A)/d lp_t = -A rho / N on each mask token
    g = 2.0 * rho1 / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [g, g, g]], dtype=D))
    assert float(stats["clip_frac_high"]) == 0.5 and float(stats["clip_frac_low"]) == 0.0
    assert float(stats["clip_frac_region"]) == 0.5 and float(stats["ratio_mean"]) == pytest.approx((rho0 + rho1) / 2)


def test_on_policy_the_gradient_is_reinforce():
    """ratio 1: the gradient of (1/N) sum_i loss_i is -(1/N) sum_i A_i sum_t grad log pi(o_it) -- every token of a
    sequence weighted by its advantage, whatever its length."""
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(3, 4, generator=g, dtype=D)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=D)
    loss, _ = rloo_sequence_loss(lp, lp.detach(), adv, mask)
    torch.testing.assert_close(loss, -adv)
    (loss.sum() / 3).backward()
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv[:, None] / 3, torch.zeros((), dtype=D)))


# ---- against TRL's RLOOTrainer ----------------------------------------------------------------------------------


class _Accelerator(OneProcess):
    """One process, as tests/test_gspo_tis.py's, with what RLOO's scoring reads besides."""

    device = torch.device("cpu")
    process_index = 0


EOS, PAD = 7, 0


def _trl_scored(rewards, old, ref, mask, truncated, *, group_size, beta, normalize, clip, mask_truncated):
    """TRL's own ``RLOOTrainer._generate_and_score_completions`` (trl/trainer/rloo_trainer.py) called unbound on a
    stub: generation returns completions of the mask's lengths (ending in EOS unless ``truncated``), the model's and
    the reference's per-token log-probs are ``old`` and ``ref``, the one reward function's values ``rewards``.
    Returns ``(output dict, logged metrics)``."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    N = old.shape[0]
    completions = []
    for i in range(N):
        ids = [5] * int(mask[i].sum())
        if not truncated[i]:
            ids[-1] = EOS
        completions.append(ids)
    ref_model = object()

    def logps(model, ids, attention_mask, logits_to_keep, batch_size=None, **kw):
        return (ref if model is ref_model else old)[:, :logits_to_keep], None, None

    fake = types.SimpleNamespace(
        accelerator=_Accelerator(),
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        ref_model=ref_model,
        _generate=lambda prompts: ([[1, 2]] * N, completions, ["c"] * N),
        _tokenizer=types.SimpleNamespace(pad_token_id=PAD),
        pad_to_multiple_of=None,
        mask_truncated_completions=mask_truncated,
        eos_token_ids=[EOS],
        args=types.SimpleNamespace(per_device_train_batch_size=N, gradient_checkpointing_kwargs=None),
        _get_per_token_logps_and_entropies=logps,
        beta=beta,
        reward_clip_range=clip,
        _calculate_rewards=lambda *a: rewards[:, None].clone(),
        num_generations=group_size,
        reward_weights=torch.ones(1, dtype=rewards.dtype),
        normalize_advantages=normalize,
        reward_func_names=["r"],
        _metrics={"train": defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": {}},
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    out = RLOOTrainer._generate_and_score_completions(fake, [{"prompt": "p"}] * N)
    return out, fake._metrics["train"]


def _rollout(seed, G=4, prompts=3, T=6):
    g = torch.Generator().manual_seed(seed)
    N = G * prompts
    old = -torch.rand(N, T, generator=g) * 3
    ref = old + 0.3 * torch.randn(N, T, generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T  # the longest row sets TRL's padded width
    mask = torch.arange(T)[None] < lengths[:, None]
    truncated = (lengths == T) & (torch.rand(N, generator=g) < 0.7)
    rewards = torch.randint(0, 3, (N,), generator=g).float() / 2  # ties within groups happen
    rewards[2] = NAN  # one row no reward function scored
    rewards[4:8] = 0.5  # one group without a spread
    return rewards, old, ref, mask, truncated


@pytest.mark.parametrize(
    "beta, normalize, clip, mask_truncated",
    [
        (0.0, False, None, False),
        (0.05, False, None, False),
        (0.05, True, None, False),
        (0.1, True, (0.0, 0.6), True),
        (0.0, True, (0.2, 0.8), True),
    ],
)
@pytest.mark.parametrize("group_size", [2, 4])
def test_advantages_and_kl_equal_trls(beta, normalize, clip, mask_truncated, group_size):
    rewards, old, ref, mask, truncated = _rollout(seed=group_size * 10 + int(beta * 100), G=group_size)
    out, metrics = _trl_scored(
        rewards,
        old,
        ref,
        mask,
        truncated,
        group_size=group_size,
        beta=beta,
        normalize=normalize,
        clip=clip,
        mask_truncated=mask_truncated,
    )
    cfg = RLOOConfig(
        group_size=group_size,
        normalize_advantages=normalize,
        reward_clip_range=list(clip) if clip else None,
        mask_truncated=mask_truncated,
        kl=RLOOKLConfig(coef=beta),
    )
    loss_mask = mask & ~truncated[:, None] if mask_truncated else mask  # what RLOO.step trains on
    adv, kl = rloo_advantages(rewards, old, ref if beta > 0 else None, loss_mask, cfg)
    torch.testing.assert_close(adv, out["advantages"], rtol=1e-5, atol=1e-6)
    assert (kl is None) == (beta == 0) and ("kl" in metrics) == (beta > 0)
    if beta > 0:
        assert kl == pytest.approx(metrics["kl"][0], rel=1e-5, abs=1e-7)
    if beta == 0 and clip is None:  # TRL's frac_reward_zero_std (of the penalised rewards: equal without a KL), on
        # rewards that all have a value (a group with one valid reward is "zero spread" in lorarl, NaN std in TRL)
        full = torch.nan_to_num(rewards, nan=1.0)
        _, metrics = _trl_scored(
            full,
            old,
            ref,
            mask,
            truncated,
            group_size=group_size,
            beta=0.0,
            normalize=False,
            clip=None,
            mask_truncated=False,
        )
        zero = leave_one_out_advantages(full, group_size).zero_std
        assert 0 < float(zero.float().mean()) == pytest.approx(metrics["frac_reward_zero_std"][0])


def _trl_loss(lp, old, adv, mask, eps_low, eps_high):
    """TRL's ``RLOOTrainer._compute_loss`` called unbound on a stub whose model forward returns ``lp``; ``old``: the
    per-token log-probs TRL sums into ``old_logps``. Returns ``(loss, logged metrics)``."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    B, T = lp.shape
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list)},
    )
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=torch.zeros(B, T, dtype=torch.long),
        completion_mask=mask.to(lp.dtype),
        old_logps=(old * mask).sum(1),
        advantages=adv,
    )
    return RLOOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.28)])
def test_loss_gradient_and_clip_metrics_equal_trls(eps):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g, dtype=D) * 2
    lp0 = old + 0.1 * torch.randn(B, T, generator=g, dtype=D)  # num_iterations > 1: moved; some sequences clip
    mask = torch.arange(T)[None] < torch.tensor([5, 2, 4, 1, 5, 3])[:, None]
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.2], dtype=D)

    lp_ours = lp0.clone().requires_grad_(True)
    loss, stats = rloo_sequence_loss(lp_ours, old, adv, mask, *eps)
    ours = loss.sum() / B  # the step's mean over its rows (lorarl.algos.rloo.rloo_loss with one micro-batch)
    ours.backward()
    lp_trl = lp0.clone().requires_grad_(True)
    theirs, metrics = _trl_loss(lp_trl, old, adv, mask, *eps)
    theirs.backward()

    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad)
    assert 0 < float(stats["clip_frac_region"]) < 1  # the case exercises the clip
    for ours_key, trl_key in [
        ("clip_frac_low", "clip_ratio/low_mean"),
        ("clip_frac_high", "clip_ratio/high_mean"),
        ("clip_frac_region", "clip_ratio/region_mean"),
    ]:
        assert float(stats[ours_key]) == pytest.approx(metrics[trl_key][0]), ours_key
