"""``y = x @ W^T`` with ``W`` in bitsandbytes' NF4 layout, for decode-sized ``x`` (1 to 256 rows), reading each packed
weight byte from memory once per call.

Why lorarl has its own kernel (options checked 2026-11-28, against the installed bitsandbytes 0.50.2 source):

* **bitsandbytes 0.50.2** has fused kernels for every ``M`` (``bitsandbytes::gemm_4bit``: SIMT below 8 rows,
  ``mma.sync`` above), but its dispatch (``backends/cuda/ops.py``, ``_gemm_4bit_use_custom_cuda``) sends most decode
  shapes on an H100 / H200 (sm90) to *dequantize the whole weight to bf16, then* ``F.linear`` as soon as ``M >= 8``
  (``M >= 5`` for some shapes): on sm90 a weight of fewer than ``num_sms / 2`` 64-column blocks (every 4096-wide
  projection of Llama-3.1-8B: 64 blocks on 132 SMs; its k/v projections; ``down_proj``) always falls back, and the
  largest (gate/up, 224 blocks) stays fused only to ``M <= 32``. The fallback reads the 4-bit weight, writes it in bf16
  and reads it again: about 9x the bytes of the packed weight. That is the profile the issue recorded at batch 16
  and 64 (``docs/measurements/gpu/nvidia-h200-2026-11-27/rollout_profile_8b_nf4.json``).
* **FLUTE** (``flute-kernel``, LUT-quantized GEMM) takes an NF4 table, but its own packed layout, tuned per SM count
  (``flute.utils.pack(W, num_bits, template_ids, num_sms)``), fp16/bf16 per-group scales (no double quantization),
  and ships CUDA wheels built against specific torch / CUDA versions (none for torch 2.13 CPU, so CI could not even
  import it). Converting bitsandbytes' weights means a second copy of the base in another format, which the shared
  base exists to avoid.
* Others that read NF4 (Unsloth's ``fast_dequantize``, the Hub's ``kernels-community/quantization-bitsandbytes``)
  wrap the same bitsandbytes kernels or dequantize first.

So this module is a Triton kernel over bitsandbytes' own tensors, no repack: ``W`` is the flat row-major ``[N, K]``
weight, two 4-bit codes per byte (flat element ``2i`` in the **high** nibble of byte ``i``, ``2i + 1`` in the low one:
``q8[::2] << 4 | q8[1::2]`` in ``bitsandbytes/backends/default/ops.py``), value = ``code[nibble] * absmax[f // bs]``
for flat index ``f = n K + k`` and blocksize ``bs`` (64 by default). With double quantization
(``compress_statistics``) the absmax itself is 8-bit: ``absmax[b] = code2[q[b]] * absmax2[b // 256] + offset`` (fp32,
``dequantize_4bit`` -> ``dequantize_blockwise`` + ``offset``); the kernel computes it per block from the 1-byte codes,
so it reads 1 byte per 64 weights, not 4. Blocks may straddle rows (``K`` not a multiple of ``bs``): the kernel indexes
flat, so any ``K`` works. With ``K`` even (every model lorarl loads) each row starts on a byte, and the kernel loads
each byte once, decodes its two codes and computes one scale for both, then interleaves them (``tl.join``); with
``K`` odd it works per element.

Tiling: one program per ``BLOCK_N`` output columns x ``BLOCK_M`` rows x one of ``SPLIT_K`` slices of ``K``; it
dequantizes a ``[BLOCK_N, BLOCK_K]`` tile to the input dtype (as ``dequantize_4bit`` does) and accumulates
``tl.dot(x_tile, w_tile^T)`` in fp32; the ``SPLIT_K`` partial sums go to an fp32 buffer summed in a fixed order
(deterministic: the same logits every call). ``SPLIT_K`` is chosen so that at least 4 programs per SM run
(:func:`launch_config`). Under the interpreter two things differ: bf16 operands go to ``tl.dot`` as fp32 (Triton
3.9's interpreter computes the bf16 dot wrongly; the products are exact in fp32 either way), and the fp32 -> bf16
rounding of the weight is done by hand on the bits on every device (the interpreter truncates). These tile sizes are **unmeasured** guesses for an H100 (no GPU was lent while this
was written); ``python -m lorarl.bench.rollout`` measures the kernel's decode step against the weight-streaming bound.

Its reference, :func:`reference_matmul`, is the NF4 dequantize in plain torch
(:func:`lorarl.model.nf4_dequant.dequantize_nf4`, bitsandbytes' values on every CPU) then a matmul; tests run the
kernel under ``TRITON_INTERPRET=1`` on the CPU against it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

try:  # Triton is optional: without it the fallback (PEFT / bitsandbytes) decodes
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

MAX_ROWS = 256  # the kernel serves x with at most this many rows; larger batches dequantize + matmul
DQ_BLOCK = 256  # bitsandbytes' blocksize for the second-level (absmax) quantization; the only one gemm_4bit takes


def interpreting() -> bool:
    """True when Triton runs its interpreter (``TRITON_INTERPRET=1``): the kernel then takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None when it can): Triton missing, or neither CUDA nor the
    interpreter."""
    if triton is None:
        return "triton is not installed (pip install 'lorarl[kernels]')"
    if device.type != "cuda" and not interpreting():
        return f"device {device.type} is not CUDA (set TRITON_INTERPRET=1 to run the kernel on the CPU, slowly)"
    return None


@dataclass
class NF4Weight:
    """bitsandbytes' NF4 weight as the kernel reads it (views of the ``Params4bit`` tensors, nothing copied but the
    16-entry code table, in fp32):

    ``packed`` uint8 ``[ceil(N K / 2)]``; ``code`` fp32 ``[16]``; ``absmax`` fp32 ``[blocks]`` (plain) or uint8
    ``[blocks]`` (double quant, then ``code2`` fp32 ``[256]``, ``absmax2`` fp32 ``[ceil(blocks / 256)]``, ``offset``
    fp32 ``[1]``); ``shape = (N, K)``; ``blocksize``."""

    packed: Tensor
    code: Tensor
    absmax: Tensor
    shape: tuple[int, int]
    blocksize: int
    code2: Tensor | None = None
    absmax2: Tensor | None = None
    offset: Tensor | None = None

    @property
    def nested(self) -> bool:
        return self.code2 is not None

    @classmethod
    def from_bnb(cls, packed: Tensor, quant_state) -> NF4Weight:
        """From a bitsandbytes ``Params4bit`` (or ``quantize_4bit``'s packed tensor) and its ``QuantState``.
        Raises ValueError for what the kernel does not read: FP4, bitsandbytes' CPU inference repacking, a 3-D
        shape, a second-level blocksize other than 256, storage other than uint8."""
        qs = quant_state
        if qs.quant_type != "nf4":
            raise ValueError(f"quant_type {qs.quant_type!r} (the kernel reads nf4)")
        if getattr(qs, "packing_format_for_cpu", False):
            raise ValueError("a weight repacked for bitsandbytes' CPU inference kernel (the kernel reads it flat)")
        if len(qs.shape) != 2:
            raise ValueError(f"weight shape {tuple(qs.shape)} (the kernel reads 2-D [out, in])")
        if packed.dtype != torch.uint8:
            raise ValueError(f"quant_storage {packed.dtype} (the kernel reads uint8)")
        n, k = int(qs.shape[0]), int(qs.shape[1])
        flat = packed.reshape(-1)
        code = qs.code.to(device=flat.device, dtype=torch.float32).contiguous()
        if not qs.nested:
            return cls(flat, code, qs.absmax.float().contiguous(), (n, k), int(qs.blocksize))
        if int(qs.state2.blocksize) != DQ_BLOCK:
            raise ValueError(f"double-quant blocksize {qs.state2.blocksize} (the kernel reads {DQ_BLOCK})")
        offset = torch.as_tensor(qs.offset, dtype=torch.float32, device=flat.device).reshape(1)
        return cls(
            flat,
            code,
            qs.absmax.contiguous(),
            (n, k),
            int(qs.blocksize),
            code2=qs.state2.code.float().contiguous(),
            absmax2=qs.state2.absmax.float().contiguous(),
            offset=offset,
        )


def reference_matmul(x: Tensor, packed: Tensor, quant_state) -> Tensor:
    """The slow, obvious version: ``x @ W^T`` with ``W`` dequantized in plain torch
    (:func:`lorarl.model.nf4_dequant.dequantize_nf4`: the values bitsandbytes' ``dequantize_4bit`` gives where it is
    right, which on CPUs with AVX-512 it is not for every shape), the weight in ``x``'s dtype (as bitsandbytes'
    dequantize + ``F.linear`` fallback has it), products summed in fp32, the result rounded to ``x``'s dtype.
    ``x [..., K]`` -> ``[..., N]``."""
    from lorarl.model.nf4_dequant import dequantize_nf4

    w = dequantize_nf4(packed, quant_state).to(x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def launch_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)`` for ``x [m, k] @ W[n, k]^T`` (unmeasured guesses for an H100's
    ``sms`` = 132 SMs): ``BLOCK_M`` the rows rounded up to 16..64 (``tl.dot``'s minimum is 16); up to 16 rows
    ``BLOCK_N = 64``, ``BLOCK_K = 256`` (more bytes in flight per program), above ``32`` and ``128``; ``SPLIT_K``
    the smallest power of two giving at least ``4 sms`` programs (a decode step's weight reads need many loads in
    flight), at most 16, each slice at least ``BLOCK_K`` wide, and at most ``k / (64 m)``: the fp32 partial sums
    (``8 SPLIT_K m n`` bytes written and read) stay within a quarter of the packed weight's ``n k / 2`` bytes.

    >>> launch_config(1, 4096, 4096)  # Llama-3.1-8B q_proj, batch 1: 64 column tiles x 16 slices of 256
    (16, 64, 256, 16)
    >>> launch_config(16, 4096, 4096)  # batch 16: 4 slices (partial sums 2 MB beside the 8 MB weight)
    (16, 64, 256, 4)
    >>> launch_config(64, 14336, 4096)  # gate_proj, batch 64: 448 column tiles, no split
    (64, 32, 128, 1)
    """
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    block_n, block_k = (64, 256) if m <= 16 else (32, 128)
    tiles = -(-n // block_n)
    cap = min(16, max(1, k // (64 * m)))
    split = 1
    while split * 2 <= cap and tiles * split < 4 * sms and block_k * split * 2 <= k:
        split *= 2
    return block_m, block_n, block_k, split


if triton is not None:

    def nf4_matmul_kernel(
        x_ptr,
        packed_ptr,
        code_ptr,
        absmax_ptr,
        code2_ptr,
        absmax2_ptr,
        offset_ptr,
        part_ptr,
        M,
        N,
        K,
        stride_xm,
        k_per_split,
        BS: tl.constexpr,
        NESTED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        X_BF16: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        # tl.full, not tl.zeros (a jit function: under the interpreter only if it was on when triton was imported)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        k_start = pid_k * k_per_split  # a multiple of BLOCK_K: slices never overlap, the last one is masked at K
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            if EVEN_K:  # byte i of row n holds k = 2i (high nibble) and 2i + 1: one load and one scale per byte
                rp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                ok = n_ok[:, None] & (rp[None, :] * 2 < K)
                pair = rn[:, None].to(tl.int64) * (K // 2) + rp[None, :]  # [BLOCK_N, BLOCK_K / 2] byte index
                byte = tl.load(packed_ptr + pair, mask=ok, other=0).to(tl.int32)
                blk = (pair * 2) // BS
            else:  # any K: flat element f = n K + k is in byte f // 2, the high nibble when f is even
                ok = w_ok
                flat = rn[:, None].to(tl.int64) * K + rk[None, :]  # [BLOCK_N, BLOCK_K]
                byte = tl.load(packed_ptr + (flat >> 1), mask=ok, other=0).to(tl.int32)
                byte = (byte >> ((1 - (flat & 1)) * 4).to(tl.int32)) & 0xF  # the element's own code
                blk = flat // BS
            if NESTED:
                q = tl.load(absmax_ptr + blk, mask=ok, other=0).to(tl.int32)
                scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + blk // 256, mask=ok, other=0.0)
                scale = scale + tl.load(offset_ptr)
            else:
                scale = tl.load(absmax_ptr + blk, mask=ok, other=0.0)
            if EVEN_K:  # interleave: element 2i from the high nibble, 2i + 1 from the low one
                hi = tl.load(code_ptr + (byte >> 4)) * scale
                lo = tl.load(code_ptr + (byte & 0xF)) * scale
                w = tl.join(hi, lo).reshape(BLOCK_N, BLOCK_K)
            else:
                w = tl.load(code_ptr + byte) * scale
            w = tl.where(w_ok, w, 0.0)  # fp32, as dequantize_4bit computes it, then rounded to x's dtype
            if X_BF16:  # round to nearest even by hand: Triton's interpreter truncates (3.9), the GPU would not
                bits = w.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                w = bits.to(tl.float32, bitcast=True)  # now exactly a bf16 value: the cast below is exact
            w = w.to(x.dtype)
            if DOT_F32:  # the interpreter's bf16 dot is wrong (triton 3.9); bf16 products are exact in fp32
                acc += tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), out_dtype=tl.float32)
            else:
                acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        out = part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


_JITTED: dict[bool, object] = {}


def compiled():
    """The kernel, ``triton.jit``-ed on first use (Triton picks interpreter or compiler when it decorates, so
    decorating at import would freeze whatever ``TRITON_INTERPRET`` was then), one per mode."""
    mode = interpreting()
    if mode not in _JITTED:
        _JITTED[mode] = triton.jit(nf4_matmul_kernel)
    return _JITTED[mode]


def nf4_matmul(x: Tensor, weight: NF4Weight, bias: Tensor | None = None, config: tuple | None = None) -> Tensor:
    """``x @ W^T (+ bias)`` for ``x [..., K]`` in bf16 / fp16 with at most :data:`MAX_ROWS` rows -> ``[..., N]`` in
    ``x``'s dtype (fp32 accumulation; equal to :func:`reference_matmul` up to the output's last-bit rounding).
    ``config`` overrides :func:`launch_config`'s ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)``."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x dtype {x.dtype} (the kernel takes bfloat16 or float16)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows (the kernel serves at most {MAX_ROWS})")
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = launch_config(m, n, k, sms)
    block_m, block_n, block_k, split = config
    k_per_split = -(-k // split)
    k_per_split = -(-k_per_split // block_k) * block_k  # whole BLOCK_K steps per slice
    split = -(-k // k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    dummy = weight.code
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    compiled()[grid](
        x2,
        weight.packed,
        weight.code,
        weight.absmax,
        weight.code2 if weight.nested else dummy,
        weight.absmax2 if weight.nested else dummy,
        weight.offset if weight.nested else dummy,
        part,
        m,
        n,
        k,
        x2.stride(0),
        k_per_split,
        BS=weight.blocksize,
        NESTED=weight.nested,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_F32=interpreting() and x.dtype == torch.bfloat16,
        X_BF16=x.dtype == torch.bfloat16,
        EVEN_K=k % 2 == 0,
    )
    y = part[0] if split == 1 else part.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n)
