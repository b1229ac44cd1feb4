"""Procedurally generated arithmetic problems: the quickstart task.

Every problem ``(a, op, b)`` with ``digits``-digit operands belongs to exactly one split, decided by a hash of the
problem and the seed: about ``HELD_OUT_FRACTION`` of all problems are held out, the rest are training problems. The
train and held-out sets are therefore disjoint by construction, whatever their sizes, and a different ``seed``
gives a different split. Rows follow TRL's conversational format::

    {"prompt": [{"role": "user", "content": "What is 23 + 45?"}], "answer": "68"}

Subtraction keeps ``a >= b`` (answers are never negative).

Example: ``make_problems("train", 2, seed=0)`` -> two rows like the one above, the same two every time.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

HELD_OUT_FRACTION = 0.2
DEFAULT_TEMPLATE = "What is {a} {op} {b}?"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Split = Literal["train", "eval"]


def split_of(a: int, op: str, b: int, seed: int) -> Split:
    """The split problem ``(a, op, b)`` belongs to under ``seed`` (a stable hash: the same on every machine)."""
    h = hashlib.sha256(f"{seed}:{a}{op}{b}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2**64  # uniform in [0, 1)
    return "eval" if u < HELD_OUT_FRACTION else "train"


def all_problems(operations: list[str], digits: int) -> list[tuple[int, str, int]]:
    """Every ``(a, op, b)`` with ``digits``-digit operands (``a >= b`` for ``-``), in a fixed order."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    out = []
    for op in operations:
        if op not in _OPS:
            raise ValueError(f"unknown operation {op!r} (use + - *)")
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                if op == "-" and a < b:
                    continue
                out.append((a, op, b))
    return out


def _sample_problems(split: Split, n: int, seed: int, operations: list[str], digits: int) -> list[tuple[int, str, int]]:
    pool = [p for p in all_problems(operations, digits) if split_of(*p, seed) == split]
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
) -> list[dict]:
    """``n`` rows of ``split`` (``"train"`` or ``"eval"``), deterministic in all arguments.

    ``template`` is formatted with ``a``, ``op``, ``b`` into the user message. Rows carry ``answer`` (a string,
    as the reward functions read it) plus ``a``, ``op``, ``b``. Distinct problems as long as the split has ``n``
    of them (1-3 digits; otherwise the split repeats); the first ``k`` rows do not depend on ``n``.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    operations = operations or ["+"]
    if digits <= 3:
        problems = _sample_problems(split, n, seed, operations, digits)
    else:  # too many problems to enumerate: rejection-sample by split
        rng = random.Random(f"{seed}:{split}")
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        problems = []
        while len(problems) < n:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(operations)
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
