"""Kill a training process with SIGKILL (during and between checkpoint writes); the resumed run's final adapter
must be bit-identical to an uninterrupted run's with the same seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

REWARD = '''
def longer(prompts, completions, **kwargs):
    """Rewards longer completions (a signal the tiny random model can follow)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(min(len(text), 40) / 40.0)
    return out
'''


def _recipe(tmp_path, model_dir):
    (tmp_path / "rewards_longer.py").write_text(REWARD)
    text = f"""
algo: grpo
model: {{name: "{model_dir}", quantization: none, dtype: float32}}
lora: {{r: 4, alpha: 8}}
data: {{source: arithmetic, train_size: 64, eval_size: 8}}
reward:
  functions:
    - name: "{tmp_path / "rewards_longer.py"}:longer"
generation: {{max_new_tokens: 8}}
train: {{steps: 6, prompts_per_step: 2, micro_batch_size: 3, learning_rate: 1e-2, lr_scheduler: cosine,
         warmup_steps: 1, save_every: 2, keep_last: 2, seed: 3}}
grpo: {{group_size: 4, num_iterations: 2, kl: {{coef: 0.05}}}}
"""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _train(recipe, out, *extra, fault=None, wait=True):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("LORARL_FAULT", None)
    if fault:
        env["LORARL_FAULT"] = fault
    cmd = [sys.executable, "-m", "lorarl.cli", "train", str(recipe), "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        _, err = proc.communicate(timeout=600)
        proc.stderr_text = err
    return proc


def _adapter(run_dir):
    return load_file(str(run_dir / "policy" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("resume")
    recipe = _recipe(tmp, tiny_model_dir)
    proc = _train(recipe, tmp / "uninterrupted")
    assert proc.returncode == 0, proc.stderr_text[-3000:]
    weights = _adapter(tmp / "uninterrupted")
    # the run really trained: LoRA B matrices left zero
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in weights.items())
    return recipe, weights


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fault", ["save:4:adapters", "save:2:renamed"])
def test_sigkill_during_checkpoint_write_then_resume_is_bit_identical(reference_run, tmp_path, fault):
    recipe, want = reference_run
    out = tmp_path / "run"
    proc = _train(recipe, out, fault=fault)
    assert proc.returncode == -signal.SIGKILL
    step = int(fault.split(":")[1])
    complete = sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    # the checkpoint being written when killed is either absent (mid-write) or complete (killed after the rename)
    if fault.endswith("renamed"):
        assert complete[-1] == f"step-{step:06d}"
    else:
        assert complete[-1] == f"step-{step - 2:06d}"
    resumed = _train(recipe, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr_text[-3000:]
    _assert_same(_adapter(out), want)
    assert not list((out / "checkpoints").glob(".step-*"))  # no half-written folders left behind


def test_sigkill_between_checkpoints_then_resume_is_bit_identical(reference_run, tmp_path):
    recipe, want = reference_run
    out = tmp_path / "run"
    proc = _train(recipe, out, wait=False)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-000002" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere inside step 3 or 4
    proc.kill()
    proc.wait()
    assert not (out / "policy").exists()
    resumed = _train(recipe, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr_text[-3000:]
    _assert_same(_adapter(out), want)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [int(__import__("json").loads(line)["step"]) for line in lines]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # metrics continue without duplicate steps


def test_fresh_run_refuses_non_empty_out_without_resume(reference_run, tmp_path):
    recipe, _ = reference_run
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    proc = _train(recipe, out)
    assert proc.returncode == 2 and "--resume" in proc.stderr_text
    assert (out / "keep.txt").read_text() == "user data"
