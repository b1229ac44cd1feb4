"""Reward functions: built-in rule rewards, a name -> function registry, and isolated, weighted scoring.

A reward function has TRL's signature, so TRL reward functions drop in::

    fn(prompts, completions, **kwargs) -> list[float | None]

``prompts`` and ``completions`` are lists of strings, or of chat-message lists for conversational data (a
completion is then ``[{"role": "assistant", "content": text}]``). Every extra dataset column is passed by name
(``answer=[...]``), plus ``completion_ids`` (token ids per completion) and what TRL's GRPOTrainer passes besides:
``trainer_state``, ``log_metric``, ``log_extra`` and, with an environment, ``environments``
(:mod:`lorarl.rewards.call_args`). ``None`` means "does not apply to this completion": the value is left out, like
TRL does.

Recipes name a function by built-in name (``numeric_match``, ``math_match``, ``format``, ``partial_credit``,
``length_penalty``, ``code_tests``) or
as ``module:function`` (``my_rewards:score``, or ``path/to/file.py:score``); ``kwargs`` in the recipe are bound to it.

:class:`RewardScorer` calls each function once per batch and isolates failures: an exception or a timeout turns that
function's column into NaN (a missing value, left out of the group statistics), is counted, and the step goes on;
:mod:`lorarl.rewards.failures` decides when failures stop the run.
``async def`` functions run concurrently (:mod:`lorarl.rewards.concurrent`); ``name: remote`` POSTs the batch to an
HTTP server (:mod:`lorarl.rewards.remote`); ``name: judge`` asks an LLM judge on the shared base
(:mod:`lorarl.rewards.judge`). docs/rewards.md has the wire format and the judge's prompts.
"""

from lorarl.core.messages import completion_text
from lorarl.rewards.answers import extract_answer, is_correct, parse_number
from lorarl.rewards.builtins import (
    BUILTIN_REWARDS,
    RewardFn,
    format_reward,
    length_penalty,
    math_match,
    numeric_match,
    partial_credit,
)
from lorarl.rewards.registry import load_reward_fn
from lorarl.rewards.scorer import RewardScorer, RewardScores, RewardTimeout, call_with_timeout, trl_completions

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardScorer",
    "RewardScores",
    "RewardTimeout",
    "call_with_timeout",
    "completion_text",
    "extract_answer",
    "format_reward",
    "is_correct",
    "length_penalty",
    "load_reward_fn",
    "math_match",
    "numeric_match",
    "parse_number",
    "partial_credit",
    "trl_completions",
]
