"""Recipes: the planner's view of a :class:`lorarl.config.Recipe`, ``lorarl plan`` and ``micro_batch_size: auto``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lorarl.config import GRPOConfig, GRPOKLConfig, PPOConfig
from lorarl.config.algorithms import DPOConfig, KTOConfig, RewardModelConfig, SFTConfig
from lorarl.errors import LorarlError
from lorarl.plan.choice import largest_fitting_generation_batch, largest_fitting_micro_batch, pick_micro_batch
from lorarl.plan.distill import distill_settings
from lorarl.plan.engine import uses_graphs
from lorarl.plan.estimate import estimate_memory
from lorarl.plan.judge import judge_settings
from lorarl.plan.settings import PLANNED_ALGOS, PlanSettings, plan_settings
from lorarl.plan.terms import GB
from lorarl.shapes import KNOWN_CONFIGS, ModelShape, known_config, model_shape

ARITHMETIC_PROMPT_TOKENS = 96  # a chat-templated arithmetic question with a system prompt stays well below this
CPU_DEFAULT_MICRO_BATCH = 8


# recipes whose step the planner models: its own steps, and online DPO and RLOO as GRPO steps of their samples
PLANNED_RECIPES = (*PLANNED_ALGOS, "online_dpo", "rloo")


def recipe_settings(
    recipe, *, device_type: str = "cuda", shape: ModelShape | None = None, budget_bytes: float | None = None
) -> PlanSettings:
    """The planner's view of a :class:`lorarl.config.Recipe` on ``device_type`` (``auto`` quantization and
    dtype resolve as the loader does: on CUDA :func:`lorarl.model.loading.choose_quantization` of the model's bf16
    weights (``shape``) against ``budget_bytes``, so bf16 for a model that is a small share of the budget and NF4
    otherwise or when either is unknown, with bf16 compute; none + fp32 on CPU; ``generation.keep_cache: auto`` as
    the run loop resolves it, :func:`auto_keep_cache`). Prompt length is ``data.max_prompt_tokens`` (the longest
    prompt the data loader keeps), or at most :data:`ARITHMETIC_PROMPT_TOKENS` for the built-in arithmetic task."""
    s = _written_settings(recipe, device_type, shape, budget_bytes)
    keep = recipe.generation.keep_cache
    if keep == "auto":
        keep = auto_keep_cache(shape, s, budget_bytes, recipe.train.micro_batch_size == "auto")
    return plan_settings(s, keep_cache=bool(keep))


def auto_keep_cache(
    shape: ModelShape | None, s: PlanSettings, budget_bytes: float | None, micro_batch_auto: bool = False
) -> bool:
    """``generation.keep_cache: auto``: keep the fast engine's decode states (static KV cache + CUDA graph pool)
    between rollouts when the step with them held fits ``budget_bytes`` (``peak_total_bytes``: the CUDA context and
    allocator slack included) and, with ``train.micro_batch_size: auto``, holding them does not lower the
    micro-batch the planner picks (fewer, larger training forwards outweigh a capture per rollout); otherwise free
    them after each rollout, so scoring and training have that memory and each rollout captures again (a few
    decode steps' time). True when nothing would be kept anyway (no CUDA graphs) or the shape or budget is
    unknown. For 64 rows of 128 + 1024 tokens on a 24 GB budget (``lorarl plan recipes/grpo_gsm8k.yaml
    generation.max_new_tokens=1024 data.max_prompt_tokens=128``): Qwen2.5-1.5B keeps its 2.1 GB of cache
    (micro-batch 32 either way), Llama-3.1-8B frees its 9.7 GB (micro-batch 2 held, 16 freed)."""
    if shape is None or budget_bytes is None or not uses_graphs(s):
        return True
    held, freed = plan_settings(s, keep_cache=True), plan_settings(s, keep_cache=False)
    if estimate_memory(shape, held)["peak_total_bytes"] > budget_bytes:
        return False
    if not micro_batch_auto:
        return True
    return (
        largest_fitting_micro_batch(shape, held, budget_bytes)[0]
        >= largest_fitting_micro_batch(shape, freed, budget_bytes)[0]
    )


def resolve_keep_cache(recipe, device_type: str, budget_gb: float | None = None) -> bool:
    """``generation.keep_cache`` as a bool for a run on ``device_type`` (true / false as written; ``auto``:
    :func:`auto_keep_cache` against ``budget_gb``, else the card's memory, times the process's memory fraction
    where one is set). Only CUDA keeps anything: True elsewhere, and when the model's shape cannot be read."""
    keep = recipe.generation.keep_cache
    if keep != "auto":
        return bool(keep)
    planned = cuda_plan(recipe, budget_gb) if device_type == "cuda" else None
    return True if planned is None else planned[1].keep_cache


def cuda_plan(recipe, budget_gb: float | None = None) -> tuple[ModelShape, PlanSettings, float] | None:
    """``(shape, settings, budget bytes)``: the planner's view of ``recipe`` on a CUDA card of ``budget_gb``
    (else :func:`cuda_budget_gb`), what each ``auto`` of a run is resolved from; None when the model's shape
    cannot be read offline."""
    budget = (cuda_budget_gb() if budget_gb is None else budget_gb) * GB
    try:
        shape = recipe_model_shape(recipe)
    except LorarlError:
        return None
    return shape, recipe_settings(recipe, device_type="cuda", shape=shape, budget_bytes=budget), budget


def cuda_budget_gb() -> float:
    """This process's share of the current CUDA card in GB: its memory x the process's memory fraction
    (:func:`lorarl.model.loading.cuda_budget_bytes`), the budget every ``auto`` of a run is resolved against."""
    import torch

    from lorarl.model.loading import cuda_budget_bytes

    return cuda_budget_bytes(torch.device("cuda", torch.cuda.current_device())) / GB


def resolve_generation_batch(recipe, device_type: str, budget_gb: float | None = None) -> int | None:
    """``generation.batch_size`` as the rows a training rollout decodes (and scores without gradient) at once,
    None for all of the step's rows in one batch. An int is returned as written. ``auto``: None off CUDA (host
    memory is rarely the limit there, and one batch is what every CPU figure measured) or when the model's shape
    cannot be read offline; on CUDA the largest divisor of the step's rows whose generation and scoring phases fit
    ``budget_gb`` (else :func:`cuda_budget_gb`) at the run's micro-batch (``train.micro_batch_size``, or the
    planner's pick for ``auto``), :func:`~lorarl.plan.choice.largest_fitting_generation_batch`; None when that is
    every row. Example (the step bench's PPO row, 24 GB): Llama-3.1-8B with 64 prompts of 128 + 1024 tokens -> 32."""
    g = recipe.generation.batch_size
    if g != "auto":
        return int(g)
    planned = cuda_plan(recipe, budget_gb) if device_type == "cuda" else None
    if planned is None:
        return None
    picked = run_sizes(recipe, *planned)[1]
    return None if picked >= planned[1].rows else picked


def run_sizes(recipe, shape: ModelShape, s: PlanSettings, budget: float) -> tuple[int, int]:
    """``(micro-batch, generation batch)`` a run of ``recipe`` (planned as ``s``) uses against ``budget`` bytes:
    each as written, or for ``auto`` the largest divisor of its rows that fits
    (:func:`~lorarl.plan.choice.largest_fitting_micro_batch`, then
    :func:`~lorarl.plan.choice.largest_fitting_generation_batch` at that micro-batch)."""
    mb, g = recipe.train.micro_batch_size, recipe.generation.batch_size
    micro = int(mb) if mb != "auto" else largest_fitting_micro_batch(shape, s, budget)[0]
    gen = min(int(g), s.rows) if g != "auto" else largest_fitting_generation_batch(shape, s, micro, budget)
    return micro, gen


def _written_settings(recipe, device_type: str, shape: ModelShape | None, budget_bytes: float | None) -> PlanSettings:
    """:func:`recipe_settings` before ``generation.keep_cache`` is resolved."""
    m = recipe.model
    quant = m.quantization
    if quant == "auto":
        from lorarl.model.loading import choose_quantization

        weights = 2 * shape.num_params() if shape is not None else None
        quant = choose_quantization(weights, budget_bytes, device_type)[0]
    if m.dtype == "auto":
        dtype_bytes = 2 if device_type == "cuda" else 4
    else:
        dtype_bytes = 4 if m.dtype == "float32" else 2
    prompt_len = recipe.data.max_prompt_tokens
    if recipe.data.source == "arithmetic":
        prompt_len = min(prompt_len, ARITHMETIC_PROMPT_TOKENS)
    mb = recipe.train.micro_batch_size
    # (rejection sampling, generation only, is planned as a GRPO step of its shape: an upper bound; online DPO as a
    # GRPO step of online_dpo.group_size samples per prompt with the reference pass: sampling, scoring, a reference
    # forward and the policy's forward / backward over the same rows; an upper bound past 2 samples, where only the
    # best and the worst of each prompt are trained on; RLOO as the GRPO step of its memory, rloo_as_grpo)
    algo = recipe.algo if recipe.algo in PLANNED_ALGOS else "grpo"
    g = recipe.generation
    grpo = recipe.grpo if recipe.grpo is not None else GRPOConfig()
    if recipe.algo == "online_dpo":
        grpo = GRPOConfig(group_size=recipe.online_dpo.group_size, kl=GRPOKLConfig(coef=recipe.online_dpo.beta))
    if recipe.algo == "rloo":
        grpo = rloo_as_grpo(recipe.rloo)
    ppo = recipe.ppo if recipe.ppo is not None else PPOConfig()
    if algo in ("dpo", "kto"):
        return dpo_settings(recipe, device_type, quant, dtype_bytes)
    if algo in ("reward_model", "sft"):
        return supervised_settings(recipe, device_type, quant, dtype_bytes)
    settings = PlanSettings(
        algo=algo,
        quantization=quant,
        dtype_bytes=dtype_bytes,
        lora_r=recipe.lora.r,
        lora_targets=recipe.lora.target_modules,
        critic_lora_r=ppo.critic.lora.r,
        critic_lora_targets=ppo.critic.lora.target_modules,
        group_size=grpo.group_size if algo == "grpo" else 1,
        prompts_per_step=recipe.train.prompts_per_step,
        prompt_len=prompt_len,
        max_new_tokens=g.max_new_tokens,
        micro_batch_size=mb if isinstance(mb, int) else 1,
        generation_batch_size=g.batch_size if isinstance(g.batch_size, int) else None,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_chunk_tokens=m.logprob_chunk_tokens,
        gradient_checkpointing=m.gradient_checkpointing,
        kl_coef=grpo.kl.coef if algo == "grpo" else ppo.kl.coef,
        num_iterations=grpo.num_iterations,
        training_entropy=(grpo.entropy_coef if algo == "grpo" else ppo.entropy_coef) > 0,
        reward_model=recipe.reward.source in ("reward_model", "both"),
        minibatch_size=ppo.minibatch_size if algo == "ppo" else None,
        sampling_filters=g.top_p < 1 or g.top_k > 0,
        reference_adapter=bool(m.init_adapter) or (algo == "grpo" and grpo.kl.ref_refresh_every > 0),
        device=device_type,
        engine=g.engine_for(device_type),
        cuda_graphs=g.cuda_graphs,
        eval_batch_size=min(recipe.eval.batch_size, recipe.eval.n) if recipe.eval.every > 0 else 0,
        eval_max_new_tokens=recipe.eval.max_new_tokens,
        **judge_settings(recipe, prompt_len, grpo.group_size if algo == "grpo" else 1),
    )
    return distill_settings(recipe, settings, budget_bytes) if algo == "distill" else settings


def rloo_as_grpo(rloo) -> GRPOConfig:
    """An RLOO step as the planner's GRPO step of the same memory: ``group_size`` samples per prompt, the reference
    pass when ``kl.coef > 0``, the policy's no-grad scoring pass when it records old log-probs (``num_iterations >
    1``, or the KL penalty on: its log-ratio is the sampling policy's, GRPO's ``num_iterations > 1`` term), a
    reference adapter for ``kl.ref_refresh_every``; no entropy bonus. The training forward / backward is GRPO's
    over the same rows (RLOO's loss is per sequence: the same log-probs, another reduction)."""
    records_old = rloo.num_iterations > 1 or rloo.kl.coef > 0
    return GRPOConfig(
        group_size=rloo.group_size,
        num_iterations=max(rloo.num_iterations, 2 if records_old else 1),
        kl=GRPOKLConfig(coef=rloo.kl.coef, ref_refresh_every=rloo.kl.ref_refresh_every),
    )


def dpo_settings(recipe, device_type: str, quant: str, dtype_bytes: int) -> PlanSettings:
    """A DPO recipe (:mod:`lorarl.plan.dpo`): ``dpo.batch_size`` pairs per step, ``train.micro_batch_size`` pairs
    per micro-batch, rows of ``dpo.max_length`` tokens (the longest pair kept) split into a prompt of
    ``min(data.max_prompt_tokens, max_length // 2)`` tokens and the response; the held-out task evaluation
    (``dpo.task_source``) decodes ``eval.max_new_tokens`` (else ``generation.max_new_tokens``). A KTO recipe the same
    from its ``kto`` section, counting rows (one completion each) instead of pairs; its reference pass always runs."""
    if recipe.algo == "kto":
        section = recipe.kto if recipe.kto is not None else KTOConfig()
        reference = True
    else:
        section = recipe.dpo if recipe.dpo is not None else DPOConfig()
        reference = section.needs_reference
    return _fixed_length_settings(
        recipe,
        device_type,
        quant,
        dtype_bytes,
        section=section,
        evaluates=section.task_source is not None and recipe.eval.every > 0,
        reference_adapter=bool(recipe.model.init_adapter),
        max_tokens_per_forward=section.max_tokens_per_forward,
        dpo_reference=reference,
    )


def supervised_settings(recipe, device_type: str, quant: str, dtype_bytes: int) -> PlanSettings:
    """A reward-model or SFT recipe (:mod:`lorarl.plan.supervised`): ``reward_model.batch_size`` pairs /
    ``sft.batch_size`` examples per step, ``train.micro_batch_size`` of them per micro-batch, rows of ``max_length``
    tokens (the longest the loader keeps) split into a prompt of ``min(data.max_prompt_tokens, max_length // 2)``
    tokens and the response; SFT's held-out evaluation (``eval.every``) decodes ``eval.max_new_tokens`` (else
    ``generation.max_new_tokens``), the reward model's scores pairs without generating."""
    algo = recipe.algo
    section = getattr(recipe, algo) or (RewardModelConfig() if algo == "reward_model" else SFTConfig())
    return _fixed_length_settings(
        recipe,
        device_type,
        quant,
        dtype_bytes,
        section=section,
        evaluates=algo == "sft" and recipe.eval.every > 0,
        max_tokens_per_forward=section.max_tokens_per_forward if algo == "reward_model" else 0,
        dpo_reference=False,
    )


def _fixed_length_settings(
    recipe, device_type: str, quant: str, dtype_bytes: int, *, section, evaluates: bool, **extra
) -> PlanSettings:
    """What DPO, the reward model and SFT plan alike: ``section.batch_size`` rows per step of ``section.max_length``
    tokens (a prompt of ``min(data.max_prompt_tokens, max_length // 2)`` and the response), ``train.micro_batch_size``
    per micro-batch, the held-out evaluation's batch when it ``evaluates``; ``extra``: the algorithm's own fields."""
    m, mb = recipe.model, recipe.train.micro_batch_size
    prompt_len = min(recipe.data.max_prompt_tokens, section.max_length // 2)
    return PlanSettings(
        algo=recipe.algo,
        quantization=quant,
        dtype_bytes=dtype_bytes,
        lora_r=recipe.lora.r,
        lora_targets=recipe.lora.target_modules,
        group_size=1,
        prompts_per_step=section.batch_size,
        prompt_len=prompt_len,
        max_new_tokens=section.max_length - prompt_len,
        micro_batch_size=mb if isinstance(mb, int) else 1,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_chunk_tokens=m.logprob_chunk_tokens,
        gradient_checkpointing=m.gradient_checkpointing,
        device=device_type,
        engine=recipe.generation.engine_for(device_type),
        cuda_graphs=recipe.generation.cuda_graphs,
        eval_batch_size=min(recipe.eval.batch_size, recipe.eval.n) if evaluates else 0,
        eval_max_new_tokens=recipe.eval.max_new_tokens or recipe.generation.max_new_tokens,
        **extra,
    )


def recipe_model_shape(recipe, model_config: str | None = None) -> ModelShape:
    """``model_config`` (config.json path, folder, or known name), else the recipe's model: a known name, or the
    ``config.json`` of its local folder. Weights are never read."""
    if model_config:
        return model_shape(model_config)
    name = recipe.model.name
    if known_config(name) is not None:
        return model_shape(name)
    p = Path(name).expanduser()
    if (p / "config.json").is_file() or p.name == "config.json":
        return model_shape(p)
    from lorarl.model.registry import resolve_model

    resolved = Path(resolve_model(name))
    if (resolved / "config.json").is_file():
        return model_shape(resolved)
    raise LorarlError(
        f"plan: cannot find the shape of model {name!r} offline; pass --model-config (a config.json or {', '.join(KNOWN_CONFIGS)})"
    )


def plan_recipe(
    recipe_path: str | os.PathLike,
    budget_gb: float = 24.0,
    model_config: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """``lorarl plan``: predict each phase's peak for the recipe as a run would use it (each ``auto`` of
    ``train.micro_batch_size`` / ``generation.batch_size`` -> the size it resolves to, :func:`run_sizes`), and pick
    micro-batch / generation batch sizes for ``budget_gb``. Prints a table; returns the JSON dict."""
    from lorarl.config import load_recipe

    recipe = load_recipe(recipe_path, overrides or [])
    shape = recipe_model_shape(recipe, model_config)
    s = recipe_settings(recipe, shape=shape, budget_bytes=budget_gb * GB)
    pick = pick_micro_batch(shape, budget_gb, s)
    micro, gen = run_sizes(recipe, shape, s, budget_gb * GB)
    est = estimate_memory(shape, s, micro_batch_size=micro, generation_batch_size=gen)
    result = {
        "recipe": str(recipe_path),
        "model": shape.name,
        "budget_gb": budget_gb,
        "micro_batch_size": recipe.train.micro_batch_size,
        "generation_batch_size": recipe.generation.batch_size,
        "run_sizes": [micro, gen],
        "picked_micro_batch_size": pick["micro_batch_size"],
        "picked_generation_batch_size": pick["generation_batch_size"],
        "fits": est["peak_total_bytes"] <= budget_gb * GB,
        "picked_fits": pick["fits"],
        "phases_gb": {k: round(v / GB, 3) for k, v in est["phases"].items()},
        "peak_gb": round(est["peak_bytes"] / GB, 3),
        "peak_total_gb": round(est["peak_total_bytes"] / GB, 3),
        "peak_phase": est["peak_phase"],
        "breakdown_gb": {p: {k: round(v / GB, 4) for k, v in terms.items()} for p, terms in est["breakdown"].items()},
        "params": est["params"],
        "settings": est["settings"],
        "advice": pick["advice"],
    }
    print(format_plan(result))
    return result


def format_plan(result: dict[str, Any]) -> str:
    """A readable summary of :func:`plan_recipe`'s result."""
    lines = [
        f"plan for {result['recipe']} on {result['model']} (budget {result['budget_gb']:g} GB)",
        f"  micro-batch: {result['micro_batch_size']} as written, {result['picked_micro_batch_size']} picked; "
        + {
            "dpo": "DPO: micro-batches count pairs, no generation",
            "kto": "KTO: micro-batches count rows (one completion each), no generation",
            "reward_model": "reward model: micro-batches count pairs, no generation",
            "sft": "SFT: micro-batches count examples, no generation",
        }.get(
            result["settings"].get("algo"),
            f"generation batch: {result['generation_batch_size']} as written, {result['run_sizes'][1]} of "
            f"{result['settings']['rows']} rows per decode / scoring batch",
        ),
    ]
    for phase, gb in result["phases_gb"].items():
        terms = result["breakdown_gb"].get(phase, {})
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3] if v > 0)
        lines.append(f"  {phase:<11} {gb:8.2f} GB allocated{('  (' + top + ')') if top else ''}")
    persist = ", ".join(f"{k} {v:.2f}" for k, v in result["breakdown_gb"]["persistent"].items())
    lines.append(f"  persistent: {persist}")
    lines.append(decode_engine_line(result))
    lines.append(
        f"  peak: {result['peak_gb']:.2f} GB allocated in {result['peak_phase']}, {result['peak_total_gb']:.2f} GB "
        f"with CUDA context and allocator slack -> {'fits' if result['fits'] else 'DOES NOT FIT'}"
    )
    lines.extend(f"  note: {a}" for a in result["advice"])
    return "\n".join(lines)


def decode_engine_line(result: dict[str, Any]) -> str:
    """The decode engine's own memory: the fast engine's static KV cache and CUDA graph pool (held between
    rollouts with graphs, else only while generating), or hf's growing cache."""
    s = result["settings"]
    if s.get("engine") != "fast":
        return "  decode engine: hf (transformers' generate; its KV cache grows during generation)"
    persistent = result["breakdown_gb"]["persistent"]
    if s.get("algo") in ("dpo", "reward_model", "sft", "kto"):
        ev = persistent.get("eval_static_kv_cache")
        if ev is None:
            return "  decode engine: fast (this step samples nothing; only a held-out task evaluation decodes)"
        return (
            f"  decode engine: fast, CUDA graphs: held-out evaluation's static KV cache {ev:.2f} GB + graph pool "
            f"{persistent['graph_pool']:.2f} GB, held between evaluations (in every phase above)"
        )
    if "static_kv_cache" in persistent:
        cache, pool = persistent["static_kv_cache"], persistent["graph_pool"]
        ev = persistent.get("eval_static_kv_cache")
        ev_text = f" + held-out evaluation's static KV cache {ev:.2f} GB" if ev else ""
        return (
            f"  decode engine: fast, CUDA graphs: static KV cache {cache:.2f} GB{ev_text} + graph pool {pool:.2f} GB, "
            "held between rollouts (in every phase above)"
        )
    gen = result["breakdown_gb"].get("generation", {})
    if s.get("cuda_graphs") and s.get("device") == "cuda":
        return (
            f"  decode engine: fast, CUDA graphs, generation.keep_cache -> false: static KV cache "
            f"{gen.get('static_kv_cache', 0.0):.2f} GB while generating, freed after each rollout (captured again)"
        )
    return (
        f"  decode engine: fast, no graphs: static KV cache {gen.get('static_kv_cache', 0.0):.2f} GB "
        "allocated while generating"
    )


def resolve_micro_batch(recipe, device_type: str | None = None, budget_gb: float | None = None) -> int:
    """``train.micro_batch_size`` as an int. An int is returned as is. ``auto``:

    * on CUDA: :func:`pick_micro_batch` with the budget ``budget_gb`` or else :func:`cuda_budget_gb` (the card x
      the process's memory fraction, as ``model.quantization`` and ``generation.keep_cache`` read it);
    * on CPU: ``min(CPU_DEFAULT_MICRO_BATCH, rows the micro-batches split)`` - host memory is rarely the limit
      at the sizes a CPU can train, and 8 rows keep each forward's activations small.
    """
    mb = recipe.train.micro_batch_size
    if mb != "auto":
        return int(mb)
    if device_type is None:
        from lorarl.model.loading import pick_device

        device_type = pick_device(recipe.model.device).type
    if device_type != "cuda":
        return max(1, min(CPU_DEFAULT_MICRO_BATCH, recipe_settings(recipe, device_type=device_type).split_rows))
    if budget_gb is None:
        budget_gb = cuda_budget_gb()
    shape = recipe_model_shape(recipe)
    s = recipe_settings(recipe, device_type="cuda", shape=shape, budget_bytes=budget_gb * GB)
    return int(pick_micro_batch(shape, budget_gb, s)["micro_batch_size"])
