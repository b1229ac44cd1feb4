"""Calling reward functions on a batch: each once, under a time limit, with every argument TRL's GRPOTrainer passes
(:mod:`lorarl.rewards.call_args`), failures isolated and counted, then combined into a weighted total (NaN where no
function has a value).

``async def`` functions (and the remote reward) run concurrently with each other on one event loop per scoring call
(:mod:`lorarl.rewards.concurrent`), while the plain functions run one after the other as before. Two kinds of
failure are counted per function (:mod:`lorarl.rewards.failures` decides when they stop the run): a failed call
(exception, timeout, malformed result: the function's whole column is NaN) and a failed value (the function returned
NaN for a row, e.g. a judge answer that did not parse, or a value that is not a finite float32: ``inf``, ``1e300``;
also a weighted value ``weight x value`` past float32). ``None`` is not a failure: it means "does not apply" (TRL's
convention).
"""

from __future__ import annotations

import functools
import inspect
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lorarl.config import RewardSpec
from lorarl.errors import LorarlError
from lorarl.rewards.builtins import BUILTIN_REWARDS, RewardFn
from lorarl.rewards.call_args import RewardLog, new_trainer_state
from lorarl.rewards.concurrent import is_async_reward, start_async_rewards, unwrap_partial
from lorarl.rewards.failures import check_failure_budget
from lorarl.rewards.registry import RewardContext, _metric_names, build_reward_fn

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    failures:     ``{name: "error message"}`` for the functions whose call failed on this batch, or some of whose
                  values failed (``"k of N values failed: ..."``).
    extra:        per-batch metrics of functions that report their own (``rewards/judge/failed_rows``, ...).
    logged:       what the functions logged with ``log_metric``: ``{name: (sum, count)}``.
    columns:      what they logged with ``log_extra``: ``{column: N values}`` (completions-table columns).
    """

    per_function: torch.Tensor
    total: torch.Tensor
    names: list[str]
    failures: dict[str, str] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    logged: dict[str, tuple[float, int]] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)

    def usable(self) -> list[int]:
        """Per function, the rows with a value (finite: failed values are NaN, like None)."""
        return [int(n) for n in (~torch.isnan(self.per_function)).sum(dim=0).tolist()]

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
    total. Keeps count, per function, of calls and failed calls (exceptions, timeouts, malformed results), and of
    values and failed (NaN or non-finite) values, across the run.

    ``context`` gives the entries that need more than their spec (``judge``: the shared base) what they need.
    ``trainer_state`` is what the functions get as ``trainer_state`` when a call gives none (the run's, set by
    :class:`~lorarl.rewards.source.RewardSource`; outside training a fresh one, step 0)."""

    def __init__(self, specs: list[RewardSpec], timeout_s: float | None = None, context: RewardContext | None = None):
        if not specs:
            raise LorarlError("rewards: at least one reward function is needed")
        self.specs = list(specs)
        self.names = _metric_names(self.specs)
        self.weights = torch.tensor([float(s.weight) for s in self.specs], dtype=torch.float32)
        self.timeout_s = timeout_s
        self.fns: list[RewardFn] = []
        for i, spec in enumerate(self.specs):
            try:
                fn = build_reward_fn(spec, context)
            except LorarlError as e:
                raise LorarlError(f"rewards[{i}].name: {e}") from None
            if spec.kwargs:
                _check_kwargs(fn, spec, i)
                fn = functools.partial(fn, **spec.kwargs)
            self.fns.append(fn)
        self.trainer_state = new_trainer_state()
        k = len(self.fns)
        self.batches = 0  # scoring calls (each calls every function once)
        self.call_failures = [0] * k  # per function: failed calls
        self.values = [0] * k  # per function: values returned (rows of calls that did not fail)
        self.failed_values = [0] * k  # per function: of those, NaN or non-finite (a failed value)

    @property
    def calls(self) -> int:
        """Function calls so far (all functions)."""
        return self.batches * len(self.fns)

    @property
    def failures(self) -> int:
        """Failed function calls so far (all functions; the ``reward_failures`` metric)."""
        return sum(self.call_failures)

    @property
    def failure_fraction(self) -> float:
        return self.failures / self.calls if self.calls else 0.0

    def value_failure_fraction(self, k: int) -> float:
        """Function ``k``'s failed values over its values (0 when it returned none)."""
        return self.failed_values[k] / self.values[k] if self.values[k] else 0.0

    def check_failure_budget(self, max_fraction: float, last_failures: dict | None = None) -> None:
        """Raise LorarlError once a function was called 4 times and more than ``max_fraction`` of its calls, or of
        its values, failed (``reward.max_failure_fraction``, :func:`lorarl.rewards.failures.check_failure_budget`);
        ``last_failures`` (name -> error) goes into the message."""
        last = "; ".join(f"{k}: {v}" for k, v in (last_failures or {}).items()) or "see above"
        check_failure_budget(
            self.names, self.batches, self.call_failures, self.values, self.failed_values, max_fraction, last
        )

    def state_dict(self) -> dict:
        return {
            "batches": self.batches,
            "call_failures": list(self.call_failures),
            "values": list(self.values),
            "failed_values": list(self.failed_values),
        }

    def load_state_dict(self, state: dict) -> None:
        k = len(self.fns)
        if "batches" in state:
            self.batches = int(state["batches"])
            self.call_failures = [int(v) for v in state["call_failures"]]
        else:  # a checkpoint from before per-function counting: total calls and failures, whose only with one
            self.batches = int(state["calls"]) // max(k, 1)
            self.call_failures = [int(state["failures"])] if k == 1 else [0] * k
        self.values = [int(v) for v in state.get("values", [0] * k)]
        self.failed_values = [int(v) for v in state.get("failed_values", [0] * k)]

    def score_rollout(self, prompts, rollout, *, trainer_state=None, environments: list | None = None) -> RewardScores:
        """Score the rows of a :class:`~lorarl.rollout.Rollout` whose prompts are rows of ``prompts`` (a
        :class:`~lorarl.data.PromptSet`, indexed by ``rollout.prompt_index``), with TRL's fields: the prompts, the
        completions (messages for conversational prompts), the extra columns, the completion token ids, and
        ``trainer_state`` / ``environments`` (:mod:`lorarl.rewards.call_args`)."""
        idx = rollout.prompt_index
        return self(
            [prompts.rows[i]["prompt"] for i in idx],
            trl_completions(rollout.completions, prompts.conversational),
            prompts.columns(idx),
            rollout.completion_token_lists(),
            group_size=rollout.group_size,
            trainer_state=trainer_state,
            environments=environments,
        )

    def __call__(
        self,
        prompts: list,
        completions: list,
        columns: dict[str, list] | None = None,
        completion_ids: list[list[int]] | None = None,
        group_size: int = 1,
        *,
        trainer_state=None,
        environments: list | None = None,
    ) -> RewardScores:
        """Score ``N`` completions: every function once (the ``async def`` ones concurrently, on one event loop, while
        the plain ones run), with TRL's arguments: ``prompts``, ``completions``, the ``columns`` by name,
        ``completion_ids``, ``trainer_state`` (default: :attr:`trainer_state`), ``log_metric``, ``log_extra``, and
        ``environments`` when given (one per completion). ``group_size``: consecutive rows answering the same prompt
        (group-relative judges)."""
        n = len(completions)
        log = RewardLog(n)
        kwargs = dict(columns or {})
        if completion_ids is not None:
            kwargs.setdefault("completion_ids", completion_ids)
        # TRL's GRPOTrainer._calculate_rewards passes these to every function (over a column of the same name)
        state = self.trainer_state if trainer_state is None else trainer_state
        kwargs.update(trainer_state=state, log_metric=log.log_metric, log_extra=log.log_extra)
        if environments is not None:
            if len(environments) != n:
                raise ValueError(f"{len(environments)} environments for {n} completions")
            kwargs["environments"] = list(environments)

        def call(fn):
            extra = {"group_size": group_size} if getattr(unwrap_partial(fn), "wants_group_size", False) else {}
            return fn(prompts=prompts, completions=completions, **kwargs, **extra)

        outcomes = self._call_all(call)
        matrix = torch.full((n, len(self.fns)), float("nan"), dtype=torch.float32)
        failures: dict[str, str] = {}
        extra_metrics: dict[str, float] = {}
        self.batches += 1
        for k, (fn, name) in enumerate(zip(self.fns, self.names)):
            ok, result = outcomes[k]
            target = unwrap_partial(fn)
            if hasattr(target, "step_metrics"):  # reported whether the call failed or not (retries, seconds, ...)
                extra_metrics.update({f"rewards/{name}/{key}": v for key, v in target.step_metrics().items()})
            try:
                if not ok:
                    raise result
                matrix[:, k], n_failed, bad = _as_column(result, n, float(self.weights[k]))
            except Exception as e:
                self.call_failures[k] += 1
                failures[name] = f"{type(e).__name__}: {e}"
                continue
            self.values[k] += n
            self.failed_values[k] += n_failed
            if n_failed:
                why = bad or getattr(target, "last_value_error", None) or "returned NaN"
                failures[name] = f"{n_failed} of {n} values failed ({why})"
        valid = ~torch.isnan(matrix)
        weighted = torch.where(valid, matrix.double() * self.weights.double(), torch.zeros((), dtype=torch.float64))
        total = torch.where(valid.any(dim=1), weighted.sum(dim=1), torch.full((n,), float("nan"), dtype=torch.float64))
        total = _overflow_to_nan(total, weighted, self.names, failures)
        return RewardScores(
            per_function=matrix,
            total=total.float(),
            names=list(self.names),
            failures=failures,
            extra=extra_metrics,
            logged=log.metric_sums(),
            columns=dict(log.columns),
        )

    def _call_all(self, call) -> dict[int, tuple[bool, Any]]:
        """``{k: (True, result) | (False, exception)}``: every function once through ``call``, the async ones
        concurrently on one event loop while the plain ones run, each under ``timeout_s``."""
        pending = start_async_rewards(
            {k: functools.partial(call, fn) for k, fn in enumerate(self.fns) if is_async_reward(fn)}, self.timeout_s
        )
        outcomes: dict[int, tuple[bool, Any]] = {}
        for k, fn in enumerate(self.fns):
            if k in pending.jobs:
                continue
            try:
                outcomes[k] = (True, call_with_timeout(functools.partial(call, fn), self.timeout_s))
            except Exception as e:  # isolation: any failure of a user's function is recorded, never fatal here
                outcomes[k] = (False, e)
        outcomes.update(pending.wait())
        return outcomes


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


def _as_column(values: Any, n: int, weight: float = 1.0) -> tuple[torch.Tensor, int, str | None]:
    """A reward function's result -> (``[N]`` float32 with NaN for None and for each failed value, the number of
    failed values, what the first non-finite one was). A failed value: NaN, or one that is not a finite float32
    (``inf``, ``1e300``), or whose weighted value ``weight x value`` is not (it would make the group's advantages
    NaN). Raises ValueError when malformed.

    Example: ``[1.0, None, 1e300, nan]`` -> ``[1, nan, nan, nan]``, 2 failed, ``"returned 1e+300, not a finite
    float32"``."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out, failed, bad = [], 0, None
    for v in values:
        if v is None:
            out.append(float("nan"))
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"returned a non-number {v!r}") from None
        try:
            v = float(v)
        except OverflowError:  # an int past float64
            v = math.inf
        if not math.isnan(v) and not abs(v) * abs(weight) <= FLOAT32_MAX:
            if bad is None:
                past = "not a finite float32" if not abs(v) <= FLOAT32_MAX else f"x weight {weight:g} past float32"
                bad = f"returned {v:g}, {past}"
            v = float("nan")
        failed += math.isnan(v)
        out.append(v)
    return torch.tensor(out, dtype=torch.float32), failed, bad


def _overflow_to_nan(total: torch.Tensor, weighted: torch.Tensor, names: list[str], failures: dict) -> torch.Tensor:
    """Rows whose weighted total ``sum_k w_k r_k`` (``total`` ``[N]``, float64, from ``weighted`` ``[N, K]``) is past
    float32 -> NaN (left out), each counted against the function with the largest ``|w_k r_k|`` of the row in
    ``failures``."""
    over = ~torch.isnan(total) & (total.abs() > FLOAT32_MAX)
    if not over.any():
        return total
    for row in over.nonzero().squeeze(1).tolist():
        name = names[int(weighted[row].abs().argmax())]
        failures.setdefault(name, f"a weighted total of {float(total[row]):g} past float32 (row {row})")
    return torch.where(over, torch.full_like(total, float("nan")), total)
