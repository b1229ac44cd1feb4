"""The fast engine's LoRA linear layer for decode on an NF4 base: the base through :func:`~lorarl.kernels.nf4_matmul.
nf4_matmul`, the LoRA path in the compute dtype.

``generation.nf4_kernel: auto`` (the default) puts :class:`KernelLoraForward` in front of every PEFT ``Linear4bit``
LoRA layer while the fast engine samples (:func:`kernel_decode`), when the model has such layers and the kernel can
run (Triton installed; CUDA, or the Triton interpreter: ``TRITON_INTERPRET=1``, which is how the CPU tests run it).
``off`` keeps PEFT's own forward (bitsandbytes' ``matmul_4bit`` + the LoRA path in the adapter's dtype).

Per call the layer computes, for ``x [..., K]`` in the base's compute dtype with at most
:data:`~lorarl.kernels.nf4_matmul.MAX_ROWS` rows::

    y = nf4_matmul(x, W) + bias + sum over active adapters a of  ((x @ A_a^T) @ B_a^T) * scaling_a

``A_a`` / ``B_a`` copied into the compute dtype at the start of each rollout (:meth:`KernelLoraForward.refresh`:
in place, so captured CUDA graphs read the new values), ``scaling_a = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA),
PEFT's own ``layer.scaling``. Dropout is not applied: a layer whose LoRA dropout is in train mode with ``p > 0``, or
that has a variant (DoRA), is merged, gets extra arguments, more rows, or another dtype, goes through PEFT's forward
for that call, so what is sampled is what PEFT computes. PEFT runs the LoRA path in the adapter's dtype (fp32 in
lorarl), this one in bf16 / fp16: the logits differ by rounding only (tested against the PEFT model).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lorarl.kernels.nf4_matmul import MAX_ROWS, NF4Weight, available, nf4_matmul, reference_matmul

if TYPE_CHECKING:
    from collections.abc import Iterator

SETTINGS = ("auto", "off")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [KernelLoraForward]


class KernelLoraForward:
    """The decode forward of one PEFT LoRA layer on a bitsandbytes ``Linear4bit`` base (see the module doc)."""

    def __init__(self, layer: torch.nn.Module):
        base = layer.base_layer
        self.layer = layer
        self.weight = NF4Weight.from_bnb(base.weight.data, base.weight.quant_state)
        self.bias = base.bias
        self.compute_dtype = base.compute_dtype
        self.copies: dict[str, tuple[Tensor, Tensor]] = {}  # adapter -> (A [r, K], B [N, r]) in the compute dtype

    def refresh(self) -> None:
        """Copy every adapter's A / B into the compute dtype, into the same buffers when the shapes still fit."""
        for name, lin_a in self.layer.lora_A.items():
            a, b = lin_a.weight, self.layer.lora_B[name].weight
            old = self.copies.get(name)
            if old is None or old[0].shape != a.shape or old[1].shape != b.shape or old[0].device != a.device:
                old = (torch.empty_like(a, dtype=self.compute_dtype), torch.empty_like(b, dtype=self.compute_dtype))
                self.copies[name] = old
            with torch.no_grad():
                old[0].copy_(a)
                old[1].copy_(b)

    def active(self) -> list[str]:
        """The adapters this call adds (PEFT's ``active_adapters`` that the layer holds; none when disabled)."""
        if self.layer.disable_adapters:
            return []
        return [a for a in self.layer.active_adapters if a in self.layer.lora_A]

    def serves(self, x: Tensor, args: tuple, kwargs: dict) -> bool:
        """Whether this call takes the kernel path (else PEFT's forward runs)."""
        layer = self.layer
        if args or kwargs or layer.merged or x.dtype != self.compute_dtype or x.dtype not in KERNEL_DTYPES:
            return False
        if x.numel() // x.shape[-1] > MAX_ROWS:
            return False
        for a in self.active():
            drop = layer.lora_dropout[a]
            if a in getattr(layer, "lora_variant", {}) or (drop.training and float(getattr(drop, "p", 0.0)) > 0):
                return False
            if a not in self.copies:
                return False
        return True

    def __call__(self, x: Tensor, *args, **kwargs) -> Tensor:
        if not self.serves(x, args, kwargs):
            return type(self.layer).forward(self.layer, x, *args, **kwargs)
        y = nf4_matmul(x, self.weight, self.bias)
        for a in self.active():
            lora_a, lora_b = self.copies[a]
            y = y + (x @ lora_a.T) @ lora_b.T * self.layer.scaling[a]
        return y


def lora_nf4_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA layers of ``module`` whose base is a quantized bitsandbytes ``Linear4bit`` the kernel reads."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    out = []
    for m in module.modules():
        base = getattr(m, "base_layer", None)
        if not (hasattr(m, "lora_A") and isinstance(base, bnb.nn.Linear4bit)):
            continue
        qs = getattr(base.weight, "quant_state", None)
        if qs is not None and qs.quant_type == "nf4" and base.weight.dtype == torch.uint8 and len(qs.shape) == 2:
            out.append(m)
    return out


def kernel_reason(module: torch.nn.Module, device: torch.device, setting: str) -> str | None:
    """Why ``generation.nf4_kernel: setting`` does not decode ``module`` through the kernel (None when it does)."""
    if setting not in SETTINGS:
        raise ValueError(f"generation.nf4_kernel must be one of {SETTINGS}, got {setting!r}")
    if setting == "off":
        return "generation.nf4_kernel: off"
    why = available(device)
    if why is not None:
        return why
    layers = lora_nf4_layers(module)
    if not layers:
        return "no NF4 LoRA layers (model.quantization is not nf4, or no adapter)"
    dtype = layers[0].base_layer.compute_dtype
    if dtype not in KERNEL_DTYPES:
        return f"compute dtype {dtype} (the kernel takes bfloat16 / float16)"
    return self_check(layers[0].base_layer)


SELF_CHECK_ROWS = (1, 16)
_CHECKED: dict[tuple, str | None] = {}  # (device, N, K, dtype) -> the self-check's reason (None: passed)


def self_check_error(got: Tensor, want: Tensor) -> float:
    """The self-check's measure: ``max |got - want| / max(max |want|, 1e-6)``, in fp32 (a relative error on the
    output's scale, so one wrong tile shows whatever the layer's magnitude)."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def self_check(base: torch.nn.Module, tolerance: float = 2e-2) -> str | None:
    """Run the kernel once on one of the model's own NF4 layers, on its device, for 1 and 16 rows, against
    :func:`~lorarl.kernels.nf4_matmul.reference_matmul` (NF4 dequantized in plain torch + matmul); a reason (and the
    engine's fallback to PEFT's forward) when it raises or differs by more than ``tolerance`` on the output's scale
    (:func:`self_check_error`; the CPU tests measure agreement to the output's last bit, so 2e-2 only catches a broken
    build or device, never rounding). Done once per device and layer shape, before any sampling: the kernel has not
    been timed or checked on every GPU, and a wrong sample would be trained on."""
    w = base.weight
    key = (str(w.device), tuple(w.quant_state.shape), base.compute_dtype)
    if key in _CHECKED:
        return _CHECKED[key]
    reason = None
    try:
        weight = NF4Weight.from_bnb(w.data, w.quant_state)
        gen = torch.Generator(device="cpu").manual_seed(0)
        for rows in SELF_CHECK_ROWS:
            x = torch.randn(rows, w.quant_state.shape[1], generator=gen).to(w.device, base.compute_dtype)
            err = self_check_error(nf4_matmul(x, weight), reference_matmul(x, w.data, w.quant_state))
            if not err <= tolerance:
                reason = (
                    f"the NF4 kernel's self-check failed on {w.device}: {rows} rows differ by {err:.3g} (> {tolerance})"
                )
                break
    except Exception as exc:  # a Triton build or launch error on this device: fall back, say why
        reason = f"the NF4 kernel's self-check raised on {w.device}: {type(exc).__name__}: {str(exc)[:200]}"
    if reason is not None:
        warnings.warn(reason + "; decoding through bitsandbytes instead (generation.nf4_kernel: off)", stacklevel=2)
    _CHECKED[key] = reason
    return reason


def wrappers_for(module: torch.nn.Module) -> list[KernelLoraForward]:
    """The layer wrappers of ``module``, built on first use and kept with it (the kernel's views of the packed
    weights cost nothing; the adapters' compute-dtype copies are ``r (K + N)`` elements per layer and adapter)."""
    if module not in _WRAPPERS:
        _WRAPPERS[module] = [KernelLoraForward(m) for m in lora_nf4_layers(module)]
    return _WRAPPERS[module]


@contextmanager
def kernel_decode(module: torch.nn.Module, device: torch.device, setting: str = "auto") -> Iterator[str | None]:
    """Inside the block every NF4 LoRA layer of ``module`` decodes through :class:`KernelLoraForward` (adapter copies
    refreshed on entry), unless :func:`kernel_reason` gives a reason, which the block receives (None: kernel on).
    PEFT's forward is back on exit."""
    reason = kernel_reason(module, device, setting)
    if reason is not None:
        yield reason
        return
    wrappers = wrappers_for(module)
    for w in wrappers:
        w.refresh()
        w.layer.forward = w
    try:
        yield None
    finally:
        for w in wrappers:
            w.layer.__dict__.pop("forward", None)
