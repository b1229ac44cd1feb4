"""The generation phase under the fast decode engine (``generation.engine: fast``, :mod:`lorarl.rollout.fast`).

The engine allocates a **static KV cache** of ``B x Lc`` columns before decoding (``Lc`` =
:func:`~lorarl.plan.terms.static_cache_columns`: ``P + C`` rounded up to 64 with CUDA graphs) and runs one decode
step at a time. With CUDA graphs (``generation.cuda_graphs``, CUDA only) the step is captured once and replayed;
everything it allocates lives in the **graph pool** (:func:`~lorarl.plan.terms.decode_step_bytes`), and the cache
and the pool are **kept between rollouts** (capture then pays off), so both are persistent terms, held in every
phase. Without graphs, or with ``generation.keep_cache`` false (resolved: :func:`keeps_between_rollouts`; the engine
frees them after each rollout), both exist only during generation. Two decode states are kept (the training rollout's and
the held-out evaluation's, :func:`eval_state_size`): with an evaluation between steps its static cache is held too.

Generation moments (``m`` distinct prompts of the call, each prefilled once; ``B`` generation rows):

* ``prefill``: the prompts' cache ``m P kv`` + one layer's forward over ``m P`` tokens + their last-position
  logits (+ the static cache when it is not persistent);
* ``cache_copy``: the prompts' cache + one layer's keys / values indexed out to the ``B`` rows, ``B P kv / L``;
* ``decode``: the output buffers ``12 B C`` (+ the static cache and one step's allocations when not persistent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.plan.terms import (
    GRAPH_BUCKET,
    decode_output_bytes,
    decode_step_bytes,
    layer_forward_bytes,
    prefill_logits_bytes,
    static_cache_columns,
    static_kv_cache_bytes,
)
from lorarl.shapes import ModelShape

NO_ROLLOUTS = ("dpo", "reward_model", "sft", "kto")  # steps that sample nothing (their evaluation may decode)

if TYPE_CHECKING:
    from lorarl.plan.settings import Moments, PlanSettings, StepSizes


def uses_graphs(s: PlanSettings) -> bool:
    """The fast engine captures its decode step (CUDA and ``cuda_graphs``)."""
    return s.engine == "fast" and s.cuda_graphs and s.device == "cuda"


def keeps_between_rollouts(s: PlanSettings) -> bool:
    """The static cache and graph pool outlive each rollout: captured steps and ``keep_cache``."""
    return uses_graphs(s) and s.keep_cache


def distinct_prompts(s: PlanSettings, rows: int) -> int:
    """Distinct prompts in a generation call of ``rows`` rows, at most: ``ceil(rows / G)``, one more when ``rows``
    is not a multiple of ``G`` (a call may then start inside a group), never more than the rows (GRPO; PPO: every
    row its own prompt).

    >>> distinct_prompts(PlanSettings(group_size=8, prompts_per_step=2), 16), distinct_prompts(PlanSettings(), 12)
    (2, 3)
    """
    if s.algo != "grpo" or s.group_size <= 1:
        return rows
    return min(rows, -(-rows // s.group_size) + (1 if rows % s.group_size else 0))


def fast_static_terms(shape: ModelShape, s: PlanSettings, z: StepSizes) -> dict[str, float]:
    """``{"static_kv_cache", "graph_pool"}`` of the fast engine for the step's generation rows."""
    cols = static_cache_columns(z.prompt_len, z.new_tokens, GRAPH_BUCKET if uses_graphs(s) else 1)
    return {
        "static_kv_cache": static_kv_cache_bytes(shape, z.generation_rows, cols, z.dt),
        "graph_pool": decode_step_bytes(shape, z.generation_rows, z.dt, z.dequantized),
    }


def eval_state_size(s: PlanSettings, z: StepSizes) -> tuple[int, int] | None:
    """``(rows, columns)`` of the held-out evaluation's decode state when it is kept beside the training one:
    CUDA graphs on, an evaluation between steps (``eval_batch_size`` rows > 0, ``C_e`` = ``eval_max_new_tokens``
    or ``C``), and a batch the training state cannot take (the engine reuses a kept state only for the same rows
    and at most its columns and new tokens, :meth:`lorarl.rollout.fast.state.DecodeState.fits`); else None.
    ``columns = ceil((P + C_e) / 64) x 64``.

    >>> z = step_sizes(model_shape("llama-3.1-8b"), PlanSettings(prompts_per_step=2))  # 16 rows, P = C = 256
    >>> s = PlanSettings(engine="fast", eval_batch_size=32, eval_max_new_tokens=100)
    >>> eval_state_size(s, z), eval_state_size(plan_settings(s, eval_batch_size=16), z)
    ((32, 384), None)
    """
    if not keeps_between_rollouts(s) or s.eval_batch_size <= 0:
        return None
    new_tokens = s.eval_max_new_tokens or z.new_tokens
    cols = static_cache_columns(z.prompt_len, new_tokens, GRAPH_BUCKET)
    if s.algo in NO_ROLLOUTS:  # the evaluation's is the only decode state
        return s.eval_batch_size, cols
    train_cols = static_cache_columns(z.prompt_len, z.new_tokens, GRAPH_BUCKET)
    if s.eval_batch_size == z.generation_rows and cols <= train_cols and new_tokens <= z.new_tokens:
        return None
    return s.eval_batch_size, cols


def fast_persistent_terms(shape: ModelShape, s: PlanSettings, z: StepSizes) -> dict[str, float]:
    """The static cache and the graph pool when they are kept between rollouts (CUDA graphs), else nothing.

    The engine keeps two decode states (:data:`lorarl.rollout.fast.graphs.KEEP_STATES`): with an evaluation
    between steps (:func:`eval_state_size`) its own static cache ``B_e x columns x kv`` is held too
    (``eval_static_kv_cache``), and the graph pool, shared by both states' captured steps (one pool handle; a
    capture reuses the blocks an earlier one freed), is the larger of their decode steps."""
    if not keeps_between_rollouts(s):
        return {}
    terms = fast_static_terms(shape, s, z) if s.algo not in NO_ROLLOUTS else {"graph_pool": 0}
    size = eval_state_size(s, z)
    if size is not None:
        rows, cols = size
        terms["eval_static_kv_cache"] = static_kv_cache_bytes(shape, rows, cols, z.dt)
        terms["graph_pool"] = max(terms["graph_pool"], decode_step_bytes(shape, rows, z.dt, z.dequantized))
    return terms if terms["graph_pool"] else {}


def fast_generation_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The generation phase's moments under the fast engine (see the module doc)."""
    b, P, kv = z.generation_rows, z.prompt_len, z.kv_per_token
    m = distinct_prompts(s, b)
    static = fast_static_terms(shape, s, z)
    held = {} if keeps_between_rollouts(s) else {"static_kv_cache": static["static_kv_cache"]}
    step = {} if keeps_between_rollouts(s) else {"decode_step": static["graph_pool"]}
    return {
        "prefill": {
            **held,
            "prompt_cache": m * P * kv,
            "layer_forward": layer_forward_bytes(shape, z.dt, m * P, True, z.dequantized),
            "last_position_logits": prefill_logits_bytes(shape, m, z.dt),
        },
        "cache_copy": {**held, "prompt_cache": m * P * kv, "cache_copy": b * P * kv / shape.num_hidden_layers},
        "decode": {**held, **step, "outputs": decode_output_bytes(b, z.new_tokens)},
    }
