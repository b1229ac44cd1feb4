"""``model.quantization: auto``: the rule (bf16 while the model's bf16 weights are <= 5% of the card, NF4 above,
full precision off CUDA) at its edges, the weight count it reads from ``config.json``, and the loader's line."""

from __future__ import annotations

import json

import pytest
import torch

from lorarl.bench.synthetic import TINY
from lorarl.config import ModelConfig
from lorarl.model import loading
from lorarl.model.loading import BF16_MAX_SHARE, bf16_weight_bytes, choose_quantization, resolve_quantization

GB = 10**9


def test_the_rule_at_its_edges():
    assert BF16_MAX_SHARE == 0.05
    # exactly 5% of the budget stays bf16; one byte more is NF4
    assert choose_quantization(4 * GB, 80 * GB, "cuda")[0] == "none"
    assert choose_quantization(4 * GB + 1, 80 * GB, "cuda")[0] == "nf4"
    # the measured case: SmolLM2-135M (134,515,008 params -> 269 MB in bf16) on an 80 GB H100 is 0.3%: bf16
    quant, why = choose_quantization(2 * 134_515_008, 85_045_837_824, "cuda")
    assert quant == "none" and "0.3% of 85.0 GB" in why and "bf16" in why
    # Qwen2.5-1.5B (3.09 GB) on a 24 GB card: 12.9% -> NF4; on an 80 GB card: 3.9% -> bf16
    assert choose_quantization(3_087_467_008, 24 * GB, "cuda") == (
        "nf4",
        "3.09 GB of bf16 weights = 12.9% of 24.0 GB > 5%: NF4",
    )
    assert choose_quantization(3_087_467_008, 80 * GB, "cuda")[0] == "none"
    # unknown size or budget: NF4, as before the rule; any non-CUDA device: full precision, whatever the size
    assert choose_quantization(None, 80 * GB, "cuda")[0] == "nf4"
    assert choose_quantization(2 * GB, None, "cuda")[0] == "nf4"
    assert choose_quantization(10**6, 80 * GB, "cpu")[0] == "none"
    assert choose_quantization(100 * GB, 80 * GB, "cpu")[0] == "none"


def test_weight_bytes_come_from_the_config(tmp_path):
    # a Llama of hidden 64, MLP 128, 2 layers, 4 heads / 2 kv heads (d 16), vocab 512, tied embeddings:
    # per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + 3 x 64x128 = 36,864; embed 512x64 = 32,768; norms 5 x 64
    cfg = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}  # (the sizes above)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert bf16_weight_bytes(tmp_path) == 2 * (2 * 36_864 + 32_768 + 5 * 64)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))  # no decoder shape: unknown
    assert bf16_weight_bytes(tmp_path) is None


def test_resolution_on_cpu_and_on_a_card(tiny_model_dir, monkeypatch, capsys):
    auto = ModelConfig(name=str(tiny_model_dir), quantization="auto")
    assert resolve_quantization(auto, torch.device("cpu"), say=True) == "none"  # CPU: as before, and no line
    assert capsys.readouterr().err == ""
    assert resolve_quantization(ModelConfig(quantization="nf4"), torch.device("cpu")) == "nf4"  # explicit kept
    # a card (its budget stubbed: no GPU here): the tiny model is far under 5% of 24 GB -> bf16; of 1 MB -> NF4
    weights = bf16_weight_bytes(tiny_model_dir)
    assert weights is not None and weights > 0
    monkeypatch.setattr(loading, "cuda_budget_bytes", lambda device: 24 * GB)
    assert resolve_quantization(auto, torch.device("cuda"), tiny_model_dir, say=True) == "none"
    assert capsys.readouterr().err == (
        f"[lorarl] model.quantization auto -> none: {weights / 1e9:.2f} GB of bf16 weights = "
        f"{100 * weights / (24 * GB):.1f}% of 24.0 GB <= 5%: bf16 (NF4 would cost accuracy for memory not needed)\n"
    )
    monkeypatch.setattr(loading, "cuda_budget_bytes", lambda device: int(weights / 0.05) - 1)
    assert resolve_quantization(auto, torch.device("cuda"), tiny_model_dir) == "nf4"
    monkeypatch.setattr(loading, "cuda_budget_bytes", lambda device: int(weights / 0.05) + 1)
    assert resolve_quantization(auto, torch.device("cuda"), tiny_model_dir) == "none"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-1.5b", "llama-3.1-8b"])
def test_known_models_on_24_and_80_gb(name):
    """The per-device choice the docs table states."""
    from lorarl.shapes import model_shape

    w = 2 * model_shape(name).num_params()
    expect = {"smollm2-135m": ("none", "none"), "qwen2.5-1.5b": ("nf4", "none"), "llama-3.1-8b": ("nf4", "nf4")}
    got = (choose_quantization(w, 24 * GB, "cuda")[0], choose_quantization(w, 80 * GB, "cuda")[0])
    assert got == expect[name], (name, w)


def test_the_planner_resolves_auto_as_the_loader_does():
    """``lorarl plan --budget-gb 24`` plans what the loader would load on a 24 GB card: the quickstart's
    SmolLM2-135M (0.27 GB of bf16 weights, 1.1%) in bf16, the GSM8K recipe's Qwen2.5-1.5B (3.09 GB, 12.9%) in NF4;
    on 80 GB the 1.5B is bf16 too (3.9%); on the CPU full precision."""
    from lorarl.plan.recipes import plan_recipe

    assert plan_recipe("recipes/grpo_arithmetic.yaml", 24.0)["settings"]["quantization"] == "none"
    assert plan_recipe("recipes/grpo_gsm8k.yaml", 24.0)["settings"]["quantization"] == "nf4"
    assert plan_recipe("recipes/grpo_gsm8k.yaml", 80.0)["settings"]["quantization"] == "none"
