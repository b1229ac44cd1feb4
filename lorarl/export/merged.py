"""``--format merged`` and ``--format adapter``: the policy merged into the full-precision base, or the adapter alone.

The merge always goes into the base reloaded in full precision (fp32, on the CPU), never into the NF4 weights the run
trained on: merging a LoRA delta into 4-bit layers re-quantizes it and corrupts the outputs. Both formats ship the
base's tokenizer (with its chat template), so the folder loads with plain transformers / peft.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError
from lorarl.export.source import RunSource

DTYPES = ("bf16", "fp16", "fp32")


def torch_dtype(name: str) -> Any:
    """``"bf16"`` -> ``torch.bfloat16`` (``fp16``, ``fp32`` likewise); any other name is a LorarlError."""
    import torch

    try:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    except KeyError:
        raise LorarlError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def load_full_precision_base(base_path: str, trust_remote_code: bool = False) -> Any:
    """The base in fp32 on the CPU, refusing a checkpoint that is stored quantized (nothing to merge into)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise LorarlError(f"base model {base_path}: cannot load ({e})") from None
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise LorarlError(
            f"base model {base_path}: stored quantized ({method}); a "
            f"merge needs the full-precision weights: point model.name at the unquantized model"
        )
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=trust_remote_code)


def merge_adapter(base_path: str, adapter_dir: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """Full-precision base + LoRA adapter -> one plain transformers model (fp32), the adapter merged in."""
    from peft import PeftModel

    base = load_full_precision_base(base_path, trust_remote_code)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    merged = peft_model.merge_and_unload(safe_merge=True)
    if getattr(merged.config, "quantization_config", None) is not None:
        del merged.config.quantization_config
    merged.config.use_cache = True
    merged.eval()
    return merged


def export_tokenizer(src: RunSource, folder: Path) -> Any:
    """Save the base's tokenizer (and its chat template) into ``folder``; returns it."""
    from lorarl.model import load_tokenizer

    tok = load_tokenizer(src.base_path, src.trust_remote_code)
    tok.save_pretrained(str(folder))
    return tok


def _generation_config(src: RunSource, merged: Any, tok: Any) -> Any:
    """The base folder's generation config (else the model's), with the tokenizer's pad / EOS where it has none, so
    ``generate`` on the export stops where the training model stopped."""
    from transformers import GenerationConfig

    if (Path(src.base_path) / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(src.base_path)
    else:
        gen = merged.generation_config or GenerationConfig.from_model_config(merged.config)
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tok.eos_token_id
    return gen


def write_merged(src: RunSource, folder: Path, dtype: str) -> dict:
    """The merged model in ``dtype`` (safetensors), its tokenizer and generation config, into ``folder``."""
    merged = merge_adapter(src.base_path, src.adapter_dir, src.trust_remote_code)
    merged = merged.to(torch_dtype(dtype))
    tok = export_tokenizer(src, folder)
    merged.generation_config = _generation_config(src, merged, tok)
    merged.save_pretrained(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" in cfg:  # never ship a quantization_config with full-precision weights
        del cfg["quantization_config"]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    notes = []
    if not getattr(tok, "chat_template", None):
        notes.append("the base tokenizer has no chat template; none was exported")
    del merged
    gc.collect()
    return {"notes": notes}


def write_adapter(src: RunSource, folder: Path, with_tokenizer: bool = True) -> dict:
    """The policy adapter as a PEFT folder whose base_model_name_or_path is ``src.base_path`` (absolute if local)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src.adapter_dir / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    cfg = json.loads((src.adapter_dir / "adapter_config.json").read_text())
    base = src.base_path
    if Path(base).expanduser().exists():
        base = str(Path(base).expanduser().resolve())
    cfg["base_model_name_or_path"] = base
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if with_tokenizer:
        export_tokenizer(src, folder)
    notes = []
    if Path(base).exists():
        notes.append(f"base_model_name_or_path is a local folder ({base}); on another machine, pass the base there")
    return {"notes": notes, "base": base}
