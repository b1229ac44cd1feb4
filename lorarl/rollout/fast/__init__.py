"""The fast decode engine (``generation.engine: fast``): a static KV cache, the model's own decode step captured
once and replayed on CUDA (eager on CPU), tokens drawn on the device, the live LoRA adapter applied unmerged.

* :mod:`lorarl.rollout.fast.sampling`: token selection, pure functions (exact rewrites of ``generate``'s);
* :mod:`lorarl.rollout.fast.state`: the static cache, its buffers and the decode step;
* :mod:`lorarl.rollout.fast.graphs`: CUDA-graph capture and what a captured step depends on;
* :mod:`lorarl.rollout.fast.engine`: :class:`FastEngine`, the :class:`~lorarl.rollout.engines.Engine` itself.

See ``docs/rollout_engine.md``.
"""

from lorarl.rollout.fast.engine import FastEngine, unsupported_reason
from lorarl.rollout.fast.graphs import adapter_key, engine_metrics, release
from lorarl.rollout.fast.sampling import SamplerSettings, cache_length, select_tokens

__all__ = [
    "FastEngine",
    "SamplerSettings",
    "adapter_key",
    "cache_length",
    "engine_metrics",
    "release",
    "select_tokens",
    "unsupported_reason",
]
