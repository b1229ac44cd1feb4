"""The planner's held-out evaluation decode state (the fast engine keeps two: training and evaluation shapes) and
its DPO plan (no generation; a no-grad reference pass; the policy's forward + backward over chosen + rejected rows
in length-sorted groups), against hand-computed bytes on Llama-3.1-8B's shape (NF4, bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.plan import estimate_memory, model_shape

REPO = Path(__file__).resolve().parents[1]
KV = 2 * 32 * 1024 * 2  # K and V x 32 layers x 1024 kv dims x bf16: bytes per cached token
DEQ = 4096 * 14336 * 2  # the largest projection dequantized to bf16 (NF4)
H, L, V = 4096, 32, 128256


def _fast(**kw):
    base = dict(group_size=8, prompts_per_step=2, prompt_len=128, max_new_tokens=128, micro_batch_size=4)
    return estimate_memory(model_shape("llama-3.1-8b"), **{**base, "engine": "fast", **kw})


# ---- the evaluation's decode state --------------------------------------------------------------------------------
def test_an_evaluation_between_steps_keeps_its_own_static_cache():
    """16 training rows x 256 columns; the evaluation: 32 rows x ceil((128 + 64) / 64) x 64 = 192 columns."""
    plain, with_eval = _fast(), _fast(eval_batch_size=32, eval_max_new_tokens=64)
    p = with_eval["breakdown"]["persistent"]
    assert p["static_kv_cache"] == 16 * 256 * KV
    assert p["eval_static_kv_cache"] == 32 * 192 * KV == 805306368
    # one graph pool for both states: the larger decode step, 32 rows: max(DEQ + 32 x 204800, 32 x V x 18)
    assert plain["breakdown"]["persistent"]["graph_pool"] == max(DEQ + 16 * 204800, 16 * V * 18) == 120717312
    assert p["graph_pool"] == max(DEQ + 32 * 204800, 32 * V * 18) == 123994112
    extra = 32 * 192 * KV + 123994112 - 120717312
    for phase in ("generation", "training", "optimizer"):
        assert with_eval["phases"][phase] - plain["phases"][phase] == extra


def test_an_evaluation_the_training_state_can_take_adds_nothing():
    """Same rows, no more columns or new tokens: the engine loads it into the training state."""
    assert "eval_static_kv_cache" not in _fast(eval_batch_size=16, eval_max_new_tokens=64)["breakdown"]["persistent"]
    assert "eval_static_kv_cache" not in _fast(eval_batch_size=16)["breakdown"]["persistent"]  # C_e = C
    # same rows but more new tokens (200 > 128): its own state, ceil(328 / 64) x 64 = 384 columns
    longer = _fast(eval_batch_size=16, eval_max_new_tokens=200)["breakdown"]["persistent"]
    assert longer["eval_static_kv_cache"] == 16 * 384 * KV


@pytest.mark.parametrize("kw", [dict(cuda_graphs=False), dict(device="cpu"), dict(eval_batch_size=0), dict()])
def test_no_kept_evaluation_state_without_graphs_or_evaluation(kw):
    est = _fast(**{"eval_batch_size": 32, **kw}) if kw else _fast()
    assert "eval_static_kv_cache" not in est["breakdown"]["persistent"]


def test_recipe_evaluation_settings():
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_settings

    path = REPO / "recipes" / "grpo_arithmetic.yaml"
    s = recipe_settings(load_recipe(path, ["eval.every=10", "eval.n=40", "eval.max_new_tokens=32"]))
    assert (s.eval_batch_size, s.eval_max_new_tokens) == (40, 32)  # eval.batch_size 100, at most eval.n
    assert recipe_settings(load_recipe(path, ["eval.every=0"])).eval_batch_size == 0  # only after the last step


# ---- DPO ------------------------------------------------------------------------------------------------------------
def _dpo(**kw):
    base = dict(
        algo="dpo",
        prompts_per_step=16,  # pairs per step
        micro_batch_size=4,  # pairs per micro-batch: R = 8 rows
        prompt_len=128,
        max_new_tokens=128,  # T = 256
        max_tokens_per_forward=1024,  # g = 1024 // 256 = 4 rows per forward
        logprob_chunk_size=256,  # c = min(256, 128) = 128
    )
    return estimate_memory(model_shape("llama-3.1-8b"), **{**base, **kw})


def test_dpo_phases_by_hand():
    est = _dpo()
    n = est["params"]["lora_policy"]
    per_layer = est["params"]["layer_train_bytes_per_token"]
    assert set(est["phases"]) == {"reference", "training", "optimizer"}  # no generation, no scoring
    kept = {
        "lora_grads": 4 * n,
        "checkpoints": L * 8 * 256 * H * 2,  # every group's checkpoints live until the micro-batch's backward
        "final_hidden": 8 * 256 * H * (2 * 2 + 4),
    }
    logits = {**kept, "logits_chunk": 4 * 128 * V * (2 + 8)}  # one group's chunk, fused (no entropy)
    layer = {
        **kept,
        "layer_recompute": 4 * 256 * per_layer,
        "dequantized_weight": DEQ,
        "attention_mask": 3 * 4 * 256 * 256,
    }
    assert sum(logits.values()) > sum(layer.values())
    assert est["moments"]["training"] == "logits" and est["breakdown"]["training"] == logits
    # reference (base, adapters off): hidden states 2 g T H dt + a chunk of no-grad logits g c V 8
    ref = {"hidden_states": 2 * 4 * 256 * H * 2, "logits_chunk": 4 * 128 * V * 8}
    assert est["breakdown"]["reference"] == ref and est["moments"]["reference"] == "logits"
    base = sum(est["breakdown"]["persistent"].values())
    assert est["phases"]["training"] == base + sum(logits.values())
    assert "lora_reference_frozen" not in est["breakdown"]["persistent"]


def test_dpo_reference_layer_moment_and_frozen_reference_adapter():
    from lorarl.plan.dpo import dpo_reference_moments
    from lorarl.plan.settings import plan_settings, step_sizes

    shape = model_shape("llama-3.1-8b")
    s = plan_settings(
        algo="dpo",
        prompts_per_step=16,
        micro_batch_size=4,
        prompt_len=128,
        max_new_tokens=128,
        max_tokens_per_forward=1024,
    )
    layer = dpo_reference_moments(shape, s, step_sizes(shape, s))["layer"]
    per_no_lora = 2 * 2 * 14336 + (2 * 2 + 4) * H  # a layer's no-grad forward per token without LoRA
    assert layer["layer_forward"] == 4 * 256 * per_no_lora + DEQ and layer["attention_mask"] == 4 * 256 * 256
    frozen = _dpo(reference_adapter=True)
    assert frozen["breakdown"]["persistent"]["lora_reference_frozen"] == 4 * frozen["params"]["lora_policy"]


def test_dpo_groups_simpo_and_sizes():
    one_group = _dpo(max_tokens_per_forward=0)["breakdown"]["training"]
    assert one_group["logits_chunk"] == 8 * 128 * V * 10  # all R = 8 rows in one forward (fused: dt + 8)
    from lorarl.plan.dpo import dpo_training_moments
    from lorarl.plan.settings import PlanSettings, step_sizes

    shape = model_shape("llama-3.1-8b")
    fields = PlanSettings.__dataclass_fields__
    s = PlanSettings(**{k: v for k, v in _dpo(max_tokens_per_forward=100)["settings"].items() if k in fields})
    # >= 1 row per forward (its chunk of logits is then below the layer moment, so read the logits moment itself)
    assert dpo_training_moments(shape, s, step_sizes(shape, s))["logits"]["logits_chunk"] == 1 * 128 * V * 10
    simpo = _dpo(dpo_reference=False)
    assert simpo["moments"]["reference"] == "not run" and simpo["breakdown"]["reference"] == {}
    assert _dpo(micro_batch_size=8)["phases"]["training"] > _dpo()["phases"]["training"]  # checkpoints grow with R
    assert _dpo(max_new_tokens=384)["phases"]["training"] > _dpo()["phases"]["training"]


def test_dpo_recipe_and_command(capsys):
    import json

    from lorarl.cli import main
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_settings

    path = REPO / "recipes" / "dpo.yaml"
    s = recipe_settings(load_recipe(path))
    # dpo.batch_size 16 pairs, micro-batch 8 pairs, max_length 256 = 128 prompt + 128 response, forwards of 2048
    assert (s.algo, s.prompts_per_step, s.micro_batch_size, s.prompt_len, s.max_new_tokens) == ("dpo", 16, 8, 128, 128)
    assert s.max_tokens_per_forward == 2048 and s.dpo_reference and s.eval_batch_size == 0
    fast = recipe_settings(load_recipe(path, ["generation.engine=fast", "eval.every=4"]))
    assert fast.eval_batch_size == 50 and fast.eval_max_new_tokens == 48
    est = estimate_memory(model_shape("llama-3.1-8b"), fast)
    p = est["breakdown"]["persistent"]
    assert "static_kv_cache" not in p  # DPO decodes no rollouts: only the evaluation's state is kept
    assert p["eval_static_kv_cache"] == 50 * 192 * KV  # ceil((128 + 48) / 64) x 64 = 192 columns
    assert main(["plan", str(path), "--model-config", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert set(result["phases_gb"]) == {"reference", "training", "optimizer"}
    assert any("DPO: micro-batches count pairs" in line for line in out[:-1])


# ---- KTO: DPO's phases over unpaired rows ---------------------------------------------------------------------------
def test_kto_phases_by_hand():
    """16 rows per step, micro-batches of 4 rows (R = 4, one completion each, not 2 x 4), T = 256, g = 4 rows per
    forward: the training moment is DPO's on 4 rows; the no-grad phase scores the policy too (KTO's KL pass)."""
    est = _dpo(algo="kto")
    n = est["params"]["lora_policy"]
    assert est["settings"]["rows"] == 16 and set(est["phases"]) == {"reference", "training", "optimizer"}
    kept = {"lora_grads": 4 * n, "checkpoints": L * 4 * 256 * H * 2, "final_hidden": 4 * 256 * H * (2 * 2 + 4)}
    assert est["breakdown"]["training"] == {**kept, "logits_chunk": 4 * 128 * V * (2 + 8)}
    assert est["breakdown"]["reference"] == {"hidden_states": 2 * 4 * 256 * H * 2, "logits_chunk": 4 * 128 * V * 8}
    assert _dpo(algo="kto")["phases"]["training"] < _dpo()["phases"]["training"]  # 4 rows, DPO's 4 pairs are 8


def test_kto_no_grad_pass_runs_the_adapter():
    """Groups of 8 rows x 256 tokens: with the LoRA (KTO's policy KL pass) one layer's forward is 2048 x 204800 bytes;
    DPO's reference (adapters off) 2048 x 90112 + the dequantized projection."""
    from lorarl.plan.dpo import dpo_reference_moments
    from lorarl.plan.settings import plan_settings, step_sizes

    shape = model_shape("llama-3.1-8b")
    kw = dict(prompts_per_step=16, micro_batch_size=8, prompt_len=128, max_new_tokens=128, max_tokens_per_forward=2048)
    kto, dpo = plan_settings(algo="kto", **kw), plan_settings(algo="dpo", **{**kw, "micro_batch_size": 4})
    assert dpo_reference_moments(shape, kto, step_sizes(shape, kto))["layer"]["layer_forward"] == 2048 * 204800
    assert dpo_reference_moments(shape, dpo, step_sizes(shape, dpo))["layer"]["layer_forward"] == 2048 * 90112 + DEQ
    frozen = _dpo(algo="kto", reference_adapter=True)
    assert frozen["breakdown"]["persistent"]["lora_reference_frozen"] == 4 * frozen["params"]["lora_policy"]


def test_kto_recipe_and_command(capsys):
    import json

    from lorarl.cli import main
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_settings

    path = REPO / "recipes" / "kto_arithmetic.yaml"
    s = recipe_settings(load_recipe(path))
    # kto.batch_size 32 rows, micro-batch 16 rows, max_length 256 = 128 prompt + 128 completion, forwards of 2048
    assert (s.algo, s.prompts_per_step, s.micro_batch_size, s.prompt_len, s.max_new_tokens) == ("kto", 32, 16, 128, 128)
    assert s.rows == 32 and s.split_rows == 32 and s.dpo_reference and s.max_tokens_per_forward == 2048
    assert main(["plan", str(path), "--model-config", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert set(json.loads(out[-1])["phases_gb"]) == {"reference", "training", "optimizer"}
    assert any("KTO: micro-batches count rows" in line for line in out[:-1])
