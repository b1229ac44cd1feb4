"""The Watch tab's time left, evaluation included.

A step's ``step_time`` (``metrics.jsonl``) is the step alone; a held-out evaluation runs after it and its seconds are
logged on that step's row as ``time/evaluation`` (every evaluated step's row is logged). The time left spreads the
evaluations seen so far over the steps they came with (:func:`evaluation_per_step`) and adds that to the median step
time (:func:`eta_seconds`); :class:`lorarl.app.watch.RunWatch` uses them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

EVAL_TIME = "time/evaluation"


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def evaluation_per_step(rows: Iterable[dict], step: int) -> float:
    """Evaluation seconds spread per step: ``sum(time/evaluation of the rows of steps 1..step) / step`` (0 before
    step 1 or without an evaluation). Example: evaluations of 30 s at steps 5 and 10, ``step`` 10 -> 6 s per step."""
    if step < 1:
        return 0.0
    total = 0.0
    for row in rows:
        s, t = row.get("step"), _number(row.get(EVAL_TIME))
        if isinstance(s, int) and 1 <= s <= step and t is not None:
            total += t
    return total / step


def eta_seconds(step_times: list[float], step: int, last_step: int | None, eval_per_step: float = 0.0) -> float | None:
    """Time left: ``(median(step time) + eval_per_step) x (last_step - step)``; None without a step time or a last
    step. Example: step times 2, 3, 10 s (median 3), 6 s of evaluation per step, step 10 of 20 -> 90 s."""
    if not step_times or last_step is None:
        return None
    return (statistics.median(step_times) + eval_per_step) * max(0, last_step - step)
