"""Reward functions: built-in rule rewards, a name -> function registry, and isolated, weighted scoring.

A reward function has TRL's signature, so TRL reward functions drop in::

    fn(prompts, completions, **dataset_columns) -> list[float | None]

``prompts`` and ``completions`` are lists of strings, or of chat-message lists for conversational data (a
completion is then ``[{"role": "assistant", "content": text}]``). Every extra dataset column is passed by name
(``answer=[...]``), plus ``completion_ids`` (token ids per completion). ``None`` means "does not apply to this
completion": the value is left out, like TRL does.

Recipes name a function by built-in name (``numeric_match``, ``format``, ``partial_credit``, ``length_penalty``) or
as ``module:function`` (``my_rewards:score``, or ``path/to/file.py:score``); ``kwargs`` in the recipe are bound to it.

:class:`RewardScorer` calls each function once per batch and isolates failures: an exception or a timeout turns that
function's column into NaN (a missing value, left out of the group statistics), is counted, and the run goes on.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorarl.config import RewardSpec
from lorarl.errors import LorarlError

RewardFn = Callable[..., list]

# ---------------------------------------------------------------------------------------------------------------
# Parsing completions
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# Built-in rule rewards (TRL signature)
# ---------------------------------------------------------------------------------------------------------------


def _need(column: Any, name: str, fn: str) -> Sequence:
    if column is None:
        raise ValueError(f"reward {fn} needs a dataset column {name!r}")
    return column


def numeric_match(prompts: list, completions: list, answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 when the final answer (the last number, or the content of ``<answer>...</answer>``) equals the
    ``answer`` column, else 0.0; None for rows whose answer is None."""
    answer = _need(answer, "answer", "numeric_match")
    return [None if a is None else float(is_correct(c, a)) for c, a in zip(completions, answer)]


def format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<think>...</think><answer>...</answer>`` (whitespace around allowed,
    both parts non-empty; DeepSeek-R1's format reward), else 0.0."""
    return [1.0 if _FORMAT.fullmatch(completion_text(c)) else 0.0 for c in completions]


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
        elif _FORMAT.fullmatch(completion_text(c)):
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
    "code_tests": code_tests,
    "format": format_reward,
    "partial_credit": partial_credit,
    "length_penalty": length_penalty,
}


# ---------------------------------------------------------------------------------------------------------------
# Name -> function
# ---------------------------------------------------------------------------------------------------------------


def load_reward_fn(name: str) -> RewardFn:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function`` -> the function."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise LorarlError(
            f"unknown reward {name!r}{hint}: use a built-in ({', '.join(BUILTIN_REWARDS)}) or module:function"
        )
    module_name, _, attr = name.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise LorarlError(f"reward {name!r}: file {path} not found")
            spec = importlib.util.spec_from_file_location(f"lorarl_user_rewards_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except LorarlError:
        raise
    except Exception as e:  # a user's module failing to import is the user's problem to fix: say which
        raise LorarlError(f"reward {name!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise LorarlError(f"reward {name!r}: {module_name} has no function {attr!r}")
    return fn


def _metric_names(specs: list[RewardSpec]) -> list[str]:
    names = []
    for spec in specs:
        base = spec.name.rpartition(":")[2] or spec.name
        name, i = base, 1
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------------------------------
# Isolation
# ---------------------------------------------------------------------------------------------------------------


class RewardTimeout(Exception):
    """A reward function ran past its time limit."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None) -> Any:
    """``fn()``, raising :class:`RewardTimeout` after ``timeout_s`` seconds (None or <= 0: no limit).

    In the main thread on POSIX a SIGALRM interrupts the call (Python code stops; a timer another tool had set is
    put back). Elsewhere the call runs in a daemon thread that is abandoned on timeout.
    """
    if not timeout_s or timeout_s <= 0:
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):

        def on_alarm(signum, frame):
            raise RewardTimeout(f"timed out after {timeout_s:g} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        t0 = time.monotonic()
        outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer_delay > 0:  # someone else's timer (e.g. pytest-timeout): give back what is left of it
                signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - t0), 1e-3), outer_interval)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="lorarl-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"timed out after {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RewardScores:
    """Scores of one batch of ``N`` completions by ``K`` reward functions.

    per_function: ``[N, K]`` float32, NaN where a function returned None or failed.
    total:        ``[N]`` float32, ``sum_k w_k r_k`` over the functions with a value; NaN where none has one.
    names:        ``K`` metric names (the function names, made unique).
    failures:     ``{name: "error message"}`` for the functions whose call failed on this batch.
    """

    per_function: torch.Tensor
    total: torch.Tensor
    names: list[str]
    failures: dict[str, str] = field(default_factory=dict)

    def means(self) -> dict[str, float]:
        """Each function's mean over its non-NaN values (NaN if it has none)."""
        out = {}
        for k, name in enumerate(self.names):
            col = self.per_function[:, k]
            ok = ~torch.isnan(col)
            out[name] = float(col[ok].mean()) if ok.any() else float("nan")
        return out


class RewardScorer:
    """Calls the recipe's reward functions on a batch and combines them into an ``[N, K]`` matrix and a weighted
    total. Keeps count of calls and failures (exceptions, timeouts, malformed results) across the run."""

    def __init__(self, specs: list[RewardSpec], timeout_s: float | None = None):
        if not specs:
            raise LorarlError("rewards: at least one reward function is needed")
        self.specs = list(specs)
        self.names = _metric_names(self.specs)
        self.weights = torch.tensor([float(s.weight) for s in self.specs], dtype=torch.float32)
        self.timeout_s = timeout_s
        self.fns: list[RewardFn] = []
        for i, spec in enumerate(self.specs):
            try:
                fn = load_reward_fn(spec.name)
            except LorarlError as e:
                raise LorarlError(f"rewards[{i}].name: {e}") from None
            if spec.kwargs:
                _check_kwargs(fn, spec, i)
                fn = functools.partial(fn, **spec.kwargs)
            self.fns.append(fn)
        self.calls = 0
        self.failures = 0

    @property
    def failure_fraction(self) -> float:
        return self.failures / self.calls if self.calls else 0.0

    def check_failure_budget(self, max_fraction: float, last_failures: dict | None = None, min_calls: int = 4) -> None:
        """Raise LorarlError once at least ``min_calls`` calls were made and more than ``max_fraction`` failed
        (``train.max_reward_failure_fraction``); ``last_failures`` (name -> error) goes into the message."""
        if self.calls >= min_calls and self.failure_fraction > max_fraction:
            last = "; ".join(f"{k}: {v}" for k, v in (last_failures or {}).items()) or "see above"
            raise LorarlError(
                f"reward functions failed in {self.failures} of {self.calls} calls ({self.failure_fraction:.0%} > "
                f"train.max_reward_failure_fraction={max_fraction:g}); last: {last}"
            )

    def score_rollout(self, prompts, rollout) -> RewardScores:
        """Score the rows of a :class:`~lorarl.rollout.Rollout` whose prompts are rows of ``prompts`` (a
        :class:`~lorarl.data.PromptSet`, indexed by ``rollout.prompt_index``), with TRL's fields: the prompts, the
        completions (messages for conversational prompts), the extra columns and the completion token ids."""
        idx = rollout.prompt_index
        return self(
            [prompts.rows[i]["prompt"] for i in idx],
            trl_completions(rollout.completions, prompts.conversational),
            prompts.columns(idx),
            rollout.completion_token_lists(),
        )

    def __call__(
        self,
        prompts: list,
        completions: list,
        columns: dict[str, list] | None = None,
        completion_ids: list[list[int]] | None = None,
    ) -> RewardScores:
        n = len(completions)
        columns = dict(columns or {})
        if completion_ids is not None:
            columns.setdefault("completion_ids", completion_ids)
        matrix = torch.full((n, len(self.fns)), float("nan"), dtype=torch.float32)
        failures: dict[str, str] = {}
        for k, (fn, name) in enumerate(zip(self.fns, self.names)):
            self.calls += 1
            try:
                values = call_with_timeout(
                    lambda fn=fn: fn(prompts=prompts, completions=completions, **columns), self.timeout_s
                )
                matrix[:, k] = _as_column(values, n)
            except Exception as e:  # isolation: any failure of a user's function is recorded, never fatal here
                self.failures += 1
                failures[name] = f"{type(e).__name__}: {e}"
        valid = ~torch.isnan(matrix)
        weighted = torch.where(valid, matrix * self.weights, torch.zeros(()))
        total = torch.where(valid.any(dim=1), weighted.sum(dim=1), torch.full((n,), float("nan")))
        return RewardScores(per_function=matrix, total=total, names=list(self.names), failures=failures)


def trl_completions(completions: list[str], conversational: bool) -> list:
    """Completions as TRL gives them to reward functions: strings, or ``[{"role": "assistant", ...}]``."""
    if conversational:
        return [[{"role": "assistant", "content": c}] for c in completions]
    return list(completions)


def _check_kwargs(fn: RewardFn, spec: RewardSpec, index: int) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    builtin = spec.name in BUILTIN_REWARDS  # built-ins take **kwargs only to absorb dataset columns
    if not builtin and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = [k for k in spec.kwargs if k not in named or k in ("prompts", "completions")]
    if unknown:
        raise LorarlError(f"rewards[{index}].kwargs: {spec.name} takes no argument {', '.join(unknown)}")


def _as_column(values: Any, n: int) -> torch.Tensor:
    """A reward function's result -> ``[N]`` float32 with NaN for None. Raises ValueError when malformed."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out = []
    for v in values:
        if v is None:
            out.append(float("nan"))
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"returned a non-number {v!r}") from None
        v = float(v)
        if math.isinf(v):
            raise ValueError("returned an infinite reward")
        out.append(v)
    return torch.tensor(out, dtype=torch.float32)


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
    "numeric_match",
    "parse_number",
    "partial_credit",
]
