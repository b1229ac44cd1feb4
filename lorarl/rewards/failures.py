"""When failing reward functions stop a run. A reward function's call fails (an exception, ``reward.timeout_s``, a
malformed result: its whole column is NaN) or some of its values fail (NaN, or not a finite float32: ``inf``,
``1e300``); either way those values are left out and the step goes on without them, with one line. Two rules then
decide whether the run may go on, both per function and both raising :class:`~lorarl.errors.LorarlError` (exit 2)
with one line naming the function and its error:

* **a dead function** (:class:`FailureStreaks`): a function that has no usable value in ``reward.max_failed_steps``
  steps in a row (default 2) -- every call of each of those steps failed, or every value it returned failed --
  stops the run before that step trains. A run that ends (at most ``max_failed_steps - 1`` steps, e.g. one step)
  with a function that failed on every step it ran fails too, instead of reporting success having trained on none
  of that function's values. A step where the function returned only None ("does not apply") is not a failure and
  breaks a streak. ``max_failed_steps: 0`` turns this rule off (a benchmark measuring a judge that never parses).
* **a flaky function** (:func:`check_failure_budget`, ``reward.max_failure_fraction``, default 0.5): once a function
  was called 4 times, more than that fraction of its calls failed, or of its values (counted over the run,
  evaluation calls included).

Both are per function, so a failing function is caught however many others work beside it (before, the calls of all
functions were pooled: one always-failing function of two was 50%, not above the default 0.5, and the run trained on
the other for all its steps).
"""

from __future__ import annotations

from lorarl.errors import LorarlError

MIN_CALLS = 4  # calls of a function before its failure fractions are judged


def check_failure_budget(
    names: list[str],
    calls: int,
    call_failures: list[int],
    values: list[int],
    failed_values: list[int],
    max_fraction: float,
    last: str = "see above",
    min_calls: int = MIN_CALLS,
) -> None:
    """Raise LorarlError when, once ``calls >= min_calls``, more than ``max_fraction`` of one function's ``calls``
    failed (``call_failures[k]``) or of its ``values[k]`` values (``failed_values[k]``); ``last``: the last errors,
    for the message.

    Example: 4 calls, call failures ``[0, 3]``, ``max_fraction 0.5`` -> ``reward b failed in 3 of its 4 calls (75% >
    reward.max_failure_fraction=0.5)``."""
    if calls < min_calls:
        return
    for k, name in enumerate(names):
        if call_failures[k] / calls > max_fraction:
            raise LorarlError(
                f"reward {name} failed in {call_failures[k]} of its {calls} calls ({call_failures[k] / calls:.0%} > "
                f"reward.max_failure_fraction={max_fraction:g}); last: {last}"
            )
        if values[k] and failed_values[k] / values[k] > max_fraction:
            raise LorarlError(
                f"reward {name}: {failed_values[k]} of its {values[k]} values failed "
                f"({failed_values[k] / values[k]:.0%} > reward.max_failure_fraction={max_fraction:g}); last: {last}"
            )


class FailureStreaks:
    """The dead-function rule (module docstring): feed it each training scoring call of a step (:meth:`record`),
    close the step (:meth:`end_step`, raises at ``limit`` failed steps in a row), and at the end of the run
    :meth:`check_finished`. Functions are known by name from their first call (the reward functions, and an
    environment's ``get_reward`` under its class name). Its state is part of a checkpoint."""

    def __init__(self, limit: int = 2):
        self.limit = int(limit)
        self.streak: dict[str, int] = {}  # failed steps in a row, up to the last closed step
        self.first_error: dict[str, str] = {}  # the first error of the current streak
        self.streak_start: dict[str, int] = {}  # the step the current streak began at
        self.steps = 0  # steps closed (this run and the ones resumed from)
        self._usable: dict[str, bool] = {}  # the open step: a usable value seen
        self._error: dict[str, str] = {}  # the open step: its first error

    def record(self, usable: dict[str, int], failures: dict[str, str]) -> None:
        """One scoring call of the open step: ``usable[name]`` values of each function were finite numbers;
        ``failures`` (name -> error) the functions that failed in it (call or values)."""
        for name, n in usable.items():
            self._usable[name] = self._usable.get(name, False) or n > 0
            if name in failures:
                self._error.setdefault(name, failures[name])

    def end_step(self, step: int) -> None:
        """Close step ``step``: a function without a usable value that failed in it extends its streak; raise at
        ``limit`` failed steps in a row."""
        self.steps += 1
        for name, usable in self._usable.items():
            error = self._error.get(name)
            if usable or error is None:  # a value, or only None ("does not apply")
                self.streak[name] = 0
                self.first_error.pop(name, None)
                continue
            if not self.streak.get(name):
                self.streak_start[name], self.first_error[name] = step, error
            self.streak[name] = self.streak.get(name, 0) + 1
        self._usable, self._error = {}, {}
        for name, n in self.streak.items():
            if self.limit and n >= self.limit:
                raise LorarlError(
                    f"reward {name} failed on every call of {n} steps in a row (steps {self.streak_start[name]}-"
                    f"{step}; reward.max_failed_steps={self.limit}): {self.first_error[name]}"
                )

    def check_finished(self) -> None:
        """At the end of a run: raise if a function failed on every step the run had (fewer than ``limit``, or the
        run would have stopped), so the run does not end as a success without ever having that reward. ``limit``
        0 (``reward.max_failed_steps: 0``) turns both checks off."""
        for name, n in self.streak.items():
            if self.limit and self.steps and n == self.steps:
                raise LorarlError(
                    f"reward {name} failed on every call of the run's {self.steps} step(s): none of its values was "
                    f"trained on; first error: {self.first_error[name]}"
                )

    def state_dict(self) -> dict:
        return {
            "streak": dict(self.streak),
            "first_error": dict(self.first_error),
            "streak_start": dict(self.streak_start),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """``state`` from :meth:`state_dict`; None (a checkpoint from before the rule): no streak, steps unknown
        (so :meth:`check_finished` does not fire on a resumed run)."""
        state = state or {}
        self.streak = {k: int(v) for k, v in state.get("streak", {}).items()}
        self.first_error = dict(state.get("first_error", {}))
        self.streak_start = {k: int(v) for k, v in state.get("streak_start", {}).items()}
        self.steps = int(state.get("steps", 0))
