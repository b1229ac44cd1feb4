"""Checkpoints: save -> load gives identical weights, optimizer state and RNG streams; writes are atomic."""

from __future__ import annotations

import random

import numpy as np
import torch

from lorarl.checkpoint import load_checkpoint, save_checkpoint
from lorarl.config import LoraSettings, ModelConfig, Recipe
from lorarl.model import SharedBase
from lorarl.runs import latest_checkpoint, list_checkpoints


def _setup(model_dir):
    sb = SharedBase.load(ModelConfig(name=str(model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("policy", LoraSettings(r=4))
    sb.add_adapter("critic", LoraSettings(r=4))
    opts = {r: torch.optim.AdamW(sb.trainable_parameters(r), lr=1e-2) for r in ("policy", "critic")}
    scheds = {r: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for r, o in opts.items()}
    return sb, opts, scheds


def _step(sb, opts, scheds, role):
    ids = torch.randint(5, 500, (2, 8))
    mask = torch.ones_like(ids)
    with sb.role(role, train=True):
        if role == "policy":
            lp, _ = sb.token_logprobs(ids, mask, start=1)
            loss = -lp.mean()
        else:
            loss = sb.values(ids, mask, start=1).pow(2).mean()
    loss.backward()
    opts[role].step()
    opts[role].zero_grad()
    scheds[role].step()


def test_save_load_roundtrip_is_exact(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    sb, opts, scheds = _setup(tiny_model_dir)
    for _ in range(2):
        _step(sb, opts, scheds, "policy")
        _step(sb, opts, scheds, "critic")
    random.seed(5)
    np.random.seed(5)
    path = save_checkpoint(tmp_path, 2, sb, ["policy", "critic"], opts, scheds, {"data_pos": 17}, Recipe(), keep_last=2)
    assert latest_checkpoint(tmp_path) == path
    # what the uninterrupted run does next
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(3))
    _step(sb, opts, scheds, "policy")
    expected = {n: p.detach().clone() for n, p in sb.peft.named_parameters() if "lora_" in n}
    expected_heads = {n: p.detach().clone() for n, p in sb.heads.named_parameters()}

    torch.manual_seed(123)  # a fresh process would start from other states
    sb2, opts2, scheds2 = _setup(tiny_model_dir)
    state = load_checkpoint(path, sb2, opts2, scheds2)
    assert state["data_pos"] == 17 and state["step"] == 2
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])
    assert scheds2["policy"].last_epoch == scheds["policy"].last_epoch - 1
    _step(sb2, opts2, scheds2, "policy")
    for n, p in sb2.peft.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, expected[n]), n
    for n, p in sb2.heads.named_parameters():
        assert torch.equal(p, expected_heads[n]), n


def test_keep_last_and_incomplete_checkpoints_ignored(tiny_model_dir, tmp_path):
    sb, opts, scheds = _setup(tiny_model_dir)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, sb, ["policy"], opts, scheds, {}, None, keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-000002", "step-000003"]
    # a folder without the COMPLETE marker (a kill mid-write of an older layout) is never picked
    (tmp_path / "checkpoints" / "step-000009").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-000003"
