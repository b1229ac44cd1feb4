"""The update step: micro-batch gradient accumulation equals the full batch (end to end through the model, for
every GRPO loss reduction with KL and entropy terms), non-finite losses / gradients skip the step untouched,
clipping, and the LR schedules."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.algos.grpo import grpo_loss
from lorarl.config import GenerationConfig, GRPOConfig, GRPOKLConfig, LoraSettings
from lorarl.core.schedules import make_scheduler
from lorarl.rollout import generate_rollout
from lorarl.update import micro_batches, optimizer_step


def test_micro_batches_cover_rows():
    assert list(micro_batches(5, 2)) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert list(micro_batches(4, 8)) == [slice(0, 4)]
    with pytest.raises(ValueError):
        list(micro_batches(3, 0))


@pytest.mark.parametrize(
    "kind, warmup, want",
    [
        ("constant", 0, [1.0, 1.0, 1.0, 1.0]),
        ("constant", 2, [0.5, 1.0, 1.0, 1.0]),
        ("linear", 0, [1.0, 0.75, 0.5, 0.25]),
        ("linear", 1, [1.0, 1.0, 2 / 3, 1 / 3]),
        ("cosine", 0, [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
    ],
)
def test_lr_schedules(kind, warmup, want):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sch = make_scheduler(opt, kind, warmup, total_steps=4)
    got = []
    for _ in range(4):
        got.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sch.step()
    assert got == pytest.approx(want, rel=1e-6)


# ---- micro-batch equivalence, end to end through the model -----------------------------------------------------


@pytest.fixture(scope="module")
def _grpo_setup(tiny_model_dir):
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("policy", LoraSettings(r=4))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.05)
    prompts = [sb.tokenizer(t)["input_ids"] for t in ["What is 12 + 7?", "Say hi"]]
    torch.manual_seed(0)
    r = generate_rollout(
        sb,
        prompts,
        GenerationConfig(max_new_tokens=5, temperature=0.9),
        group_size=4,
        record_old=True,
        reference="reference",
    )
    # ragged completions: give the rows different lengths so the reductions really differ
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])[:, None]
    r.completion_mask &= torch.arange(r.completion_ids.shape[1])[None, :] < lengths
    # make old log-probs differ from the current policy so ratios move away from 1 (both clip sides get hit)
    gen = torch.Generator().manual_seed(1)
    r.old_logprobs = r.old_logprobs + 0.3 * torch.randn(r.old_logprobs.shape, generator=gen)
    advantages = torch.tensor([1.5, -0.5, 0.0, -1.0, 0.7, -0.7, 2.0, -2.0])
    return sb, r, advantages


@pytest.fixture()
def grpo_setup(_grpo_setup):
    """A tiny policy with non-zero LoRA weights and a 2-prompt x 4-completion rollout with old / ref log-probs
    (ragged lengths, old log-probs perturbed so ratios leave 1). Each test gets its own copy of the rollout."""
    import copy

    sb, r, adv = _grpo_setup
    return sb, copy.deepcopy(r), adv.clone()


def _setup_loss(sb, r, advantages, cfg, rows, use_reference):
    """``grpo_loss`` of ``rows`` on the fixture's rollout: its completion mask as the loss mask, temperature 0.9,
    5 new tokens, all of its rows and tokens in the normaliser."""
    return grpo_loss(
        rows,
        shared=sb,
        rollout=r,
        advantages=advantages,
        loss_mask=r.completion_mask,
        cfg=cfg,
        temperature=0.9,
        total_rows=len(r),
        total_sequences=len(r),
        total_tokens=int(r.completion_mask.sum()),
        max_len=5,
        use_reference=use_reference,
    )


def _grads_after(sb, r, advantages, cfg, mbs, rows=None):
    params = sb.trainable_parameters("policy")
    rows = torch.arange(len(r)) if rows is None else rows
    losses = []
    for p in params:
        p.grad = None
    for s in micro_batches(len(rows), mbs):
        loss, _ = _setup_loss(sb, r, advantages, cfg, rows[s], use_reference=True)
        loss.backward()
        losses.append(float(loss.detach()))
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return sum(losses), grads


@pytest.mark.parametrize(
    "reduction, estimator", [("seq_mean_token_mean", "k3"), ("token_mean", "k3_unbiased"), ("seq_sum_norm", "k3")]
)
def test_micro_batch_gradients_equal_full_batch(grpo_setup, reduction, estimator):
    sb, r, adv = grpo_setup
    cfg = GRPOConfig(
        loss_reduction=reduction,
        kl=GRPOKLConfig(coef=0.1, estimator=estimator),
        entropy_coef=0.01,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    full_loss, full = _grads_after(sb, r, adv, cfg, mbs=8)
    assert any(float(g.abs().max()) > 0 for g in full)
    loss, grads = _grads_after(sb, r, adv, cfg, mbs=3)  # micro-batches of 3, 3 and 2 rows
    assert loss == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
    for g, f in zip(grads, full):
        # fp32 summation order differs: absolute tolerance scaled to the tensor's own magnitude
        torch.testing.assert_close(g, f, rtol=1e-4, atol=1e-5 * float(f.abs().max()))


def test_seq_mean_reduction_matches_hand_formula(grpo_setup):
    """The GRPO loss value for ratio = 1 (old = current), no KL / entropy: -(1/N) sum_i (1/|o_i|) sum_t A_i."""
    sb, r, adv = grpo_setup
    r.old_logprobs = None  # num_iterations == 1: the detached current log-probs are the old ones
    cfg = GRPOConfig(loss_reduction="seq_mean_token_mean", kl=GRPOKLConfig(coef=0.0))
    loss, stats = _setup_loss(sb, r, adv, cfg, torch.arange(8), use_reference=False)
    assert loss.item() == pytest.approx(-float(adv.mean()), abs=1e-6)  # each row's token mean of -A_i is -A_i
    assert stats["clip_frac_low"][0] == 0 and stats["clip_frac_high"][0] == 0
    assert "kl" not in stats


def test_skipping_zero_advantage_rows_leaves_the_gradient_unchanged(grpo_setup):
    """The loop skips rows with A = 0 when there is no KL / entropy term; the normaliser still counts them."""
    sb, r, adv = grpo_setup
    cfg = GRPOConfig(loss_reduction="token_mean", kl=GRPOKLConfig(coef=0.0))

    def grads(rows):
        params = sb.trainable_parameters("policy")
        loss, _ = _setup_loss(sb, r, adv, cfg, rows, use_reference=False)
        loss.backward()
        out = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return loss.item(), out

    full_loss, full = grads(torch.arange(8))
    part_loss, part = grads((adv != 0).nonzero().squeeze(1))
    assert part_loss == pytest.approx(full_loss, abs=1e-6)
    for a, b in zip(part, full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_optimizer_step_equals_one_full_batch_step(grpo_setup):
    sb, r, adv = grpo_setup
    cfg = GRPOConfig(loss_reduction="seq_mean_token_mean", kl=GRPOKLConfig(coef=0.05))
    params = sb.trainable_parameters("policy")
    start = [p.detach().clone() for p in params]

    def run(mbs):
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        opt = torch.optim.SGD(params, lr=1.0)

        def loss_fn(rows):
            return _setup_loss(sb, r, adv, cfg, rows, use_reference=True)

        res = optimizer_step(
            params, opt, (torch.arange(8)[s] for s in micro_batches(8, mbs)), loss_fn, max_grad_norm=None
        )
        return res, [p.detach().clone() for p in params]

    full, after_full = run(8)
    part, after_part = run(3)
    assert not full.skipped and not part.skipped and part.micro_batches == 3
    assert part.loss == pytest.approx(full.loss, rel=1e-5)
    assert part.grad_norm == pytest.approx(full.grad_norm, rel=1e-4)
    # token-weighted stats are the same whatever the split (sum / count accumulation)
    for k in ("clip_frac_low", "clip_frac_high", "kl", "entropy", "approx_kl"):
        assert part.stats[k] == pytest.approx(full.stats[k], rel=1e-4, abs=1e-7)
    for a, b, s in zip(after_part, after_full, start):
        torch.testing.assert_close(a - s, b - s, rtol=1e-4, atol=1e-5 * float((b - s).abs().max()))
    with torch.no_grad():  # the module-scoped model is shared with other tests
        for p, s in zip(params, start):
            p.copy_(s)


# ---- non-finite losses and gradients ------------------------------------------------------------------------


def _toy():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    return w, opt


def test_nan_loss_skips_without_touching_weights_or_optimizer():
    w, opt = _toy()
    before = w.detach().clone()
    res = optimizer_step(
        [w],
        opt,
        [0, 1],
        lambda b: ((w * float("nan")).sum() if b == 1 else w.sum(), {}),
        max_grad_norm=1.0,
    )
    assert res.skipped and res.micro_batches == 2 and math.isnan(res.loss)
    assert torch.equal(w, before) and w.grad is None
    assert not opt.state  # Adam moments never created


def test_a_held_update_leaves_weights_and_optimizer_untouched():
    """PPO's early stop: ``hold`` sees the batch's stats before the step; True keeps the weights as they were."""
    w, opt = _toy()
    before = w.detach().clone()
    seen = []
    res = optimizer_step(
        [w], opt, [0], lambda b: ((w**2).sum(), {"approx_kl": (0.3, 1.0)}), hold=lambda st: seen.append(st) or True
    )
    assert res.held and not res.skipped and seen == [{"approx_kl": 0.3}]
    assert torch.equal(w, before) and w.grad is None and not opt.state
    res = optimizer_step([w], opt, [0], lambda b: ((w**2).sum(), {"approx_kl": (0.0, 1.0)}), hold=lambda st: False)
    assert not res.held and not torch.equal(w, before)


def test_the_schedule_advances_once_per_step_even_when_no_update_ran():
    from lorarl.core.schedules import advance

    w, opt = _toy()
    sch = make_scheduler(opt, "linear", 0, 4)
    for _ in range(2):  # two RL steps whose updates were all skipped
        advance(sch)
    assert sch.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)


def test_inf_gradient_with_finite_loss_skips():
    w, opt = _toy()
    before = w.detach().clone()
    w.register_hook(lambda g: g * float("inf"))
    res = optimizer_step([w], opt, [0], lambda b: ((w**2).sum(), {}), max_grad_norm=1.0)
    assert res.skipped and math.isfinite(res.loss) and not math.isfinite(res.grad_norm)
    assert torch.equal(w, before) and not opt.state


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_gradient_element_among_many_tensors_skips(bad):
    """The step reads one number, the total gradient norm: a single NaN / inf element in one of several gradient
    tensors (the others finite and small) must still skip the update."""
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    opt = torch.optim.AdamW(ws, lr=0.1)
    before = [w.detach().clone() for w in ws]
    ws[3].register_hook(lambda g: g.index_put((torch.tensor([2]), torch.tensor([1])), torch.tensor(bad)))
    res = optimizer_step(ws, opt, [0], lambda b: (sum((w**2).sum() for w in ws), {}), max_grad_norm=1.0)
    assert res.skipped and math.isfinite(res.loss) and not math.isfinite(res.grad_norm)
    assert all(torch.equal(w, b) for w, b in zip(ws, before)) and not opt.state


def test_clipping_and_stats_accumulation():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    target = torch.tensor([3.0, 4.0])  # gradient of -(w . target) is -target, norm 5

    def loss_fn(b):
        return -(w * target).sum() / 2, {"x": (b * 2.0, 2.0)}

    res = optimizer_step([w], opt, [1.0, 3.0], loss_fn, max_grad_norm=1.0)
    assert not res.skipped and res.grad_norm == pytest.approx(5.0)
    assert w.tolist() == pytest.approx([0.6, 0.8])  # clipped to norm 1
    assert res.stats["x"] == pytest.approx((2.0 + 6.0) / 4.0)


def test_out_of_memory_halves_the_micro_batch_and_gives_the_full_batch_gradient():
    from lorarl.update import optimizer_step_halving

    torch.manual_seed(0)
    x = torch.randn(12, 5)
    y = torch.randn(12)

    def run(max_rows_that_fit):
        w = torch.zeros(5, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        seen = []

        def loss_fn(rows):
            seen.append(len(rows))
            loss = ((x[rows] @ w - y[rows]) ** 2).sum() / len(x)  # the micro-batch's share of the full-batch loss
            if len(rows) > max_rows_that_fit:
                loss.backward()  # partial gradients exist when the OOM strikes: they must be dropped
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return loss, {}

        halvings = []
        rows = torch.arange(12)
        result, size = optimizer_step_halving(
            [w],
            opt,
            lambda n: (rows[s] for s in micro_batches(12, n)),
            12,
            loss_fn,
            on_halve=lambda a, b: halvings.append((a, b)),
        )
        return w.detach(), size, halvings, result

    w_full, size_full, halvings_full, _ = run(12)
    w_small, size_small, halvings_small, result = run(4)
    assert size_full == 12 and halvings_full == []
    assert size_small == 3 and halvings_small == [(12, 6), (6, 3)]
    assert not result.skipped and result.micro_batches == 4
    torch.testing.assert_close(w_small, w_full, rtol=1e-6, atol=1e-7)

    def never_fits(rows):
        raise torch.OutOfMemoryError("CUDA out of memory")

    w = torch.zeros(5, requires_grad=True)
    with pytest.raises(torch.OutOfMemoryError):
        optimizer_step_halving([w], torch.optim.SGD([w], lr=0.1), lambda n: [torch.arange(4)], 4, never_fits)
    other = RuntimeError("shape mismatch")

    def broken(rows):
        raise other

    with pytest.raises(RuntimeError, match="shape mismatch"):
        optimizer_step_halving([w], torch.optim.SGD([w], lr=0.1), lambda n: [torch.arange(4)], 4, broken)
