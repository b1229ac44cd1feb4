"""Export: merged model == adapter on the full-precision base, PEFT adapter folder, atomic folders and errors (tiny
model, CPU). The verl / OpenRLHF hand-offs: tests/test_handoff.py. The fidelity gate: tests/test_gate.py; the
NF4-vs-merged gap: tests/test_nf4_gap.py (skipped here with gate_n=0, to keep these tests fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lorarl.config import LoraSettings, ModelConfig, Recipe, RewardSpec, recipe_to_dict
from lorarl.errors import LorarlError
from lorarl.export import export, locate

MESSAGES = [
    [{"role": "user", "content": "What is 23 + 45?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 8? Think first."}],
]


def _recipe(model_dir: Path, rewards: list[RewardSpec] | None = None) -> Recipe:
    r = Recipe()
    r.model = ModelConfig(name=str(model_dir), quantization="none", dtype="float32")
    r.lora = LoraSettings(r=8, alpha=16.0)
    r.data.source = "arithmetic"
    r.data.train_size = 24
    r.data.eval_size = 8
    r.rewards = rewards or [
        RewardSpec(name="numeric_match", weight=1.0),
        RewardSpec(name="format", weight=0.5),
        RewardSpec(name="partial_credit", weight=0.25, kwargs={"partial": 0.4}),
    ]
    r.train.steps = 2
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A run directory as `lorarl train` leaves it: recipe.yaml, metrics.jsonl, policy/ and one step checkpoint.
    The policy's LoRA weights are random (B != 0), so merging changes the model."""
    from lorarl.model import SharedBase

    run = tmp_path_factory.mktemp("run")
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    shared.add_adapter("policy", LoraSettings(r=8, alpha=16.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    cp = run / "checkpoints" / "step-000001"
    shared.save_adapter("policy", cp / "policy")
    (cp / "state.json").write_text(json.dumps({"step": 1, "roles": ["policy"]}))
    (cp / "COMPLETE").write_text("1")
    with torch.no_grad():  # the final adapter differs from the step-1 checkpoint
        for p in shared.adapter_parameters("policy"):
            p.mul_(1.5)
    shared.save_adapter("policy", run / "policy")
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(_recipe(tiny_model_dir)), sort_keys=False))
    rows = [{"step": 1, "reward_mean": 0.25, "kl": 0.0}, {"step": 2, "reward_mean": 0.625, "kl": 0.01}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "trunc')
    return run


def _prompt_batch(tok):
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _logits(model, batch) -> torch.Tensor:
    mask = batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos).logits
    return out[mask.bool()]  # [real tokens, V]


@pytest.fixture(scope="module")
def merged_fp32(run_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("exports") / "merged"
    result = export(run_dir, out, fmt="merged", dtype="fp32", gate_n=0)
    return out, result


def test_merged_logits_equal_adapter_on_full_precision_base(merged_fp32, run_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, result = merged_fp32
    assert result["format"] == "merged" and result["step"] == 2 and result["dtype"] == "fp32"
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, run_dir / "policy").eval()
    tok = AutoTokenizer.from_pretrained(out)
    batch = _prompt_batch(tok)

    a, b = _logits(merged, batch), _logits(with_adapter, batch)
    assert (a - b).abs().max().item() < 1e-4
    with with_adapter.disable_adapter():
        plain = _logits(with_adapter, batch)
    assert (a - plain).abs().max().item() > 1e-2  # the merge is not a no-op

    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert tok.chat_template
    card = (out / "README.md").read_text()
    assert "reward_mean | 0.625" in card and "numeric_match" in card and "AutoModelForCausalLM" in card
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_merged_loads_with_plain_transformers_only(merged_fp32):
    """A fresh interpreter loads the export with transformers alone: lorarl is never imported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = merged_fp32
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32)\n"
        f"tok = AutoTokenizer.from_pretrained({str(out)!r})\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 2 + 2?'}], add_generation_prompt=True,"
        " return_tensors='pt', return_dict=True)\n"
        "with torch.no_grad():\n"
        "    row = m(**ids).logits[0, -1, :8].tolist()\n"
        "assert not [k for k in sys.modules if k.startswith('lorarl')], 'lorarl was imported'\n"
        "print(json.dumps(row))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        want = m(**ids).logits[0, -1, :8]
    assert torch.allclose(torch.tensor(row), want, atol=1e-5)


def test_merged_bf16_and_adapter_export_load_with_peft(run_dir, tiny_model_dir, tmp_path, merged_fp32):
    from peft import AutoPeftModelForCausalLM
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = tmp_path / "merged-bf16"
    export(run_dir, bf16, fmt="merged", gate_n=0)  # default dtype: bf16
    with safe_open(str(bf16 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    out = tmp_path / "adapter"
    result = export(run_dir, out, fmt="adapter", gate_n=0)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    assert result["dtype"] is None and "adapter_model.safetensors" in result["files"]
    model = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    batch = _prompt_batch(tok)
    merged = AutoModelForCausalLM.from_pretrained(merged_fp32[0], dtype=torch.float32).eval()
    assert (_logits(model, batch) - _logits(merged, batch)).abs().max().item() < 1e-4
    assert "AutoPeftModelForCausalLM" in (out / "README.md").read_text()


def test_checkpoint_export_and_errors(run_dir, tmp_path):
    out = tmp_path / "cp"
    result = export(run_dir, out, fmt="adapter", checkpoint="step-000001", gate_n=0)
    assert result["step"] == 1 and "reward_mean | 0.25" in (out / "README.md").read_text()
    assert locate(run_dir / "checkpoints" / "step-000001").step == 1  # a checkpoint folder works too
    assert locate(run_dir, checkpoint="latest").step == 1

    with pytest.raises(LorarlError, match=f"{out}: already exists; pass --force"):
        export(run_dir, out, fmt="adapter")
    (out / "stale.txt").write_text("old")
    export(run_dir, out, fmt="adapter", force=True, gate_n=0)  # replaced as a whole
    assert not (out / "stale.txt").exists() and json.loads((out / "adapter_config.json").read_text())

    empty = tmp_path / "empty"
    empty.mkdir()
    export(run_dir, empty, fmt="adapter", gate_n=0)  # an empty folder is not "existing work"

    missing = tmp_path / "no-such-run"
    with pytest.raises(LorarlError, match=f"{missing}: run directory not found"):
        export(missing, tmp_path / "x")
    bare = tmp_path / "bare-run"
    bare.mkdir()
    with pytest.raises(LorarlError, match=f"{bare}: no policy adapter"):
        export(bare, tmp_path / "y")
    with pytest.raises(LorarlError, match="refusing to export over the run itself"):
        export(run_dir, run_dir, fmt="adapter", force=True)
    with pytest.raises(LorarlError, match="no such checkpoint"):
        export(run_dir, tmp_path / "z", checkpoint="step-000009")
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_export_and_quantized_base_refused(run_dir, tmp_path, tiny_model_dir, capsys):
    from lorarl.cli import main
    from lorarl.export import load_full_precision_base

    out = tmp_path / "cli-adapter"
    assert main(["export", str(run_dir), "--out", str(out), "--format", "adapter", "--gate-n", "0"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["format"] == "adapter" and last["step"] == 2 and last["out"] == str(out)
    assert main(["export", str(run_dir), "--out", str(out), "--format", "adapter"]) == 2
    assert f"{out}: already exists" in capsys.readouterr().err

    quantized = tmp_path / "q"
    quantized.mkdir()
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LorarlError, match="stored quantized"):
        load_full_precision_base(str(quantized))
