"""An LLM-judge reward in the plan (``reward.functions: [{name: judge, ...}]``, :mod:`lorarl.rewards.judge`).

Persistent terms:

* ``judge.model: base`` -- nothing: the judge is the shared base with adapters disabled;
* ``judge.model: adapter`` -- a frozen LoRA adapter, counted like the frozen reward adapter: sized like the
  policy's, ``4`` bytes per parameter (``lora_judge_frozen``);
* ``judge.model: folder`` -- a second base model, loaded once with the base's quantization and dtype: its weights
  by :func:`lorarl.plan.terms.base_weight_bytes` on its own shape (``judge_base_*``).

The **judging** phase (greedy ``generate`` of the judge prompts, ``Bj = judge.batch_size`` prompts per call, each
``Tj`` tokens long with its answer), at the end of decoding: the judge's KV cache ``Bj Tj kv_j`` + one layer's
concatenation copy ``Bj Tj kv_j / L_j`` + the sampling logits ``Bj V_j (dt + 12)``. ``Tj`` is estimated from the
recipe: the rubric (``chars / 3`` tokens) + the answer-format line (48 tokens) + the prompt (``P``) + the
completions it shows (``C`` pointwise, ``G C`` plus 8 tokens of markup each for a group) + the answer
(``judge.max_new_tokens``).
"""

from __future__ import annotations

from typing import Any

from lorarl.plan.terms import frozen_model_terms, kv_bytes_per_token, sampling_logits_bytes
from lorarl.shapes import ModelShape, model_shape

FORMAT_TOKENS = 48  # the answer-format line lorarl.rewards.judge_prompts appends
MARKUP_TOKENS = 8  # <response id="i"> ... </response> around each completion of a group
RUBRIC_CHARS_PER_TOKEN = 3


def judge_settings(recipe, prompt_len: int, group_size: int) -> dict[str, Any]:
    """The planner's judge fields of a recipe (``judge``, ``judge_model``, ``judge_rows``, ``judge_tokens``): its
    first ``judge`` reward entry, or ``judge: none``."""
    specs = [s for s in recipe.reward.functions if s.name == "judge" and s.judge is not None]
    if recipe.reward.source == "reward_model" or not specs:
        return {"judge": "none"}
    from lorarl.rewards.judge_prompts import DEFAULT_RUBRICS, default_answer_tokens

    cfg = specs[0].judge
    C = recipe.generation.max_new_tokens
    shown = C if cfg.mode == "pointwise" else group_size * (C + MARKUP_TOKENS)
    answer = cfg.max_new_tokens or default_answer_tokens(cfg.mode, group_size)
    rubric = cfg.rubric or DEFAULT_RUBRICS[cfg.mode]
    tokens = len(rubric) // RUBRIC_CHARS_PER_TOKEN + FORMAT_TOKENS + prompt_len + shown + answer
    return {
        "judge": cfg.model,
        "judge_model": cfg.path if cfg.model == "folder" else None,
        "judge_rows": cfg.batch_size,
        "judge_tokens": tokens,
    }


def _judge_shape(shape: ModelShape, s) -> ModelShape:
    return model_shape(s.judge_model) if s.judge == "folder" else shape


def judge_persistent_terms(shape: ModelShape, s, n_policy: int, dtype_bytes: int) -> dict[str, float]:
    """What the judge holds in every phase (module docstring)."""
    kind = {"adapter": "adapter", "folder": "model"}.get(s.judge, "none")
    judge = _judge_shape(shape, s) if kind == "model" else shape
    return frozen_model_terms("judge", kind, judge, s.quantization, dtype_bytes, s.double_quant, n_policy)


def judging_moments(shape: ModelShape, s, dtype_bytes: int) -> dict[str, dict[str, float]]:
    """The judging phase's moment (module docstring); none without a judge."""
    if s.judge == "none":
        return {}
    j = _judge_shape(shape, s)
    kv = s.judge_rows * s.judge_tokens * kv_bytes_per_token(j, dtype_bytes)
    return {
        "judge_decode_end": {
            "judge_kv_cache": kv,
            "judge_kv_cache_growth": kv / j.num_hidden_layers,
            "judge_sampling_logits": sampling_logits_bytes(j, s.judge_rows, dtype_bytes),
        }
    }
