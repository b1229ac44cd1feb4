"""The memory planner: formulas against hand-computed numbers, monotonicity, budgets, recorded H100 measurements,
and the ``lorarl plan`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.errors import LorarlError
from lorarl.plan import (
    GIB,
    KNOWN_CONFIGS,
    PlanSettings,
    estimate_memory,
    lora_params,
    model_shape,
    nf4_bytes,
    pick_micro_batch,
    resolve_targets,
    total_bytes,
)

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "docs" / "plan_validation"


def test_known_configs_have_the_published_parameter_counts():
    expected = {
        "llama-3.1-8b": 8_030_261_248,
        "qwen2.5-7b": 7_615_616_512,
        "qwen2.5-1.5b": 1_543_714_304,
        "qwen2.5-0.5b": 494_032_768,
        "mistral-7b": 7_241_732_096,
        "smollm2-135m": 134_515_008,
    }
    assert set(expected) == set(KNOWN_CONFIGS)
    for name, n in expected.items():
        assert model_shape(name).num_params() == n, name


def test_names_resolve_from_hub_ids_and_instruct_variants():
    assert model_shape("Qwen/Qwen2.5-7B-Instruct").hidden_size == 3584
    assert model_shape("meta-llama/Llama-3.1-8B").num_key_value_heads == 8
    with pytest.raises(LorarlError, match="known name"):
        model_shape("no-such-model-xyz")


def test_shape_from_a_config_json(tmp_path):
    cfg = dict(KNOWN_CONFIGS["qwen2.5-0.5b"], head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = model_shape(tmp_path)  # a folder holding config.json
    assert (s.hidden_size, s.num_hidden_layers, s.vocab_size, s.d, s.kvd) == (896, 24, 151936, 64, 128)
    assert model_shape(tmp_path / "config.json") == s


def test_smollm2_known_config_matches_the_converted_model(default_model_dir):
    assert model_shape(default_model_dir).num_params() == model_shape("smollm2-135m").num_params()


def test_nf4_bytes_by_hand():
    # 256 x 512 weights: 65536 bytes of 4-bit codes, 2048 blocks of 64 -> 2048 8-bit absmax, 8 fp32 second-level
    assert nf4_bytes(256 * 512) == 65536 + 2048 + 8 * 4
    assert nf4_bytes(256 * 512, double_quant=False) == 65536 + 2048 * 4
    assert nf4_bytes(10**6) / 10**6 == pytest.approx(4.127 / 8, rel=1e-3)  # 4.127 bits per weight


def test_nf4_bytes_match_bitsandbytes_storage():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    try:
        w = bnb.nn.Params4bit(
            torch.randn(512, 256, dtype=torch.bfloat16), requires_grad=False, compress_statistics=True, quant_type="nf4"
        ).to("cpu")
    except Exception as e:  # noqa: BLE001 - a bitsandbytes build without CPU kernels
        pytest.skip(f"bitsandbytes cannot quantize on CPU here: {e}")
    qs = w.quant_state
    stored = w.numel() * w.element_size() + qs.absmax.numel() * qs.absmax.element_size() + qs.state2.absmax.numel() * 4
    assert stored == nf4_bytes(512 * 256)


def test_lora_and_kv_terms_by_hand():
    llama = model_shape("llama-3.1-8b")
    # per layer: r * sum(in + out) = 16 * (8192 + 5120 + 5120 + 8192 + 3 * 18432)
    assert lora_params(llama, 16, resolve_targets(llama, "all-linear")) == 32 * 16 * 81920 == 41_943_040
    assert resolve_targets(llama, ["q_proj", "model.layers.0.self_attn.v_proj"]) == ["q_proj", "v_proj"]
    est = estimate_memory(
        llama, group_size=8, prompts_per_step=2, prompt_len=128, max_new_tokens=128, micro_batch_size=4
    )
    p = est["breakdown"]["persistent"]
    assert p["lora_policy"] == 4 * 41_943_040
    assert p["adam_states"] == 8 * 41_943_040
    embed = 128256 * 4096 * 2
    assert p["base_other_weights"] == 2 * embed + (2 * 32 + 1) * 4096 * 2  # embeddings + untied lm_head + norms
    # the KV cache of Llama-3 8B in bf16 is 128 KiB per token: 2 (k, v) * 32 layers * 8 heads * 128 dims * 2 bytes
    gen = estimate_memory(
        llama, group_size=8, prompts_per_step=2, prompt_len=8, max_new_tokens=1024, micro_batch_size=4
    )
    assert gen["moments"]["generation"] == "decode_end"
    assert gen["breakdown"]["generation"]["kv_cache"] == 16 * (8 + 1024 - 1) * 128 * 1024


def test_base_weights_match_the_h100_measurement():
    """Allocated bytes right after building the NF4 Llama-3.1-8B on an H100 (scripts/validate_plan_gpu.py)."""
    from lorarl.plan import base_weight_bytes

    b = base_weight_bytes(model_shape("llama-3.1-8b"), "nf4", 2)
    assert sum(b.values()) / GIB == pytest.approx(5.311105728149414, rel=1e-3)


def _peak(**kw):
    base = dict(group_size=8, prompts_per_step=2, prompt_len=128, max_new_tokens=128, micro_batch_size=4, kl_coef=0.04)
    return estimate_memory(model_shape("qwen2.5-1.5b"), **{**base, **kw})


@pytest.mark.parametrize(
    "key,small,large",
    [
        ("max_new_tokens", 64, 512),
        ("prompt_len", 64, 512),
        ("group_size", 4, 16),
        ("prompts_per_step", 1, 4),
        ("lora_r", 8, 64),
        ("logprob_chunk_size", 32, 256),
    ],
)
def test_peak_grows_with_each_size(key, small, large):
    assert _peak(**{key: small})["peak_bytes"] < _peak(**{key: large})["peak_bytes"]


def test_training_grows_with_micro_batch_and_generation_does_not():
    # (the micro-batch is not in test_peak_grows_with_each_size: with the fused logits chunk the training phase of
    # these sizes is below generation's, so the step's peak does not move with it)
    a, b = _peak(micro_batch_size=2), _peak(micro_batch_size=8)
    assert a["phases"]["training"] < b["phases"]["training"]
    assert a["phases"]["generation"] == b["phases"]["generation"]


def test_reference_pass_only_when_it_runs():
    assert _peak(kl_coef=0.0)["moments"]["scoring"] == "not run"
    assert _peak(kl_coef=0.04)["phases"]["scoring"] > _peak(kl_coef=0.0)["phases"]["scoring"]


def test_ppo_has_critic_and_reward_adapters():
    est = estimate_memory(model_shape("qwen2.5-0.5b"), PlanSettings(algo="ppo", prompts_per_step=8))
    assert {"lora_critic_and_head", "lora_reward_and_head_frozen"} <= set(est["breakdown"]["persistent"])
    assert "critic_training" in est["phases"]
    assert (
        "lora_reward_and_head_frozen"
        not in estimate_memory(model_shape("qwen2.5-0.5b"), PlanSettings(algo="ppo", reward_model=False))["breakdown"][
            "persistent"
        ]
    )


def test_pick_micro_batch_respects_the_budget():
    shape = model_shape("llama-3.1-8b")
    s = PlanSettings(group_size=8, prompts_per_step=8, prompt_len=256, max_new_tokens=512)
    pick = pick_micro_batch(shape, 24.0, s)
    assert pick["fits"]
    mb = pick["micro_batch_size"]
    assert 64 % mb == 0
    est = estimate_memory(shape, s, micro_batch_size=mb, generation_batch_size=pick["generation_batch_size"])
    assert est["peak_total_bytes"] <= 24e9
    if mb < 64:  # the next larger divisor does not fit
        bigger = min(d for d in range(mb + 1, 65) if 64 % d == 0)
        assert total_bytes(estimate_memory(shape, s, micro_batch_size=bigger)["phases"]["training"]) > 24e9


def test_pick_micro_batch_says_when_nothing_fits():
    pick = pick_micro_batch(model_shape("qwen2.5-7b"), 4.0, PlanSettings(prompts_per_step=8))
    assert not pick["fits"]
    assert pick["micro_batch_size"] == 1
    assert "does not fit" in pick["advice"][0]


def _recorded_runs():
    for f in sorted(VALIDATION.glob("h100_*.json")):
        for res in json.loads(f.read_text())["results"]:
            for algo, run in res["runs"].items():
                yield f.name, res["model"], algo, run


@pytest.mark.skipif(not VALIDATION.is_dir(), reason="no recorded GPU validation")
def test_predictions_stay_within_15_percent_of_the_recorded_h100_peaks():
    """Re-predict every phase measured on the H100 (docs/plan_validation/*.json) with the current formulas."""
    fields = PlanSettings.__dataclass_fields__
    worst = 0.0
    n = 0
    for fname, model, _algo, run in _recorded_runs():
        # runs recorded before packed GRPO training measured one full row per completion
        settings = PlanSettings(
            **{"packed_training": False, **{k: v for k, v in run["settings"].items() if k in fields}}
        )
        est = estimate_memory(model_shape(model), settings)
        for phase, r in run["phases"].items():
            keys = [phase, "optimizer"] if "training" in phase else [phase]
            pred = max(est["phases"][k] for k in keys)
            err = abs(pred / r["measured"] - 1)
            assert err <= 0.15, (
                f"{fname} {model} {phase}: predicted {pred / GIB:.2f} GiB, measured {r['measured'] / GIB:.2f}"
            )
            worst = max(worst, err)
            n += 1
    assert n >= 50 and worst <= 0.15


def test_cli_prints_the_plan_as_json(capsys):
    from lorarl.cli import main

    rc = main(
        ["plan", str(REPO / "recipes" / "grpo_arithmetic.yaml"), "--model-config", "llama-3.1-8b", "--budget-gb", "24"]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["model"] == "llama-3.1-8b"
    assert isinstance(result["picked_micro_batch_size"], int) and result["picked_micro_batch_size"] >= 1
    assert all(isinstance(v, (int, float)) for v in result["phases_gb"].values())
    assert isinstance(result["peak_total_gb"], float) and result["fits"] in (True, False)
    assert "plan for" in "\n".join(out[:-1])  # the table before the JSON line


def test_cli_plan_with_an_override_and_the_recipe_model(capsys):
    from lorarl.cli import main

    rc = main(["plan", str(REPO / "recipes" / "grpo_arithmetic.yaml"), "train.micro_batch_size=auto"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "smollm2-135m" and result["micro_batch_size"] == "auto"


def test_resolve_micro_batch():
    from lorarl.config import recipe_from_dict
    from lorarl.plan import resolve_micro_batch

    fixed = recipe_from_dict({"train": {"micro_batch_size": 4}})
    assert resolve_micro_batch(fixed) == 4
    auto = recipe_from_dict({"train": {"micro_batch_size": "auto", "prompts_per_step": 2}, "grpo": {"group_size": 8}})
    assert resolve_micro_batch(auto, device_type="cpu") == 8
    mb = resolve_micro_batch(auto, device_type="cuda", budget_gb=24)
    assert mb >= 1 and 16 % mb == 0


@pytest.mark.slow
def test_gpu_validation_script_runs_on_cpu(tmp_path):
    """The GPU validation's code path (model build, SharedBase, the real GRPO and PPO steps built from recipes,
    per-phase peaks, table, JSON) on a tiny model."""
    import subprocess
    import sys

    cmd = [sys.executable, str(REPO / "scripts" / "validate_plan_gpu.py"), "--device", "cpu", "--models", "tiny"]
    cmd += ["--prompt-len", "16", "--max-new-tokens", "8", "--out", str(tmp_path), "--jobs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "validate_plan.json").read_text())
    assert not summary["failures"]
    runs = summary["results"][0]["runs"]
    assert set(runs) == {"grpo", "ppo"}
    assert {"generation", "scoring", "training"} <= set(runs["grpo"]["phases"])
    assert {"generation", "scoring", "training", "critic_training"} <= set(runs["ppo"]["phases"])
    assert "optimizer" in runs["ppo"]["measured"]["all_phases"]  # phases the real step marks, read by hooks
    assert all(r["measured"] > 0 and r["predicted"] > 0 for run in runs.values() for r in run["phases"].values())


# ---- the fast decode engine's static cache and graph pool -------------------------------------------------------
def test_static_cache_and_graph_pool_terms_by_hand():
    from lorarl.plan.terms import decode_step_bytes, static_cache_columns, static_kv_cache_bytes

    llama = model_shape("llama-3.1-8b")
    assert static_cache_columns(100, 128, 64) == 256 and static_cache_columns(100, 128) == 228
    # 16 rows x 256 columns x (2 x 32 layers x 1024 kv dims x 2 bytes)
    assert static_kv_cache_bytes(llama, 16, 256, 2) == 16 * 256 * 131072 == 512 * 2**20
    # one step: a layer's forward with a dequantized 4096 x 14336 projection, or sampling 16 x 128256 x (2 + 16)
    deq = 4096 * 14336 * 2
    assert decode_step_bytes(llama, 16, 2, deq) == max(deq + 16 * 204800, 16 * 128256 * 18)
    assert decode_step_bytes(llama, 64, 2, deq) == 64 * 128256 * 18  # at 64 rows the sampling is the larger


def _fast(**kw):
    base = dict(group_size=8, prompts_per_step=2, prompt_len=128, max_new_tokens=128, micro_batch_size=4)
    return estimate_memory(model_shape("llama-3.1-8b"), **{**base, **kw})


def test_with_cuda_graphs_the_cache_and_pool_are_held_in_every_phase():
    hf, fast = _fast(), _fast(engine="fast")
    p = fast["breakdown"]["persistent"]
    assert p["static_kv_cache"] == 16 * 256 * 131072  # 128 + 128 columns, already a multiple of 64
    assert p["graph_pool"] > 0
    held = p["static_kv_cache"] + p["graph_pool"]
    for phase in ("training", "optimizer"):
        assert fast["phases"][phase] - hf["phases"][phase] == held
    assert "static_kv_cache" not in fast["breakdown"]["generation"]  # counted once, as persistent
    assert "static_kv_cache" not in hf["breakdown"]["persistent"]


def test_without_graphs_the_cache_exists_only_while_generating():
    for kw in (dict(cuda_graphs=False), dict(device="cpu")):
        est, hf = _fast(engine="fast", **kw), _fast(**kw)
        assert "static_kv_cache" not in est["breakdown"]["persistent"]
        assert est["breakdown"]["generation"]["static_kv_cache"] == 16 * 256 * 131072
        assert est["phases"]["training"] == hf["phases"]["training"]


def test_fast_generation_grows_with_rows_and_length():
    small, large = _fast(engine="fast"), _fast(engine="fast", max_new_tokens=512)
    assert small["breakdown"]["persistent"]["static_kv_cache"] < large["breakdown"]["persistent"]["static_kv_cache"]
    more_rows = _fast(engine="fast", prompts_per_step=8)
    assert more_rows["breakdown"]["persistent"]["graph_pool"] > small["breakdown"]["persistent"]["graph_pool"]


def test_cli_plan_shows_the_fast_engines_memory(capsys):
    from lorarl.cli import main

    recipe = str(REPO / "recipes" / "grpo_arithmetic.yaml")
    rc = main(
        ["plan", recipe, "--model-config", "llama-3.1-8b", "generation.engine=fast", "generation.keep_cache=true"]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["settings"]["engine"] == "fast" and result["breakdown_gb"]["persistent"]["static_kv_cache"] > 0
    assert any("static KV cache" in line and "graph pool" in line for line in out[:-1])
    # auto: 64 rows in one micro-batch do not fit 24 GB with the cache held, so the plan frees it after each rollout
    main(["plan", recipe, "--model-config", "llama-3.1-8b", "generation.engine=fast"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["settings"]["keep_cache"] is False and "static_kv_cache" not in result["breakdown_gb"]["persistent"]
    assert any("keep_cache -> false" in line and "freed after each rollout" in line for line in out[:-1])
    main(["plan", recipe, "--model-config", "llama-3.1-8b", "generation.engine=fast", "generation.cuda_graphs=false"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("no graphs" in line for line in lines[:-1])


def test_the_default_engine_is_fast_on_cuda_and_hf_on_cpu():
    """``generation.engine: auto`` (the default; no shipped recipe names an engine) plans the fast engine's static
    cache and graph pool for a GPU and ``generate`` for a CPU; a recipe that names an engine keeps it."""
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_settings

    path = REPO / "recipes" / "grpo_arithmetic.yaml"
    recipe = load_recipe(path)
    assert recipe.generation.engine == "auto"
    assert recipe_settings(recipe, device_type="cuda").engine == "fast"
    assert recipe_settings(recipe, device_type="cpu").engine == "hf"
    assert recipe_settings(load_recipe(path, ["generation.engine=hf"]), device_type="cuda").engine == "hf"
    assert recipe_settings(load_recipe(path, ["generation.engine=fast"]), device_type="cpu").engine == "fast"
    gpu = estimate_memory(model_shape("llama-3.1-8b"), recipe_settings(recipe, device_type="cuda"))
    assert gpu["breakdown"]["persistent"]["static_kv_cache"] > 0


def test_cli_plan_of_a_default_recipe_shows_the_fast_engine_on_a_gpu(capsys):
    from lorarl.cli import main

    assert main(["plan", str(REPO / "recipes" / "grpo_arithmetic.yaml"), "--model-config", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["settings"]["engine"] == "fast"
    assert any(line.startswith("  decode engine: fast, CUDA graphs") for line in out[:-1])


def test_a_scoring_chunk_of_logits_holds_at_most_logprob_chunk_tokens_tokens():
    """64 scoring rows of 1024 new tokens on Qwen2.5-1.5B (V = 151,936, bf16: 8 bytes per no-grad logit): 2048 // 64
    = 32 positions per chunk, 2.49 GB; without the token bound 256 positions, 19.9 GB (what the planner found)."""
    from lorarl.plan.estimate import scoring_moments
    from lorarl.plan.settings import PlanSettings, plan_settings, step_sizes

    shape = model_shape("qwen2.5-1.5b")
    s = PlanSettings(prompts_per_step=8, group_size=8, max_new_tokens=1024, kl_coef=0.04)
    chunk = scoring_moments(shape, s, step_sizes(shape, s))["logits"]["logits_chunk"]
    assert chunk == 64 * 32 * 151936 * 8
    s = plan_settings(s, logprob_chunk_tokens=10**9)
    assert scoring_moments(shape, s, step_sizes(shape, s))["logits"]["logits_chunk"] == 64 * 256 * 151936 * 8


@pytest.mark.parametrize(
    "model,keep", [("Qwen/Qwen2.5-1.5B-Instruct", True), ("meta-llama/Llama-3.1-8B-Instruct", False)]
)
def test_keep_cache_auto_frees_the_static_cache_where_holding_it_costs_training(model, keep):
    """GRPO, 64 rows of 128 + 1024 tokens, 24 GB: the 8B's 9.66 GB static cache (32 layers x 8 KV heads x 128 x
    2 x 2 bytes x 64 rows x 1152 columns) would cut the planned micro-batch from 16 to 2, so auto frees it after
    each rollout (then it is a generation term, not a persistent one); the 1.5B keeps its cache. Written true /
    false is obeyed; on CPU nothing is kept, so auto resolves to true."""
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_model_shape, recipe_settings, resolve_keep_cache
    from lorarl.plan.terms import GB

    over = [f"model.name={model}", "generation.max_new_tokens=1024", "data.max_prompt_tokens=128"]
    recipe = load_recipe(REPO / "recipes" / "grpo_gsm8k.yaml", over)
    shape = recipe_model_shape(recipe)
    assert resolve_keep_cache(recipe, "cuda", budget_gb=24) is keep
    assert resolve_keep_cache(recipe, "cpu") is True
    est = estimate_memory(shape, recipe_settings(recipe, shape=shape, budget_bytes=24 * GB))
    cache = 32 * 8 * 128 * 2 * 2 * 64 * 1152 if not keep else None
    if keep:
        assert "static_kv_cache" in est["breakdown"]["persistent"]
    else:
        assert "static_kv_cache" not in est["breakdown"]["persistent"]
        assert est["breakdown"]["generation"]["static_kv_cache"] == cache
    written = load_recipe(REPO / "recipes" / "grpo_gsm8k.yaml", [*over, f"generation.keep_cache={not keep}"])
    assert resolve_keep_cache(written, "cuda", budget_gb=24) is (not keep)


def test_generation_batch_auto_splits_a_rollout_only_where_one_batch_does_not_fit(capsys):
    """PPO, 64 prompts of 96 + 1024 tokens, micro-batch 8, 24 GB: Llama-3.1-8B's no-grad scoring of all 64 rows at
    once needs 29.4 GB with the context and slack, 32 rows at a time 19.5 GB, so ``generation.batch_size: auto``
    resolves to 32 on CUDA (the step bench's 8B PPO row was 25.1 GB in one batch); Qwen2.5-1.5B fits in one batch
    (None). A CPU run decodes in one batch; a written size is used as written, on any device. ``lorarl plan`` shows
    the size a run uses and plans the phases with it."""
    from lorarl.cli import main
    from lorarl.config import load_recipe
    from lorarl.plan.recipes import recipe_model_shape, recipe_settings, resolve_generation_batch
    from lorarl.plan.terms import GB

    path = REPO / "recipes" / "ppo.yaml"
    over = ["generation.max_new_tokens=1024", "train.prompts_per_step=64", "model.gradient_checkpointing=true"]
    big = load_recipe(path, [*over, "model.name=meta-llama/Llama-3.1-8B-Instruct"])
    assert resolve_generation_batch(big, "cuda", budget_gb=24) == 32
    assert resolve_generation_batch(big, "cpu") is None
    shape = recipe_model_shape(big)
    s = recipe_settings(big, shape=shape, budget_bytes=24 * GB)
    one = estimate_memory(shape, s, micro_batch_size=8)
    split = estimate_memory(shape, s, micro_batch_size=8, generation_batch_size=32)
    assert one["peak_total_bytes"] > 24 * GB >= split["peak_total_bytes"]
    assert one["peak_phase"] == split["peak_phase"] == "scoring"
    small = load_recipe(path, [*over, "model.name=Qwen/Qwen2.5-1.5B-Instruct"])
    assert resolve_generation_batch(small, "cuda", budget_gb=24) is None
    written = load_recipe(path, [*over, "model.name=meta-llama/Llama-3.1-8B-Instruct", "generation.batch_size=16"])
    assert resolve_generation_batch(written, "cuda", budget_gb=24) == 16
    assert resolve_generation_batch(written, "cpu") == 16
    assert recipe_settings(written, shape=shape, budget_bytes=24 * GB).generation_batch_size == 16

    argv = ["plan", str(path), "--model-config", "llama-3.1-8b", *over]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["run_sizes"] == [8, 32] and result["fits"] and result["settings"]["generation_rows"] == 32
    assert any("generation batch: auto as written, 32 of 64 rows" in line for line in out[:-1])
    main([*argv, "generation.batch_size=64"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["run_sizes"] == [8, 64] and not result["fits"]
