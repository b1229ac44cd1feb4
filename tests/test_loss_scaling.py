"""Dynamic loss scaling for fp16 bases (GPUs without bf16), on the CPU: gradients that flush to 0 in fp16 survive
scaling and come back unscaled; an overflow skips the step and halves the scale without stopping the run; the scale
travels with the optimizer's state dict (checkpoints, resume); and a real SFT / GRPO step on a tiny fp16 model trains
through it."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.update import (
    SCALER_KEY,
    NonFiniteGuard,
    StepResult,
    attach_loss_scaler,
    loss_scaler,
    one_pass,
    optimizer_step,
)


def _fp16_loss(w: torch.Tensor, x: torch.Tensor, factor: float):
    """A loss whose backward runs through fp16: ``sum(fp16(w) * x) * factor`` (the gradient reaching the fp16 product
    is ``factor``, times the loss scale when scaled)."""

    def loss_fn(_batch):
        y = w.half() * x.half()
        return y.float().sum() * factor, {}

    return loss_fn


def test_scaler_only_for_fp16():
    assert isinstance(loss_scaler(torch.float16, "cpu"), torch.amp.GradScaler)
    assert loss_scaler(torch.bfloat16, "cpu") is None and loss_scaler(torch.float32, "cuda") is None


def test_small_gradients_survive_only_with_loss_scaling():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    factor = 1e-8  # d loss / d y = 1e-8: below fp16's smallest subnormal (6e-8), it flushes to 0
    moved = {}
    for scaled in (False, True):
        w = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.SGD([w], lr=1.0)
        scaler = loss_scaler(torch.float16, "cpu") if scaled else None
        res = optimizer_step([w], opt, [0], _fp16_loss(w, x, factor), scaler=scaler)
        assert not res.skipped
        moved[scaled] = -w.detach().clone()  # SGD, lr 1, from 0: the gradient the step used
        if scaled:
            assert res.loss_scale == 2.0**16 and scaler.get_scale() == 2.0**16  # no overflow: unchanged
    assert torch.equal(moved[False], torch.zeros(4))  # without scaling the gradient vanished
    torch.testing.assert_close(moved[True], x * factor, rtol=2e-3, atol=0)  # scaled, then unscaled in fp32


def test_an_overflow_halves_the_scale_and_redoes_the_pass_on_the_same_batch():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = loss_scaler(torch.float16, "cpu")
    calls = []

    def loss_fn(batch):  # d loss / d y x 2^16 = 65536 > fp16's max (65504): the first pass overflows
        calls.append(batch)
        return _fp16_loss(w, torch.tensor([1.0, 1.5]), 1.0)(batch)

    res = optimizer_step([w], opt, iter([7]), loss_fn, scaler=scaler)  # a one-shot iterator: the batch is kept
    assert calls == [7, 7] and res.overflows == 1
    assert not res.skipped and res.loss_scale == 2.0**15 and scaler.get_scale() == 2.0**15
    torch.testing.assert_close(w.detach(), -torch.tensor([1.0, 1.5]))  # the unscaled gradient, one step
    assert res.grad_norm == pytest.approx(3.25**0.5)


def test_a_lone_overflowing_pass_is_skipped_and_counted_but_not_fatal():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = loss_scaler(torch.float16, "cpu")
    res = one_pass([w], opt, [0], _fp16_loss(w, torch.ones(2), 1.0), scaler=scaler)
    assert res.skipped and res.overflow and res.loss_scale == 2.0**16 and scaler.get_scale() == 2.0**15
    assert torch.equal(w.detach(), torch.zeros(2))
    guard = NonFiniteGuard(max_in_row=1)  # even one counted non-finite step would stop the run
    assert guard.check(res, step=1) is True and guard.skipped == 1 and guard.in_row == 0


def test_overflow_below_a_scale_of_one_is_a_real_non_finite_step():
    guard = NonFiniteGuard(max_in_row=2)
    bad = StepResult(1.0, float("inf"), True, 1, overflow=True, loss_scale=0.5)
    guard.check(bad, 1)
    with pytest.raises(Exception, match="2 non-finite losses or gradients in a row"):
        guard.check(bad, 2)


def test_a_non_finite_loss_is_not_an_overflow():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = loss_scaler(torch.float16, "cpu")
    res = optimizer_step([w], opt, [0], lambda b: ((w * float("nan")).sum(), {}), scaler=scaler)
    assert res.skipped and not res.overflow and scaler.get_scale() == 2.0**16


def test_the_scale_is_saved_and_restored_with_the_optimizer(tmp_path):
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w])
    scaler = loss_scaler(torch.float16, "cpu")
    attach_loss_scaler(opt, scaler)
    one_pass([w], opt, [0], _fp16_loss(w, torch.ones(2), 1.0), scaler=scaler)  # overflows: 2^15
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True)  # what lorarl.checkpoint reads back
    assert state[SCALER_KEY]["scale"] == 2.0**15
    w2 = torch.nn.Parameter(torch.zeros(2))
    opt2, scaler2 = torch.optim.AdamW([w2]), loss_scaler(torch.float16, "cpu")
    attach_loss_scaler(opt2, scaler2)
    opt2.load_state_dict(state)
    assert scaler2.get_scale() == 2.0**15


@pytest.fixture(scope="module")
def fp16_model_dir(tmp_path_factory, default_model_dir):
    """The tiny Llama with its output layer x100 (logits of a real model's scale), saved in fp16."""
    from conftest import make_tiny_model
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path_factory.mktemp("fp16") / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.mul_(100.0)
    model.save_pretrained(folder)
    return folder


def test_sft_on_an_fp16_base_trains_through_the_loss_scaler(fp16_model_dir):
    from lorarl.algos.sft import SFT
    from lorarl.config import recipe_from_dict
    from lorarl.model import SharedBase

    recipe = recipe_from_dict(
        {
            "algo": "sft",
            "model": {"name": str(fp16_model_dir), "quantization": "none", "dtype": "float16"},
            "lora": {"r": 8, "alpha": 16},
            "data": {"train_size": 2, "eval_size": 2},
            "sft": {"batch_size": 2},
            "train": {"steps": 2, "learning_rate": 2e-2, "micro_batch_size": 1, "seed": 0},
            "eval": {"n": 4, "batch_size": 4},
        }
    )
    sb = SharedBase.load(recipe.model)
    algo = SFT(recipe, sb)
    assert algo.policy.scaler is not None and {p.dtype for p in algo.policy.params} == {torch.float32}
    seen = []
    real = algo.policy.scaler.scale
    algo.policy.scaler.scale = lambda loss: (
        seen.append(float(loss.detach())) or real(loss)
    )  # each micro-batch is scaled
    rows = [algo.step(algo.batch(s)) for s in (1, 2)]  # the same 2 rows twice (one epoch)
    scale = algo.policy.scaler.get_scale()
    redone = round(math.log2(2.0**16 / scale))  # each overflow halved the scale and redid a step's 2 micro-batches
    assert 1 <= redone and len(seen) == 2 * (2 + redone)  # logits of tens of units overflow fp16 at 2^16
    assert all(r["skipped_updates"] == 0 for r in rows)  # no step lost to an overflow
    losses = [r["loss"] for r in rows]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert SCALER_KEY in algo.policy.optimizer.state_dict()
