"""lorarl.kernels: the NF4 matmul under Triton's interpreter on the CPU, against NF4 dequantized in plain torch + matmul
(:func:`lorarl.model.nf4_dequant.dequantize_nf4`: bitsandbytes' own CPU dequantize is wrong on CPUs with AVX-512 for
rows of 96 or 160, tests/test_nf4_dequant.py), and the fast engine's kernel layer against the PEFT model it stands
in for.

Tolerance: the kernel and the reference round the weight to the input dtype identically (``code * absmax`` in fp32,
then ``.to(dtype)``), multiply exactly (bf16 / fp16 products are exact in fp32) and sum in fp32 in different orders
(a difference of order ``K * 2^-24 * sum |x w|``), then round to the dtype: so they differ by at most one unit in the
last place of the output (``rtol`` = 2^-7 for bf16, 2^-10 for fp16) plus ``1e-5 * sum_k |x_k w_k|`` for the
reordered fp32 sums.
"""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import pytest
import torch

from lorarl.kernels.nf4_matmul import NF4Weight, launch_config, nf4_matmul, reference_matmul
from lorarl.model.nf4_dequant import dequantize_nf4

RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

# (N, K) of the projections of the NF4 families in docs/families.md (Llama, Qwen2) at small sizes (square q / o
# run in the logits test below): GQA k / v (N < K), MLP up (N > K) and down (K > N); K = 96 and 160 are not multiples of the 64 blocksize, so blocks
# straddle rows; 96 x 160 has 240 blocks, 40 x 72 an odd count (45); K = 33 is odd, so rows start mid-byte (the
# kernel's per-element path; even K takes the per-byte path).
SHAPES = [(32, 64), (160, 96), (96, 160), (40, 72), (24, 33)]


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    """The kernel runs on CPU tensors under Triton's interpreter, for this module only (elsewhere the fast engine
    on a CPU keeps bitsandbytes' path: :func:`lorarl.kernels.nf4_matmul.available`)."""
    import torch._dynamo

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        # bitsandbytes dequantizes an odd last dimension on the CPU through torch.compile (~20 s per new shape on 2
        # cores); eager runs the same function (config.patch restores the entry; monkeypatch's undo deleted it, which
        # broke the next module in the same process)
        with torch._dynamo.config.patch(disable=True):
            yield


def quantized(n: int, k: int, dtype, nested: bool, seed: int = 0):
    torch.manual_seed(seed)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    return bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=nested, blocksize=64)


def assert_matches(y, x, packed, qs, bias=None):
    ref = reference_matmul(x, packed, qs)
    w = dequantize_nf4(packed, qs).float()
    slack = 1e-5 * (x.float().abs() @ w.abs().T)
    if bias is not None:
        ref = (ref.float() + bias.float()).to(x.dtype)
        slack = slack + bias.float().abs() * RTOL[x.dtype]
    diff = (y.float() - ref.float()).abs()
    allowed = RTOL[x.dtype] * ref.float().abs() + slack + 1e-30
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((diff <= allowed).all()), f"max excess {(diff - allowed).max().item()}"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype,nested", [(torch.bfloat16, True), (torch.float16, False)])
def test_kernel_equals_bitsandbytes_dequantize_matmul(n, k, dtype, nested):
    packed, qs = quantized(n, k, dtype, nested)
    weight = NF4Weight.from_bnb(packed, qs)
    assert weight.nested == nested
    for m in (1, 3, 16, 64):
        x = torch.randn(m, k).to(dtype)
        # small tiles, so that several N tiles, K steps and split-K slices run; at M = 3 and 64 also launch_config's
        for config in [(16, 32, 32, 2)] + ([launch_config(m, n, k)] if m in (3, 64) else []):
            assert_matches(nf4_matmul(x, weight, config=config), x, packed, qs)


def test_kernel_other_dtype_nesting_bias_and_3d_input():
    """bf16 without double quant, fp16 with it; a bias (Qwen2's q/k/v); x [batch, 1, K] as the decode step has it."""
    for dtype, nested in ((torch.bfloat16, False), (torch.float16, True)):
        packed, qs = quantized(96, 160, dtype, nested, seed=1)
        bias = (torch.randn(96) * 0.1).to(dtype)
        x = torch.randn(5, 1, 160).to(dtype)
        y = nf4_matmul(x, NF4Weight.from_bnb(packed, qs), bias)
        assert y.shape == (5, 1, 96)
        assert_matches(y.reshape(5, 96), x.reshape(5, 160), packed, qs, bias)


def test_kernel_reads_nibbles_and_nested_absmax_as_bitsandbytes_does():
    """A weight whose row ``n`` is ``n``-th NF4 code times a per-block scale: flipping the nibble order or the
    absmax indexing would move values between columns / blocks."""
    code = bnbf.get_4bit_type("nf4", device="cpu")
    n, k = 16, 128
    scales = torch.linspace(0.5, 2.0, n * k // 64).repeat_interleave(64)
    w = (code[torch.arange(n * k) % 16] * scales).reshape(n, k)
    packed, qs = bnbf.quantize_4bit(w.to(torch.bfloat16), quant_type="nf4", compress_statistics=True)
    eye = torch.eye(k, dtype=torch.bfloat16)[:64]  # x = e_0 .. e_63: y[i, j] = W[j, i]
    y = nf4_matmul(eye, NF4Weight.from_bnb(packed, qs))
    deq = dequantize_nf4(packed, qs)
    assert torch.equal(y, deq[:, :64].T.contiguous())


def test_launch_config_examples():
    """The docstring's examples (hand-computed there: tiles x slices, and the partial-sum bytes cap)."""
    import doctest

    from lorarl.kernels import nf4_matmul as module

    assert doctest.testmod(module).failed == 0
    assert launch_config(1, 1024, 4096) == (16, 64, 256, 16)  # k_proj: 16 tiles x 16 slices of one BLOCK_K each
    assert launch_config(1, 4096, 512) == (16, 64, 256, 2)  # a short K: slices at least BLOCK_K wide


def test_kernel_refuses_what_it_cannot_read():
    packed, qs = quantized(32, 64, torch.bfloat16, False)
    weight = NF4Weight.from_bnb(packed, qs)
    with pytest.raises(ValueError, match="300 rows"):
        nf4_matmul(torch.zeros(300, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="float32"):
        nf4_matmul(torch.zeros(1, 64), weight)
    fp4, fqs = bnbf.quantize_4bit(torch.randn(32, 64, dtype=torch.bfloat16), quant_type="fp4")
    with pytest.raises(ValueError, match="fp4"):
        NF4Weight.from_bnb(fp4, fqs)


@pytest.fixture(scope="module")
def nf4_shared():
    """The tiny test shape (Llama, hidden 64) in bf16 with NF4 projections (bitsandbytes on the CPU), a policy
    adapter with non-zero B, on a SharedBase."""
    from lorarl.bench.rollout import add_policy
    from lorarl.bench.synthetic import TINY, IdTokenizer, random_model
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    model, n_quant = random_model(dict(TINY), torch.device("cpu"), torch.bfloat16, "nf4")
    assert n_quant == 14
    cfg = ModelConfig(name="tiny", quantization="nf4", dtype="bfloat16", gradient_checkpointing=False)
    shared = SharedBase(model, IdTokenizer(TINY["vocab_size"]), cfg, base_path="tiny")
    add_policy(shared, r=8)
    return shared


def test_kernel_layer_logits_equal_the_peft_model(nf4_shared):
    """What the fast engine samples from with the kernel equals what the trainer scores (PEFT's forward): logits
    of the policy and of the reference (adapters disabled) on the tiny NF4 model; the layers go back after."""
    from lorarl.kernels.lora_decode import kernel_decode, lora_nf4_layers

    shared = nf4_shared
    layers = lora_nf4_layers(shared.module)
    assert len(layers) == 14
    ids = torch.randint(3, 512, (2, 6))
    for role in ("policy", None):
        with shared.role(role) if role else shared.module.disable_adapter(), torch.no_grad():
            want = shared.module(input_ids=ids).logits.float()
            with kernel_decode(shared.module, shared.device, "auto") as reason:
                assert reason is None
                assert all("forward" in m.__dict__ for m in layers)
                got = shared.module(input_ids=ids).logits.float()
        assert all("forward" not in m.__dict__ for m in layers)
        # the base alone (reference role): bitsandbytes on the CPU dequantizes and multiplies as the kernel does, so
        # up to the last bit (measured: equal); the policy adds the LoRA path in bf16 where PEFT runs it in fp32
        # (measured 2026-11-28: 0.43% of the largest logit, every argmax equal)
        scale = want.abs().max()
        tol, agree = (0.01, 0.9) if role else (2.0**-7, 1.0)
        assert (got - want).abs().max() <= tol * scale, (role, (got - want).abs().max() / scale)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= agree


def test_engine_key_switches_the_kernel_and_greedy_tokens_agree(nf4_shared):
    """``generation.nf4_kernel``: auto decodes through the kernel (under the interpreter on the CPU), off through
    bitsandbytes; greedy completions agree; a bad value is refused naming the key."""
    from lorarl.config import GenerationConfig
    from lorarl.kernels.lora_decode import kernel_reason
    from lorarl.rollout.fast import FastEngine

    shared = nf4_shared
    prompts = [[5, 9, 17, 33], [7, 8]]
    out = {}
    for setting in ("auto", "off"):
        engine = FastEngine()
        gen = GenerationConfig(max_new_tokens=3, nf4_kernel=setting)
        with shared.role("policy"):
            out[setting] = engine.sample(shared, prompts, 1, gen, greedy=True).completion_ids
        assert (engine.kernel_reason is None) == (setting == "auto"), engine.kernel_reason
    assert torch.equal(out["auto"], out["off"])
    with pytest.raises(ValueError, match="generation.nf4_kernel"):
        kernel_reason(shared.module, shared.device, "on")


def test_recipe_key_is_validated():
    from lorarl.config.loader import recipe_from_dict
    from lorarl.errors import LorarlError

    assert recipe_from_dict({"generation": {"nf4_kernel": "off"}}).generation.nf4_kernel == "off"
    with pytest.raises(LorarlError, match="generation.nf4_kernel"):
        recipe_from_dict({"generation": {"nf4_kernel": "fast"}})


def test_self_check_error_by_hand():
    """max |got - want| / max |want|: [1, -4] against [1, -2] is 2 / 2 = 1; equal outputs are 0."""
    from lorarl.kernels.lora_decode import self_check_error

    assert self_check_error(torch.tensor([1.0, -4.0]), torch.tensor([1.0, -2.0])) == 1.0
    assert self_check_error(torch.tensor([3.0, 0.5]), torch.tensor([3.0, 0.5])) == 0.0


def test_self_check_falls_back_when_the_kernel_is_wrong_or_raises(nf4_shared, monkeypatch):
    """Before ``auto`` decodes through the kernel, it runs once on one of the model's own layers against bitsandbytes:
    a kernel that is off by a tile, or that fails to build on the device, gives a reason (a warning naming the
    device and the error) and the engine keeps PEFT's forward, which samples the same tokens as ``off``."""
    from lorarl.kernels import lora_decode

    layer = lora_decode.lora_nf4_layers(nf4_shared.module)[0].base_layer
    monkeypatch.setattr(lora_decode, "_CHECKED", {})
    assert lora_decode.self_check(layer) is None  # the real kernel passes (interpreter)

    def wrong(x, weight, bias=None, config=None):
        y = reference_matmul(x, layer.weight.data, layer.weight.quant_state)
        y[..., :8] += 1.0  # one wrong tile
        return y

    def raises(*args, **kwargs):
        raise RuntimeError("PTX build failed")

    for bad, says in ((wrong, "differ by"), (raises, "RuntimeError: PTX build failed")):
        monkeypatch.setattr(lora_decode, "_CHECKED", {})
        monkeypatch.setattr(lora_decode, "nf4_matmul", bad)
        with pytest.warns(UserWarning, match=says):
            reason = lora_decode.kernel_reason(nf4_shared.module, nf4_shared.device, "auto")
        assert reason is not None and says in reason
        with lora_decode.kernel_decode(nf4_shared.module, nf4_shared.device, "auto") as why:
            assert why == reason  # cached: no second warning, no kernel in front of the layers
            assert all("forward" not in m.__dict__ for m in lora_decode.lora_nf4_layers(nf4_shared.module))
