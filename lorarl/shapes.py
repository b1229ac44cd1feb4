"""Model shapes: the numbers of a decoder-only transformer that memory depends on, read from a ``config.json``, a
folder holding one, or a published config in :data:`KNOWN_CONFIGS` (no weights are read, nothing is downloaded).
At the base of the package (it needs only :mod:`lorarl.errors`, and no torch): the planner (:mod:`lorarl.plan`)
and the loader's quantization choice (:mod:`lorarl.model.loading`) both read it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # one decoder layer's

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


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer (Llama / Qwen2 / Mistral layout) that memory depends on.

    Notation of the formulas: ``H`` hidden size, ``I`` MLP intermediate size, ``L`` layers, ``V`` vocabulary,
    ``nh`` / ``nkv`` query / key-value heads, ``d`` head dim, ``qd = nh d``, ``kvd = nkv d``.
    """

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
        """Head dim ``d``: ``head_dim``, else ``H // nh``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qd(self) -> int:
        """Width of the queries ``qd = nh d``."""
        return self.num_attention_heads * self.d

    @property
    def kvd(self) -> int:
        """Width of the keys (and of the values) ``kvd = nkv d``."""
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
        """Weights of one decoder layer's 7 projections: ``sum in x out``."""
        return sum(i * o for i, o in self.linear_shapes().values())

    def other_params(self) -> dict[str, int]:
        """The parameters outside the projections: embeddings ``V H``, ``lm_head`` ``V H`` unless tied, RMSNorm
        weights ``(2L + 1) H`` and q/k/v biases ``L (qd + 2 kvd)`` (Qwen2)."""
        H, V, L = self.hidden_size, self.vocab_size, self.num_hidden_layers
        return {
            "embed_tokens": V * H,
            "lm_head": 0 if self.tie_word_embeddings else V * H,
            "norms": (2 * L + 1) * H,
            "biases": L * (self.qd + 2 * self.kvd) if self.attention_bias else 0,
        }

    def num_params(self) -> int:
        """All parameters of the base model."""
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
