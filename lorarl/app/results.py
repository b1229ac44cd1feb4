"""What a run achieved, as the Watch tab shows it at the top of a run: the held-out result (base and trained), the
training figures of the last steps, the total time; and for each curve that stays empty, why.

Everything is read from the run folder, so a run from a terminal shows the same:

* held-out result: ``RUN/eval_base.json`` and ``RUN/eval_trained.json`` (what ``scripts/quickstart.sh`` writes:
  ``lorarl eval``'s last line for the base and for the run) or ``RUN/eval.json`` (``lorarl eval RECIPE
  --checkpoint RUN`` writes it for a run's final policy); else the held-out evaluations logged during training
  (``eval/accuracy`` and the like in ``metrics.jsonl``, with ``eval.every``);
* training figures: ``summary.json``'s ``reward_last10`` / ``accuracy_last10`` (GRPO, PPO, ...);
* total time: ``summary.json``'s ``wall_s`` when one process trained every step (model loading included), else the
  steps' ``step_time`` plus their ``time/evaluation`` (a resumed run: the processes' loading left out).

Pure functions of the folder's parsed files; :class:`lorarl.app.watch.RunWatch` calls them on each look.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

HELDOUT_KEYS = ("eval/accuracy", "eval/rewards/accuracies", "eval/reward_mean")  # first present wins
BASE_FILE, TRAINED_FILES = "eval_base.json", ("eval_trained.json", "eval.json")


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def read_json_file(path: Path) -> dict | None:
    """The JSON object in ``path``; None when missing or unreadable (a half-written file is skipped, not shown)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def format_seconds(s: float | None) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``; None -> ``?``."""
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _pct(v: float) -> str:
    return f"{v:.1%}"


def _eval_figure(result: dict) -> tuple[str, float] | None:
    """``("accuracy", 0.77)`` of a ``lorarl eval`` result, else ``("reward", mean)``, else None."""
    for key, name in (("accuracy", "accuracy"), ("reward_mean", "reward")):
        v = _number(result.get(key))
        if v is not None:
            return name, v
    return None


def heldout_line(files: dict[str, dict | None], rows: list[dict]) -> str | None:
    """The held-out result in one line: from ``lorarl eval``'s files (``files``: name -> parsed JSON, see the
    module docstring), base -> trained; else the first and last held-out evaluation logged during training;
    None when the run has neither.

    Example: base accuracy 0.225 and trained 0.77 on n 200 -> ``held-out accuracy (greedy, 200 examples): base
    22.5% -> trained 77.0%``."""
    base = files.get(BASE_FILE)
    trained = next((files[f] for f in TRAINED_FILES if files.get(f)), None)
    fb, ft = (_eval_figure(r) if r else None for r in (base, trained))
    if ft is not None:
        name, value = ft
        n = trained.get("n")
        of = f" (greedy, {n} examples)" if isinstance(n, int) else ""
        shown = _pct(value) if name == "accuracy" else f"{value:.3f}"
        if fb is not None and fb[0] == name:
            before = _pct(fb[1]) if name == "accuracy" else f"{fb[1]:.3f}"
            return f"held-out {name}{of}: base {before} → trained {shown}"
        return f"held-out {name}{of}: trained {shown} (base not measured: `lorarl eval RECIPE --checkpoint base`)"
    for key in HELDOUT_KEYS:
        points = [(r["step"], _number(r.get(key))) for r in rows if _number(r.get(key)) is not None]
        if points:
            fmt = _pct if "accurac" in key else (lambda v: f"{v:.3f}")
            (s0, v0), (s1, v1) = points[0], points[-1]
            if s0 == s1:
                return f"held-out {key}: {fmt(v1)} at step {s1}"
            return f"held-out {key}: {fmt(v0)} at step {s0} → {fmt(v1)} at step {s1} ({len(points)} evaluations)"
    return None


def training_line(summary: dict | None) -> str | None:
    """The training batches' figures of the last 10 steps (``summary.json``: ``reward_last10``,
    ``accuracy_last10``), or None."""
    if not summary:
        return None
    parts = []
    reward, acc = _number(summary.get("reward_last10")), _number(summary.get("accuracy_last10"))
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if acc is not None:
        parts.append(f"accuracy {_pct(acc)}")
    return "training batches, last 10 steps: " + ", ".join(parts) if parts else None


def time_line(summary: dict | None, rows: list[dict], steps: int | None) -> str | None:
    """The run's total time: ``summary.json``'s ``wall_s`` when one process trained every step (``steps_this_run
    == steps``); else the sum of the rows' ``step_time`` and ``time/evaluation`` when every step is logged; else
    None. Example: rows of 10 s and 12 s steps and a 5 s evaluation -> ``total time 0m27s in steps and
    evaluations``."""
    if summary and _number(summary.get("wall_s")) is not None and summary.get("steps_this_run") == summary.get("steps"):
        return f"total time {format_seconds(summary['wall_s'])} (one process, model loading included)"
    times = [_number(r.get("step_time")) for r in rows]
    if not rows or None in times or (steps is not None and len(rows) < steps):
        return None
    evals = sum(v for r in rows if (v := _number(r.get("time/evaluation"))) is not None)
    return f"total time {format_seconds(sum(times) + evals)} in steps and evaluations (resumed: loading not counted)"


def eval_files(run_dir: Path) -> dict[str, dict | None]:
    """``lorarl eval``'s result files in the run folder (name -> parsed JSON, None when missing)."""
    return {name: read_json_file(Path(run_dir) / name) for name in (BASE_FILE, *TRAINED_FILES)}


def result_markdown(run_dir: Path, rows: list[dict], steps: int | None, files: dict | None = None) -> str:
    """The result block of a finished run (see the module docstring): one line per figure it has."""
    files = eval_files(run_dir) if files is None else files
    summary = read_json_file(Path(run_dir) / "summary.json")
    lines = [heldout_line(files, rows), training_line(summary), time_line(summary, rows, steps)]
    if lines[0] is None:
        lines[0] = "held-out result: none measured (`lorarl eval RECIPE --checkpoint RUN` measures it)"
    return "**Result** · " + " · ".join(line for line in lines if line)


def _get(recipe: dict, dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def final_eval_of(algo: str | None) -> bool | None:
    """Whether algorithm ``algo`` evaluates at its last step when ``eval.every`` is 0 (its class's ``final_eval``,
    as the run loop reads it); None for an unknown name."""
    from lorarl.algos import ALGORITHMS, algorithm_class

    return bool(algorithm_class(algo).final_eval) if algo in ALGORITHMS else None


def empty_reason(
    label: str, keys: tuple[str, ...], recipe: dict, rows: list[dict], final_eval: bool | None, measured: bool = False
) -> str:
    """Why the curve ``label`` (fed by metric ``keys``) has no point, in one line. ``recipe``: the run's
    ``recipe.yaml``; ``rows``: its metrics rows; ``final_eval``: whether its algorithm evaluates at the last step
    when ``eval.every`` is 0 (None: unknown); ``measured``: a held-out result was measured after the run (its
    ``lorarl eval`` files)."""
    algo = str(recipe.get("algo", "grpo"))
    if not rows:
        return "no step logged yet"
    if label == "held-out accuracy":
        every = _get(recipe, "eval.every") or 0
        if every == 0 and not final_eval:
            after = "; the result line above has the run's held-out figures" if measured else ""
            return f"no held-out evaluation during training (eval.every is 0){after}"
        if every == 0:
            return "evaluated at the last step only (eval.every is 0)"
        last = max(r["step"] for r in rows)
        if last < every:
            return f"the first held-out evaluation comes at step {every} (eval.every {every})"
    if label == "KL":
        for section in ("grpo", "ppo", "online_dpo"):
            if algo == section and _get(recipe, f"{section}.kl.coef") == 0:
                return f"not computed: {section}.kl.coef is 0 (the reference model never runs)"
    logged = [k for k in keys if any(k in r for r in rows)]
    if logged:
        return f"{logged[0]} is logged but never a number (not computed in this run)"
    return f"a {algo} run does not log it ({' / '.join(keys)})"
