"""Rollouts: sample completions with one role of the shared base and record what the update needs."""

from lorarl.model.logprobs import PACK_TOKENS  # noqa: F401  (the planner models the packs' size)
from lorarl.rollout.generate import generate_rollout, prefill_cache, sequence_logprobs
from lorarl.rollout.types import Rollout

__all__ = ["Rollout", "generate_rollout", "prefill_cache", "sequence_logprobs"]
