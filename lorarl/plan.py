"""Memory planner: predict the peak GPU memory of a recipe and pick micro-batch sizes that fit a budget.

``lorarl plan RECIPE [--budget-gb 24] [--model-config PATH|NAME]`` reads the recipe, takes the model's shape from
``--model-config`` (a ``config.json``, a folder holding one, or a name from :data:`KNOWN_CONFIGS`) or else from the
recipe's model folder, **without loading weights**, and prints one JSON object: the predicted peak of each phase of
one step, a term-by-term breakdown, and the micro-batch sizes it picked.

What is modelled (one step of lorarl's GRPO / PPO loop on one base model, every role a LoRA adapter)
-----------------------------------------------------------------------------------------------------
Notation: ``H`` hidden size, ``I`` MLP intermediate size, ``L`` layers, ``V`` vocabulary, ``nh`` / ``nkv`` query /
key-value heads, ``d`` head dim, ``qd = nh d``, ``kvd = nkv d``; ``dt`` bytes of the compute dtype (2 for bf16 on
GPU, 4 for fp32); ``P`` prompt tokens, ``C`` = ``max_new_tokens``, ``T = P + C``; ``B`` rows in a forward pass.

Persistent (every phase):

* **base linear weights** (the 7 projections of each decoder layer). NF4 with double quantization (bitsandbytes,
  block size 64): 4 bits per weight + one 8-bit absmax per 64 weights + one fp32 absmax-of-absmax per 256 blocks
  = 4 + 8/64 + 32/(64*256) = **4.127 bits = 0.51587 bytes per parameter** (+ about 1.1 KB of code tables per
  layer). Without double quantization: 4 + 32/64 = 4.5 bits. Unquantized: ``dt`` bytes.
* **base other weights**: embeddings ``V H``, ``lm_head`` ``V H`` unless tied, RMSNorm weights ``(2L + 1) H``,
  q/k/v biases (Qwen2) - all in the compute dtype (bitsandbytes never quantizes embeddings or ``lm_head``).
* **LoRA adapters**: ``r (in + out)`` fp32 parameters per targeted projection (PEFT keeps adapters fp32 on a bf16
  base). Trainable adapters also hold two fp32 AdamW states (``8`` bytes/param, kept between steps); their fp32
  gradients (``4`` bytes/param) live from the first backward to the optimizer step (training phase only).
  Frozen adapters (PPO's reward model): ``4`` bytes/param. Value / score heads: ``H + 1`` fp32 params each.
* **cuBLAS workspace**: 32 MiB, taken through PyTorch's allocator at the first matmul (CUDA only).

A phase's peak is the largest of its *moments* (terms alive at the same time); each phase adds its moment's
terms to the persistent ones. ``tokens = B T``.

Generation (``B = generation rows`` per ``generate`` call; GRPO: ``group_size x prompts_per_step`` by default),
``max`` of:

* **prefill**: KV cache of the prompts ``B P kv`` (``kv = 2 L kvd dt`` bytes per token: keys and values of every
  layer) + one layer's forward over ``B P`` tokens (:func:`layer_forward_bytes_per_token`) + the last position's
  logits ``B V (dt + 4)``;
* **end of decoding**: the full KV cache ``B (T - 1) kv`` + one layer's concatenation copy ``B (T - 1) kv / L`` +
  a dequantized projection ``max(in x out) dt`` (bitsandbytes dequantizes a whole weight for a batched matmul) +
  the sampling logits ``B V (dt + 12)`` (``+ 16`` with top-p / top-k: sorted values and int64 indices).

Scoring (no-grad forwards over the rollout, ``B`` = the scoring rows: GRPO's reference log-probs when
``kl_coef > 0``, old log-probs when ``num_iterations > 1``; PPO's old / reference log-probs, values and reward
scores), ``max`` of: hidden states ``2 tokens H dt`` + one layer's forward (with or without an active adapter) +
the 4-D attention mask ``B T^2``; or hidden states + one chunk of logits ``B c V x 8`` (fp32 logits / T and one
fp32 temporary of logsumexp), ``c = min(logprob_chunk_size, C)``.

Training (``B = micro_batch_size``, gradient checkpointing on): LoRA gradients + **checkpoints** (each decoder
layer's input, ``L tokens H dt``) + ``max`` of:

* **a chunk of logits**, recomputed in backward: ``B c V (dt + 18)`` (bf16 logits, the fp32 copy kept for
  logsumexp, exp, softmax for the entropy the loops log, the gradient and the gather's scatter buffer; ``dt + 12``
  without entropy) + the last hidden state and its norm ``tokens H (2 dt + 4)``;
* **one layer recomputed** with its backward: ``tokens x`` :func:`layer_train_bytes_per_token` (``48 H + 10 I``
  for NF4 + bf16 + fp32 LoRA on all linear layers) + a dequantized projection + the attention mask ``3 B T^2``.

Without checkpointing every layer keeps its saved tensors: ``L tokens x (per-layer bytes)``. PPO's critic takes
its own optimizer step after the policy's (phase ``critic_training``): the same minus the logits, plus fp32
hidden states for the value head. Optimizer: LoRA grads + a foreach AdamW temporary (4 bytes per parameter).

The constants of these formulas were checked on an H100 (``scripts/validate_plan_gpu.py``: random-init NF4
Llama-3.1-8B, Qwen2.5-7B / 1.5B / 0.5B and Mistral-7B, one GRPO and one PPO step each, two sets of shapes):
every phase's peak within 13% of ``torch.cuda.max_memory_allocated`` (``docs/plan_validation/``).

What ``torch.cuda.max_memory_allocated`` sees is ``peak_bytes``. The budget is checked against
``peak_bytes x (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES``: the CUDA context and the caching allocator's
reserved-but-free blocks are not allocations but do take device memory (measured on the H100: 0.70-0.77 GiB of
context, 7-26% of slack; the whole-device figure came within -21%..+17% of what the device reported).

Example::

    >>> est = estimate_memory(model_shape("qwen2.5-1.5b"), group_size=8, prompts_per_step=2, prompt_len=128,
    ...                       max_new_tokens=256, micro_batch_size=4)
    >>> sorted(est["phases"])
    ['generation', 'optimizer', 'scoring', 'training']
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

GIB = 1024**3
GB = 1e9

# ---- constants (each documented in the module docstring) ----------------------------------------------------
NF4_BLOCK = 64  # weights per absmax block
NF4_NESTED_BLOCK = 256  # absmax values per second-level block (double quantization)
NF4_CODE_BYTES_PER_TENSOR = 256 * 4 + 16 * 4 + 8  # nested code table + NF4 code + offset, per quantized weight
# Device memory that is not an allocation. Measured on an H100 (torch 2.11, CUDA 13): the CUDA context and kernels
# took 0.70-0.77 GiB; the caching allocator held 7-26% more than the peak allocation at the end of a step
# (blocks of differently shaped phases do not reuse each other).
RUNTIME_OVERHEAD_BYTES = int(0.8 * GIB)
ALLOCATOR_SLACK = 0.25
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Published shapes (the models' config.json on the Hugging Face hub). Mistral-7B is v0.1 (v0.3: vocab 32768).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "hub_name": "meta-llama/Llama-3.1-8B",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hub_name": "Qwen/Qwen2.5-7B",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": True,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hub_name": "Qwen/Qwen2.5-1.5B",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": True,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hub_name": "Qwen/Qwen2.5-0.5B",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": True,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "hub_name": "mistralai/Mistral-7B-v0.1",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hub_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
    },
}


def _alias(name: str) -> str:
    """``"Qwen/Qwen2.5-7B-Instruct"`` -> ``"qwen2.5-7b"``; ``"Meta-Llama-3.1-8B"`` -> ``"llama-3.1-8b"``."""
    n = name.strip().lower().rstrip("/").split("/")[-1]
    for suffix in ("-instruct", "-chat", "-it", "-base"):
        if n.endswith(suffix):
            n = n[: -len(suffix)]
    n = n.replace("meta-llama-", "llama-").replace("mistral-7b-v0.1", "mistral-7b")
    return n


# ---- model shapes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer (Llama / Qwen2 / Mistral layout) that memory depends on."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    model_type: str = "llama"

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qd(self) -> int:
        return self.num_attention_heads * self.d

    @property
    def kvd(self) -> int:
        return self.num_key_value_heads * self.d

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        H, F = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (H, self.qd),
            "k_proj": (H, self.kvd),
            "v_proj": (H, self.kvd),
            "o_proj": (self.qd, H),
            "gate_proj": (H, F),
            "up_proj": (H, F),
            "down_proj": (F, H),
        }

    def linear_params_per_layer(self) -> int:
        return sum(i * o for i, o in self.linear_shapes().values())

    def other_params(self) -> dict[str, int]:
        H, V, L = self.hidden_size, self.vocab_size, self.num_hidden_layers
        return {
            "embed_tokens": V * H,
            "lm_head": 0 if self.tie_word_embeddings else V * H,
            "norms": (2 * L + 1) * H,
            "biases": L * (self.qd + 2 * self.kvd) if self.attention_bias else 0,
        }

    def num_params(self) -> int:
        return self.num_hidden_layers * self.linear_params_per_layer() + sum(self.other_params().values())

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "model") -> ModelShape:
        """From a transformers ``config.json`` mapping (a ``text_config`` inside is used when present)."""
        d = d.get("text_config") or d
        need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [k for k in need if k not in d]
        if missing:
            raise LorarlError(f"model config {name}: missing {', '.join(missing)} (not a decoder-only LM config?)")
        model_type = str(d.get("model_type", "llama"))
        return cls(
            name=name,
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            vocab_size=int(d["vocab_size"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            head_dim=int(d.get("head_dim") or 0),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
        )


def known_config(name: str) -> dict[str, Any] | None:
    """The published config of a known model (by key, hub name, or ``-Instruct`` variant), else None."""
    key = _alias(name)
    if key in KNOWN_CONFIGS:
        return dict(KNOWN_CONFIGS[key])
    for cfg in KNOWN_CONFIGS.values():
        if _alias(cfg["hub_name"]) == key:
            return dict(cfg)
    return None


def model_shape(source: str | os.PathLike | dict) -> ModelShape:
    """A model's shape from a known name, a ``config.json`` path, a folder holding one, or a config mapping."""
    if isinstance(source, dict):
        return ModelShape.from_dict(source, str(source.get("name", "model")))
    text = str(source)
    p = Path(text).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise LorarlError(f"{p}: cannot read model config ({e})") from None
        return ModelShape.from_dict(data, p.parent.name)
    known = known_config(text)
    if known is not None:
        return ModelShape.from_dict(known, _alias(text))
    raise LorarlError(
        f"model config {text!r}: not a config.json, a folder with one, or a known name "
        f"({', '.join(KNOWN_CONFIGS)}); pass --model-config"
    )


# ---- per-term formulas -------------------------------------------------------------------------------------
def resolve_targets(shape: ModelShape, target_modules: str | list[str]) -> list[str]:
    """LoRA target projections of one layer. ``all-linear`` is every projection (PEFT leaves ``lm_head`` out);
    a list keeps the names that end like a projection (``self_attn.q_proj`` -> ``q_proj``)."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return list(LINEAR_NAMES)
        target_modules = [target_modules]
    return [n for n in LINEAR_NAMES if any(t == n or t.endswith("." + n) or t.endswith(n) for t in target_modules)]


def lora_params(shape: ModelShape, r: int, targets: list[str]) -> int:
    """``L sum_targets r (in + out)``."""
    shapes = shape.linear_shapes()
    return shape.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def nf4_bytes(numel: int, double_quant: bool = True) -> float:
    """Bytes of ``numel`` weights in NF4: ``numel/2`` + absmax (8-bit per 64 with double quantization, whose fp32
    second-level absmax adds 4 bytes per 256 blocks; else fp32 per 64)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    if double_quant:
        return numel / 2 + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK)
    return numel / 2 + 4 * blocks


def base_weight_bytes(
    shape: ModelShape, quantization: str, dtype_bytes: int, double_quant: bool = True
) -> dict[str, float]:
    """Base weights: the decoder projections (NF4 or ``dtype_bytes``) and the rest (always ``dtype_bytes``)."""
    L = shape.num_hidden_layers
    if quantization == "nf4":
        lin = L * sum(
            nf4_bytes(i * o, double_quant) + NF4_CODE_BYTES_PER_TENSOR for i, o in shape.linear_shapes().values()
        )
    else:
        lin = L * shape.linear_params_per_layer() * dtype_bytes
    other = sum(shape.other_params().values()) * dtype_bytes
    return {"base_linear_weights": lin, "base_other_weights": other}


def layer_train_bytes_per_token(
    shape: ModelShape, dtype_bytes: int, targets: list[str], lora_fp32: bool = True
) -> float:
    """Bytes per token of one decoder layer recomputed with gradients under checkpointing: the tensors it saves
    for backward plus the backward's gradient buffers (the working set of one layer's backward).

    ``cast = 4`` when the LoRA branch upcasts its input to fp32 (fp32 adapters on a bf16 base), else 0.
    Saved: the norms' fp32 copies ``2 x 4 H`` (none when ``dt = 4``); each targeted projection's input as the
    LoRA branch keeps it (``4 in`` each when upcast; else the shared input once, ``dt in``); attention q, repeated
    k / v and output ``4 dt qd``; the MLP's gate, up and activation ``3 dt I``. Gradient buffers: ``4 dt H``.
    For NF4 + bf16 + LoRA on all linear layers this is ``48 H + 10 I``; H100 measurements of Llama-3.1-8B,
    Qwen2.5-7B, Mistral-7B and Qwen2.5-0.5B/1.5B agree within 15% (``scripts/validate_plan_gpu.py``).
    """
    H, F, qd = shape.hidden_size, shape.intermediate_size, shape.qd
    dt = dtype_bytes
    cast = 4 if (lora_fp32 and dt < 4) else 0
    shapes = shape.linear_shapes()
    norms = 2 * 4 * H if dt < 4 else 0
    lora_inputs = 0.0
    shared_inputs: set[str] = set()
    group = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    for t in targets:
        fan_in = shapes[t][0]
        if cast:
            lora_inputs += cast * fan_in
        elif group.get(t, t) not in shared_inputs:  # the projection's own input is saved; q/k/v, gate/up share
            shared_inputs.add(group.get(t, t))
            lora_inputs += dt * fan_in
    attention = 4 * dt * qd
    mlp = 3 * dt * F
    grad_buffers = 4 * dt * H
    return norms + lora_inputs + attention + mlp + grad_buffers


def layer_forward_bytes_per_token(shape: ModelShape, dtype_bytes: int, lora: bool = True) -> float:
    """Peak bytes per token of one layer's forward without saved tensors (generation prefill, scoring, the
    checkpointed forward). The MLP's up projection is the peak: the activation ``dt I`` and the projection's
    output ``dt I`` are alive while the LoRA branch holds ``lora_B``'s fp32 output and its scaled copy ``2 x 4 I``
    (``(2 dt + 8) I``; without an active adapter ``2 dt I``), plus the residual stream, the normed input and its
    fp32 copy for the LoRA branch ``(2 dt + 4) H``."""
    F, H, dt = shape.intermediate_size, shape.hidden_size, dtype_bytes
    return ((2 * dt + 8) if lora else 2 * dt) * F + (2 * dt + 4) * H


LOGIT_BYTES_NO_GRAD = 8  # per [row, position, vocab] element: fp32 logits / T + one fp32 temporary of logsumexp
LOGIT_BYTES_TRAIN_EXTRA = 18  # + dt: bf16 logits, fp32 copy kept, exp, softmax (entropy), gradient, scatter buffer
CUBLAS_WORKSPACE_BYTES = 32 * 1024**2  # allocated through PyTorch's allocator at the first matmul (Hopper)


# ---- the estimate ------------------------------------------------------------------------------------------
@dataclass
class PlanSettings:
    """What one step looks like (the recipe numbers the planner reads)."""

    algo: str = "grpo"  # grpo | ppo
    quantization: str = "nf4"  # nf4 | none
    double_quant: bool = True
    dtype_bytes: int = 2  # compute dtype: 2 (bf16 / fp16) or 4 (fp32)
    lora_r: int = 16
    lora_targets: Any = "all-linear"
    critic_lora_r: int = 16  # ppo
    critic_lora_targets: Any = "all-linear"  # ppo
    group_size: int = 8  # grpo; ppo samples one completion per prompt
    prompts_per_step: int = 8
    prompt_len: int = 256
    max_new_tokens: int = 256
    micro_batch_size: int = 8
    generation_batch_size: int | None = None  # rows per generate call; None: all rows of the step at once
    scoring_batch_size: int | None = None  # rows per no-grad log-prob / value / score pass; None: generation's
    logprob_chunk_size: int = 256
    gradient_checkpointing: bool = True
    kl_coef: float = 0.0  # > 0 runs the reference
    num_iterations: int = 1  # grpo: > 1 records old log-probs
    reference_adapter: bool = False  # the reference is a frozen adapter (init_adapter / iterative GRPO), not the base
    minibatch_size: int | None = None  # ppo: rows per optimizer step (micro-batches split a minibatch)
    reward_model: bool = True  # ppo: a frozen reward adapter + score head is scored
    sampling_filters: bool = False  # top_p < 1 or top_k > 0
    training_entropy: bool = True  # the loops compute the policy's entropy in every training forward
    device: str = "cuda"  # cuda | cpu (the cuBLAS workspace is a CUDA term)
    share_prompts: bool = True  # GRPO rollouts prefill / score each distinct prompt once (lorarl.rollout)
    # GRPO training under checkpointing packs each micro-batch's completions behind their shared prompt
    # (lorarl.rollout.pack_completions); False: one full row per completion (what docs/plan_validation measured)
    packed_training: bool = True

    @property
    def rows(self) -> int:
        """Completions per step."""
        return self.prompts_per_step * (self.group_size if self.algo == "grpo" else 1)


def _peak(moments: dict[str, dict[str, float]]) -> tuple[str, dict[str, float]]:
    """The moment of a phase with the most bytes alive, and its terms."""
    name = max(moments, key=lambda k: sum(moments[k].values()))
    return name, moments[name]


def estimate_memory(shape: ModelShape, settings: PlanSettings | None = None, **overrides: Any) -> dict[str, Any]:
    """Predict the peak allocated memory of each phase of one step (bytes), with a term-by-term breakdown.

    ``settings`` (or keyword overrides of :class:`PlanSettings`) describe the step. A phase's peak is the largest
    of its *moments* (terms alive at the same time): generation = max(prefill, end of decoding); scoring and
    training = max(inside a decoder layer, computing a chunk of logits). Returns::

        {"phases": {phase: bytes}, "breakdown": {"persistent": {...}, phase: {...terms at its peak}},
         "moments": {phase: name of the peak moment}, "peak_bytes", "peak_phase",
         "peak_total_bytes" (with runtime overhead and allocator slack), "params": {...}, "settings": {...}}

    A phase's bytes are the persistent terms plus that phase's terms at its peak moment.
    """
    s = PlanSettings(**{**(asdict(settings) if settings else {}), **overrides})
    if s.algo not in ("grpo", "ppo"):
        raise LorarlError(f"plan: algo must be grpo or ppo, got {s.algo!r}")
    dt = s.dtype_bytes
    H, V, L, F = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers, shape.intermediate_size
    P, C = s.prompt_len, s.max_new_tokens
    T = P + C
    c = min(s.logprob_chunk_size, C)
    targets = resolve_targets(shape, s.lora_targets)
    n_policy = lora_params(shape, s.lora_r, targets)
    head = H + 1
    trainable = n_policy
    n_critic = 0
    persistent: dict[str, float] = dict(base_weight_bytes(shape, s.quantization, dt, s.double_quant))
    persistent["lora_policy"] = 4 * n_policy
    if s.algo == "ppo":
        critic_targets = resolve_targets(shape, s.critic_lora_targets)
        n_critic = lora_params(shape, s.critic_lora_r, critic_targets) + head
        trainable += n_critic
        persistent["lora_critic_and_head"] = 4 * n_critic
        if s.reward_model:
            persistent["lora_reward_and_head_frozen"] = 4 * (n_policy + head)
    if s.reference_adapter and s.kl_coef > 0:
        persistent["lora_reference_frozen"] = 4 * n_policy
    persistent["adam_states"] = 8 * trainable
    persistent["cublas_workspace"] = CUBLAS_WORKSPACE_BYTES if s.device == "cuda" else 0

    rows = s.rows
    gen_b = min(s.generation_batch_size or rows, rows)
    score_b = min(s.scoring_batch_size or gen_b, rows)
    split = rows if s.algo == "grpo" else min(rows, s.minibatch_size or rows)
    mb = min(s.micro_batch_size, split)
    max_linear = max(i * o for i, o in shape.linear_shapes().values())
    dequant = max_linear * dt if s.quantization == "nf4" else 0
    kv_per_token = 2 * L * shape.kvd * dt  # keys + values of every layer

    def layer_forward(tokens: int, lora: bool) -> float:
        # the MLP peak; a dequantized weight is alive only during its own base matmul (not with the LoRA branch)
        per = layer_forward_bytes_per_token(shape, dt, lora)
        return max(tokens * per, tokens * (2 * dt * F + (2 * dt + 4) * H) + dequant)

    # generation: the prefill of the prompts, or the end of decoding with the full KV cache. With shared prompts
    # (lorarl.rollout: group_size > 1, one generate call) each distinct prompt is prefilled once and its cache
    # copied to the G rows that share it.
    share = s.share_prompts and s.algo == "grpo" and s.group_size > 1 and s.generation_batch_size is None
    decode_end = {
        "kv_cache": gen_b * (T - 1) * kv_per_token,
        "kv_cache_growth": gen_b * (T - 1) * kv_per_token / L,  # one layer's concatenation copy
        "dequantized_weight": dequant,
        "sampling_logits": gen_b * V * (dt + 12 + (16 if s.sampling_filters else 0)),
    }
    if share:
        m = s.prompts_per_step
        gen_moments = {
            "prefill": {"kv_cache": m * P * kv_per_token, "layer_forward": layer_forward(m * P, True)},
            "cache_copy": {"kv_cache": (m + gen_b) * P * kv_per_token},
            "decode_end": decode_end,
        }
    else:
        gen_moments = {
            "prefill": {
                "kv_cache": gen_b * P * kv_per_token,
                "layer_forward": layer_forward(gen_b * P, True),
                "last_position_logits": gen_b * V * (dt + 4),
            },
            "decode_end": decode_end,
        }

    # scoring: no-grad forwards over the rollout (reference / old log-probs; PPO values and reward scores). With
    # shared prompts the prompts run once and the completions run on the rows' copied prompt caches.
    scoring_moments: dict[str, dict[str, float]] = {}
    if s.algo == "ppo" or s.kl_coef > 0 or s.num_iterations > 1:
        lora_scoring = s.algo == "ppo" or s.num_iterations > 1 or s.reference_adapter
        share_scoring = s.share_prompts and s.algo == "grpo" and s.group_size > 1
        tok = score_b * (C if share_scoring else T)  # positions the full forward runs over
        prompt_cache = score_b * P * kv_per_token if share_scoring else 0
        scoring_moments = {
            "layer": {
                "prompt_cache": prompt_cache,
                "hidden_states": 2 * tok * H * dt,
                "layer_forward": layer_forward(tok, lora_scoring),
                "attention_mask": score_b * T * T,
            },
            "logits": {
                "prompt_cache": prompt_cache,
                "hidden_states": 2 * tok * H * dt,
                "logits_chunk": score_b * c * V * max(LOGIT_BYTES_NO_GRAD, dt + 4),
            },
        }

    # training: checkpoints of every layer + the larger of (a chunk of logits, one layer recomputed)
    per_layer = layer_train_bytes_per_token(shape, dt, targets)
    tok = mb * T
    attention_mask = 3 * mb * T * T
    packed = s.packed_training and s.share_prompts and s.algo == "grpo" and s.group_size > 1
    if packed and s.gradient_checkpointing:
        # packs [prompt | c_1 | ... | c_k]: k completions per pack (PACK_TOKENS), one more pack when a micro-batch
        # starts inside a group; a 4-D additive mask of R x L x L in the compute dtype (+ the bool it is built from)
        from lorarl.rollout import PACK_TOKENS

        per_pack = max(1, min(s.group_size, mb, (PACK_TOKENS - P) // max(C, 1)))
        n_packs = min(mb, math.ceil(mb / per_pack) + (1 if mb % s.group_size else 0))
        pack_len = P + per_pack * C
        tok = n_packs * pack_len
        attention_mask = n_packs * pack_len * pack_len * (dt + 1)
    ckpt_key = "checkpoints" if s.gradient_checkpointing else "saved_activations"  # every layer's, without
    checkpoints = L * tok * H * dt if s.gradient_checkpointing else L * tok * per_layer
    logit_extra = LOGIT_BYTES_TRAIN_EXTRA if s.training_entropy else LOGIT_BYTES_TRAIN_EXTRA - 6
    train_moments = {
        "logits": {
            "lora_grads": 4 * n_policy,
            ckpt_key: checkpoints,
            "final_hidden": tok * H * (2 * dt + 4),
            "logits_chunk": mb * c * V * (dt + logit_extra),
            "loss_terms": mb * C * 4 * 12,
        },
        "layer": {
            "lora_grads": 4 * n_policy,
            ckpt_key: checkpoints,
            "layer_recompute": tok * per_layer if s.gradient_checkpointing else 0,
            "dequantized_weight": dequant,
            "attention_mask": attention_mask,
        },
    }
    phase_moments = {"generation": gen_moments, "scoring": scoring_moments, "training": train_moments}
    if s.algo == "ppo":
        # the critic's own optimizer step after the policy's: no logits; fp32 hidden states for the value head
        phase_moments["critic_training"] = {
            "layer": {
                "lora_grads": 4 * n_critic,
                ckpt_key: checkpoints,
                "layer_recompute": tok * per_layer if s.gradient_checkpointing else 0,
                "dequantized_weight": dequant,
                "attention_mask": 3 * mb * T * T,
            },
            "value_head": {
                "lora_grads": 4 * n_critic,
                ckpt_key: checkpoints,
                "final_hidden": tok * H * (2 * dt + 4) + mb * C * H * 4,
            },
        }
    phase_moments["optimizer"] = {"step": {"lora_grads": 4 * n_policy, "adam_temporary": 4 * n_policy}}

    base = sum(persistent.values())
    phases, breakdown, moments = {}, {"persistent": {k: int(v) for k, v in persistent.items()}}, {}
    for phase, ms in phase_moments.items():
        if not ms:
            phases[phase] = int(base)
            breakdown[phase] = {}
            moments[phase] = "not run"
            continue
        name, terms = _peak(ms)
        phases[phase] = int(base + sum(terms.values()))
        breakdown[phase] = {k: int(v) for k, v in terms.items()}
        moments[phase] = name
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    return {
        "model": shape.name,
        "phases": phases,
        "breakdown": breakdown,
        "moments": moments,
        "peak_bytes": peak,
        "peak_phase": peak_phase,
        "peak_total_bytes": total_bytes(peak),
        "params": {
            "base": shape.num_params(),
            "lora_policy": n_policy,
            "trainable": trainable,
            "layer_train_bytes_per_token": int(per_layer),
        },
        "settings": asdict(s) | {"rows": rows, "generation_rows": gen_b, "scoring_rows": score_b, "micro_batch": mb},
    }


def total_bytes(peak_allocated: float) -> int:
    """Device memory a peak allocation needs: ``peak (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES``."""
    return int(peak_allocated * (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES)


def _divisors_desc(n: int) -> list[int]:
    return sorted({d for d in range(1, n + 1) if n % d == 0}, reverse=True)


def pick_micro_batch(
    shape: ModelShape, budget_gb: float = 24.0, settings: PlanSettings | None = None, **overrides: Any
) -> dict[str, Any]:
    """The largest micro-batch (a divisor of the rows it splits, so micro-batches are equal) whose training
    phase fits ``budget_gb`` (10^9 bytes, with runtime overhead and slack); then, if generation does not fit
    with all rows at once, the largest generation batch (a divisor of the step's rows) that does.

    Returns ``{"micro_batch_size", "generation_batch_size", "fits", "estimate", "tried": [[mb, total GB], ...],
    "advice": [...]}``; ``fits`` is False (with the smallest sizes and advice) when nothing fits.
    """
    s = PlanSettings(**{**(asdict(settings) if settings else {}), **overrides})
    budget = budget_gb * GB
    rows = s.rows
    split = rows if s.algo == "grpo" else min(rows, s.minibatch_size or rows)
    tried: list[list[float]] = []
    chosen = 1
    for mb in _divisors_desc(split):
        est = estimate_memory(shape, s, micro_batch_size=mb)
        need = total_bytes(
            max(v for k, v in est["phases"].items() if k in ("training", "critic_training", "optimizer"))
        )
        tried.append([mb, round(need / GB, 3)])
        if need <= budget:
            chosen = mb
            break
    gen_b = s.generation_batch_size or rows
    for g in _divisors_desc(rows):
        if g > gen_b:
            continue
        est = estimate_memory(shape, s, micro_batch_size=chosen, generation_batch_size=g)
        gen_b = g
        if total_bytes(max(est["phases"]["generation"], est["phases"]["scoring"])) <= budget:
            break
    est = estimate_memory(shape, s, micro_batch_size=chosen, generation_batch_size=gen_b)
    fits = est["peak_total_bytes"] <= budget
    advice = []
    if not fits:
        worst = max(est["phases"], key=est["phases"].get)
        top = max(est["breakdown"][worst].items(), key=lambda kv: kv[1])
        advice.append(
            f"does not fit {budget_gb:g} GB even at micro-batch {chosen} / generation batch {gen_b}: the "
            f"{worst} phase needs {total_bytes(est['phases'][worst]) / GB:.2f} GB; its largest term is {top[0]} "
            f"({top[1] / GB:.2f} GB). Lower max_new_tokens, prompt length, model.logprob_chunk_size or the "
            "model size."
        )
    elif est["breakdown"]["training"]["logits_chunk"] > 0.25 * est["phases"]["training"]:
        advice.append("logits dominate training memory: a smaller model.logprob_chunk_size saves memory")
    return {
        "micro_batch_size": chosen,
        "generation_batch_size": gen_b,
        "fits": fits,
        "estimate": est,
        "tried": tried,
        "advice": advice,
    }


# ---- recipes -----------------------------------------------------------------------------------------------
ARITHMETIC_PROMPT_TOKENS = 96  # a chat-templated arithmetic question with a system prompt stays well below this


def recipe_settings(recipe, *, device_type: str = "cuda") -> PlanSettings:
    """The planner's view of a :class:`lorarl.config.Recipe` on ``device_type`` (``auto`` quantization and
    dtype resolve as the loader does: NF4 + bf16 on CUDA, none + fp32 on CPU). Prompt length is
    ``data.max_prompt_tokens`` (the longest prompt the data loader keeps), or at most
    :data:`ARITHMETIC_PROMPT_TOKENS` for the built-in arithmetic task."""
    m = recipe.model
    quant = m.quantization if m.quantization != "auto" else ("nf4" if device_type == "cuda" else "none")
    if m.dtype == "auto":
        dtype_bytes = 2 if device_type == "cuda" else 4
    else:
        dtype_bytes = 4 if m.dtype == "float32" else 2
    prompt_len = recipe.data.max_prompt_tokens
    if recipe.data.source == "arithmetic":
        prompt_len = min(prompt_len, ARITHMETIC_PROMPT_TOKENS)
    mb = recipe.train.micro_batch_size
    algo = recipe.algo if recipe.algo in ("grpo", "ppo") else "grpo"
    g = recipe.generation
    return PlanSettings(
        algo=algo,
        quantization=quant,
        dtype_bytes=dtype_bytes,
        lora_r=recipe.lora.r,
        lora_targets=recipe.lora.target_modules,
        critic_lora_r=recipe.ppo.critic_lora.r,
        critic_lora_targets=recipe.ppo.critic_lora.target_modules,
        group_size=recipe.grpo.group_size if algo == "grpo" else 1,
        prompts_per_step=recipe.train.prompts_per_step,
        prompt_len=prompt_len,
        max_new_tokens=g.max_new_tokens,
        micro_batch_size=mb if isinstance(mb, int) else 1,
        logprob_chunk_size=m.logprob_chunk_size,
        gradient_checkpointing=m.gradient_checkpointing,
        kl_coef=recipe.grpo.kl_coef if algo == "grpo" else recipe.ppo.kl_coef,
        num_iterations=recipe.grpo.num_iterations,
        reward_model=recipe.ppo.reward_source in ("reward_model", "both"),
        minibatch_size=recipe.ppo.minibatch_size if algo == "ppo" else None,
        sampling_filters=g.top_p < 1 or g.top_k > 0,
        reference_adapter=bool(m.init_adapter) or (algo == "grpo" and recipe.grpo.ref_refresh_every > 0),
        device=device_type,
    )


def recipe_model_shape(recipe, model_config: str | None = None) -> ModelShape:
    """``model_config`` (config.json path, folder, or known name), else the recipe's model: a known name, or the
    ``config.json`` of its local folder. Weights are never read."""
    if model_config:
        return model_shape(model_config)
    name = recipe.model.name
    if known_config(name) is not None:
        return model_shape(name)
    p = Path(name).expanduser()
    if (p / "config.json").is_file() or p.name == "config.json":
        return model_shape(p)
    from lorarl.models import resolve_model

    resolved = Path(resolve_model(name))
    if (resolved / "config.json").is_file():
        return model_shape(resolved)
    raise LorarlError(
        f"plan: cannot find the shape of model {name!r} offline; pass --model-config (a config.json or {', '.join(KNOWN_CONFIGS)})"
    )


def plan_recipe(
    recipe_path: str | os.PathLike,
    budget_gb: float = 24.0,
    model_config: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """``lorarl plan``: predict each phase's peak for the recipe as written (micro-batch ``auto`` -> the picked
    one) and pick micro-batch / generation batch sizes for ``budget_gb``. Prints a table; returns the JSON dict."""
    from lorarl.config import load_recipe

    recipe = load_recipe(recipe_path, overrides or [])
    shape = recipe_model_shape(recipe, model_config)
    s = recipe_settings(recipe)
    pick = pick_micro_batch(shape, budget_gb, s)
    as_written = recipe.train.micro_batch_size
    est = pick["estimate"] if as_written == "auto" else estimate_memory(shape, s, micro_batch_size=int(as_written))
    result = {
        "recipe": str(recipe_path),
        "model": shape.name,
        "budget_gb": budget_gb,
        "micro_batch_size": as_written,
        "picked_micro_batch_size": pick["micro_batch_size"],
        "picked_generation_batch_size": pick["generation_batch_size"],
        "fits": est["peak_total_bytes"] <= budget_gb * GB,
        "picked_fits": pick["fits"],
        "phases_gb": {k: round(v / GB, 3) for k, v in est["phases"].items()},
        "peak_gb": round(est["peak_bytes"] / GB, 3),
        "peak_total_gb": round(est["peak_total_bytes"] / GB, 3),
        "peak_phase": est["peak_phase"],
        "breakdown_gb": {p: {k: round(v / GB, 4) for k, v in terms.items()} for p, terms in est["breakdown"].items()},
        "params": est["params"],
        "settings": est["settings"],
        "advice": pick["advice"],
    }
    print(format_plan(result))
    return result


def format_plan(result: dict[str, Any]) -> str:
    """A readable summary of :func:`plan_recipe`'s result."""
    lines = [
        f"plan for {result['recipe']} on {result['model']} (budget {result['budget_gb']:g} GB)",
        f"  micro-batch: {result['micro_batch_size']} as written, {result['picked_micro_batch_size']} picked; "
        f"generation batch picked: {result['picked_generation_batch_size']}",
    ]
    for phase, gb in result["phases_gb"].items():
        terms = result["breakdown_gb"].get(phase, {})
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3] if v > 0)
        lines.append(f"  {phase:<11} {gb:8.2f} GB allocated{('  (' + top + ')') if top else ''}")
    persist = ", ".join(f"{k} {v:.2f}" for k, v in result["breakdown_gb"]["persistent"].items())
    lines.append(f"  persistent: {persist}")
    lines.append(
        f"  peak: {result['peak_gb']:.2f} GB allocated in {result['peak_phase']}, {result['peak_total_gb']:.2f} GB "
        f"with CUDA context and allocator slack -> {'fits' if result['fits'] else 'DOES NOT FIT'}"
    )
    lines.extend(f"  note: {a}" for a in result["advice"])
    return "\n".join(lines)


CPU_DEFAULT_MICRO_BATCH = 8


def resolve_micro_batch(recipe, device_type: str | None = None, budget_gb: float | None = None) -> int:
    """``train.micro_batch_size`` as an int. An int is returned as is. ``auto``:

    * on CUDA: :func:`pick_micro_batch` with the budget ``budget_gb`` or else the device's total memory;
    * on CPU: ``min(CPU_DEFAULT_MICRO_BATCH, rows the micro-batches split)`` - host memory is rarely the limit
      at the sizes a CPU can train, and 8 rows keep each forward's activations small.
    """
    mb = recipe.train.micro_batch_size
    if mb != "auto":
        return int(mb)
    s = recipe_settings(recipe, device_type=device_type or "cuda")
    split = s.rows if recipe.algo != "ppo" else min(s.rows, recipe.ppo.minibatch_size)
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type != "cuda":
        return max(1, min(CPU_DEFAULT_MICRO_BATCH, split))
    if budget_gb is None:
        import torch

        budget_gb = torch.cuda.get_device_properties(0).total_memory / GB
    shape = recipe_model_shape(recipe)
    return int(pick_micro_batch(shape, budget_gb, s)["micro_batch_size"])
