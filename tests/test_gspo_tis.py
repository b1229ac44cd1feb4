"""GSPO's sequence-level ratio and truncated importance sampling (TIS): the pure functions against hand-computed
values and against TRL's GRPOTrainer on identical tensors; the default GRPO loss path against the loss formula."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from lorarl.algos.grpo import grpo_loss, grpo_token_loss
from lorarl.config import GenerationConfig, GRPOConfig, LoraSettings, recipe_from_dict
from lorarl.config.algorithms import GRPOKLConfig, TISConfig
from lorarl.core.losses import gspo_clip_loss, reduce_loss, tis_weights
from lorarl.errors import RecipeError

D = torch.float64


# ---- GSPO by hand -----------------------------------------------------------------------------------------------


def test_gspo_docstring_example_is_clipped_per_sequence():
    lp = torch.tensor([[0.3, -0.1]], dtype=D, requires_grad=True)
    loss, stats = gspo_clip_loss(
        lp, torch.zeros(1, 2, dtype=D), torch.tensor([1.0], dtype=D), torch.ones(1, 2), 0.05, 0.05
    )
    assert math.exp(0.1) == pytest.approx(1.10517, abs=1e-5)
    torch.testing.assert_close(loss, torch.tensor([[-1.05, -1.05]], dtype=D))
    loss.sum().backward()
    assert torch.all(lp.grad == 0)  # clipped: no gradient
    assert float(stats["clip_frac_high"]) == 1.0 and float(stats["ratio_mean"]) == pytest.approx(math.exp(0.1))


def test_gspo_geometric_mean_over_the_mask_and_its_gradient():
    """Row 0: log-ratios 0.02, -0.01 on the mask (the third token is padding holding 5.0: never read)
    -> s = exp(0.005); A = 2, unclipped: loss = -2 s on both tokens; d(mean_t loss)/d lp_t = -A s / 2 per token.
    Row 1: one token, log-ratio -0.5, A = -1: s = e^-0.5 < 1 - eps_low with A < 0 -> clipped at 1 - eps_low."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], dtype=D)
    lp = (old + torch.tensor([[0.02, -0.01, 5.0], [-0.5, 9.0, 9.0]], dtype=D)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0], dtype=D)
    loss, stats = gspo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    s0 = math.exp(0.005)
    want = torch.tensor([[-2 * s0, -2 * s0, 0.0], [0.8, 0.0, 0.0]], dtype=D)  # -min(s A, 0.8 A) with A = -1 -> 0.8
    torch.testing.assert_close(loss, want)
    red = reduce_loss(loss, mask, "seq_mean_token_mean", total_rows=2, total_sequences=2, total_tokens=3, max_len=3)
    assert float(red.detach()) == pytest.approx((-2 * s0 + 0.8) / 2)
    red.backward()
    # (1/N) * d(-A s)/d lp_t = (1/2) * (-A s / |y|) with |y| = 2; row 1 clipped -> 0; padding -> 0
    g = -2.0 * s0 / 2 / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert float(stats["clip_frac_low"]) == 0.5 and float(stats["clip_frac_high"]) == 0.0


def test_gspo_refuses_per_token_advantages():
    with pytest.raises(ValueError, match="one advantage per sequence"):
        gspo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


# ---- TIS by hand ------------------------------------------------------------------------------------------------


def test_tis_weights_hand_values_cap_mask_and_nan():
    old = torch.tensor([[-1.0, -0.5, -0.3], [-2.0, -1.0, 0.0]], dtype=D)
    sampler = torch.tensor([[-1.2, -2.0, float("nan")], [-1.0, -1.0, -7.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w = tis_weights(old, sampler, mask, cap=2.0)
    want = torch.tensor([[math.exp(0.2), 2.0, 1.0], [math.exp(-1.0), 1.0, 1.0]], dtype=D)
    torch.testing.assert_close(w, want)
    assert not w.requires_grad


# ---- against TRL's GRPOTrainer._compute_loss on identical tensors -----------------------------------------------


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


def _trl_loss(
    lp, old, adv, mask, *, level, eps_low, eps_high, beta=0.0, ref=None, bias_kl=False, is_ratio=None, **more
):
    """TRL's own ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py), called unbound on a lightweight
    object that holds exactly the attributes it reads; the model forward is replaced by the given log-probs.
    ``more``: ``loss_type`` (default grpo), ``entropies`` ``[B, T]`` with ``entropy_coef`` (the bonus), ``accum``
    (TRL's gradient accumulation steps), ``max_completion_length`` (dr_grpo's constant), ``num_items_in_batch``
    (dapo / cispo / vespo's normaliser: the loss tokens of the accumulated batch) and ``args`` (more GRPOConfig
    fields: sapo's temperatures, vespo's parameters)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, T = lp.shape
    ent = more.get("entropies", torch.zeros(B, T, dtype=lp.dtype))
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,  # VESPO's (a static method)
        entropy_coef=more.get("entropy_coef", 0.0),
        use_adaptive_entropy=False,
        max_completion_length=more.get("max_completion_length", T),
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=more.get("loss_type", "grpo"),
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=types.SimpleNamespace(
            delta=None,
            use_bias_correction_kl=bias_kl,
            steps_per_generation=more.get("accum", 1),
            **more.get("args", {}),
        ),
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=more.get("accum", 1),
        _entropy_bonus_enabled=more.get("entropy_coef", 0.0) != 0.0,
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list)},
    )
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=torch.zeros(B, T, dtype=torch.long),
        completion_mask=mask.to(lp.dtype),
        advantages=adv,
        old_per_token_logps=old,
        num_items_in_batch=torch.tensor(float(more.get("num_items_in_batch", mask.sum()))),
    )
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


def _batch(seed=0, B=5, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    lp0 = old + 0.0008 * torch.randn(B, T, generator=g, dtype=D)  # a GSPO-sized move: some sequences clip
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    sampler = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)  # a sampler that differs beyond noise
    lengths = torch.tensor([6, 3, 1, 5, 4])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9], dtype=D)[:B]
    return old, lp0, ref, sampler, mask, adv


def _lorarl_loss(lp, old, adv, mask, cfg, **kw):
    per_token, stats = grpo_token_loss(lp, old, adv, mask, cfg, entropy=torch.zeros_like(lp), **kw)
    n_seq, n_tok = int(mask.any(-1).sum()), int(mask.sum())
    loss = reduce_loss(
        per_token, mask, "seq_mean_token_mean", total_rows=n_seq, total_sequences=n_seq, total_tokens=n_tok, max_len=6
    )
    return loss, stats


@pytest.mark.parametrize(
    "level, eps, beta, estimator",
    [
        ("sequence", (3e-4, 4e-4), 0.0, "k3"),
        ("sequence", (3e-4, 4e-4), 0.04, "k3"),
        ("token", (2e-4, 3e-4), 0.04, "k3"),
    ],
)
def test_gspo_and_token_loss_equal_trls_compute_loss(level, eps, beta, estimator):
    old, lp0, ref, _, mask, adv = _batch()
    cfg = GRPOConfig(
        importance_sampling_level=level,
        clip_eps_low=eps[0],
        clip_eps_high=eps[1],
        kl=GRPOKLConfig(coef=beta, estimator=estimator),
    )
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours, stats = _lorarl_loss(lp_a, old, adv, mask, cfg, ref_logprobs=ref if beta else None)
    theirs, metrics = _trl_loss(
        lp_b, old, adv, mask, level=level, eps_low=eps[0], eps_high=eps[1], beta=beta, ref=ref if beta else None
    )
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)
    assert lp_a.grad.abs().sum() > 0
    # the batch exercises both branches: some sequences (or tokens) clipped, some not
    clipped = stats["clip_frac_low"][0] + stats["clip_frac_high"][0]
    assert 0 < clipped < stats["clip_frac_low"][1]
    for ours_key, trl_key in (("clip_frac_low", "clip_ratio/low_mean"), ("clip_frac_high", "clip_ratio/high_mean")):
        s, n = stats[ours_key]
        assert s / n == pytest.approx(metrics[trl_key][0], abs=1e-6)  # TRL logs float32 means


def test_unbiased_kl_at_token_level_equals_trls_bias_corrected_kl():
    old, lp0, ref, _, mask, adv = _batch(seed=1)
    cfg = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl=GRPOKLConfig(coef=0.1, estimator="k3_unbiased"))
    lp_a, lp_b = (lp0 + 0.1).requires_grad_(True), (lp0 + 0.1).requires_grad_(True)
    ours, _ = _lorarl_loss(lp_a, old, adv, mask, cfg, ref_logprobs=ref)
    theirs, _ = _trl_loss(
        lp_b, old, adv, mask, level="token", eps_low=0.2, eps_high=0.28, beta=0.1, ref=ref, bias_kl=True
    )
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)


def test_dr_grpo_normaliser_counts_an_all_masked_row_as_trls_does():
    """Dr. GRPO's constant normaliser (rows x max_new_tokens) keeps a row whose tokens are all masked (a truncated
    row under mask_truncated): 4 rows, row 2 masked, max_len 8 -> sum / 32, not / 24; two micro-batches of 2 rows
    with gradient accumulation equal TRL's ``dr_grpo`` (its micro-batch rows x max_completion_length x 2 steps)."""
    from lorarl.algos.grpo import reduce_grpo_loss
    from lorarl.core.losses import batch_totals

    old, lp0, _, _, mask, adv = _batch(seed=3, B=4)
    mask[2] = False
    cfg = GRPOConfig(loss_reduction="seq_sum_norm")
    totals = batch_totals(mask)
    assert totals == {"total_rows": 4, "total_sequences": 3, "total_tokens": 14}
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours = theirs = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        per_token, _ = grpo_token_loss(lp_a[rows], old[rows], adv[rows], mask[rows], cfg)
        ours = ours + reduce_grpo_loss(per_token, torch.zeros_like(per_token), mask[rows], cfg, **totals, max_len=8)
        trl, _ = _trl_loss(
            lp_b[rows], old[rows], adv[rows], mask[rows], level="token", eps_low=0.2, eps_high=0.2,
            loss_type="dr_grpo", max_completion_length=8, accum=2,
        )  # fmt: skip
        theirs = theirs + trl
    # ratio 1 + 8e-4 noise, unclipped at eps 0.2: the loss is -sum_i A_i sum_t m_it ratio_it / (4 * 8)
    hand = -(adv[:, None] * torch.exp(lp0 - old) * mask).sum() / 32
    assert float(ours.detach()) == pytest.approx(float(hand), rel=1e-12)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "reduction, trl_type", [("seq_mean_token_mean", "grpo"), ("token_mean", "bnpo"), ("seq_sum_norm", "dr_grpo")]
)
def test_entropy_bonus_is_trls_token_mean_whatever_the_reduction(reduction, trl_type):
    """grpo.entropy_coef follows TRL: the bonus is coef x the token mean of the entropy for every loss_reduction
    (one micro-batch, as TRL's bonus is a mean per micro-batch). Hand value: lengths 6, 3, 1, 5, 4 -> 19 tokens; the
    bonus lowers the loss by coef * sum(m H) / 19, where verl's convention (entropy reduced like the loss) would
    lower it by a different amount for seq_mean_token_mean and seq_sum_norm."""
    from lorarl.algos.grpo import reduce_grpo_loss
    from lorarl.core.losses import batch_totals

    old, lp0, _, _, mask, adv = _batch(seed=4)
    ent0 = torch.rand(5, 6, generator=torch.Generator().manual_seed(9), dtype=D) * 2
    coef, totals = 0.05, dict(**batch_totals(mask), max_len=6)
    with_bonus = GRPOConfig(loss_reduction=reduction, entropy_coef=coef)
    without = GRPOConfig(loss_reduction=reduction)
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ent_a, ent_b = ent0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
    per_token, _ = grpo_token_loss(lp_a, old, adv, mask, with_bonus, entropy=ent_a)
    ours = reduce_grpo_loss(per_token, ent_a, mask, with_bonus, **totals)
    theirs, _ = _trl_loss(
        lp_b, old, adv, mask, level="token", eps_low=0.2, eps_high=0.2, loss_type=trl_type, entropies=ent_b,
        entropy_coef=coef, max_completion_length=6,
    )  # fmt: skip
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent_a.grad, ent_b.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent_a.grad, -coef * mask.to(D) / 19, rtol=1e-12, atol=0)
    bonus = float((reduce_grpo_loss(per_token, ent0, mask, without, **totals) - ours).detach())
    assert bonus == pytest.approx(coef * float((ent0 * mask).sum()) / 19, rel=1e-12)
    verl_bonus = coef * float(reduce_loss(ent0, mask, reduction, **totals))
    assert (abs(verl_bonus - bonus) > 1e-4) == (reduction != "token_mean")


def _trl_token_truncate_ratio(old, sampling, mask, clip_max, clip_min=None):
    """TRL's token-level truncated IS ratio, reproduced line for line from ``GRPOTrainer._generate_and_score_completions``
    (trl 1.16.0, trl/trainer/grpo_trainer.py lines 2660-2685, ``vllm_importance_sampling_mode="token_truncate"``):
    that method generates with vLLM and cannot be called without it, so its arithmetic is copied here."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    ratio = torch.exp(per_token_logps_diff)
    return torch.clamp(ratio, min=clip_min, max=clip_max)


@pytest.mark.parametrize("level, eps", [("token", (0.2, 0.28)), ("sequence", (3e-4, 4e-4))])
def test_tis_weights_and_weighted_loss_equal_trls(level, eps):
    old, lp0, _, sampler, mask, adv = _batch(seed=2)
    cap = 2.0
    w = tis_weights(old, sampler, mask, cap)
    trl_ratio = _trl_token_truncate_ratio(old, sampler, mask.to(D), cap)
    torch.testing.assert_close(w, trl_ratio, rtol=0, atol=0)
    assert (w[mask] == cap).any() and (w[mask] < 1).any()  # both truncated and down-weighted tokens
    cfg = GRPOConfig(importance_sampling_level=level, clip_eps_low=eps[0], clip_eps_high=eps[1], tis=TISConfig(cap=cap))
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours, stats = _lorarl_loss(lp_a, old, adv, mask, cfg, sampler_logprobs=sampler, tis_cap=cap)
    theirs, _ = _trl_loss(lp_b, old, adv, mask, level=level, eps_low=eps[0], eps_high=eps[1], is_ratio=trl_ratio)
    ours.backward()
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)
    s, n = stats["tis_truncated"]
    assert s / n == pytest.approx(float((w[mask] >= cap).double().mean()))


# ---- the default loss path is the GRPO formula ------------------------------------------------------------------


def test_default_grpo_token_loss_is_the_ppo_clip_formula():
    """Defaults (token level, eps 0.2 / 0.2, no KL, no entropy, no TIS): per token -min(r A, clip(r, 0.8, 1.2) A),
    reduced as (1/N) sum_i mean_t; value and gradient written out here from the formula."""
    cfg = GRPOConfig()
    assert (cfg.importance_sampling_level, cfg.clip_eps_low, cfg.clip_eps_high) == ("token", 0.2, 0.2)
    assert not cfg.dynamic_sampling.enabled and cfg.tis.mode == "auto"
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.1, -4.0]], dtype=D)
    lp = (old + torch.tensor([[0.3, -0.1, 0.0], [-0.4, 0.05, 1.0]], dtype=D)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -2.0], dtype=D)
    per_token, _ = grpo_token_loss(lp, old, adv, mask, cfg, entropy=torch.zeros_like(lp))
    loss = reduce_loss(
        per_token, mask, "seq_mean_token_mean", total_rows=2, total_sequences=2, total_tokens=5, max_len=3
    )
    loss.backward()
    # row 0 (A = 0.5): r = e^0.3 = 1.3499 -> clipped at 1.2 (no grad); e^-0.1 = 0.9048 and 1: unclipped
    # row 1 (A = -2): r = e^-0.4 = 0.6703 -> clipped at 0.8 (no grad); e^0.05 = 1.0513: unclipped
    row0 = [-1.2 * 0.5, -math.exp(-0.1) * 0.5, -1.0 * 0.5]
    row1 = [0.8 * 2.0, math.exp(0.05) * 2.0]
    assert float(loss.detach()) == pytest.approx((sum(row0) / 3 + sum(row1) / 2) / 2, rel=1e-12)
    want_grad = [[0.0, -math.exp(-0.1) * 0.5 / 3 / 2, -0.5 / 3 / 2], [0.0, math.exp(0.05) * 2.0 / 2 / 2, 0.0]]
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=D), rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def policy_rollout(tiny_model_dir):
    from lorarl.model import SharedBase
    from lorarl.rollout import generate_rollout

    sb = SharedBase.load(recipe_from_dict({"model": _tiny_model(tiny_model_dir)}).model)
    sb.add_adapter("policy", LoraSettings(r=4))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.05)
    prompts = [sb.tokenizer(t)["input_ids"] for t in ["What is 3 + 4?", "Count to three"]]
    torch.manual_seed(0)
    r = generate_rollout(
        sb, prompts, GenerationConfig(max_new_tokens=5, temperature=0.9), group_size=4, record_old=True
    )
    r.completion_mask &= (
        torch.arange(r.completion_ids.shape[1])[None, :] < torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])[:, None]
    )
    r.old_logprobs = r.old_logprobs + 0.3 * torch.randn(
        r.old_logprobs.shape, generator=torch.Generator().manual_seed(1)
    )
    return sb, r


def _tiny_model(d):
    return {"name": str(d), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False}


def test_default_grpo_loss_through_the_model_equals_the_formula(policy_rollout):
    """grpo_loss with a default recipe's grpo section on a real (tiny) forward: the loss and its gradient equal the
    GRPO formula applied to the policy's log-probs computed separately (ratios off 1, both clip sides hit)."""
    from lorarl.model import completion_logprobs

    sb, r = policy_rollout
    cfg = recipe_from_dict({"model": {"name": "x"}}).grpo
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0, 0.7, -0.7, 2.0, -2.0])
    mask = r.completion_mask
    params = sb.trainable_parameters("policy")
    with sb.role("policy", train=True):
        loss, _ = grpo_loss(
            torch.arange(8),
            shared=sb,
            rollout=r,
            advantages=adv,
            loss_mask=mask,
            cfg=cfg,
            temperature=0.9,
            total_rows=8,
            total_sequences=8,
            total_tokens=int(mask.sum()),
            max_len=5,
            use_reference=False,
        )
        loss.backward()
        got = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        lp, _ = completion_logprobs(sb, r, 0.9)
        ratio = torch.exp(lp - r.old_logprobs)
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        want = sum((per_token[i][mask[i]].sum() / mask[i].sum()) for i in range(8)) / 8
        want.backward()
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert clipped[mask].any() and (~clipped)[mask].any()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
        p.grad = None


# ---- recipe keys ------------------------------------------------------------------------------------------------


def test_recipe_keys_clip_defaults_and_refusals():
    seq = recipe_from_dict({"grpo": {"importance_sampling_level": "sequence"}}).grpo
    assert (seq.clip_eps_low, seq.clip_eps_high) == (3e-4, 4e-4)  # GSPO paper v2 Sec. 5.1
    tok = recipe_from_dict({}).grpo
    assert (tok.clip_eps_low, tok.clip_eps_high) == (0.2, 0.2)
    given = recipe_from_dict({"grpo": {"importance_sampling_level": "sequence", "clip_eps_high": 1e-3}}).grpo
    assert (given.clip_eps_low, given.clip_eps_high) == (3e-4, 1e-3)
    for reduction in ("token_mean", "seq_sum_norm"):
        with pytest.raises(RecipeError, match=r"grpo.importance_sampling_level sequence \(GSPO\) needs grpo.loss_"):
            recipe_from_dict({"grpo": {"importance_sampling_level": "sequence", "loss_reduction": reduction}})
    with pytest.raises(RecipeError, match="grpo.importance_sampling_level must be one of"):
        recipe_from_dict({"grpo": {"importance_sampling_level": "seq"}})
    with pytest.raises(RecipeError, match="grpo.tis.cap must be >= 1"):
        recipe_from_dict({"grpo": {"tis": {"cap": 0.5}}})
    with pytest.raises(RecipeError, match="ppo.tis.mode must be one of"):
        recipe_from_dict({"algo": "ppo", "ppo": {"tis": {"mode": "on"}}})
    with pytest.raises(RecipeError, match="grpo.dynamic_sampling.max_rounds must be >= 1"):
        recipe_from_dict({"grpo": {"dynamic_sampling": {"enabled": True, "max_rounds": 0}}})
