"""lorarl.model.nf4_dequant: NF4 dequantized in plain torch (by hand, against exact weights and bitsandbytes' own
pure-torch compute), and the load-time check that routes the shapes bitsandbytes' CPU ``dequantize_4bit`` gets wrong
(its AVX-512 branch, rows of 96 or 160 with blocks of 64): simulated on every CPU, real where the CPU has AVX-512."""

from __future__ import annotations

import warnings
from math import prod

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch

from lorarl.errors import LorarlError
from lorarl.model import nf4_dequant
from lorarl.model.nf4_dequant import NF4_TABLE, block_scales, byte_values, check_cpu_dequantize, dequantize_nf4

STRADDLING = [(8, 96), (6, 160), (5, 33), (3, 40)]  # rows not a multiple of 64: blocks cross rows (33: odd)


def exact_nf4_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight NF4 represents exactly: flat block ``b`` is ``NF4[code] * s_b`` with its first element code 15
    (1.0), so the block's absmax is ``s_b`` and quantizing loses nothing."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols
    codes = torch.randint(0, 16, (n,), generator=g)
    codes[::64] = 15
    scales = (torch.rand(-(-n // 64), generator=g) + 0.5).repeat_interleave(64)[:n]
    return (torch.tensor(NF4_TABLE)[codes] * scales).reshape(rows, cols)


def test_table_and_byte_values_by_hand():
    assert torch.equal(torch.tensor(NF4_TABLE), bnbf.get_4bit_type("nf4", device="cpu"))
    pairs = byte_values(torch.tensor(NF4_TABLE))
    assert pairs.shape == (256, 2)
    assert pairs[0xF0].tolist() == [1.0, -1.0] and pairs[0x7F].tolist() == [0.0, 1.0]
    # the docstring's example: bytes F0 7F, one block of scale 2 -> [[2, -2], [0, 2]]
    packed = torch.tensor([0xF0, 0x7F], dtype=torch.uint8)
    out = nf4_dequant.dequantize_flat(packed, torch.tensor([2.0]), 64, (2, 2), torch.float32)
    assert out.tolist() == [[2.0, -2.0], [0.0, 2.0]]


@pytest.mark.parametrize("rows,cols", STRADDLING)
def test_dequantize_gives_back_an_exact_weight_across_rows(rows, cols):
    w = exact_nf4_weight(rows, cols)
    packed, qs = bnbf.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=False)
    assert torch.equal(dequantize_nf4(packed, qs), w)


@pytest.mark.parametrize("rows,cols", STRADDLING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nested_dequantize_equals_bitsandbytes_pure_torch_compute(rows, cols, dtype):
    """Double quantization: the block scales equal bitsandbytes' ``dequantize_blockwise + offset`` and the weight its
    pure-torch ``_dequantize_4bit_compute`` (its default backend, flat indexing), bit for bit."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    torch.manual_seed(rows * cols)
    packed, qs = bnbf.quantize_4bit(torch.randn(rows * 7, cols).to(dtype), quant_type="nf4", compress_statistics=True)
    assert qs.nested
    scales = bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    assert torch.equal(block_scales(qs), scales)
    code = _get_4bit_code("nf4", "cpu")
    with torch._dynamo.config.patch(disable=True):  # eager: torch.compile costs ~20 s per shape on 2 cores
        want = _dequantize_4bit_compute(packed.reshape(-1), scales, code, 64, qs.shape, dtype)
    got = dequantize_nf4(packed, qs)
    assert got.dtype == dtype and torch.equal(got, want)


def test_dequantize_refuses_what_it_does_not_read():
    packed, qs = bnbf.quantize_4bit(torch.randn(4, 64), quant_type="fp4")
    with pytest.raises(ValueError, match="fp4"):
        dequantize_nf4(packed, qs)


# ------------------------------------------------------------------ bitsandbytes' AVX-512 branch, simulated


def avx512_branch(A, absmax, blocksize, quant_type, shape, dtype):
    """bitsandbytes 0.50.2's CPU dequantize (csrc/cpu_ops.cpp, dequantizeBlockwise4bitCpu) in torch: where the row
    length n is a multiple of 16 and the blocksize at least 16 (its AVX-512 branch) row r, column c takes the scale
    ``absmax[r * (n // bs) + c // bs]``; elsewhere (its scalar branch) ``absmax[(r n + c) // bs]``."""
    m, n = prod(shape[:-1]), shape[-1]
    values = byte_values(bnbf.get_4bit_type(quant_type, device="cpu"))[A.reshape(-1).view(torch.uint8).int()]
    values = values.reshape(-1)[: m * n].reshape(m, n)
    if n % 16 == 0 and blocksize >= 16:
        block = torch.arange(m)[:, None] * (n // blocksize) + torch.arange(n)[None, :] // blocksize
    else:
        block = (torch.arange(m * n) // blocksize).reshape(m, n)
    return (values * absmax.float()[block]).reshape(tuple(shape)).to(dtype)


@pytest.fixture
def bnb_unrouted():
    """bitsandbytes' CPU kernel as it is, lorarl's routing (from models loaded earlier in this process) taken off
    for the test and put back after."""
    saved = nf4_dequant.unroute()
    yield
    nf4_dequant.unroute()
    if saved:
        nf4_dequant.route_to_reference(saved)


@pytest.fixture
def simulated_avx512(bnb_unrouted):
    """bitsandbytes' CPU ``dequantize_4bit`` replaced by :func:`avx512_branch` (on any CPU), recording each call's
    shape."""
    calls = []

    def kernel(A, absmax, blocksize, quant_type, shape, dtype):
        calls.append(tuple(shape))
        return avx512_branch(A, absmax, blocksize, quant_type, shape, dtype)

    lib = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("dequantize_4bit", kernel, "CPU")
    yield calls
    nf4_dequant.unroute()  # lorarl's kernel first (it sits on top of the simulation), then the simulation
    lib._destroy()


def nf4_linear(n_in: int, n_out: int, seed: int) -> bnb.nn.Linear4bit:
    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(n_in, n_out, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(n_out, n_in), requires_grad=False, quant_type="nf4", module=layer).to(
        "cpu"
    )
    layer.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1, requires_grad=False)
    return layer


def reference_forward(layer: bnb.nn.Linear4bit, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize_nf4(layer.weight.data, layer.weight.quant_state), layer.bias)


def test_wrong_shapes_are_detected_and_routed(simulated_avx512):
    """Under the simulated AVX-512 branch, the check finds the two straddling shapes (not the 64-wide one), says so
    in one warning, and from then on the layers' forward and backward (PEFT's path: bitsandbytes' matmul_4bit) equal
    ``x @ W^T + b`` with ``W`` from the plain-torch dequantize; the 64-wide shape still runs bitsandbytes' kernel."""
    model = torch.nn.Sequential(
        nf4_linear(96, 160, 0), nf4_linear(160, 96, 1), nf4_linear(96, 96, 2), nf4_linear(64, 32, 3)
    )
    x = torch.randn(3, 96)
    assert (model[0](x) - reference_forward(model[0], x)).abs().max() > 0.5  # the simulation is wrong here
    with pytest.warns(
        UserWarning, match=r"bitsandbytes .*wrong on this CPU .*shape \[160, 96\], \[96, 160\], \[96, 96\]"
    ) as rec:
        found = check_cpu_dequantize(model)
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert [(m.layer, m.shape) for m in found] == [("0", (160, 96)), ("1", (96, 160)), ("2", (96, 96))]
    assert found[0].max_error > 0.5 and found[0].wrong > found[0].total // 4
    for layer, n_in in ((model[0], 96), (model[1], 160)):
        xg = torch.randn(4, n_in, requires_grad=True)
        y = layer(xg)
        assert torch.equal(y, reference_forward(layer, xg))
        y.sum().backward()
        w = dequantize_nf4(layer.weight.data, layer.weight.quant_state)
        assert torch.allclose(xg.grad, w.sum(0).expand(4, -1), rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # the inference path (gemm_4bit) too
            assert torch.equal(layer(xg), reference_forward(layer, xg))
    calls = len(simulated_avx512)
    model[3](torch.randn(2, 64))
    assert simulated_avx512[calls:] == [(32, 64)]  # a shape bitsandbytes gets right stays with bitsandbytes
    assert check_cpu_dequantize(model) == []  # checked again: nothing left to route, no second warning


def test_refuses_in_one_line_where_routing_fails(simulated_avx512, monkeypatch):
    from importlib.metadata import version

    model = torch.nn.Sequential(nf4_linear(64, 32, 0), nf4_linear(96, 160, 1))

    def cannot(keys):
        raise RuntimeError("no dispatcher here")

    monkeypatch.setattr(nf4_dequant, "route_to_reference", cannot)
    with pytest.raises(LorarlError) as err:
        check_cpu_dequantize(model)
    line = str(err.value)
    assert (
        "\n" not in line and "1" in line and "[160, 96]" in line and f"bitsandbytes {version('bitsandbytes')}" in line
    )
    assert "no dispatcher here" in line and "model.quantization: none" in line

    monkeypatch.setattr(nf4_dequant, "route_to_reference", lambda keys: None)  # installed, but does not take
    with pytest.raises(LorarlError, match=r"routing 1 to lorarl's dequantize did not take"):
        check_cpu_dequantize(model)


# ------------------------------------------------------------------ the real bitsandbytes on this CPU


def test_a_loaded_nf4_model_computes_with_the_right_weights(tmp_path):
    """``load_base`` with NF4 on the CPU, a model 48 wide (rows of 48 and 96: blocks straddle rows): every
    ``Linear4bit``'s forward, and the model's logits, equal those computed with the plain-torch dequantized weights.
    On a CPU where bitsandbytes takes its AVX-512 branch this holds only through the routing (without it the logits
    differ: measured on this project's AMD EPYC, 2026-11-28); elsewhere bitsandbytes is right by itself."""
    from lorarl.bench.synthetic import tiny_llama_folder
    from lorarl.config import ModelConfig
    from lorarl.model import load_base

    folder = tiny_llama_folder(tmp_path / "m48", hidden=48, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the routing's warning, on CPUs that need it
        model, tok, _ = load_base(
            ModelConfig(name=str(folder), quantization="nf4", dtype="float32"), torch.device("cpu")
        )
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert {tuple(m.weight.quant_state.shape) for m in layers} == {(48, 48), (24, 48), (96, 48), (48, 96)}
    ids = torch.tensor([[1, 17, 250, 3000, 42, 9]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        for m in layers:
            x = torch.randn(2, m.in_features)
            assert torch.equal(m(x), reference_forward(m, x))
            m.forward = lambda x, m=m: reference_forward(m, x)
        want = model(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="bitsandbytes takes its AVX-512 branch only on CPUs with AVX-512 (where it does, the simulation is checked)",
)
def test_the_simulation_is_bitsandbytes_on_an_avx512_cpu(bnb_unrouted):
    """:func:`avx512_branch` equals bitsandbytes' CPU dequantize exactly, for the shapes it gets wrong (96, 160) and
    right (100, 128, 576), so the simulated tests above test what happens on such a CPU."""
    for cols in (96, 160, 100, 128, 576, 48):
        torch.manual_seed(cols)
        packed, qs = bnbf.quantize_4bit(torch.randn(16, cols), quant_type="nf4", compress_statistics=False)
        got = bnbf.dequantize_4bit(packed, qs)
        assert torch.equal(got, avx512_branch(packed, qs.absmax, 64, "nf4", qs.shape, torch.float32)), cols
        assert torch.equal(got, dequantize_nf4(packed, qs)) == (cols % 64 == 0 or cols % 16 != 0), cols
