"""The generation phase under the fast decode engine (``generation.engine: fast``, :mod:`lorarl.rollout.fast`).

The engine allocates a **static KV cache** of ``B x Lc`` columns before decoding (``Lc`` =
:func:`~lorarl.plan.terms.static_cache_columns`: ``P + C`` rounded up to 64 with CUDA graphs) and runs one decode
step at a time. With CUDA graphs (``generation.cuda_graphs``, CUDA only) the step is captured once and replayed;
everything it allocates lives in the **graph pool** (:func:`~lorarl.plan.terms.decode_step_bytes`), and the cache
and the pool are **kept between rollouts** (capture then pays off), so both are persistent terms, held in every
phase. Without graphs both exist only during generation.

Generation moments (``m`` distinct prompts of the call, each prefilled once; ``B`` generation rows):

* ``prefill``: the prompts' cache ``m P kv`` + one layer's forward over ``m P`` tokens + their last-position
  logits (+ the static cache when it is not persistent);
* ``cache_copy``: the prompts' cache + one layer's keys / values indexed out to the ``B`` rows, ``B P kv / L``;
* ``decode``: the output buffers ``12 B C`` (+ the static cache and one step's allocations when not persistent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.plan.shapes import ModelShape
from lorarl.plan.terms import (
    GRAPH_BUCKET,
    decode_output_bytes,
    decode_step_bytes,
    layer_forward_bytes,
    prefill_logits_bytes,
    static_cache_columns,
    static_kv_cache_bytes,
)

if TYPE_CHECKING:
    from lorarl.plan.estimate import Moments, PlanSettings, StepSizes


def uses_graphs(s: PlanSettings) -> bool:
    """The fast engine captures its decode step (CUDA and ``cuda_graphs``)."""
    return s.engine == "fast" and s.cuda_graphs and s.device == "cuda"


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


def fast_persistent_terms(shape: ModelShape, s: PlanSettings, z: StepSizes) -> dict[str, float]:
    """The static cache and the graph pool when they are kept between rollouts (CUDA graphs), else nothing."""
    return fast_static_terms(shape, s, z) if uses_graphs(s) else {}


def fast_generation_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The generation phase's moments under the fast engine (see the module doc)."""
    b, P, kv = z.generation_rows, z.prompt_len, z.kv_per_token
    m = distinct_prompts(s, b)
    static = fast_static_terms(shape, s, z)
    held = {} if uses_graphs(s) else {"static_kv_cache": static["static_kv_cache"]}
    step = {} if uses_graphs(s) else {"decode_step": static["graph_pool"]}
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
