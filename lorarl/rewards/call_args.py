"""What a reward function is handed besides the data, with the meaning TRL 1.16's ``GRPOTrainer`` gives it
(``_calculate_rewards``: every reward function gets all of these as keyword arguments, so it takes ``**kwargs``):

* ``trainer_state``: transformers' own ``TrainerState`` (the class TRL passes), one object for the whole run, so a
  curriculum may keep it. ``global_step``: the optimizer steps done before this scoring (0 in step 1, ``s - 1`` in
  step ``s``: what TRL's state holds when it scores that step's completions; ``s`` in an evaluation after step
  ``s``; in ``lorarl eval`` of a run's adapter, its checkpoint's step); ``max_steps``: the run's ``train.steps``
  (what the LR schedule spans, also under ``--max-steps`` / ``LORARL_TRL_MAX_STEPS``); ``epoch``: passes over the
  training prompts done, ``global_step x prompts_per_step / rows`` (fractional, as TRL's); ``num_train_epochs``,
  ``train_batch_size`` (prompts per step), ``logging_steps``, ``save_steps``, ``eval_steps`` from the recipe.
  ``log_history`` stays empty (the rows are in ``metrics.jsonl``).
* ``log_metric(name, value)``: a number logged under ``name`` (TRL's: no prefix) in the step's metrics row
  (``metrics.jsonl`` and the trackers); every value logged during a step, by every function and every scoring call
  of it, is averaged into one. A name lorarl logs itself (``reward``, ``accuracy``, ...) goes under
  ``log_metric/<name>`` instead, with one notice.
* ``log_extra(column, values)``: one value per completion of the call, a column of the completions table
  (``completions.jsonl``, ``train.log_completions`` rows) beside ``prompt`` / ``completion`` / ``reward``; a column
  name the table has already goes under ``log_extra/<column>``. A second call for the same column in the same
  scoring call replaces the first. Values are written as JSON (numbers, strings, booleans, None; NaN / inf -> null;
  anything else as its ``str``).
* ``environments``: with an environment (``agent.environment``, TRL's ``environment_factory``), the rollout's
  environment instances, one per completion, in the completions' order; released (``close()``) after scoring.

Misuse fails the reward function's call with one line (``log_extra('hint'): 3 values for 8 completions``), counted
like any failed call (:mod:`lorarl.rewards.failures`).
"""

from __future__ import annotations

import json
import math
from typing import Any

# keyword arguments a reward function gets beside prompts, completions and the dataset's columns (TRL's names)
CALL_ARGS = ("trainer_state", "log_metric", "log_extra", "environments")
LOG_METRIC_PREFIX = "log_metric/"  # where a logged metric goes when lorarl logs that name itself
LOG_EXTRA_PREFIX = "log_extra/"  # likewise for a completions-table column


def new_trainer_state(
    max_steps: int = 0, per_step: int = 1, logging_steps: int = 1, save_steps: int = 0, eval_steps: int = 0
) -> Any:
    """transformers' ``TrainerState`` for a run of ``max_steps`` steps of ``per_step`` prompts (step 0 done)."""
    from transformers import TrainerState

    return TrainerState(
        epoch=0.0,
        global_step=0,
        max_steps=int(max_steps),
        logging_steps=int(logging_steps),
        eval_steps=int(eval_steps),
        save_steps=int(save_steps),
        train_batch_size=int(per_step),
    )


def set_steps_done(state: Any, done: int, n_rows: int | None) -> None:
    """``state`` after ``done`` optimizer steps: ``global_step = done``, ``epoch = done x train_batch_size /
    n_rows`` and ``num_train_epochs = max_steps x train_batch_size / n_rows`` (``n_rows``: the training prompts;
    None or 0 leaves the epochs alone).

    Example: 10 steps of 4 prompts over 16 rows, 3 done -> ``epoch 0.75``, ``num_train_epochs 2.5``."""
    state.global_step = int(done)
    if n_rows:
        per_step = state.train_batch_size or 1
        state.epoch = done * per_step / n_rows
        state.num_train_epochs = state.max_steps * per_step / n_rows


def _json_value(v: Any) -> Any:
    """A value of a ``log_extra`` column as JSON holds it: tensors / numpy scalars as numbers, NaN / inf -> None,
    anything json cannot write -> its ``str``."""
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return str(v)
    return v


class RewardLog:
    """What the reward functions of one scoring call of ``n`` completions logged through ``log_metric`` (values by
    name) and ``log_extra`` (a column by name, ``n`` values)."""

    def __init__(self, n: int):
        self.n = n
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: record ``value`` under ``name`` (averaged over the step)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric(name, value): name must be a non-empty string, got {name!r}")
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"log_metric({name!r}): value must be a number, got {type(value).__name__}")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column of the completions table, one value per completion of this call."""
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra(column, values): column must be a non-empty string, got {column!r}")
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"log_extra({column!r}): values must be a list, got {type(values).__name__}")
        if len(values) != self.n:
            raise ValueError(f"log_extra({column!r}): {len(values)} values for {self.n} completions")
        self.columns[column] = [_json_value(v) for v in values]

    def metric_sums(self) -> dict[str, tuple[float, int]]:
        """``{name: (sum, count)}`` of the logged values."""
        return {k: (sum(v), len(v)) for k, v in self.metrics.items()}


def pool_sums(*parts: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """``{name: (sum, count)}`` dicts added name by name. Example: ``{"a": (1, 1)}``, ``{"a": (5, 2)}`` ->
    ``{"a": (6, 3)}`` (mean 2)."""
    out: dict[str, tuple[float, int]] = {}
    for part in parts:
        for k, (s, c) in part.items():
            s0, c0 = out.get(k, (0.0, 0))
            out[k] = (s0 + s, c0 + c)
    return out


def add_logged(row: dict, values: dict[str, Any], prefix: str, reserved: tuple[str, ...] = ("step",)) -> list[str]:
    """Add ``values`` to ``row`` under their names, except a name ``row`` has already (or a ``reserved`` one, which
    the writer adds): that one goes under ``prefix + name``, so what lorarl logs is never replaced. Returns the
    names that moved. Example: row ``{"reward": 1}``, values ``{"reward": 2, "hint": "x"}`` -> ``{"reward": 1,
    "log_extra/reward": 2, "hint": "x"}``, ``["reward"]``."""
    moved = []
    for name, value in values.items():
        if name in row or name in reserved:
            moved.append(name)
            name = prefix + name
        row[name] = value
    return moved
