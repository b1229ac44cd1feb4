"""Reading a completion's final answer: one ``completion_text`` and one ``extract_answer`` for every reward, task
and report (strings, chat messages, ``<answer>`` tags, numbers with thousands separators)."""

from __future__ import annotations

import math
import re
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_FORMAT = re.compile(r"\s*<think>(.+?)</think>\s*<answer>(.+?)</answer>\s*", re.S)


def completion_text(completion: Any) -> str:
    """A completion as text: strings as they are, chat messages joined by their ``content``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion)
    return str(completion)


def parse_number(text: str) -> float | None:
    """``"1,234"`` -> 1234.0, ``"-7.5"`` -> -7.5, anything else -> None."""
    try:
        return float(str(text).strip().replace(",", ""))
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last number inside the last ``<answer>...</answer>`` if there is such a tag,
    else the last number in the text; the tag's stripped content when it holds no number; None when nothing.

    Examples: ``"3 + 4 = 7."`` -> ``"7"``; ``"<answer>12</answer> or 13"`` -> ``"12"``; ``"no idea"`` -> None.
    """
    tags = _ANSWER_TAG.findall(text)
    region = tags[-1] if tags else text
    numbers = _NUMBER.findall(region)
    if numbers:
        return numbers[-1].replace(",", "")
    if tags and region.strip():
        return region.strip()
    return None


def is_correct(completion: Any, answer: Any) -> bool:
    """Does the completion's final answer (:func:`extract_answer`) equal ``answer``? Numbers compare as numbers
    (``"68.0"`` == ``68``), other answers as stripped strings."""
    if answer is None:
        return False
    pred = extract_answer(completion_text(completion))
    if pred is None:
        return False
    want, got = parse_number(str(answer)), parse_number(pred)
    if want is not None and got is not None:
        return math.isclose(want, got, rel_tol=0.0, abs_tol=1e-6)
    return pred.strip() == str(answer).strip()
