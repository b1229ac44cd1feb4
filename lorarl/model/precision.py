"""Which precision the base computes in on a GPU, and what lorarl says when a set-up would run wrong or slowly.

Decided once at load, from facts passed in (so every rule is a pure function, tested without a GPU):

* **bf16 only where the GPU has it natively** (compute capability 8.0 and up: Ampere, Ada, Hopper, Blackwell).
  ``torch.cuda.is_bf16_supported()`` also says yes on a T4 / RTX 20xx (7.5), where bf16 matmuls are emulated;
  there ``model.dtype: auto`` is fp16, which trains with dynamic loss scaling (:func:`needs_loss_scaling`,
  :func:`lorarl.update.optimizer_step`).
* **NF4 on CUDA** computes in bf16 (fp16 on GPUs without bf16), through bitsandbytes 0.50 or newer
  (:data:`MIN_BITSANDBYTES`; the release the NF4 path is built against, with its fused 4-bit kernels).
  :func:`cuda_advice` turns the facts into lines: a refusal where the run would be wrong, a warning where it would
  be slow or fragile, nothing when all is as it should be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BITSANDBYTES = (0, 50)
NATIVE_BF16 = (8, 0)  # compute capability from which bf16 matmuls run natively


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.50.2"`` -> ``(0, 50, 2)``; suffixes dropped (``"0.45.0.dev0"`` -> ``(0, 45, 0)``, ``"1.0rc1"`` -> ``(1, 0)``)."""
    out = []
    for part in version.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(out)


def native_bf16(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA device of compute ``capability`` runs bf16 matmuls natively (8.0 and up; None: no GPU)."""
    return capability is not None and tuple(capability) >= NATIVE_BF16


def cuda_auto_dtype(capability: tuple[int, int]) -> torch.dtype:
    """``model.dtype: auto`` on a CUDA device: bf16 where native, else fp16 (trained with loss scaling)."""
    return torch.bfloat16 if native_bf16(capability) else torch.float16


def nf4_compute_dtype(dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> torch.dtype:
    """The dtype NF4 layers compute in: the model's dtype, except fp32 on CUDA, which computes in the GPU's 16-bit
    dtype (bf16 where native, else fp16): a fp32 compute dtype runs bitsandbytes' slowest path for no accuracy gain.
    On the CPU the model's dtype as it is."""
    if device_type == "cuda" and dtype == torch.float32:
        return cuda_auto_dtype(capability or (0, 0))
    return dtype


@dataclass(frozen=True)
class Advice:
    """One line for the user: ``refuse`` (LorarlError at load) or ``warn`` (a warning, the run goes on)."""

    level: str  # refuse | warn
    message: str


def cuda_advice(
    quantization: str,
    dtype_setting: str,
    capability: tuple[int, int],
    bitsandbytes: str | None,
    gpu: str = "this GPU",
) -> list[Advice]:
    """What to tell a user loading the base on a CUDA device of compute ``capability`` with
    ``model.quantization: quantization`` (``nf4`` or ``none``, resolved), ``model.dtype: dtype_setting`` and
    bitsandbytes version ``bitsandbytes`` (None: not installed). Empty: nothing to say. A refusal comes alone.

    Refused: NF4 without bitsandbytes; ``model.dtype: bfloat16`` on a GPU without native bf16. Warned (each its own
    line): NF4 with bitsandbytes older than :data:`MIN_BITSANDBYTES`; ``model.dtype: float16`` on a GPU that has
    bf16 (fp16 overflows where bf16 does not); fp16 because the GPU has no bf16 (training then scales the loss).
    """
    want = ".".join(map(str, MIN_BITSANDBYTES))
    nf4 = quantization == "nf4"
    if nf4 and bitsandbytes is None:
        return [
            Advice(
                "refuse",
                f"model.quantization nf4 needs bitsandbytes on CUDA: pip install 'bitsandbytes>={want}' "
                "(or set model.quantization: none)",
            )
        ]
    bf16 = native_bf16(capability)
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if dtype_setting == "bfloat16" and not bf16:
        return [
            Advice(
                "refuse",
                f"model.dtype bfloat16: {gpu} ({cc}) has no native bfloat16 (it would be emulated, many times "
                "slower); set model.dtype: auto (float16, trained with dynamic loss scaling)",
            )
        ]
    out = []
    if nf4 and version_tuple(bitsandbytes) < MIN_BITSANDBYTES:
        out.append(
            Advice(
                "warn",
                f"bitsandbytes {bitsandbytes} is older than {want}, which NF4 on CUDA is built for (its fused 4-bit "
                f"kernels): decoding and training run slower; pip install -U 'bitsandbytes>={want}'",
            )
        )
    if dtype_setting == "float16" and bf16:
        out.append(
            Advice(
                "warn",
                f"model.dtype float16 on {gpu}, which has bfloat16: set model.dtype: auto or bfloat16 "
                "(float16 needs loss scaling and overflows where bfloat16 does not)",
            )
        )
    elif not bf16:
        out.append(
            Advice(
                "warn",
                f"{gpu} ({cc}) has no native bfloat16: the base computes in float16 and training uses dynamic "
                "loss scaling",
            )
        )
    return out


def needs_loss_scaling(compute_dtype: torch.dtype) -> bool:
    """Whether training through a base that computes in ``compute_dtype`` needs dynamic loss scaling: fp16 only
    (5 exponent bits: small activation gradients flush to 0; bf16 has fp32's exponent range)."""
    return compute_dtype == torch.float16


def base_compute_dtype(model) -> torch.dtype:
    """The dtype a loaded transformers model computes in: its bitsandbytes 4-bit compute dtype when quantized,
    else the dtype of its input embeddings."""
    quant = getattr(model.config, "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None) if quant is not None else None
    if isinstance(quant, dict):
        compute = quant.get("bnb_4bit_compute_dtype")
    if isinstance(compute, str):
        compute = getattr(torch, compute.replace("torch.", ""), None)
    if isinstance(compute, torch.dtype) and getattr(model, "is_loaded_in_4bit", False):
        return compute
    return model.get_input_embeddings().weight.dtype
