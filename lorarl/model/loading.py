"""Loading the one base model and its tokenizer, and building LoRA configs and heads.

The base is loaded once: NF4 (bitsandbytes, double quantization, bf16 compute) on CUDA by default, full precision
on CPU (NF4 wrecks a 135M model's accuracy; measured). ``model.name`` is a name from ``lorarl models`` (the embedded
default is converted once into a cache folder), a local transformers folder, or a hub name where the network allows.
"""

from __future__ import annotations

import torch
from torch import nn

from lorarl.config import LoraSettings, ModelConfig
from lorarl.errors import LorarlError
from lorarl.model.precision import cuda_advice, cuda_auto_dtype, nf4_compute_dtype
from lorarl.model.registry import resolve_model


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_quantization(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.quantization == "auto":
        return "nf4" if device.type == "cuda" else "none"
    return cfg.quantization


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

    device = device or pick_device()
    path = resolve_model(cfg.name)
    quant = resolve_quantization(cfg, device)
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
