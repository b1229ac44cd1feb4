"""Rollouts: sample completions with one role of the shared base and record what the update needs."""

from lorarl.model.logprobs import PACK_TOKENS  # noqa: F401  (the planner models the packs' size)
from lorarl.rollout.engines import Engine, HFEngine, Sampled, prefill_cache
from lorarl.rollout.generate import generate_rollout, sequence_logprobs
from lorarl.rollout.registry import ENGINES, make_engine
from lorarl.rollout.types import Rollout

__all__ = [
    "ENGINES",
    "Engine",
    "HFEngine",
    "Rollout",
    "Sampled",
    "generate_rollout",
    "make_engine",
    "prefill_cache",
    "sequence_logprobs",
]
