"""Reading a completion's final answer: one ``extract_answer`` for every reward, task and report (``<answer>`` tags,
numbers with thousands separators); a completion's text comes from :func:`lorarl.core.messages.completion_text`."""

from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from lorarl.core.messages import completion_text, tag_blocks

# Every reading of a completion here is linear in its length (model output is hostile input): tags are found once
# (lorarl.core.messages.tag_blocks), and the number regex has no two ways to match the same text.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
THINK, END_THINK, ANSWER, END_ANSWER = "<think>", "</think>", "<answer>", "</answer>"


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
    tags = tag_blocks(text, ANSWER, END_ANSWER)
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


# ---------------------------------------------------------------------------------------------------------------
# Mathematical equivalence (math-verify: LaTeX, fractions, \boxed{}, units)
# ---------------------------------------------------------------------------------------------------------------

MATH_ITEM_TIMEOUT_S = 5.0  # each parse / the comparison of one answer (math-verify's timer); slower counts as wrong
_MV = None  # (math_verify module, extraction configs), imported on first use


def answer_region(text: str) -> str:
    """Where a completion's final answer is looked for: the content of its last ``<answer>...</answer>`` (the R1
    format), else the whole text."""
    tags = tag_blocks(text, ANSWER, END_ANSWER)
    return tags[-1] if tags else text


def has_r1_format(text: str) -> bool:
    """Is ``text`` exactly ``<think>A</think><answer>B</answer>`` with ``A`` and ``B`` not empty, white space allowed
    around the whole and between the two parts (DeepSeek-R1's format; what ``re.fullmatch(r"\\s*<think>(.+?)</think>
    \\s*<answer>(.+?)</answer>\\s*", text, re.S)`` accepts, ``A`` may hold ``</think>``), in one pass: the regex
    backtracked over every ``</think>``, quadratic.

    >>> has_r1_format("<think>7+8=15</think>\\n<answer>15</answer>"), has_r1_format("<answer>15</answer>")
    (True, False)
    """
    core = text.strip()
    if not (core.startswith(THINK) and core.endswith(END_ANSWER)):
        return False
    middle = core[len(THINK) : len(core) - len(END_ANSWER)]  # A </think> white space <answer> B
    i = middle.find(END_THINK, 1)  # A holds at least one character
    while i >= 0:
        j = i + len(END_THINK)
        while j < len(middle) and middle[j].isspace():  # runs after different </think> never overlap: one pass
            j += 1
        if middle.startswith(ANSWER, j) and j + len(ANSWER) < len(middle):  # B holds at least one character
            return True
        i = middle.find(END_THINK, j)
    return False


def math_equivalent(completion: Any, answer: Any, timeout_s: float | None = MATH_ITEM_TIMEOUT_S) -> bool | None:
    """Is the completion's final answer mathematically equal to ``answer``, by math-verify (``parse`` then
    ``verify(gold, prediction)``, the check TRL's ``accuracy_reward`` and Open-R1 use)?

    The gold ``answer`` is parsed as LaTeX or a plain expression (``"72"``, ``"\\frac{3}{4}"``, ``"$0.75$"``; bare
    LaTeX such as ``"\\sqrt{8}"`` is read as if it stood between ``$`` signs); the prediction is taken from
    :func:`answer_region` with ``\\boxed{}`` first, then LaTeX, then a plain expression, units normalised
    (``"\\boxed{5\\text{ cm}}"`` -> 5). None when the gold answer cannot be parsed (the row is left out, like TRL);
    False when the prediction cannot. Each parse and the comparison run under math-verify's own timer of
    ``timeout_s`` (whole seconds; a timeout counts as not equivalent); in the main thread a reward's time limit that
    was running is put back afterwards (math-verify's timer would cancel it), so the answer runs inside it.

    Examples: ``("so it is \\boxed{\\frac{1}{2}}", "0.5")`` -> True; ``("1/2", "0.5")`` -> True; ``("72", "71")``
    -> False; ``("no idea", "3")`` -> False; ``("12", "")`` -> None.
    """
    if answer is None:
        return None
    mv, configs = _math_verify()
    main = threading.current_thread() is threading.main_thread()
    t = max(1, math.ceil(timeout_s)) if timeout_s and main else None  # math-verify's timer needs the main thread
    gold_text, text = str(answer), answer_region(completion_text(completion))
    with _outer_timer_kept(main):
        gold = mv.parse(gold_text, parsing_timeout=t) or mv.parse(f"${gold_text}$", parsing_timeout=t)
        if not gold:
            return None
        pred = mv.parse(text, extraction_config=configs, parsing_timeout=t)
        return bool(pred) and bool(mv.verify(gold, pred, timeout_seconds=t))


@contextlib.contextmanager
def _outer_timer_kept(main: bool) -> Iterator[None]:
    """A SIGALRM timer running before the block (a reward's ``reward.timeout_s``) is running after it, minus the time
    spent: math-verify's ``signal.alarm`` timeouts cancel it when they end."""
    remaining, interval = signal.getitimer(signal.ITIMER_REAL) if main else (0.0, 0.0)
    t0 = time.monotonic()
    try:
        yield
    finally:
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, max(remaining - (time.monotonic() - t0), 1e-3), interval)


def _math_verify():
    """The ``math_verify`` module and the prediction's extraction configs (imported once, quietly)."""
    global _MV
    if _MV is None:
        import logging

        try:
            import math_verify
            from latex2sympy2_extended import NormalizationConfig
        except ImportError:  # pragma: no cover - a declared dependency
            raise ImportError("math_match / data.verifier math need the `math-verify` package") from None
        for name in ("math_verify.parser", "math_verify.grader"):  # "timeout is disabled" (threads), parse errors
            logging.getLogger(name).setLevel(logging.ERROR)
        configs = [
            math_verify.LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True), boxed_match_priority=0
            ),
            math_verify.ExprExtractionConfig(),
        ]
        _MV = (math_verify, configs)
    return _MV
