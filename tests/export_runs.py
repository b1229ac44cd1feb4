"""Run directories for the export tests (tests/test_gguf.py, tests/test_gate.py): a policy adapter with random LoRA
weights (B != 0, so merging changes the model) on a tiny Llama, and the recipe beside it, as `lorarl train` leaves
them."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml


def make_run(run: Path, model_dir: Path, scale: float = 0.1, max_new_tokens: int = 8) -> Path:
    """``run/policy`` (random LoRA r 8 on every linear layer) and ``run/recipe.yaml`` (arithmetic held-out prompts,
    ``max_new_tokens`` per completion)."""
    from lorarl.config import LoraSettings, ModelConfig, Recipe, recipe_to_dict
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=str(model_dir), quantization="none", dtype="float32"))
    shared.add_adapter("policy", LoraSettings(r=8, alpha=16.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    shared.save_adapter("policy", run / "policy")
    recipe = Recipe()
    recipe.model = ModelConfig(name=str(model_dir), quantization="none", dtype="float32")
    recipe.lora = LoraSettings(r=8, alpha=16.0)
    recipe.data.train_size = 24
    recipe.data.eval_size = 8
    recipe.generation.max_new_tokens = max_new_tokens
    recipe.generation.temperature = 0.7
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    return run


def make_loud_model(src: Path, dst: Path, factor: float = 10.0) -> Path:
    """A copy of the tiny model ``src`` with its attention and MLP weights scaled by ``factor``, so that those
    layers, not the tied embeddings, decide the next token: at init std 0.02 a random tiny model is dominated by its
    embeddings (which NF4 does not quantize), so rounding its layers would change no greedy answer."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(factor)
    model.save_pretrained(dst)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst
