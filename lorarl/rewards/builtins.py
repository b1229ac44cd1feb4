"""Built-in rule rewards, with TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lorarl.core.messages import completion_text
from lorarl.rewards.answers import MATH_ITEM_TIMEOUT_S, has_r1_format, is_correct, math_equivalent

RewardFn = Callable[..., list]


def _need(column: Any, name: str, fn: str) -> Sequence:
    if column is None:
        raise ValueError(f"reward {fn} needs a dataset column {name!r}")
    return column


def numeric_match(prompts: list, completions: list, answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 when the final answer (the last number, or the content of ``<answer>...</answer>``) equals the
    ``answer`` column, else 0.0; None for rows whose answer is None."""
    answer = _need(answer, "answer", "numeric_match")
    return [None if a is None else float(is_correct(c, a)) for c, a in zip(completions, answer)]


def math_match(
    prompts: list,
    completions: list,
    answer: list | None = None,
    item_timeout_s: float = MATH_ITEM_TIMEOUT_S,
    **kwargs,
) -> list[float | None]:
    """1.0 when the final answer (inside ``<answer>...</answer>`` if there is one, ``\\boxed{}`` first) is
    mathematically equal to the ``answer`` column by math-verify (LaTeX, fractions, decimals, units:
    :func:`lorarl.rewards.answers.math_equivalent`), else 0.0; None for rows whose answer is None or unparseable.
    Each parse and comparison runs under ``item_timeout_s`` (math-verify's timer), inside the reward's own
    ``reward.timeout_s``, which keeps running."""
    answer = _need(answer, "answer", "math_match")
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        ok = math_equivalent(c, a, item_timeout_s)
        out.append(None if ok is None else float(ok))
    return out


def format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<think>...</think><answer>...</answer>`` (whitespace around allowed,
    both parts non-empty; DeepSeek-R1's format reward), else 0.0."""
    return [1.0 if has_r1_format(completion_text(c)) else 0.0 for c in completions]


def partial_credit(
    prompts: list, completions: list, answer: list | None = None, partial: float = 0.5, **kwargs
) -> list[float | None]:
    """The seeds' graded reward: 1.0 for the correct final answer; ``partial`` (0.5) for a well-formed solution
    (``<think>reasoning</think><answer>...</answer>``) with a wrong result; 0.0 otherwise."""
    answer = _need(answer, "answer", "partial_credit")
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        if a is None:
            out.append(None)
        elif is_correct(c, a):
            out.append(1.0)
        elif has_r1_format(completion_text(c)):
            out.append(float(partial))
        else:
            out.append(0.0)
    return out


def length_penalty(
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    max_length: int = 512,
    buffer: int = 128,
    **kwargs,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), with ``L`` the completion length in tokens
    (characters when ``completion_ids`` is not given):

    ``0`` if ``L <= max_length - buffer``; ``((max_length - buffer) - L) / buffer`` if
    ``max_length - buffer < L <= max_length``; ``-1`` if ``L > max_length``.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"length_penalty needs 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}")
    lengths = (
        [len(ids) for ids in completion_ids]
        if completion_ids is not None
        else [len(completion_text(c)) for c in completions]
    )
    start = max_length - buffer
    return [0.0 if n <= start else (-1.0 if n > max_length else (start - n) / buffer) for n in lengths]


def code_tests(
    prompts: list,
    completions: list,
    tests: list | None = None,
    wall_seconds: float = 5.0,
    cpu_seconds: int = 4,
    memory_mb: int = 512,
    **kwargs,
) -> list[float | None]:
    """Pass fraction of each completion's last fenced Python block on its row's ``tests`` (asserts or stdin/stdout
    pairs), run in the sandbox of :mod:`lorarl.sandbox` (subprocess, unprivileged uid, rlimits, no network where the
    OS allows, a fresh temporary directory). No code block: 0.0; a row without tests: None."""
    from lorarl.sandbox import SandboxLimits, make_code_tests_reward

    limits = SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, memory_mb=memory_mb)
    return make_code_tests_reward(limits)(prompts, completions, tests=tests, **kwargs)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "numeric_match": numeric_match,
    "math_match": math_match,
    "code_tests": code_tests,
    "format": format_reward,
    "partial_credit": partial_credit,
    "length_penalty": length_penalty,
}


# ---------------------------------------------------------------------------------------------------------------
