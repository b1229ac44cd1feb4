"""The Watch tab's data: a run folder read as it grows (metrics, completions, log, state), and the list of runs.

:class:`RunWatch` keeps a byte offset per file and reads only what was appended since the last :meth:`RunWatch.poll`;
a half-written last line is left for the next poll. A file that shrank or was replaced (a resumed run truncates
``metrics.jsonl`` and ``completions.jsonl`` to its checkpoint's step) is read again from the start; a row for a step
seen before replaces it. Curves use the metric keys the loop logs (:data:`SERIES`: the first key a run logs wins,
so GRPO's ``reward``, PPO's ``objective/kl`` and DPO's ``rewards/margins`` all land on a curve). Runs started from a
terminal are read the same way: everything comes from the folder (:mod:`lorarl.runstate` for the state), the health
warnings from the metrics rows (``health/warning``) as well as from ``train.log``. :func:`list_runs` lists the run
folders and the stages of a ``lorarl pipeline`` output folder (``PIPELINE/STAGE``); a folder whose state file cannot be
read is listed as ``unreadable`` with the reason.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.app.jobs import FINAL_ADAPTERS, LOG_FILE, read_launch, resume_refusal
from lorarl.app.live import inside_step, stop_outcome
from lorarl.app.paths import EXPORTS, is_pipeline_dir
from lorarl.app.results import empty_reason, eval_files, final_eval_of, format_seconds, result_markdown
from lorarl.app.timeleft import eta_seconds, evaluation_per_step
from lorarl.errors import LorarlError
from lorarl.runs import is_adapter
from lorarl.runstate import COMPLETIONS_FILE, PID_FILE, live_pid, read_state
from lorarl.stepprogress import read_step

METRICS_FILE = "metrics.jsonl"
# curve label -> the metric keys that feed it, first present wins (GRPO / PPO / DPO / reward model / SFT)
SERIES: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "rewards/margins", "margin"),
    "held-out accuracy": ("eval/accuracy", "eval/rewards/accuracies"),
    "KL": ("kl", "objective/kl", "kl_per_token"),
    "entropy": ("entropy",),
    "completion length": ("completions/mean_length",),
    "step time (s)": ("step_time",),
}
RECENT = 20  # completions and log lines kept for the page
HEALTH_MARK = "health:"
HEALTH_KEY = "health/warning"  # a metrics row's new warnings, " | "-joined (lorarl.health.HealthMonitor.check)
ERROR_MARK = "lorarl: error:"
ENDED_EARLY = "the process ended before training started, without an error line (killed? out of memory? a traceback?)"
UNREADABLE = "unreadable"  # the state of a folder whose state file cannot be read
RESUMABLE = ("new", "stopped", "crashed", "failed")  # states Resume may continue (resume_refusal has the last word)
_STEP = re.compile(r"^step (\d+): ")


class _Tail:
    """New complete lines of one file since the last read (offset kept; a torn last line waits).

    A file rewritten since (a resume rewrites ``metrics.jsonl`` in place with the rows up to its checkpoint, then
    appends) is noticed even when it has grown past the old offset again: the bytes just before the offset must
    still be the ones read last time, else the file is read again from the start (``reset``)."""

    MARK = 256  # bytes before the offset compared on each read

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.ino: int | None = None
        self.mark = b""  # the last bytes read, ending at the offset
        self.reset = False  # set when the last read started over (the file shrank, was replaced or rewritten)

    def _still_same(self, f, size: int) -> bool:
        if size < self.offset:
            return False
        f.seek(self.offset - len(self.mark))
        return f.read(len(self.mark)) == self.mark

    def read(self) -> list[str]:
        self.reset = False
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            if self.offset:
                self.offset, self.mark, self.reset = 0, b"", True
            return []
        with f:
            st = os.fstat(f.fileno())
            if self.ino is not None and (st.st_ino != self.ino or not self._still_same(f, st.st_size)):
                self.offset, self.mark, self.reset = 0, b"", True
            self.ino = st.st_ino
            if st.st_size == self.offset:
                return []
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        self.mark = (self.mark + data[: end + 1])[-self.MARK :]
        return data[:end].decode("utf-8", errors="replace").split("\n")  # not splitlines(): "\r" is a bar redraw


def _json_rows(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def series_key(rows: list[dict], keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` that some row logs with a number."""
    for k in keys:
        if any(_number(r.get(k)) is not None for r in rows):
            return k
    return None


@dataclass
class Progress:
    """``step`` of ``last_step``, the median step time and the time left (seconds; None when unknown)."""

    step: int = 0
    last_step: int | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    inside: str = ""  # the running step now (lorarl.app.live.inside_step): phase, tokens, seconds

    @property
    def text(self) -> str:
        of = f"/{self.last_step}" if self.last_step else ""
        per = f", {self.step_time_s:.1f} s/step" if self.step_time_s is not None else ""
        left = f", about {format_seconds(self.eta_s)} left" if self.eta_s is not None else ""
        now = f" · now {self.inside}" if self.inside else ""
        return f"step {self.step}{of} done{per}{left}{now}" if self.inside else f"step {self.step}{of}{per}{left}"


@dataclass
class WatchView:
    """What the Watch tab shows of one run after a :meth:`RunWatch.poll`.

    series:      curve label -> ``[(step, value)]`` (labels of :data:`SERIES` the run logs); ``series_keys`` the
                 metric key behind each.
    warnings:    the run's health warnings as ``step N: health: ...`` lines, by step: the metrics rows'
                 ``health/warning`` and train.log's ``health:`` lines (a run from a terminal has no train.log).
    completions: the last 20 rows of completions.jsonl (``step``, ``prompt``, ``completion``, ``reward``, ...).
    state:       ``new`` | ``starting`` (a process is loading, no state yet) | ``running`` | ``stopped`` |
                 ``finished`` | ``crashed`` | ``failed`` (the command stopped before training: its error line) |
                 ``unreadable`` (state.json cannot be read); ``error`` the state's error line.
    resumable:   Resume may continue it once no process trains (a stopped, crashed, failed or unstarted run with a
                 recipe or launch record; not a finished run, nor a pipeline's stage: :func:`lorarl.app.jobs.
                 resume_refusal`). No process trains it now either.
    log_tail:    the last 20 lines of train.log; ``crash_lines`` the same when crashed or failed, else [].
    result:      a finished run's held-out result, training figures and total time (:mod:`lorarl.app.results`).
    note:        a stopped run: how the stop ended (the step finished and saved, or abandoned while generating);
                 a crashed one: why Resume would fail the same way (set by the page).
    empty:       for each curve of :data:`SERIES` with no point, why (``eval.every`` 0, ``kl.coef`` 0, ...).
    """

    run: str
    state: str
    error: str | None
    progress: Progress
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    series_keys: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    completions: list[dict] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)
    crash_lines: list[str] = field(default_factory=list)
    latest: dict = field(default_factory=dict)  # the newest metrics row
    new_rows: int = 0  # metrics rows read by this poll
    resumable: bool = False
    result: str = ""  # a finished run's result line (lorarl.app.results.result_markdown)
    note: str = ""  # a stopped run: how its stop ended (lorarl.app.live.stop_outcome)
    empty: dict[str, str] = field(default_factory=dict)  # curve label -> why it has no point


def health_warnings(rows: list[dict], log_warnings: list[str]) -> list[str]:
    """The run's warnings, each once, by step: ``step N: health: W`` for each ``W`` of a row's ``health/warning``
    (``" | "``-joined), and train.log's ``health:`` lines (the same text when the run's output went there; lines
    without a ``step N:`` prefix stay where they came)."""
    from_rows = [
        f"step {r['step']}: health: {w.strip()}"
        for r in rows
        if isinstance(r.get(HEALTH_KEY), str)
        for w in r[HEALTH_KEY].split(" | ")
        if w.strip()
    ]
    merged = list(log_warnings) + from_rows
    last = 0
    keyed = []
    for text in merged:
        m = _STEP.match(text)
        last = int(m.group(1)) if m else last
        keyed.append((last, text))
    return list(dict.fromkeys(t for _, t in sorted(keyed, key=lambda k: k[0])))


def _recipe_steps(run_dir: Path) -> int | None:
    from lorarl.config import yaml_load

    try:
        data = yaml_load((run_dir / "recipe.yaml").read_text(encoding="utf-8"))
        steps = data.get("train", {}).get("steps", 100)
    except Exception:  # no or unreadable recipe
        return None
    return steps if isinstance(steps, int) else None


def run_state(run_dir: Path, log_lines: list[str] | None = None) -> tuple[str, str | None, dict]:
    """``(state, error, state.json)``: :func:`lorarl.runstate.read_state`, with ``new`` refined: ``starting`` (a live
    process, no state yet), ``failed`` (train.log ends with the CLI's error line, or the process that was started
    for the run -- its ``train.pid`` is left -- is gone before it wrote a state), ``finished`` (final adapters of a
    run from before state.json); ``unreadable`` with the reason when state.json cannot be read."""
    try:
        st = read_state(run_dir)
    except LorarlError as e:
        return UNREADABLE, str(e), {}
    state, error = st.get("state", "new"), st.get("error")
    if state != "new":
        return state, error, st
    if live_pid(run_dir) is not None:
        return "starting", None, st
    errors = [line for line in (log_lines or []) if line.startswith(ERROR_MARK)]
    if errors:
        return "failed", errors[-1][len(ERROR_MARK) :].strip(), st
    if any(is_adapter(run_dir / role) for role in FINAL_ADAPTERS):
        return "finished", None, st
    if (run_dir / PID_FILE).exists():  # a process was started for it and is gone: no state, no error line
        return "failed", ENDED_EARLY, st
    return "new", None, st


class RunWatch:
    """Follows one run folder; :meth:`poll` reads what was appended since the last call."""

    def __init__(self, run_dir: str | os.PathLike, name: str | None = None):
        self.run_dir = Path(run_dir)
        self.name = name or self.run_dir.name  # how the page names it (``PIPELINE/STAGE`` for a stage)
        self._metrics = _Tail(self.run_dir / METRICS_FILE)
        self._completions = _Tail(self.run_dir / COMPLETIONS_FILE)
        self._log = _Tail(self.run_dir / LOG_FILE)
        self.rows: dict[int, dict] = {}
        self.completions: deque = deque(maxlen=RECENT)
        self.log_lines: deque = deque(maxlen=200)
        self.warnings: list[str] = []
        self._recipe: tuple[float, dict] | None = None  # (recipe.yaml mtime, its mapping)

    def recipe(self) -> dict:
        """The run's ``recipe.yaml`` as a mapping (read again when it changes; {} when missing or unreadable)."""
        from lorarl.config import yaml_load

        path = self.run_dir / "recipe.yaml"
        try:
            mtime = path.stat().st_mtime
            if self._recipe is None or self._recipe[0] != mtime:
                data = yaml_load(path.read_text(encoding="utf-8"))
                self._recipe = (mtime, data if isinstance(data, dict) else {})
        except Exception:  # no or unreadable recipe: nothing to say from it
            return {}
        return self._recipe[1]

    def _read(self) -> int:
        new = _json_rows(self._metrics.read())
        if self._metrics.reset:
            self.rows = {}
        for row in new:
            self.rows[row["step"]] = row
        comps = _json_rows(self._completions.read())
        if self._completions.reset:
            self.completions.clear()
        self.completions.extend(comps)
        lines = self._log.read()
        if self._log.reset:
            self.log_lines.clear()
            self.warnings = []
        for line in lines:
            line = line.rsplit("\r", 1)[-1].rstrip()  # a progress bar's last redraw
            if not line:
                continue
            self.log_lines.append(line)
            if HEALTH_MARK in line:
                self.warnings.append(line)
        return len(new)

    def poll(self) -> WatchView:
        new_rows = self._read()
        rows = [self.rows[s] for s in sorted(self.rows)]
        series, keys = {}, {}
        for label, candidates in SERIES.items():
            key = series_key(rows, candidates)
            if key is not None:
                keys[label] = key
                series[label] = [(r["step"], _number(r[key])) for r in rows if _number(r.get(key)) is not None]
        tail = list(self.log_lines)
        state, error, st = run_state(self.run_dir, tail)
        step = st.get("step") if isinstance(st.get("step"), int) else (rows[-1]["step"] if rows else 0)
        last_step = st.get("last_step") if isinstance(st.get("last_step"), int) else _recipe_steps(self.run_dir)
        times = [t for t in (_number(r.get("step_time")) for r in rows) if t is not None]
        resumable = state in RESUMABLE and live_pid(self.run_dir) is None and resume_refusal(self.run_dir) is None
        progress = Progress(
            step=step,
            last_step=last_step,
            step_time_s=statistics.median(times) if times else None,
            eta_s=(  # evaluation included (lorarl.app.timeleft)
                eta_seconds(times, step, last_step, evaluation_per_step(rows, step))
                if state in ("running", "starting")
                else None
            ),
            inside=inside_step(read_step(self.run_dir), rows) if state == "running" else "",
        )
        recipe = self.recipe()
        files = eval_files(self.run_dir)
        measured = any(files.values())
        final_eval = final_eval_of(recipe.get("algo", "grpo"))
        empty = {
            label: empty_reason(label, SERIES[label], recipe, rows, final_eval, measured)
            for label in SERIES
            if label not in series
        }
        return WatchView(
            run=self.name,
            state=state,
            error=error,
            progress=progress,
            series=series,
            series_keys=keys,
            warnings=health_warnings(rows, self.warnings),
            completions=list(self.completions),
            log_tail=tail[-RECENT:],
            crash_lines=tail[-RECENT:] if state in ("crashed", "failed") else [],
            latest=rows[-1] if rows else {},
            new_rows=new_rows,
            resumable=resumable,
            result=result_markdown(self.run_dir, rows, last_step, files) if state == "finished" else "",
            note=stop_outcome(tail, step) if state == "stopped" else "",
            empty=empty,
        )


# ---------------------------------------------------------------------------------------------------------------
# Listing runs
# ---------------------------------------------------------------------------------------------------------------

RUN_MARKERS = ("recipe.yaml", METRICS_FILE, LOG_FILE, "state.json", "train.pid")


@dataclass(frozen=True)
class RunSummary:
    """One run folder: its name, state (:func:`run_state`), step of last step, algorithm, last change (mtime)."""

    name: str
    path: Path
    state: str
    step: int | None
    last_step: int | None
    algo: str | None
    mtime: float

    @property
    def label(self) -> str:
        of = f"/{self.last_step}" if self.last_step else ""
        at = f" step {self.step}{of}" if self.step is not None else ""
        return f"{self.name} · {self.algo or '?'} · {self.state}{at}"


def tail_lines(path: Path, n: int, window: int = 16384) -> list[str]:
    """The last ``n`` lines of a file (read from its last ``window`` bytes; [] when missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - window))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return [line for line in lines if line][-n:]


def _last_metrics_step(path: Path) -> int | None:
    rows = _json_rows(tail_lines(path, 5))
    return rows[-1]["step"] if rows else None


def _mtime(paths: list[Path]) -> float:
    """The newest modification time of ``paths``; a file removed meanwhile (train.pid as a run ends) is skipped."""
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def _algo(run: Path) -> str | None:
    """The run's algorithm: its ``recipe.yaml``'s, else (a launch still loading) the launched recipe's."""
    from lorarl.config import yaml_load

    launch = read_launch(run)
    for path in (run / "recipe.yaml", Path(launch["recipe"]) if launch else None):
        try:
            data = yaml_load(path.read_text(encoding="utf-8")) if path is not None else None
        except Exception:  # no or unreadable recipe
            continue
        if isinstance(data, dict):
            return str(data.get("algo", "grpo"))
    return None


def summarize(run: Path, name: str) -> RunSummary | None:
    """One run folder as a :class:`RunSummary` (None: no run file in it). Never raises for a broken folder: what
    cannot be read is left out, an unreadable state file reads as ``unreadable``."""
    present = [run / m for m in RUN_MARKERS if (run / m).exists()]
    if not present:
        return None
    try:
        state, _, st = run_state(run, tail_lines(run / LOG_FILE, 5))
        step = st.get("step") if isinstance(st.get("step"), int) else _last_metrics_step(run / METRICS_FILE)
        last = st.get("last_step") if isinstance(st.get("last_step"), int) else _recipe_steps(run)
    except OSError:  # the folder changed under us (a run ending, a folder removed)
        state, step, last = UNREADABLE, None, None
    return RunSummary(name, run, state, step, last, _algo(run), _mtime(present))


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


def list_runs(runs_dir: str | os.PathLike) -> list[RunSummary]:
    """Every run folder directly under ``runs_dir`` (launched here or from a terminal) and every stage of a pipeline
    output folder there (named ``PIPELINE/STAGE``), newest change first; the exports folder and folders without any
    run file are left out. One broken folder never hides the others."""
    out = []
    for run in _subdirs(Path(runs_dir)):
        if run.name == EXPORTS:
            continue
        if is_pipeline_dir(run):
            out += [s for stage in _subdirs(run) if (s := summarize(stage, f"{run.name}/{stage.name}"))]
            continue
        summary = summarize(run, run.name)
        if summary is not None:
            out.append(summary)
    return sorted(out, key=lambda r: r.mtime, reverse=True)


def run_choices(runs_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """``(label, name)`` pairs of :func:`list_runs` for a dropdown."""
    return [(r.label, r.name) for r in list_runs(runs_dir)]
