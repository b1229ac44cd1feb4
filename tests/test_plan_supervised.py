"""The planner's reward-model and SFT steps (lorarl.plan.supervised): no generation, no reference; one adapter's
forward + backward. Against hand-computed bytes on Llama-3.1-8B's shape (NF4, bf16), the shipped recipes, and, on
the CPU, the tensor peak torch's profiler measures for a real step of each (lorarl.bench.plan_validation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.plan import estimate_memory, model_shape

REPO = Path(__file__).resolve().parents[1]
DEQ = 4096 * 14336 * 2  # the largest projection dequantized to bf16 (NF4)
H, L, V = 4096, 32, 128256


def _plan(algo: str, **kw):
    base = dict(
        algo=algo,
        prompts_per_step=16,  # pairs (reward model) / examples (SFT) per step
        micro_batch_size=4,
        prompt_len=128,
        max_new_tokens=128,  # T = 256
        max_tokens_per_forward=1024,  # reward model: g = 1024 // 256 = 4 rows per forward
        logprob_chunk_size=256,  # c = min(256, 128) = 128
    )
    return estimate_memory(model_shape("llama-3.1-8b"), **{**base, **kw})


def test_reward_model_phases_by_hand():
    est = _plan("reward_model")
    n = est["params"]["lora_policy"]  # the trained parameters: the reward adapter and its score head
    assert n == _plan("sft")["params"]["lora_policy"] + H + 1
    per_layer = est["params"]["layer_train_bytes_per_token"]
    assert set(est["phases"]) == {"training", "optimizer"}  # no generation, no scoring, no reference
    p = est["breakdown"]["persistent"]
    assert p["lora_reward_and_head"] == 4 * n and p["adam_states"] == 8 * n and "lora_policy" not in p
    # R = 2 x 4 pairs = 8 rows of 256 tokens; forwards of g = 4 rows; the score head: no vocabulary logits
    layer = {
        "lora_grads": 4 * n,
        "checkpoints": L * 8 * 256 * H * 2,
        "final_hidden": 8 * 256 * H * (2 * 2 + 4),
        "layer_recompute": 4 * 256 * per_layer,
        "dequantized_weight": DEQ,
        "attention_mask": 3 * 4 * 256 * 256,
    }
    assert est["moments"]["training"] == "layer" and est["breakdown"]["training"] == layer
    assert est["phases"]["training"] == sum(p.values()) + sum(layer.values())
    one = _plan("reward_model", max_tokens_per_forward=0)["breakdown"]["training"]
    assert one["layer_recompute"] == 8 * 256 * per_layer and one["attention_mask"] == 3 * 8 * 256 * 256


def test_sft_phases_by_hand():
    est = _plan("sft")
    n = est["params"]["lora_policy"]
    assert set(est["phases"]) == {"training", "optimizer"}
    # R = 4 examples of 256 tokens in one forward; the loss's chunk of logits recomputed in backward, no entropy
    kept = {"lora_grads": 4 * n, "checkpoints": L * 4 * 256 * H * 2, "final_hidden": 4 * 256 * H * (2 * 2 + 4)}
    logits = {**kept, "logits_chunk": 4 * 128 * V * (2 + 8)}  # the fused chunk (terms.LOGIT_BYTES_FUSED)
    assert est["moments"]["training"] == "logits" and est["breakdown"]["training"] == logits
    assert _plan("sft", micro_batch_size=8)["phases"]["training"] > est["phases"]["training"]
    assert "static_kv_cache" not in est["breakdown"]["persistent"]  # SFT samples nothing


@pytest.mark.parametrize(
    "recipe, algo, expect",
    [
        # reward_model.batch_size 16 pairs, micro-batch 16, max_length 256 = 128 + 128, forwards of 1024 tokens
        ("reward_model.yaml", "reward_model", (16, 16, 128, 128, 1024)),
        # sft.batch_size 16 examples, micro-batch 16, max_length 256 = 128 + 128 (rows are padded to the longest,
        # so only the total counts), one forward per micro-batch
        ("sft_subtraction.yaml", "sft", (16, 16, 128, 128, 0)),
    ],
)
def test_shipped_recipes_are_planned_as_their_own_step(recipe, algo, expect, capsys):
    from lorarl.cli import main
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_settings

    path = REPO / "recipes" / recipe
    r = load_recipe(path)
    s = recipe_settings(r)
    got = (s.prompts_per_step, s.micro_batch_size, s.prompt_len, s.max_new_tokens, s.max_tokens_per_forward)
    section = getattr(r, algo)
    mb = r.train.micro_batch_size
    assert s.algo == algo and got[0] == section.batch_size and got[2] + got[3] == section.max_length
    assert got[1] == (mb if isinstance(mb, int) else 1) and got == expect
    assert main(["plan", str(path), "--model-config", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert set(json.loads(out[-1])["phases_gb"]) == {"training", "optimizer"}
    assert any("no generation" in line for line in out[:-1])


def test_real_steps_on_the_cpu_stay_under_the_plan_and_close_to_it(tmp_path):
    """A real reward-model step and a real SFT step (lorarl.bench.plan_validation: the algorithms ``lorarl train``
    builds, on rows of exactly the planned length) on a tiny random model: the training phase's tensor peak, read
    by the profiler, against what the planner predicts: within 5% below and 35% above (the GPU validation of the RL
    steps held 12.7%; the plan is meant as a bound, rounding of small terms aside)."""
    from lorarl.bench.plan_validation import validate

    argv = ["--device", "cpu", "--models", "tiny", "--algos", "reward_model,sft", "--jobs", "1"]
    summary = validate(argv + ["--prompt-len", "32", "--max-new-tokens", "32", "--out", str(tmp_path)])
    assert not summary["failures"]
    runs = summary["results"][0]["runs"]
    for algo in ("reward_model", "sft"):
        row = runs[algo]["phases"]["training"]
        assert runs[algo]["estimate"]["settings"]["algo"] == algo
        assert 0.95 <= row["ratio"] <= 1.35, (algo, row)
