"""Procedurally generated arithmetic problems: the quickstart task.

Every problem ``(a, op, b)`` with ``digits``-digit operands belongs to exactly one split, decided by a hash of the
problem and the seed: about ``HELD_OUT_FRACTION`` of all problems are held out, the rest are training problems. The
train and held-out sets are therefore disjoint by construction, whatever their sizes, and a different ``seed``
gives a different split. Rows follow TRL's conversational format::

    {"prompt": [{"role": "user", "content": "What is 23 + 45?"}], "answer": "68"}

Subtraction keeps ``a >= b`` (answers are never negative).

Example: ``make_problems("train", 2, seed=0)`` -> two rows like the one above, the same two every time.

**Cold-start data** (:func:`make_worked_examples`): the same training problems with a worked solution as the
completion, in DeepSeek-R1's ``<think>...</think><answer>...</answer>`` format (what the ``format`` reward checks),
written out column by column (:func:`worked_solution`). They come from the train split, so they never show a
held-out problem.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

HELD_OUT_FRACTION = 0.2
DEFAULT_TEMPLATE = "What is {a} {op} {b}?"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Split = Literal["train", "eval"]


def task_options(data) -> dict:
    """The keywords every arithmetic row maker takes (:func:`make_problems`, :func:`make_worked_examples`,
    :func:`lorarl.tasks.tool_traces.make_tool_traces`), from a recipe's ``data`` section: ``data.seed`` and
    ``data.arithmetic``'s ``operations``, ``digits``, ``digits_b`` and ``prompt_template``."""
    a = data.arithmetic
    return {
        "seed": data.seed,
        "operations": a.operations,
        "digits": a.digits,
        "digits_b": a.digits_b,
        "template": a.prompt_template,
    }


def split_of(a: int, op: str, b: int, seed: int) -> Split:
    """The split problem ``(a, op, b)`` belongs to under ``seed`` (a stable hash: the same on every machine)."""
    h = hashlib.sha256(f"{seed}:{a}{op}{b}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2**64  # uniform in [0, 1)
    return "eval" if u < HELD_OUT_FRACTION else "train"


def _range(digits: int) -> tuple[int, int]:
    return (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1


def all_problems(operations: list[str], digits: int, digits_b: int | None = None) -> list[tuple[int, str, int]]:
    """Every ``(a, op, b)`` with a ``digits``-digit ``a`` and a ``digits_b``-digit ``b`` (default ``digits``;
    ``a >= b`` for ``-``), in a fixed order."""
    lo, hi = _range(digits)
    lo_b, hi_b = _range(digits_b or digits)
    out = []
    for op in operations:
        if op not in _OPS:
            raise ValueError(f"unknown operation {op!r} (use + - *)")
        for a in range(lo, hi + 1):
            for b in range(lo_b, hi_b + 1):
                if op == "-" and a < b:
                    continue
                out.append((a, op, b))
    return out


def _sample_problems(
    split: Split, n: int, seed: int, operations: list[str], digits: int, digits_b: int | None = None
) -> list[tuple[int, str, int]]:
    pool = [p for p in all_problems(operations, digits, digits_b) if split_of(*p, seed) == split]
    random.Random(f"{seed}:{split}").shuffle(pool)  # prefix-stable: the first 100 of 200 rows are the 100 rows
    return [pool[i % len(pool)] for i in range(n)]  # more rows than problems: the shuffled pool repeats


def make_problems(
    split: Split,
    n: int,
    *,
    seed: int = 1234,
    operations: list[str] | None = None,
    digits: int = 2,
    template: str = DEFAULT_TEMPLATE,
    digits_b: int | None = None,
) -> list[dict]:
    """``n`` rows of ``split`` (``"train"`` or ``"eval"``), deterministic in all arguments.

    ``template`` is formatted with ``a``, ``op``, ``b`` into the user message. Rows carry ``answer`` (a string,
    as the reward functions read it) plus ``a``, ``op``, ``b``. Distinct problems as long as the split has ``n``
    of them (1-3 digits; otherwise the split repeats); the first ``k`` rows do not depend on ``n``. ``digits_b``
    gives the second operand another size (3-digit x 2-digit multiplication: ``digits=3, digits_b=2``).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    operations = operations or ["+"]
    if max(digits, digits_b or digits) <= 3:
        problems = _sample_problems(split, n, seed, operations, digits, digits_b)
    else:  # too many problems to enumerate: rejection-sample by split
        rng = random.Random(f"{seed}:{split}")
        (lo, hi), (lo_b, hi_b) = _range(digits), _range(digits_b or digits)
        problems = []
        while len(problems) < n:
            a, b, op = rng.randint(lo, hi), rng.randint(lo_b, hi_b), rng.choice(operations)
            if op == "-" and a < b:
                a, b = b, a
            if split_of(a, op, b, seed) == split:
                problems.append((a, op, b))
    rows = []
    for a, op, b in problems:
        rows.append(
            {
                "prompt": [{"role": "user", "content": template.format(a=a, op=op, b=b)}],
                "answer": str(_OPS[op](a, b)),
                "a": a,
                "op": op,
                "b": b,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Cold-start data: worked solutions in the <think>/<answer> format
# ---------------------------------------------------------------------------------------------------------------

PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands", "millions")


def _digits(x: int, width: int) -> list[int]:
    """The ``width`` lowest decimal digits of ``x``, ones first: ``_digits(47, 3)`` -> ``[7, 4, 0]``."""
    return [(x // 10**i) % 10 for i in range(width)]


def addition_steps(a: int, b: int) -> list[str]:
    """Column addition, ones first, one clause per column: ``digit_a+digit_b(+carry)=s``, and the carry it passes on.

    Example: 47 + 38 -> ``["ones: 7+8=15, carry 1", "tens: 4+3+1=8"]``.
    """
    width = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for i, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
        total = x + y + carry
        lhs = f"{x}+{y}" + (f"+{carry}" if carry else "")
        carry = total // 10
        steps.append(f"{PLACES[i]}: {lhs}={total}" + (f", carry {carry}" if carry else ""))
    return steps


def subtraction_steps(a: int, b: int) -> list[str]:
    """Column subtraction (``a >= b``), ones first: ``digit_a(-borrow)-digit_b=d``; a column whose digit is too
    small borrows ten from the next one (written ``1x-...``, and ``borrow 1``).

    Example: 47 - 38 -> ``["ones: 17-8=9, borrow 1", "tens: 4-1-3=0"]``.
    """
    if a < b:
        raise ValueError(f"subtraction_steps needs a >= b, got {a} - {b}")
    width = len(str(a))
    steps, borrow = [], 0
    for i, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
        need = x - borrow < y
        top = x + 10 if need else x
        lhs = f"{top}" + ("-1" if borrow else "") + f"-{y}"
        steps.append(f"{PLACES[i]}: {lhs}={top - borrow - y}" + (", borrow 1" if need else ""))
        borrow = int(need)
    return steps


def multiplication_steps(a: int, b: int) -> list[str]:
    """Partial products of ``a`` by each digit of ``b`` (shifted by its place), then their sum.

    Example: 47 * 38 -> ``["47*8=376", "47*30=1410", "376+1410=1786"]``.
    """
    parts = [(d * 10**i) for i, d in enumerate(_digits(b, len(str(b)))) if d]
    steps = [f"{a}*{p}={a * p}" for p in parts]
    if len(parts) > 1:
        steps.append("+".join(str(a * p) for p in parts) + f"={a * b}")
    return steps or [f"{a}*{b}=0"]


_STEPS = {"+": addition_steps, "-": subtraction_steps, "*": multiplication_steps}


def worked_solution(a: int, op: str, b: int) -> str:
    """A worked solution of ``a op b`` in DeepSeek-R1's format: the column steps in ``<think>``, then the result, the
    bare number in ``<answer>``.

    Example: ``worked_solution(47, "-", 38)`` ->
    ``"<think>ones: 17-8=9, borrow 1. tens: 4-1-3=0. So 47-38=9.</think>\n<answer>9</answer>"``.
    """
    result = _OPS[op](a, b)
    steps = ". ".join(_STEPS[op](a, b))
    return f"<think>{steps}. So {a}{op}{b}={result}.</think>\n<answer>{result}</answer>"


def make_worked_examples(n: int, **problems) -> list[dict]:
    """``n`` supervised rows in TRL's conversational prompt-completion format: the training problems of
    :func:`make_problems` (``problems``: its ``seed``, ``operations``, ``digits``, ``template``; so the prompts are
    exactly the RL prompts and none is held out), each with its :func:`worked_solution` as the assistant's
    completion::

        {"prompt": [{"role": "user", "content": "What is 47 - 38?"}],
         "completion": [{"role": "assistant", "content": "<think>...</think>\n<answer>9</answer>"}],
         "answer": "9", "a": 47, "op": "-", "b": 38}
    """
    rows = make_problems("train", n, **problems)
    for row in rows:
        row["completion"] = [{"role": "assistant", "content": worked_solution(row["a"], row["op"], row["b"])}]
    return rows
