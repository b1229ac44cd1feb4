"""Scoring code against tests in the sandbox, and the TRL reward built on it: :func:`extract_code` (the code
of a completion), :func:`run_tests` (pass fraction on asserts and stdin/stdout pairs) and
:func:`make_code_tests_reward` / :data:`code_tests_reward`."""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from lorarl.core.messages import completion_text
from lorarl.sandbox.limits import SandboxError, SandboxLimits, SandboxUnavailable
from lorarl.sandbox.runner import _COMPILE_ERROR_RC, _execute, isolation_info

logger = logging.getLogger(__name__)

_FENCE_LANGS = ("", "python", "py", "python3")


def extract_code(completion: str, *, fallback_raw: bool = False) -> str | None:
    """The last fenced Python block of ``completion``.

    Takes the last closed ```` ``` ```` block whose info string is ``python``,
    ``py``, ``python3`` or empty (blocks in other languages are skipped).
    Without such a block returns ``None``: the raw text is *not* run, unless
    ``fallback_raw=True`` (then the stripped text, or ``None`` if empty).
    An unclosed final fence (a truncated generation) does not count.
    """
    if not isinstance(completion, str):
        return None
    blocks: list[str] = []
    lines = completion.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = (stripped[3:].split() or [""])[0].lower()
            for j in range(i + 1, len(lines)):
                if lines[j].strip() == "```":
                    if lang in _FENCE_LANGS:
                        blocks.append("\n".join(lines[i + 1 : j]) + "\n")
                    i = j
                    break
            else:
                break  # unclosed fence
        i += 1
    if blocks:
        return blocks[-1]
    if fallback_raw and completion.strip():
        return completion.strip() + "\n"
    return None


# --------------------------------------------------------------------------
# Tests.


def _normalize_output(text: str) -> str:
    """Output as stdin/stdout tests compare it: stripped, without trailing spaces on any line."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _io_test(test: object) -> tuple[str, str] | None:
    """``(input, output)`` of a ``{"input": str, "output": str}`` test, else ``None``."""
    if isinstance(test, Mapping) and "input" in test and "output" in test:
        inp, out = test["input"], test["output"]
        if isinstance(inp, str) and isinstance(out, str):
            return inp, out
    return None


def _passed_asserts(code: str, asserts: list[str], limits: SandboxLimits, mode: str) -> int | None:
    """How many of ``asserts`` pass, all run in one process after ``code``; ``None`` if it does not compile."""
    nonce = secrets.token_hex(16)
    res = _execute({"solution.py": code, "tests.json": json.dumps(asserts)}, "asserts", nonce + "\n", limits, mode)
    if res.returncode == _COMPILE_ERROR_RC:
        return None
    seen = set()
    prefix = nonce + ":"
    for line in res.stdout.splitlines():
        if line.startswith(prefix) and line[len(prefix) :].isdigit():
            seen.add(int(line[len(prefix) :]))
    return len(seen & set(range(len(asserts))))


def run_tests(
    code: str, tests: Sequence[object], limits: SandboxLimits = SandboxLimits(), *, isolation: str | None = None
) -> float:
    """Fraction of ``tests`` that ``code`` passes, in [0, 1].

    ``tests`` holds assert statements (strings) and/or ``{"input": str,
    "output": str}`` pairs.  All asserts run in one sandboxed process: the
    code first (as ``__main__``; an exception or a non-zero ``sys.exit`` in
    it fails every assert), then each assert on its own, so a failing one
    does not stop the others; asserts that passed before a timeout still
    count.  Each pair runs the code as a script with ``input`` on stdin and
    passes if it exits with status 0 within the limits and its stdout equals
    ``output`` after stripping (surrounding whitespace, and trailing spaces of
    each line).  Entries of any other shape count as failed.  A code that
    does not compile, or a sandbox failure (logged), gives 0.0.
    """
    tests = list(tests)
    if not tests or not isinstance(code, str):
        return 0.0
    mode = isolation or isolation_info()["mode"]
    asserts = [t for t in tests if isinstance(t, str)]
    pairs = [p for p in map(_io_test, tests) if p is not None]
    passed = 0
    try:
        if asserts:
            n = _passed_asserts(code, asserts, limits, mode)
            if n is None:
                return 0.0
            passed += n
        for inp, expected in pairs:
            res = _execute({"solution.py": code}, "script", inp, limits, mode)
            if res.returncode == _COMPILE_ERROR_RC:
                return 0.0
            if res.ok and _normalize_output(res.stdout) == _normalize_output(expected):
                passed += 1
    except SandboxUnavailable:
        raise
    except SandboxError as exc:
        logger.warning("sandbox failure, scoring 0: %s", exc)
        return 0.0
    return passed / len(tests)

    # --------------------------------------------------------------------------
    # The TRL reward.

    return None


def _row_tests(tests: object) -> list | None:
    """A dataset row's tests as a list: a list as is, a JSON-encoded list, or one test."""
    if tests is None:
        return None
    if isinstance(tests, str):  # a JSON-encoded list, or one assert
        try:
            decoded = json.loads(tests)
        except ValueError:
            return [tests]
        return decoded if isinstance(decoded, list) else [tests]
    if isinstance(tests, Mapping):
        return [tests]
    return list(tests)


def make_code_tests_reward(
    limits: SandboxLimits | None = None,
    *,
    max_workers: int | None = None,
    fallback_raw: bool = False,
    isolation: str | None = None,
):
    """Build a TRL reward function (see :func:`code_tests_reward`) with these settings.

    ``max_workers`` completions are scored in parallel (default
    ``min(4, os.cpu_count())``).
    """
    limits = limits or SandboxLimits()
    workers = max_workers or min(4, os.cpu_count() or 1)

    def code_tests_reward(prompts=None, completions=None, tests=None, **kwargs) -> list[float | None]:
        """Pass fraction of each completion's last fenced Python block on its row's tests.

        ``completions`` are strings or conversations (lists of ``{"role",
        "content"}`` messages; the last assistant message is used).  ``tests``
        is the dataset column: one list of tests per row (or a JSON string of
        one).  A completion without a code block scores 0.0; a row without
        tests (``None`` or empty) gets ``None`` (TRL then ignores this reward
        for it).
        """
        completions = list(completions or [])
        if tests is None:
            return [None] * len(completions)
        rows = list(tests)
        if len(rows) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows of tests")

        def score(i: int) -> float | None:
            row = _row_tests(rows[i])
            if not row:
                return None
            text = completion_text(completions[i])
            code = extract_code(text, fallback_raw=fallback_raw) if text else None
            if code is None:
                return 0.0
            return run_tests(code, row, limits, isolation=isolation)

        if workers <= 1 or len(completions) <= 1:
            return [score(i) for i in range(len(completions))]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(score, range(len(completions))))

    return code_tests_reward


#: The reward with default limits: ``code_tests_reward(prompts, completions, tests=..., **kwargs)``.
code_tests_reward = make_code_tests_reward()
