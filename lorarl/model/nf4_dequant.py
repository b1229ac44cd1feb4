"""NF4 dequantization in plain torch, and the load-time check of bitsandbytes' CPU ``dequantize_4bit`` against it.

Why lorarl has its own: bitsandbytes 0.50.2's CPU ``dequantize_4bit`` is wrong on CPUs with AVX-512 for weights
whose blocks straddle rows. Its AVX-512 branch (``csrc/cpu_ops.cpp``, ``dequantizeBlockwise4bitCpu``; taken when
the row length ``n`` is a multiple of 16 and the blocksize at least 16) reads the scale of row ``r``, column ``c``
as ``absmax[r * (n // bs) + c // bs]``, which is the flat block ``(r n + c) // bs`` only when ``n % bs == 0``; its
arm64 branch has that guard, the x86 one does not (still so at bitsandbytes main 95f9af3). With ``bs = 64`` and
rows of 96 or 160 (the tiny test models, or any model of such a width) rows after the first read other rows'
scales: a max error of 2.0 on a ``randn`` weight, where NF4's own rounding is 0.45 (measured on this project's
AMD EPYC with AVX-512 and an Intel Xeon with AVX-512, 2026-11-28). PEFT's forward and backward on such a layer
dequantize through it, so a model trains on wrong weights without a word.

So, once per distinct layer shape when a model with NF4 layers on the CPU is loaded (:func:`check_cpu_dequantize`),
lorarl compares bitsandbytes' ``dequantize_4bit`` of one layer with :func:`dequantize_nf4`, written here from the
NF4 table and the block scales; for the shapes that differ it puts a CPU kernel in front of the operator
``bitsandbytes::dequantize_4bit`` that dequantizes those shapes in plain torch and hands every other call to
bitsandbytes' own kernel (:func:`route_to_reference`), then checks again; where that cannot be done it refuses with
one line naming the layer, its shape and the bitsandbytes version. The format (``bitsandbytes/functional.py``,
``quantize_4bit``): a flat row-major weight of ``N`` values, two 4-bit codes per byte (element ``2i`` in the high
nibble of byte ``i``), blocks of ``bs`` consecutive flat elements, each with one fp32 scale.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from math import prod

import torch
from torch import Tensor, nn

from lorarl.errors import LorarlError

# The 16 NF4 values (QLoRA, Dettmers et al. 2023, arXiv:2305.14314, appendix E: quantiles of N(0, 1) scaled to
# [-1, 1], with an exact 0), as bitsandbytes' get_4bit_type("nf4") and its CUDA / CPU kernels hold them.
NF4_TABLE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# A dequantized value may differ from the reference by this much of its own size: two bf16 units in the last place
# (both round the same fp32 product, so they agree exactly in practice); a wrong scale is off by a factor.
RTOL = 2.0**-7
OP = "bitsandbytes::dequantize_4bit"


def byte_values(table: Tensor) -> Tensor:
    """``[256, 2]``: the two values a packed byte holds, ``table[b >> 4]`` (its flat element ``2i``) and
    ``table[b & 15]`` (element ``2i + 1``). Example: byte ``0xF0`` -> ``(table[15], table[0])`` = ``(1.0, -1.0)``
    for NF4."""
    b = torch.arange(256)
    return torch.stack((table[b >> 4], table[b & 15]), dim=1)


def dequantize_flat(packed: Tensor, absmax: Tensor, blocksize: int, shape, dtype: torch.dtype) -> Tensor:
    """``W[f] = NF4[q_f] * absmax[f // bs]`` for flat index ``f = r n + c`` of a weight of ``shape`` (``n`` its last
    size), ``q_f`` the ``f``-th 4-bit code of ``packed`` (high nibble first), computed in fp32 and then rounded to
    ``dtype`` (as bitsandbytes' kernels do). ``packed``: the codes, any storage dtype (read as bytes);
    ``absmax [ceil(N / bs)]``: one fp32 scale per block. Example: ``packed = [0xF0, 0x7F]``, ``absmax = [2.0]``,
    ``bs = 64``, ``shape = (2, 2)`` -> ``[[2.0, -2.0], [0.0, 2.0]]``."""
    numel = prod(shape)
    table = torch.tensor(NF4_TABLE, dtype=torch.float32, device=packed.device)
    codes = packed.reshape(-1).view(torch.uint8).int()
    values = byte_values(table).index_select(0, codes).reshape(-1)[:numel]  # index_select: 2x faster than [codes]
    blocks = absmax.numel()
    if blocks * blocksize != numel:
        values = nn.functional.pad(values, (0, blocks * blocksize - numel))
    scaled = values.view(blocks, blocksize) * absmax.to(torch.float32).view(blocks, 1)
    return scaled.reshape(-1)[:numel].reshape(tuple(shape)).to(dtype)


def block_scales(quant_state) -> Tensor:
    """The fp32 scale of each block. With double quantization (``quant_state.nested``) they are stored as 8-bit
    codes ``q`` with a second level of scales: ``absmax[j] = code2[q_j] * absmax2[j // bs2] + offset`` (``code2``,
    ``absmax2``, ``bs2``: ``quant_state.state2``'s ``code``, ``absmax``, ``blocksize``; as ``dequantize_blockwise``
    then ``+ offset`` in ``bitsandbytes.functional.dequantize_4bit``)."""
    qs = quant_state
    if not qs.nested:
        return qs.absmax.to(torch.float32)
    s2 = qs.state2
    idx = torch.arange(qs.absmax.numel(), device=qs.absmax.device)
    scales = s2.code.to(torch.float32)[qs.absmax.int()] * s2.absmax.to(torch.float32)[idx // s2.blocksize]
    return scales + torch.as_tensor(qs.offset, dtype=torch.float32, device=scales.device)


def dequantize_nf4(packed: Tensor, quant_state) -> Tensor:
    """An NF4 weight (bitsandbytes' ``Params4bit`` data and its ``QuantState``) in ``quant_state.dtype``:
    :func:`dequantize_flat` with :func:`block_scales`. The reference for bitsandbytes' ``dequantize_4bit`` on every
    device and CPU. Raises ValueError for a format it does not read (FP4, the CPU inference repacking)."""
    qs = quant_state
    if qs.quant_type != "nf4":
        raise ValueError(f"quant_type {qs.quant_type!r} (this reads nf4)")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("a weight repacked for bitsandbytes' CPU inference kernel (this reads the flat layout)")
    return dequantize_flat(packed, block_scales(qs), int(qs.blocksize), tuple(qs.shape), qs.dtype)


# ------------------------------------------------------------------------------------ routing the operator


@dataclass
class Route:
    """lorarl's CPU kernel in front of ``bitsandbytes::dequantize_4bit``: ``keys`` (shape, blocksize, quant type,
    dtype) go to :func:`dequantize_flat`, the rest to ``original`` (bitsandbytes' kernel, as the dispatcher had it)."""

    library: torch.library.Library
    original: object
    keys: set = field(default_factory=set)

    def kernel(self, A, absmax, blocksize, quant_type, shape, dtype):
        if (tuple(shape), blocksize, quant_type, dtype) in self.keys:
            return dequantize_flat(A, absmax, blocksize, shape, dtype)
        cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        return self.original.call_boxed(cpu, A, absmax, blocksize, quant_type, shape, dtype)


_ROUTE: Route | None = None


def route_to_reference(keys) -> None:
    """From now on, in this process, bitsandbytes' CPU ``dequantize_4bit`` of an NF4 weight whose ``(shape,
    blocksize, "nf4", dtype)`` is in ``keys`` runs :func:`dequantize_flat` (every caller: PEFT's forward and
    backward, ``gemm_4bit``, merges). Installed once; later calls add keys. Raises what torch raises where its
    dispatcher cannot be reached this way."""
    global _ROUTE
    if _ROUTE is None:
        original = torch._C._dispatch_get_computed_kernel_for_dispatch_key(OP, torch._C.DispatchKey.CPU)
        library = torch.library.Library("bitsandbytes", "IMPL")
        route = Route(library, original)
        with warnings.catch_warnings():  # torch says once that a kernel is overridden: that is the point
            warnings.simplefilter("ignore")
            library.impl("dequantize_4bit", route.kernel, "CPU")
        _ROUTE = route
    _ROUTE.keys.update(keys)


def unroute() -> set:
    """Remove lorarl's kernel (bitsandbytes' own is back); returns the keys it routed."""
    global _ROUTE
    if _ROUTE is None:
        return set()
    route, _ROUTE = _ROUTE, None
    route.library._destroy()
    return route.keys


# ------------------------------------------------------------------------------------ the load-time check


@dataclass(frozen=True)
class Mismatch:
    """One layer shape bitsandbytes' CPU ``dequantize_4bit`` gets wrong: ``wrong`` of ``total`` values off by more
    than :data:`RTOL` of the reference's, ``max_error`` the largest difference."""

    layer: str
    shape: tuple
    blocksize: int
    dtype: torch.dtype
    wrong: int
    total: int
    max_error: float

    @property
    def key(self) -> tuple:
        return (self.shape, self.blocksize, "nf4", self.dtype)


def cpu_nf4_layers(model: nn.Module) -> dict[tuple, tuple[str, nn.Module]]:
    """The first NF4 bitsandbytes layer on the CPU of each distinct ``(shape, blocksize, "nf4", dtype)``, by name."""
    out: dict[tuple, tuple[str, nn.Module]] = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is None or w.device.type != "cpu" or qs.quant_type != "nf4" or getattr(qs, "packing_format_for_cpu", 0):
            continue
        out.setdefault((tuple(qs.shape), int(qs.blocksize), "nf4", qs.dtype), (name, m))
    return out


def compare(name: str, weight) -> Mismatch | None:
    """bitsandbytes' ``dequantize_4bit`` of ``weight`` (a ``Params4bit``) against :func:`dequantize_nf4`: a
    :class:`Mismatch` when any value differs by more than :data:`RTOL` of the reference's, else None."""
    import bitsandbytes.functional as bnbf

    qs = weight.quant_state
    got = bnbf.dequantize_4bit(weight.data, qs).float()
    want = dequantize_nf4(weight.data, qs).float()
    off = (got - want).abs() > RTOL * want.abs()
    if not bool(off.any()):
        return None
    err = float((got - want).abs().max())
    return Mismatch(name, tuple(qs.shape), int(qs.blocksize), qs.dtype, int(off.sum()), off.numel(), err)


def describe(found: list[Mismatch], version: str | None) -> str:
    """The shapes and an example layer, for the warning and the refusal."""
    shapes = ", ".join(f"[{', '.join(map(str, m.shape))}]" for m in found)
    m = found[0]
    return (
        f"bitsandbytes {version}'s CPU dequantize_4bit is wrong on this CPU for NF4 weights of shape {shapes} "
        f"(blocksize {m.blocksize}; e.g. {m.layer}: {m.wrong} of {m.total} values off, "
        f"max error {m.max_error:.3g})"
    )


def check_cpu_dequantize(model: nn.Module) -> list[Mismatch]:
    """Check bitsandbytes' CPU ``dequantize_4bit`` on one layer of each distinct NF4 shape of ``model`` (cheap: one
    dequantize each way per shape) and route the shapes it gets wrong to :func:`dequantize_flat`, with a one-line
    warning; check them again through bitsandbytes' entry point. Returns what was found (``[]``: bitsandbytes is
    right here, nothing changed). Raises :class:`LorarlError` (one line: layer, shape, bitsandbytes version) where
    the routing cannot be installed or does not take."""
    from importlib.metadata import version

    layers = cpu_nf4_layers(model)
    found = [m for m in (compare(name, mod.weight) for name, mod in layers.values()) if m is not None]
    if not found:
        return []
    why = describe(found, version("bitsandbytes"))
    advice = "load the model in full precision on the CPU (model.quantization: none) or use another bitsandbytes"
    try:
        route_to_reference(m.key for m in found)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the dispatcher ends in the refusal
        raise LorarlError(f"{why}, and lorarl cannot route it ({type(exc).__name__}: {exc}); {advice}") from None
    still = [m for m in found if compare(m.layer, layers[m.key][1].weight) is not None]
    if still:
        raise LorarlError(f"{why}, and routing {still[0].layer} to lorarl's dequantize did not take; {advice}")
    warnings.warn(f"{why}: lorarl dequantizes those shapes in plain torch (lorarl.model.nf4_dequant)", stacklevel=2)
    return found
