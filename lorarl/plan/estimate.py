"""The estimate: the peak allocated memory of each phase of one step, term by term.

A phase's peak is the largest of its *moments* (terms alive at the same time); each phase adds its peak moment's
terms to the persistent ones. One function per phase returns that phase's moments (:func:`generation_moments`,
:func:`scoring_moments`, :func:`training_moments`, :func:`critic_training_moments`, :func:`optimizer_moments`);
:func:`persistent_terms` returns what every phase holds; :func:`estimate_memory` composes them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lorarl.errors import LorarlError
from lorarl.plan.distill import distill_training_moments, teacher_persistent_terms
from lorarl.plan.engine import fast_generation_moments, fast_persistent_terms
from lorarl.plan.judge import judge_persistent_terms, judging_moments
from lorarl.plan.settings import (
    PLANNED_ALGOS,
    PREFERENCE_STEPS,
    Moment,
    Moments,
    PlanSettings,
    StepSizes,
    plan_settings,
    step_sizes,
)
from lorarl.plan.supervised import SUPERVISED, supervised_training_moments
from lorarl.plan.terms import (
    CUBLAS_WORKSPACE_BYTES,
    base_weight_bytes,
    checkpoint_bytes,
    final_hidden_bytes,
    head_params,
    layer_forward_bytes,
    loss_terms_bytes,
    packed_layout,
    prefill_logits_bytes,
    sampling_logits_bytes,
    scoring_logits_bytes,
    total_bytes,
    train_logits_bytes,
    value_head_input_bytes,
)
from lorarl.shapes import ModelShape


# ---- persistent -----------------------------------------------------------------------------------------------
def persistent_terms(shape: ModelShape, s: PlanSettings, z: StepSizes) -> dict[str, float]:
    """What every phase holds: base weights, the adapters (fp32: ``4`` bytes per parameter; PPO's critic and
    value head, the frozen reward adapter + score head, a frozen reference adapter), the AdamW states of the
    trainable parameters (``8`` bytes each) and the cuBLAS workspace (CUDA only)."""
    persistent: dict[str, float] = dict(base_weight_bytes(shape, s.quantization, z.dt, s.double_quant))
    persistent["lora_reward_and_head" if s.algo == "reward_model" else "lora_policy"] = 4 * z.n_policy
    if s.algo == "ppo":
        persistent["lora_critic_and_head"] = 4 * z.n_critic
        if s.reward_model:
            persistent["lora_reward_and_head_frozen"] = 4 * (z.n_policy + head_params(shape))
    if s.reference_adapter and (s.kl_coef > 0 or (s.algo in PREFERENCE_STEPS and s.dpo_reference)):
        persistent["lora_reference_frozen"] = 4 * z.n_policy
    persistent["adam_states"] = 8 * (z.n_policy + z.n_critic)
    persistent["cublas_workspace"] = CUBLAS_WORKSPACE_BYTES if s.device == "cuda" else 0
    persistent.update(fast_persistent_terms(shape, s, z))
    persistent.update(judge_persistent_terms(shape, s, z.n_policy, z.dt))
    persistent.update(teacher_persistent_terms(shape, s, z.n_policy, z.dt))
    return persistent


# ---- generation -----------------------------------------------------------------------------------------------
def _shares_prompts(s: PlanSettings) -> bool:
    """GRPO groups (``group_size > 1``) whose completions share their prompt's forward (lorarl.rollout)."""
    return s.share_prompts and s.algo == "grpo" and s.group_size > 1


def _prefill_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The prefill: the prompts' KV cache ``B P kv`` + one layer's forward over ``B P`` tokens + the last
    position's logits. With shared prompts (one generate call) each distinct prompt (``m`` of them) is prefilled
    once and its cache then copied to the ``B`` rows that share it (``(m + B) P kv`` during the copy)."""
    P, kv = z.prompt_len, z.kv_per_token
    if _shares_prompts(s) and s.generation_batch_size is None:
        m = s.prompts_per_step
        return {
            "prefill": {
                "kv_cache": m * P * kv,
                "layer_forward": layer_forward_bytes(shape, z.dt, m * P, True, z.dequantized),
            },
            "cache_copy": {"kv_cache": (m + z.generation_rows) * P * kv},
        }
    b = z.generation_rows
    return {
        "prefill": {
            "kv_cache": b * P * kv,
            "layer_forward": layer_forward_bytes(shape, z.dt, b * P, True, z.dequantized),
            "last_position_logits": prefill_logits_bytes(shape, b, z.dt),
        }
    }


def _decode_end_moment(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moment:
    """The end of decoding: the full KV cache ``B (T - 1) kv`` + one layer's concatenation copy
    ``B (T - 1) kv / L`` + a dequantized projection + the sampling logits."""
    kv_cache = z.generation_rows * (z.seq_len - 1) * z.kv_per_token
    return {
        "kv_cache": kv_cache,
        "kv_cache_growth": kv_cache / shape.num_hidden_layers,  # one layer's concatenation copy
        "dequantized_weight": z.dequantized,
        "sampling_logits": sampling_logits_bytes(shape, z.generation_rows, z.dt, s.sampling_filters),
    }


def generation_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """Generation (``B`` = generation rows per ``generate`` call): the prefill of the prompts (and, with shared
    prompts, the copy of their caches) or the end of decoding with the full KV cache. Under the fast engine:
    :func:`lorarl.plan.engine.fast_generation_moments`."""
    if s.engine == "fast":
        return fast_generation_moments(shape, s, z)
    return {**_prefill_moments(shape, s, z), "decode_end": _decode_end_moment(shape, s, z)}


# ---- scoring --------------------------------------------------------------------------------------------------
def scoring_runs(s: PlanSettings) -> bool:
    """Whether no-grad scoring forwards run: PPO (old / reference log-probs, values, reward scores); GRPO's
    reference log-probs when ``kl_coef > 0``, old log-probs when ``num_iterations > 1``."""
    return s.algo == "ppo" or s.kl_coef > 0 or s.num_iterations > 1


def scoring_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """Scoring (no-grad forwards over the rollout, ``B`` = scoring rows; none when it does not run): hidden states
    ``2 tokens H dt`` + one layer's forward (with or without an active adapter) + the 4-D attention mask
    ``B T^2``; or the hidden states + one chunk of logits. With shared prompts the prompts' caches are kept
    (``B P kv``) and the forward runs over the completions only (``tokens = B C``, else ``B T``)."""
    if not scoring_runs(s):
        return {}
    lora = s.algo == "ppo" or s.num_iterations > 1 or s.reference_adapter
    share = _shares_prompts(s)
    b, T = z.scoring_rows, z.seq_len
    tok = b * (z.new_tokens if share else T)  # positions the full forward runs over
    held = {
        "prompt_cache": b * z.prompt_len * z.kv_per_token if share else 0,
        "hidden_states": 2 * tok * shape.hidden_size * z.dt,
    }
    return {
        "layer": {
            **held,
            "layer_forward": layer_forward_bytes(shape, z.dt, tok, lora, z.dequantized),
            "attention_mask": b * T * T,
        },
        "logits": {**held, "logits_chunk": scoring_logits_bytes(shape, b, z.chunk(b), z.dt)},
    }


# ---- training -------------------------------------------------------------------------------------------------
def training_tokens(s: PlanSettings, z: StepSizes) -> tuple[int, int]:
    """``(tokens, attention mask bytes)`` of one training micro-batch: ``B T`` tokens and a mask of ``3 B T^2``;
    packed GRPO (under checkpointing, :func:`lorarl.plan.terms.packed_layout`): ``packs x pack length`` tokens and
    a 4-D additive mask of ``packs x length^2`` in the compute dtype (+ the bool it is built from)."""
    mb, T = z.micro_batch, z.seq_len
    if not (s.packed_training and _shares_prompts(s) and s.gradient_checkpointing):
        return mb * T, 3 * mb * T * T
    from lorarl.rollout import PACK_TOKENS

    n_packs, pack_len = packed_layout(s.group_size, mb, z.prompt_len, z.new_tokens, PACK_TOKENS)
    return n_packs * pack_len, n_packs * pack_len * pack_len * (z.dt + 1)


def _kept_terms(shape: ModelShape, s: PlanSettings, z: StepSizes, n_trainable: int, tok: int) -> Moment:
    """What a training step keeps through its backward: the fp32 LoRA gradients ``4 n`` and the checkpoints
    ``L tokens H dt`` (without checkpointing every layer's saved activations, ``L tokens x per-layer bytes``)."""
    if s.gradient_checkpointing:
        return {"lora_grads": 4 * n_trainable, "checkpoints": checkpoint_bytes(shape, tok, z.dt)}
    return {"lora_grads": 4 * n_trainable, "saved_activations": shape.num_hidden_layers * tok * z.per_layer}


def _layer_recompute_moment(s: PlanSettings, z: StepSizes, kept: Moment, tok: int, attention_mask: int) -> Moment:
    """One layer recomputed with its backward (checkpointing): ``tokens x`` :func:`layer_train_bytes_per_token`
    + a dequantized projection + the attention mask, on top of what the step keeps."""
    return {
        **kept,
        "layer_recompute": tok * z.per_layer if s.gradient_checkpointing else 0,
        "dequantized_weight": z.dequantized,
        "attention_mask": attention_mask,
    }


def training_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """Training (``B`` = micro-batch): LoRA gradients + checkpoints + either a chunk of logits recomputed in
    backward with the last hidden state, its norm and the loss's per-token terms, or one layer recomputed."""
    tok, attention_mask = training_tokens(s, z)
    kept = _kept_terms(shape, s, z, z.n_policy, tok)
    mb = z.micro_batch
    return {
        "logits": {
            **kept,
            "final_hidden": final_hidden_bytes(shape, tok, z.dt),
            "logits_chunk": train_logits_bytes(shape, mb, z.chunk(mb), z.dt, s.training_entropy),
            "loss_terms": loss_terms_bytes(mb, z.new_tokens),
        },
        "layer": _layer_recompute_moment(s, z, kept, tok, attention_mask),
    }


def critic_training_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """PPO's critic takes its own optimizer step after the policy's: the training phase's moments without the
    logits, plus fp32 hidden states for the value head (``4 B C H``). None for GRPO."""
    if s.algo != "ppo":
        return {}
    tok, attention_mask = training_tokens(s, z)
    kept = _kept_terms(shape, s, z, z.n_critic, tok)
    value_head = final_hidden_bytes(shape, tok, z.dt) + value_head_input_bytes(shape, z.micro_batch, z.new_tokens)
    return {
        "layer": _layer_recompute_moment(s, z, kept, tok, attention_mask),
        "value_head": {**kept, "final_hidden": value_head},
    }


def optimizer_moments(z: StepSizes) -> Moments:
    """The policy's optimizer step: LoRA gradients + a foreach AdamW temporary (4 bytes per parameter each)."""
    return {"step": {"lora_grads": 4 * z.n_policy, "adam_temporary": 4 * z.n_policy}}


# ---- composition ----------------------------------------------------------------------------------------------
def peak_moment(moments: Moments) -> tuple[str, Moment]:
    """The moment of a phase with the most bytes alive, and its terms."""
    name = max(moments, key=lambda k: sum(moments[k].values()))
    return name, moments[name]


def phase_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> dict[str, Moments]:
    """Every phase's moments in the order a step runs them (``critic_training`` for PPO only; DPO:
    ``reference``, ``training``, ``optimizer``, :mod:`lorarl.plan.dpo`, and KTO the same; the reward model and SFT: ``training``,
    ``optimizer``, :mod:`lorarl.plan.supervised`)."""
    if s.algo in SUPERVISED:
        return {"training": supervised_training_moments(shape, s, z), "optimizer": optimizer_moments(z)}
    if s.algo in PREFERENCE_STEPS:
        from lorarl.plan.dpo import dpo_reference_moments, dpo_training_moments

        return {
            "reference": dpo_reference_moments(shape, s, z),
            "training": dpo_training_moments(shape, s, z),
            "optimizer": optimizer_moments(z),
        }
    phases = {
        "generation": generation_moments(shape, s, z),
        "scoring": scoring_moments(shape, s, z),
        "training": distill_training_moments(shape, s, z) if s.algo == "distill" else training_moments(shape, s, z),
    }
    if s.algo == "ppo":
        phases["critic_training"] = critic_training_moments(shape, s, z)
    phases["optimizer"] = optimizer_moments(z)
    if s.judge != "none":
        phases["judging"] = judging_moments(shape, s, z.dt)
    return phases


def phase_peaks(
    persistent: dict[str, float], moments_by_phase: dict[str, Moments]
) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, str]]:
    """``(phases, breakdown, moments)``: each phase's bytes (persistent + its peak moment's terms), the terms of
    its peak (``breakdown["persistent"]`` first) and the peak moment's name (``"not run"``: no moments)."""
    base = sum(persistent.values())
    phases: dict[str, int] = {}
    breakdown = {"persistent": {k: int(v) for k, v in persistent.items()}}
    moments: dict[str, str] = {}
    for phase, ms in moments_by_phase.items():
        if not ms:
            phases[phase] = int(base)
            breakdown[phase] = {}
            moments[phase] = "not run"
            continue
        name, terms = peak_moment(ms)
        phases[phase] = int(base + sum(terms.values()))
        breakdown[phase] = {k: int(v) for k, v in terms.items()}
        moments[phase] = name
    return phases, breakdown, moments


def estimate_memory(shape: ModelShape, settings: PlanSettings | None = None, **overrides: Any) -> dict[str, Any]:
    """Predict the peak allocated memory of each phase of one step (bytes), with a term-by-term breakdown.

    ``settings`` (or keyword overrides of :class:`PlanSettings`) describe the step. A phase's peak is the largest
    of its *moments* (terms alive at the same time): generation = max(prefill, end of decoding); scoring and
    training = max(inside a decoder layer, computing a chunk of logits). Returns::

        {"phases": {phase: bytes}, "breakdown": {"persistent": {...}, phase: {...terms at its peak}},
         "moments": {phase: name of the peak moment}, "peak_bytes", "peak_phase",
         "peak_total_bytes" (with runtime overhead and allocator slack), "params": {...}, "settings": {...}}

    A phase's bytes are the persistent terms plus that phase's terms at its peak moment.
    """
    s = plan_settings(settings, **overrides)
    if s.algo not in PLANNED_ALGOS:
        raise LorarlError(f"plan: algo must be one of {', '.join(PLANNED_ALGOS)}, got {s.algo!r}")
    z = step_sizes(shape, s)
    phases, breakdown, moments = phase_peaks(persistent_terms(shape, s, z), phase_moments(shape, s, z))
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    return {
        "model": shape.name,
        "phases": phases,
        "breakdown": breakdown,
        "moments": moments,
        "peak_bytes": peak,
        "peak_phase": peak_phase,
        "peak_total_bytes": total_bytes(peak),
        "params": {
            "base": shape.num_params(),
            "lora_policy": z.n_policy,
            "trainable": z.n_policy + z.n_critic,
            "layer_train_bytes_per_token": int(z.per_layer),
        },
        "settings": asdict(s)
        | {
            "rows": z.rows,
            "generation_rows": z.generation_rows,
            "scoring_rows": z.scoring_rows,
            "micro_batch": z.micro_batch,
        },
    }
