"""Tasks: where prompts come from and how an answer is checked. A task owns its correctness check, so loops and
reports never parse answers themselves: they call :func:`accuracy`, which uses the recipe's ``data.verifier``.

| ``data.verifier`` | correct when | use it for |
|---|---|---|
| ``numeric`` (default) | the final number of the completion (in ``<answer>`` if present) equals ``answer`` (:func:`lorarl.rewards.is_correct`) | plain-number answers: the built-in ``arithmetic`` task, GSM8K |
| ``math`` | the final answer is mathematically equal to ``answer`` by math-verify: LaTeX, fractions, ``\\boxed{}``, units (:func:`lorarl.rewards.answers.math_equivalent`) | MATH-style answers (``\\frac{3}{4}``, ``2\\sqrt{2}``) |

A verifier is ``check(completion, answer) -> bool | None``; None (an answer the verifier cannot read) leaves the row
out of the accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorarl.rewards.answers import is_correct, math_equivalent

Verifier = Callable[[Any, Any], "bool | None"]

VERIFIERS: dict[str, Verifier] = {"numeric": is_correct, "math": math_equivalent}


def verifier(recipe) -> Verifier:
    """The recipe's answer check (``data.verifier``; ``numeric`` for recipes that predate the key)."""
    return VERIFIERS[getattr(recipe.data, "verifier", "numeric")]


def accuracy(recipe, completions: list, columns: dict[str, list]) -> float | None:
    """The fraction of ``completions`` whose answer the recipe's verifier accepts against the ``answer`` column of
    their rows, over the rows it can judge (rows whose answer is None or unreadable are left out). None when the rows
    have no ``answer`` or none can be judged.

    Example: completions ``["7", "8", "x"]``, answers ``["7", "7", None]``, numeric -> 1/2 (the third is left out)."""
    answers = columns.get("answer")
    if not answers or not completions:
        return None
    check = verifier(recipe)
    verdicts = [None if a is None else check(c, a) for c, a in zip(completions, answers)]
    judged = [bool(v) for v in verdicts if v is not None]
    return sum(judged) / len(judged) if judged else None
