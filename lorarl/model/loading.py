"""Loading the one base model and its tokenizer, and building LoRA configs and heads.

The base is loaded once: on CUDA NF4 (bitsandbytes, double quantization, bf16 compute) by default, bf16 where the
model's bf16 weights are a small share of the card (:func:`choose_quantization`); full precision on CPU (NF4 wrecks
a 135M model's accuracy; measured). ``model.name`` is a name from ``lorarl models`` (the embedded
default is converted once into a cache folder), a local transformers folder, or a hub name where the network allows.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from lorarl.config import LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model.nf4_dequant import check_cpu_dequantize
from lorarl.model.precision import cuda_advice, cuda_auto_dtype, nf4_compute_dtype
from lorarl.model.registry import resolve_model


def pick_device(setting: str = "auto") -> torch.device:
    """The device a run uses (``model.device``): ``auto`` is CUDA when a GPU is visible, else the CPU; ``cpu`` is
    the CPU even beside a GPU (TRL's ``use_cpu``)."""
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


# ``model.quantization: auto`` keeps the weights in 16 bits while they take at most this share of the budget
BF16_MAX_SHARE = 0.05


def choose_quantization(bf16_weight_bytes: int | None, budget_bytes: int | None, device_type: str) -> tuple[str, str]:
    """``model.quantization: auto``: ``(quantization, why)``, the rule in one place (pure: sizes in, choice out).

    * not CUDA -> ``none`` (full precision; bitsandbytes' NF4 is a GPU format and costs a small model its accuracy);
    * CUDA, ``W / M <= s`` with ``W`` the model's weights in bf16 (2 bytes x parameters), ``M`` the memory budget
      (the card's memory x the process's memory fraction) and ``s = BF16_MAX_SHARE = 0.05`` -> ``none`` (bf16);
    * CUDA otherwise, or ``W`` / ``M`` unknown -> ``nf4``.

    Why: NF4 costs a small model accuracy for memory it does not need. Measured on an H100 (2026-11-27, the
    quickstart recipe, 40 steps, 200 held-out problems): SmolLM2-135M's base accuracy 27% in bf16 vs 7.5% in NF4,
    trained 76% vs 68.5%; its bf16 weights (0.27 GB) are 0.3% of the card. At 5% a 24 GB card keeps models up to
    0.6B parameters in bf16 (Qwen2.5-0.5B: 1.0 GB = 4.1%) and an 80 GB card up to 2B (Qwen2.5-1.5B: 3.1 GB =
    3.9%); Llama-3.1-8B (16 GB) is NF4 on both."""
    if device_type != "cuda":
        return "none", f"{device_type}: full precision (NF4 is for CUDA)"
    if not bf16_weight_bytes or not budget_bytes:
        return "nf4", "CUDA: the model's size or the memory budget is unknown, so NF4"
    share = bf16_weight_bytes / budget_bytes
    gb = f"{bf16_weight_bytes / 1e9:.2f} GB of bf16 weights = {100 * share:.1f}% of {budget_bytes / 1e9:.1f} GB"
    if share <= BF16_MAX_SHARE:
        return "none", f"{gb} <= {100 * BF16_MAX_SHARE:.0f}%: bf16 (NF4 would cost accuracy for memory not needed)"
    return "nf4", f"{gb} > {100 * BF16_MAX_SHARE:.0f}%: NF4"


def bf16_weight_bytes(path) -> int | None:
    """2 bytes x the parameters of the model at ``path`` (from its ``config.json``; None where it has no decoder
    shape lorarl reads)."""
    from lorarl.shapes import model_shape

    try:
        return 2 * model_shape(path).num_params()
    except (LorarlError, OSError, ValueError, TypeError):
        return None


def cuda_budget_bytes(device: torch.device) -> int:
    """The process's share of the card: total memory x ``torch.cuda.get_per_process_memory_fraction``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def resolve_quantization(cfg: ModelConfig, device: torch.device, path=None, say: bool = False) -> str:
    """``model.quantization`` on ``device``; ``auto`` by :func:`choose_quantization` (``path``: the resolved model
    folder; ``say``: on CUDA, where the choice depends on the model, print the one line saying which and why)."""
    if cfg.quantization != "auto":
        return cfg.quantization
    if device.type != "cuda":
        return choose_quantization(None, None, device.type)[0]  # (full precision, as always: nothing to say)
    weights = bf16_weight_bytes(path if path is not None else resolve_model(cfg.name))
    quant, why = choose_quantization(weights, cuda_budget_bytes(device), device.type)
    if say:
        print(f"[lorarl] model.quantization auto -> {'nf4' if quant == 'nf4' else 'none'}: {why}", file=sys.stderr)
    return quant


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA ``device`` (None for any other device)."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``model.dtype``: ``auto`` is fp32 on the CPU, on CUDA bf16 where the GPU has it natively and fp16 where it
    does not (T4, RTX 20xx: :func:`lorarl.model.precision.cuda_auto_dtype`)."""
    if cfg.dtype == "auto":
        if device.type == "cuda":
            return cuda_auto_dtype(cuda_capability(device))
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # prompts are left padded so every completion starts at the same column
    return tok


def check_cuda_precision(quant: str, cfg: ModelConfig, device: torch.device) -> None:
    """On CUDA, refuse (LorarlError) or warn, one line each, as :func:`lorarl.model.precision.cuda_advice` decides
    from the GPU, ``model.dtype`` and the installed bitsandbytes."""
    import importlib.metadata
    import warnings

    if device.type != "cuda":
        return
    try:
        bnb = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        bnb = None
    gpu = torch.cuda.get_device_name(device)
    for advice in cuda_advice(quant, cfg.dtype, cuda_capability(device), bnb, gpu):
        if advice.level == "refuse":
            raise LorarlError(advice.message)
        warnings.warn(advice.message, stacklevel=3)


def load_base(cfg: ModelConfig, device: torch.device | None = None):
    """Load the base model once: NF4 (bitsandbytes, double quantization, compute in the GPU's 16-bit dtype) or
    full precision."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = device or pick_device(cfg.device)
    path = resolve_model(cfg.name)
    quant = resolve_quantization(cfg, device, path, say=True)
    dtype = resolve_dtype(cfg, device)
    check_cuda_precision(quant, cfg, device)
    kwargs: dict = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=nf4_compute_dtype(dtype, device.type, cuda_capability(device)),
        )
        kwargs["device_map"] = {"": str(device) if device.type == "cpu" else device.index or 0}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise LorarlError(f"model {cfg.name}: cannot load ({e})") from None
    if quant != "nf4":
        model.to(device)
    else:
        keep_nf4_trainable(model)
        check_cpu_dequantize(model)
    tok = load_tokenizer(path, cfg.trust_remote_code)
    return model, tok, path


def keep_nf4_trainable(model: nn.Module) -> int:
    """Switch off bitsandbytes' CPU inference repacking on every ``Linear4bit`` of ``model``; returns how many.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit weight for a faster inference kernel the first
    time the layer runs in eval mode without gradients -- which every rollout does -- and from then on runs every
    forward through that kernel, which has no backward: a later training forward gets no gradient through the base
    layer (torch only warns at backward that the result "may be silently incorrect"), and a layer with a bias fails
    with an in-place error. lorarl samples and trains on the same layers, so the repacking stays off (on CUDA it never
    applies)."""
    n = 0
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def lora_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def new_head(hidden_size: int, device) -> nn.Linear:
    """Value / score head: hidden -> 1, kept in fp32 on the base's device (small; no dtype traps)."""
    head = nn.Linear(hidden_size, 1, bias=True, dtype=torch.float32, device=device)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


class OutputHead(nn.Module):
    """The output projection followed by the model's own logit transform, op for op as its ``forward`` applies it
    after ``lm_head``, in the model's dtype: Cohere's ``z * logit_scale``, Granite's ``z / logits_scaling``, then
    Gemma 2/3's final soft-capping ``tanh(z / c) * c`` (three ops, each rounded to the dtype as the model rounds it:
    in bf16 an fp32 tanh differs from the model's by up to 0.12 at logits near ``c``). Scoring and the fast decode
    engine compute logits through this, so log-probs describe exactly what the model samples from."""

    def __init__(
        self,
        lm_head: nn.Module,
        softcap: float | None = None,
        multiply: float | None = None,
        divide: float | None = None,
    ):
        super().__init__()
        self.lm_head, self.softcap, self.multiply, self.divide = lm_head, softcap, multiply, divide

    @property
    def weight(self) -> torch.Tensor:
        """The output projection's weight ``[V, H]`` (as ``lm_head.weight``)."""
        return self.lm_head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


def logit_transform(config) -> dict:
    """The keyword arguments of :class:`OutputHead` for a transformers config: ``softcap`` from
    ``final_logit_softcapping`` (Gemma 2/3), ``multiply`` from ``logit_scale`` (Cohere), ``divide`` from
    ``logits_scaling`` (Granite); ``{}`` for models whose logits are ``lm_head(h)`` as is (Llama, Qwen2, Mistral,
    Phi-3, SmolLM2, ...). :meth:`lorarl.model.SharedBase.check_output_path` refuses a model whose forward does
    anything else."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out: dict = {}
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        out["softcap"] = float(cap)
    if getattr(text, "logit_scale", None) not in (None, 1.0):
        out["multiply"] = float(text.logit_scale)
    elif getattr(text, "logits_scaling", None) not in (None, 1.0):
        out["divide"] = float(text.logits_scaling)
    return out
