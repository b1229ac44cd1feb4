"""An LLM judge's prompts and the strict reading of its answers: pure functions (no model).

Pointwise (``judge.mode: pointwise``): one prompt per completion, the rubric with ``{completion}`` (and optionally
``{prompt}`` and dataset columns such as ``{answer}``) filled in, then the answer format: one line ``Score: N``.

Group-relative (``judge.mode: group``), as ART's RULER does it (Corbitt et al. 2025): one prompt per group of ``G``
completions of the same prompt, the rubric with ``{completions}`` filled by the numbered responses
(``<response id="1"> ... </response>``), then the answer format: a JSON object
``{"scores": [{"id": 1, "score": S1}, ..., {"id": G, "score": SG}]}``. Relative scores are what GRPO's group
advantage uses.

Scores must lie in ``[min_score, max_score]``; the reward is ``(s - min_score) / (max_score - min_score)`` in
``[0, 1]``. An answer that does not follow the format raises :class:`JudgeParseError` (the value fails: NaN, left
out, counted), never a silent 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from lorarl.config.rewards import RUBRIC_PLACEHOLDER, rubric_fields
from lorarl.core.messages import completion_text, decode_json

DEFAULT_RUBRICS = {
    "pointwise": (
        "You are grading an answer to a task.\n\nTask:\n{prompt}\n\nAnswer:\n{completion}\n\n"
        "Grade how well the answer solves the task: a correct, complete answer gets a high score, a wrong or "
        "missing one a low score."
    ),
    "group": (
        "All of the responses below answer the same task. Score each of them, taking the others into account.\n\n"
        "Task:\n{prompt}\n\nResponses:\n{completions}\n\nGrading standards:\n"
        "- A response that solves the task gets a much higher score than one that does not.\n"
        "- If one response is only slightly better than another, their scores differ a little; if it is much "
        "better, they differ a lot."
    ),
}


class JudgeParseError(ValueError):
    """A judge answer that does not follow the requested format."""


def _fmt(x: float) -> str:
    return f"{x:g}"


def fill_rubric(rubric: str, values: Mapping[str, Any]) -> str:
    """``rubric`` with each ``{name}`` replaced by ``values[name]`` (other braces untouched). Raises ValueError naming
    the first placeholder without a value.

    >>> fill_rubric('Q: {prompt} A: {completion} {"x": 1}', {"prompt": "2+2?", "completion": "4"})
    'Q: 2+2? A: 4 {"x": 1}'
    """
    missing = [f for f in rubric_fields(rubric) if f not in values]
    if missing:
        raise ValueError(f"the rubric uses {{{missing[0]}}} but there is no such field (prompt, dataset columns)")
    return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), rubric)


def prompt_text_of(prompt: Any) -> str:
    """A TRL prompt as text for the judge: a string as it is; a message list as ``role: content`` lines of its
    non-system messages."""
    if isinstance(prompt, str):
        return prompt
    lines = []
    for m in prompt if isinstance(prompt, (list, tuple)) else []:
        if isinstance(m, Mapping) and m.get("role") != "system":
            lines.append(f"{m.get('role', 'user')}: {completion_text([{**m, 'role': 'assistant'}])}")
    if len(lines) == 1:
        return lines[0].split(": ", 1)[1]
    return "\n".join(lines)


def pointwise_prompt(rubric: str, fields: Mapping[str, Any], min_score: float, max_score: float) -> str:
    """The judge's user message for one completion: the filled rubric, then the answer format."""
    return (
        fill_rubric(rubric, fields)
        + f"\n\nReply with one line: Score: N, where N is a number from {_fmt(min_score)} to {_fmt(max_score)}."
    )


def group_prompt(
    rubric: str, fields: Mapping[str, Any], completions: list[str], min_score: float, max_score: float
) -> str:
    """The judge's user message for a group: ``{completions}`` = the numbered responses, then the answer format."""
    listed = "\n".join(f'<response id="{i}">\n{c}\n</response>' for i, c in enumerate(completions, start=1))
    example = ", ".join(f'{{"id": {i}, "score": S{i}}}' for i in range(1, len(completions) + 1))
    return (
        fill_rubric(rubric, {**fields, RUBRIC_PLACEHOLDER["group"]: listed})
        + f'\n\nReply with only a JSON object {{"scores": [{example}]}}: one entry per response id, each score a '
        f"number from {_fmt(min_score)} to {_fmt(max_score)}."
    )


# A judge's answer is model output (hostile input): no two parts of this pattern can match the same text (the white
# space before "/ 10" belongs to that optional group), so a line is matched in linear time; `\s*` then `[*_.\s]*`
# took 6.5 s on a line of 20,000 spaces. Group answers are read by lorarl.core.messages.decode_json (depth-bounded).
_SCORE_LINE = re.compile(r"^[*_#\s]*score[*_\s]*[:=][*_\s]*(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?[*_.\s]*$", re.I)


def _in_range(s: float, min_score: float, max_score: float) -> float:
    if not (math.isfinite(s) and min_score <= s <= max_score):
        raise JudgeParseError(f"score {s:g} is outside [{min_score:g}, {max_score:g}]")
    return s


def parse_pointwise(text: str, min_score: float, max_score: float) -> float:
    """The score in a pointwise answer: the number on its ``Score: N`` line (``**Score:** 7``, ``Score: 7/10``
    accepted). Raises JudgeParseError when there is no such line, when two such lines disagree, or when N is out
    of range.

    >>> parse_pointwise("The answer is right.\\nScore: 9", 0, 10)
    9.0
    """
    found = [float(m.group(1)) for line in text.splitlines() if (m := _SCORE_LINE.match(line.strip()))]
    if not found:
        raise JudgeParseError(f"no 'Score: N' line in {text[:60]!r}")
    if len(set(found)) > 1:
        raise JudgeParseError(f"several different scores {found}")
    return _in_range(found[0], min_score, max_score)


def parse_group(text: str, group_size: int, min_score: float, max_score: float) -> list[float]:
    """The ``G`` scores of a group answer: the first JSON object in the text must be ``{"scores": [...]}`` with one
    ``{"id": i, "score": s}`` for each ``i`` in ``1..G`` (any order, no repeats). Raises JudgeParseError otherwise.

    >>> parse_group('{"scores": [{"id": 2, "score": 1}, {"id": 1, "score": 8}]}', 2, 0, 10)
    [8.0, 1.0]
    """
    start = text.find("{")
    if start < 0:
        raise JudgeParseError(f"no JSON object in {text[:60]!r}")
    try:
        obj, _ = decode_json(text, start)  # nested past 64 brackets, or a 5,000-digit number: this row fails
    except ValueError as e:
        raise JudgeParseError(f"not valid JSON ({e})") from None
    scores = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(scores, list):
        raise JudgeParseError("the JSON object has no 'scores' list")
    out: dict[int, float] = {}
    for entry in scores:
        if not isinstance(entry, dict) or "id" not in entry or "score" not in entry:
            raise JudgeParseError(f"an entry is not {{'id': i, 'score': s}}: {entry!r}")
        i, s = entry["id"], entry["score"]
        if isinstance(i, str) and i.strip().isdigit():
            i = int(i)
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= group_size or i in out:
            raise JudgeParseError(f"bad or repeated id {i!r} (expected each of 1..{group_size} once)")
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise JudgeParseError(f"score of id {i} is not a number: {s!r}")
        out[i] = _in_range(float(s), min_score, max_score)
    if len(out) != group_size:
        raise JudgeParseError(f"{len(out)} scores for {group_size} responses")
    return [out[i] for i in range(1, group_size + 1)]


def default_answer_tokens(mode: str, group_size: int) -> int:
    """The judge's answer length when ``judge.max_new_tokens`` is not set: 16 tokens for ``Score: N`` (pointwise);
    ``8 + 16 G`` for a group's JSON (measured with SmolLM2's tokenizer: 5 + 13.5 per ``{"id": i, "score": s}``).

    >>> default_answer_tokens("group", 8)
    136
    """
    return 16 if mode == "pointwise" else 8 + 16 * group_size


def to_unit(score: float, min_score: float, max_score: float) -> float:
    """``(score - min_score) / (max_score - min_score)``: a judge score in ``[0, 1]``."""
    return (score - min_score) / (max_score - min_score)
