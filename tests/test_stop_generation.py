"""A stop request (SIGTERM, the workbench's Stop) during a step's generation: both rollout engines end the
generation at the next token, the step is abandoned (nothing trains on the partial rollout, nothing of it is logged
or saved), the run stops at the step before it, and ``--resume`` continues bit-identically. Also a real
``python -m lorarl.cli train`` stopped deep in a 131,072-token generation; and sizes that multiply past the machine
refused before the model loads (lorarl.plan.bounds), checked against a KV cache computed by hand."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_run_control import adapters, tiny, without_timings

from lorarl import runstate
from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict
from lorarl.runs import read_metrics


def sigterm_at_token(monkeypatch, cls, at_step: int, token: int, calls: list) -> None:
    """Patch ``cls.step`` so that in step ``at_step`` the model's embedding layer counts its calls (one per prefill
    and one per decoded token) in ``calls`` and SIGTERMs this process in its ``token``-th call, as
    ``lorarl.runstate.request_stop`` does from another process."""
    real = cls.step

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == token:
            os.kill(os.getpid(), signal.SIGTERM)

    def step(self, batch):
        if batch.step != at_step:
            return real(self, batch)
        handle = self.shared.module.get_input_embeddings().register_forward_hook(hook)
        try:
            return real(self, batch)
        finally:
            handle.remove()

    monkeypatch.setattr(cls, "step", step)


def test_sigterm_during_generation_abandons_the_step_and_resume_is_bit_identical(tiny_model_dir, tmp_path, monkeypatch):
    """The fast engine in the run loop (hf: the real process below); save_every 0, so the checkpoint of step 1 is
    written when step 2 is abandoned, from the RNGs and algorithm state taken before step 2."""
    from lorarl.algos.grpo import GRPO

    data = tiny(tiny_model_dir, tmp_path, generation={"engine": "fast"}, train={"steps": 2})  # 6 new tokens
    recipe = recipe_from_dict(data)
    train(recipe, tmp_path / "straight", progress=False)

    out, calls = tmp_path / "split", []
    sigterm_at_token(monkeypatch, GRPO, 2, 3, calls)
    stopped = train(recipe, out, progress=False)
    # the prefill (token 1) and tokens 2-3 ran; the SIGTERM came in the third call and no fourth came (6 allowed)
    assert len(calls) == 3
    assert stopped["stopped"] is True and stopped["step"] == 1 and stopped["steps_this_run"] == 1
    assert stopped["checkpoint"] == str(out / "checkpoints" / "step-000001")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]  # no half step saved
    state = runstate.read_state(out)
    assert (state["state"], state["step"], state["last_step"], state["error"]) == ("stopped", 1, 2, None)
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert {json.loads(line)["step"] for line in (out / "completions.jsonl").read_text().splitlines()} == {1}
    assert not (out / "policy").exists() and not (out / "train.pid").exists()

    monkeypatch.undo()
    resumed = train(recipe, out, resume=True, progress=False)
    assert "stopped" not in resumed and resumed["steps_this_run"] == 1  # step 2, again
    a, b = adapters(tmp_path / "straight"), adapters(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)  # it trained
    assert without_timings(read_metrics(tmp_path / "straight")) == without_timings(read_metrics(out))


def test_a_stop_flag_outside_a_step_leaves_generation_alone(tiny_shared):
    """Evaluation, chat and programs calling the engines are not training steps: a raised flag that no step observes
    does not cut their generation; an observed one raises StepAbandoned in both engines."""
    from lorarl.config import GenerationConfig, LoraSettings
    from lorarl.rollout import generate_rollout
    from lorarl.rollout.engines import HFEngine
    from lorarl.rollout.fast import FastEngine

    tiny_shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    gen = GenerationConfig(max_new_tokens=5)
    eos = max(tiny_shared.eos_ids) + 1  # no EOS: every row runs to the cap
    prompts = [[1, 2, 3], [4, 5]]
    stop = runstate.StopRequest()
    stop.set()
    # calls of the embedding layer before token 2: hf prefills each prompt's first columns once for its group,
    # then `generate` runs the last prompt column (token 1); fast prefills in one call (token 1 from its logits)
    prefill = {"hf": 2, "fast": 1}
    tokens: list = []
    for engine in (HFEngine(), FastEngine()):
        tokens.clear()
        handle = tiny_shared.module.get_input_embeddings().register_forward_hook(lambda *a: tokens.append(1))
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(type(tiny_shared), "eos_ids", property(lambda self: [eos]))
                rollout = generate_rollout(tiny_shared, prompts, gen, group_size=2, engine=engine)
                assert rollout.completion_ids.shape == (4, 5), engine.name
                assert len(tokens) == prefill[engine.name] + 4, engine.name  # tokens 2-5: one decode step each
                tokens.clear()
                with stop.observed(), pytest.raises(runstate.StepAbandoned, match="stop requested during"):
                    generate_rollout(tiny_shared, prompts, gen, group_size=2, engine=engine)
                assert len(tokens) == prefill[engine.name], engine.name  # token 1, and no decode step
        finally:
            handle.remove()
    assert runstate.observed_stop() is None


CHILD = """
import sys
from pathlib import Path

from lorarl.algos.grpo import GRPO
from lorarl.model import SharedBase

real = GRPO.step


def step(self, batch):
    if batch.step == 2:  # a generation of minutes: no EOS, the load-time cap on max_new_tokens
        SharedBase.eos_ids = property(lambda s: [10**6])
        self.recipe.generation.max_new_tokens = 131072
        Path(sys.argv[1]).write_text("generating")
    return real(self, batch)


GRPO.step = step
from lorarl.cli import main

sys.exit(main(sys.argv[2:]))
"""


def digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_train_stopped_deep_in_a_generation_exits_in_seconds(tiny_model_dir, tmp_path):
    import yaml

    data = tiny(tiny_model_dir, tmp_path, train={"steps": 3, "save_every": 1})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out, marker = tmp_path / "run", tmp_path / "generating"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-c", CHILD, str(marker), "train", str(recipe), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "step 2 did not start within 120 s"
            time.sleep(0.05)
        time.sleep(1.0)  # well into step 2's generation (131,072 tokens: minutes on this model)
        assert proc.poll() is None and runstate.read_state(out)["step"] == 1
        checkpoint = out / "checkpoints" / "step-000001"
        before = digests(checkpoint)
        t0 = time.perf_counter()
        assert runstate.request_stop(out) is True
        while runstate.read_state(out)["state"] == "running" and time.perf_counter() - t0 < 30:
            time.sleep(0.01)
        took = time.perf_counter() - t0  # SIGTERM -> state.json says stopped (0.12 s on 2 cores at load 9)
        # the interpreter's exit after that takes seconds on a busy machine (torch's and transformers' teardown)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert took < 5, f"{took:.1f} s from SIGTERM to state stopped"
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] is True and summary["step"] == 1
    assert "step 2: stop requested during generation: step abandoned; checkpoint of step 1" in stdout
    state = runstate.read_state(out)
    assert (state["state"], state["step"], state["last_step"]) == ("stopped", 1, 3)
    assert digests(checkpoint) == before and (checkpoint / "COMPLETE").is_file()  # intact, not rewritten
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert [r["step"] for r in read_metrics(out)] == [1] and not (out / "train.pid").exists()


# --- sizes against the planner's estimate, before the model loads -----------------------------------------------

HUGE = {"generation": {"max_new_tokens": 131072}, "train": {"prompts_per_step": 32}, "grpo": {"group_size": 8}}
GB = 1e9


def huge_kv_bytes() -> int:
    """The KV cache at the end of HUGE's generation, by hand: SmolLM2-135M's published config (30 layers, 3 KV
    heads of 576 / 9 = 64 dims), fp32 on CPU, 32 x 8 = 256 rows of 96 prompt tokens (the arithmetic task's planned
    prompt) + 131072 new ones, less the last token: rows x (T - 1) x 2 (keys, values) x layers x kv dims x 4 bytes."""
    return 256 * (96 + 131072 - 1) * 2 * 30 * (3 * 64) * 4  # 1,547,308,892,160


def test_sizes_that_multiply_past_the_machine_are_refused_naming_the_keys():
    from lorarl.plan.bounds import memory_refusal

    kv = huge_kv_bytes()
    line = memory_refusal(recipe_from_dict({"algo": "grpo", **HUGE}), "cpu", 24 * 10**9)
    assert line is not None and "\n" not in line
    assert "over 4 x this machine's 24.0 GB of RAM" in line
    assert f"its generation peak is mostly the KV cache ({kv / GB:,.1f} GB)" in line  # 1,547.3 GB
    assert "256 completions [train.prompts_per_step (32) x grpo.group_size (8)]" in line
    assert "data.max_prompt_tokens (96) + generation.max_new_tokens (131072)" in line
    need = float(line.split("needs about ")[1].split(" GB")[0].replace(",", "")) * GB
    # the end of decoding also holds one layer's concatenation copy (kv / 30), the weights (0.6 GB) and the logits
    assert kv * 31 / 30 < need < kv * 31 / 30 + 2 * GB
    # the default sizes (about 2.4 GB) pass on a 1 GB machine (4 GB allowed), and HUGE on a 400 GB one (1.6 TB)
    assert memory_refusal(recipe_from_dict({"algo": "grpo"}), "cpu", 10**9) is None
    assert memory_refusal(recipe_from_dict({"algo": "grpo", **HUGE}), "cpu", 400 * 10**9) is None
    # CUDA: 2 x the card (80 GB). The fast engine's static cache, kept between rollouts with CUDA graphs, by hand:
    # 256 rows x (96 + 131072 rounded up to the graphs' 64-token bucket = 131200) x 2 x 30 x 192 x 2 bytes (bf16)
    line = memory_refusal(recipe_from_dict({"algo": "grpo", **HUGE}), "cuda", 80 * 10**9)
    static = 256 * 131200 * 2 * 30 * 192 * 2  # 773,849,088,000
    assert "over 2 x the card's 80.0 GB" in line and f"mostly the static KV cache ({static / GB:,.1f} GB)" in line


def test_train_refuses_before_loading_or_writing_anything(tmp_path, monkeypatch, capsys):
    import yaml

    from lorarl import cli
    from lorarl.plan import bounds

    monkeypatch.setattr(bounds, "machine_memory", lambda device_type: 24 * 10**9)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"algo": "grpo", **HUGE}))
    assert cli.main(["train", str(recipe), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lorarl: error: recipe: one step needs about ")
    assert f"KV cache ({huge_kv_bytes() / GB:,.1f} GB)" in err[0]
    assert not (tmp_path / "run").exists()
