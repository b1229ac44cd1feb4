"""Tasks: where prompts come from and how an answer is checked. A task owns its correctness check, so loops and
reports never parse answers themselves: they call :func:`accuracy`.

| task / verifier | data | correct when |
|---|---|---|
| ``numeric`` | any rows with an ``answer`` column (the built-in ``arithmetic`` generator among them) | the final number of the completion equals ``answer`` (:func:`lorarl.rewards.is_correct`) |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorarl.rewards.answers import is_correct

Verifier = Callable[[Any, Any], bool]

VERIFIERS: dict[str, Verifier] = {"numeric": is_correct}


def verifier(recipe) -> Verifier:
    """The recipe's answer check."""
    return VERIFIERS["numeric"]


def accuracy(recipe, completions: list, columns: dict[str, list]) -> float | None:
    """The fraction of ``completions`` whose answer the task's verifier accepts against the ``answer`` column of
    their rows (None when the rows have no ``answer``)."""
    answers = columns.get("answer")
    if not answers or not completions:
        return None
    check = verifier(recipe)
    return sum(bool(check(c, a)) for c, a in zip(completions, answers)) / len(completions)
