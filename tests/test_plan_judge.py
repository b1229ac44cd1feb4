"""The planner counts an LLM-judge reward: a judge folder's weights (loaded once), a judge adapter, and the judging
phase's KV cache and logits, with the token estimate of lorarl.plan.judge."""

from __future__ import annotations

import pytest

from lorarl.config import recipe_from_dict
from lorarl.plan import estimate_memory, model_shape, recipe_settings
from lorarl.plan.judge import FORMAT_TOKENS
from lorarl.plan.terms import base_weight_bytes, kv_bytes_per_token, sampling_logits_bytes


def judge_recipe(**judge) -> object:
    return recipe_from_dict(
        {
            "algo": "grpo",
            "model": {"name": "qwen2.5-1.5b"},
            "generation": {"max_new_tokens": 100},
            "grpo": {"group_size": 4},
            "reward": {"functions": [{"name": "numeric_match"}, {"name": "judge", "judge": judge}]},
        }
    )


def test_judge_settings_estimate_the_judge_prompt_length():
    rubric = "x" * 300 + " {completions}"  # 314 chars -> 104 tokens
    s = recipe_settings(judge_recipe(mode="group", rubric=rubric, batch_size=4), device_type="cuda")
    # rubric + format line + prompt (arithmetic: 96) + 4 x (100 + 8 markup) + the answer (8 + 16 x 4)
    assert (s.judge, s.judge_rows, s.judge_model) == ("base", 4, None)
    assert s.judge_tokens == 314 // 3 + FORMAT_TOKENS + 96 + 4 * 108 + 72
    plain = recipe_settings(recipe_from_dict({"algo": "grpo", "model": {"name": "qwen2.5-1.5b"}}))
    assert plain.judge == "none"


def test_judge_folder_weights_and_judging_phase_are_counted():
    shape = model_shape("qwen2.5-1.5b")
    base = recipe_settings(judge_recipe(model="base"), device_type="cuda")
    folder = recipe_settings(judge_recipe(model="folder", path="qwen2.5-7b"), device_type="cuda")
    est_base, est_folder = estimate_memory(shape, base), estimate_memory(shape, folder)
    judge_shape = model_shape("qwen2.5-7b")
    weights = base_weight_bytes(judge_shape, "nf4", 2, True)
    persistent = est_folder["breakdown"]["persistent"]
    assert persistent["judge_base_linear_weights"] == int(weights["base_linear_weights"])
    assert persistent["judge_base_other_weights"] == int(weights["base_other_weights"])
    assert "judge_base_linear_weights" not in est_base["breakdown"]["persistent"]  # the bare base: no extra weights
    extra = sum(weights.values())
    assert est_folder["phases"]["training"] - est_base["phases"]["training"] == pytest.approx(extra, abs=2)
    kv = folder.judge_rows * folder.judge_tokens * kv_bytes_per_token(judge_shape, 2)
    assert est_folder["breakdown"]["judging"] == {
        "judge_kv_cache": int(kv),
        "judge_kv_cache_growth": int(kv / judge_shape.num_hidden_layers),
        "judge_sampling_logits": sampling_logits_bytes(judge_shape, folder.judge_rows, 2),
    }
    adapter = recipe_settings(judge_recipe(model="adapter", path="somewhere"), device_type="cuda")
    est_adapter = estimate_memory(shape, adapter)
    assert est_adapter["breakdown"]["persistent"]["lora_judge_frozen"] == 4 * est_adapter["params"]["lora_policy"]
