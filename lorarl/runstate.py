"""Run control files of a run directory: who is training it (``train.pid``) and how far it got (``state.json``).

Pure file I/O and process checks (no torch), so the browser workbench can read them while a run trains.
:func:`lorarl.algos.loop.train` writes both; anything else only reads them, or asks a live run to stop
(:func:`request_stop`: SIGTERM, which the loop turns into "finish this step, save a checkpoint, exit 0").

``DIR/train.pid`` (present only while ``loop.train`` runs; written atomically)::

    {"pid": 4242, "host": "gpu-box", "started": "2026-11-25T16:40:00+00:00", "argv": ["lorarl", "train", ...],
     "proc_start": 123456, "pgid": 4242}

``proc_start`` is the process's start time in clock ticks since boot (field 22 of ``/proc/PID/stat``; absent where
there is no ``/proc``): a pid reused by another process after the run died has another start time, so a stale file
never names a live run (and Stop never signals the wrong process). ``pgid`` is its process group. Where ``/proc``
exists a file without ``proc_start`` names no live run (a forged or foreign file blocks nothing), and Stop
(:func:`request_stop`) signals only a process whose start time and process group both match the file, never this
process -- never a process picked by its name. All of these fields can be read, and so forged, by anyone who can write
the folder: :func:`request_stop` is for a script's own run folder; the workbench signals only the processes it
started itself (:mod:`lorarl.app.jobs`).

``DIR/state.json`` (written atomically at the start, after every step, and at the end)::

    {"state": "running", "step": 3, "last_step": 40, "updated": "2026-11-25T16:41:07+00:00", "error": null}

``state``: ``running`` (a process is training it), ``stopped`` (it stopped on request after a checkpoint of
``step``: ``lorarl train --resume`` continues), ``finished`` (final adapters written), ``crashed`` (an exception, its
one line in ``error``; or the process died without saying why: a ``running`` file whose process is gone reads as
``crashed``). A folder without the file reads as ``{"state": "new"}``.

``DIR/completions.jsonl`` (:class:`CompletionsLog`): a few sampled completions per step (``train.log_completions``).
:class:`StopRequest` is the SIGTERM flag the loop checks after each step; inside a step the rollout engines
watch it too (:meth:`StopRequest.observed`) and end a long generation early with :class:`StepAbandoned`.
docs/metrics.md describes the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from lorarl.errors import LorarlError
from lorarl.runfiles import open_nofollow, write_atomic

PID_FILE = "train.pid"
STATE_FILE = "state.json"
LOG_FILE = "train.log"  # the workbench's launches write the process's output here (lorarl.app.jobs)
LAUNCH_FILE = "launch.json"  # the workbench's record of a launch: recipe, overrides, working folder (lorarl.app.jobs)
VOTES_FILE = "votes.jsonl"  # a retrain's copy of the chat's votes at launch (lorarl.app.retrain), ties beside it
VOTES_TIES_FILE = "votes_ties.jsonl"
# written before `lorarl train` starts: a folder of only these is not a run
PRE_RUN_FILES = (LOG_FILE, LAUNCH_FILE, VOTES_FILE, VOTES_TIES_FILE)
STATES = ("new", "running", "stopped", "finished", "crashed")
KILLED = "the process ended without saying why (killed?)"


def now_iso() -> str:
    """The current UTC time, ISO 8601 with seconds (``2026-11-25T16:40:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` atomically (:func:`lorarl.runfiles.write_atomic`: a reader sees the old
    file or the new one, never half of one; a link at ``path`` is refused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data))


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None when the file does not exist. A file that cannot be read or is not a JSON
    object raises :class:`LorarlError` naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise LorarlError(f"{path}: cannot read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LorarlError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise LorarlError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


# --- train.pid ----------------------------------------------------------------------------------------------------


def proc_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot: field 22 (``starttime``) of ``/proc/PID/stat``; None
    when there is no such process or no ``/proc``. The fields are counted after the last ``)``, since the command
    name in parentheses (field 2) may itself hold spaces and parentheses."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields 3, 4, ...: field N is fields[N - 3]
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def write_pid(run_dir: str | os.PathLike, argv: list[str] | None = None, pid: int | None = None) -> Path:
    """``DIR/train.pid`` for this process (or for child ``pid``, which a launcher writes the moment it starts it, so
    the run counts as live while it still loads): pid, host name, start time, command line (default ``sys.argv``)
    and the process's start time in clock ticks (:func:`proc_start_ticks`)."""
    path = Path(run_dir) / PID_FILE
    pid = os.getpid() if pid is None else pid
    info = {"pid": pid, "host": socket.gethostname(), "started": now_iso(), "argv": list(argv or sys.argv)}
    ticks = proc_start_ticks(pid)
    if ticks is not None:
        info["proc_start"] = ticks
    with contextlib.suppress(OSError):
        info["pgid"] = os.getpgid(pid)
    write_json_atomic(path, info)
    return path


def clear_pid(run_dir: str | os.PathLike) -> None:
    """Remove ``DIR/train.pid`` if it is this process's (a file another process wrote since is left alone)."""
    path = Path(run_dir) / PID_FILE
    try:
        info = read_json(path)
    except LorarlError:
        info = None
    if info is not None and info.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def process_alive(pid: int, proc_start: int | None = None) -> bool:
    """Whether ``pid`` is the running process a ``train.pid`` names: it exists (``os.kill(pid, 0)``), is not a
    zombie, and (where ``/proc`` exists) started at ``proc_start`` (clock ticks, :func:`proc_start_ticks`). Without
    a ``proc_start`` it counts as dead where ``/proc`` exists: a process is never recognised by its name (a forged
    file naming any process, this one included, blocks nothing). A pid reused by another process counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():  # no /proc (macOS): existence is all we can tell
        return True
    try:
        stat = (proc / "stat").read_text()
    except OSError:  # it ended between the checks
        return False
    if stat[stat.rfind(")") + 2 :].startswith("Z"):  # state field follows "(comm) "
        return False
    return proc_start is not None and proc_start_ticks(pid) == proc_start


def process_owner(pid: int) -> int | None:
    """The user id that owns process ``pid`` (the owner of ``/proc/PID``), None where there is no ``/proc``."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def describe_process(pid: int, width: int = 80) -> str:
    """``pid 4242, `python -m lorarl.cli train ...`, user alice``: what a page shows of a process a ``train.pid``
    names (its command line from ``/proc/PID/cmdline``, clipped to ``width``; its owner when it is not this user)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        command = " ".join(" ".join(a.decode("utf-8", "replace") for a in argv).split()).replace("`", "'")
    except OSError:
        command = ""
    command = command if len(command) <= width else command[: width - 1] + "…"
    text = f"pid {pid}" + (f", `{command}`" if command else "")
    owner = process_owner(pid)
    if owner is not None and owner != os.getuid():
        import pwd

        try:
            text += f", user {pwd.getpwuid(owner).pw_name}"
        except KeyError:
            text += f", user id {owner}"
    return text


def live_pid(run_dir: str | os.PathLike) -> int | None:
    """The pid training ``run_dir`` now: ``DIR/train.pid`` exists, names this host, and its process is alive and is
    the one that wrote the file (:func:`process_alive` with the file's ``proc_start``); else None."""
    try:
        info = read_json(Path(run_dir) / PID_FILE)
    except (LorarlError, OSError):
        return None
    if not info or info.get("host") != socket.gethostname():
        return None
    pid, start = info.get("pid"), info.get("proc_start")
    if not isinstance(pid, int) or not process_alive(pid, start if isinstance(start, int) else None):
        return None
    return pid


def stop_refusal(run_dir: str | os.PathLike, pid: int) -> str | None:
    """Why Stop must not signal ``pid`` (the live pid of ``run_dir``'s ``train.pid``), or None: it is this process,
    or its process group is not the one the file recorded (``pgid``; a file without one, where ``/proc`` exists,
    names no group)."""
    if pid == os.getpid():
        return f"{run_dir}: train.pid names this process (pid {pid}); not signalled"
    try:
        info = read_json(Path(run_dir) / PID_FILE) or {}
        group = os.getpgid(pid)
    except (LorarlError, OSError):
        return f"{run_dir}: process {pid} is gone"
    recorded = info.get("pgid")
    if Path("/proc").is_dir() and (not isinstance(recorded, int) or recorded != group):
        return f"{run_dir}: process {pid} is in process group {group}, not the run's ({recorded}); not signalled"
    return None


def request_stop(run_dir: str | os.PathLike) -> bool:
    """Ask the live run of ``run_dir`` to stop (SIGTERM: it finishes its step, saves a checkpoint, writes state
    ``stopped`` and exits 0). False when no process is training it, or when :func:`stop_refusal` gives a reason not
    to signal the one its ``train.pid`` names (the process is identified by start time and process group only)."""
    pid = live_pid(run_dir)
    if pid is None or stop_refusal(run_dir, pid) is not None:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


# --- state.json ---------------------------------------------------------------------------------------------------


def write_state(run_dir: str | os.PathLike, state: str, step: int, last_step: int, error: str | None = None) -> dict:
    """Write ``DIR/state.json`` atomically and return what was written."""
    if state not in STATES[1:]:
        raise ValueError(f"state must be one of {STATES[1:]}, got {state!r}")
    data = {"state": state, "step": int(step), "last_step": int(last_step), "updated": now_iso(), "error": error}
    write_json_atomic(Path(run_dir) / STATE_FILE, data)
    return data


def read_state(run_dir: str | os.PathLike) -> dict:
    """The run's state: ``DIR/state.json``, ``{"state": "new"}`` when there is none; a ``running`` state whose
    process is gone (no :func:`live_pid`) reads as ``crashed`` with the error :data:`KILLED`."""
    data = read_json(Path(run_dir) / STATE_FILE)
    if data is None:
        return {"state": "new"}
    if data.get("state") == "running" and live_pid(run_dir) is None:
        data = {**data, "state": "crashed", "error": KILLED}
    return data


def error_line(exc: BaseException) -> str:
    """An exception as one line: ``"ValueError: bad shape"`` (only the first line of a long message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def check_not_live(run_dir: str | os.PathLike) -> None:
    """Raise :class:`LorarlError` when another process is training ``run_dir`` now (two writers would interleave
    checkpoints and metrics)."""
    pid = live_pid(run_dir)
    if pid is not None and pid != os.getpid():
        raise LorarlError(
            f"{run_dir}: a run is training in this folder now (pid {pid}); stop it first (or remove "
            f"{Path(run_dir) / PID_FILE} if nothing trains it)"
        )


# --- stop on SIGTERM ----------------------------------------------------------------------------------------------


class StopRequest:
    """A flag set by SIGTERM while installed (``with StopRequest() as stop: ... stop.requested``).

    The handler is installed only in the main thread (Python allows no other) and the previous one is put back on
    exit. The loop checks :attr:`requested` after each step: it then saves a checkpoint, writes state ``stopped``
    and returns. :meth:`set` raises the flag without a signal (tests, an embedding program)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.requested = False
        self.signal: int | None = None  # the signal that set the flag, if one did
        self._previous: dict[int, object] = {}

    def set(self, signum: int | None = None) -> None:
        self.requested, self.signal = True, signum

    def _handle(self, signum, frame) -> None:
        self.set(signum)

    def __enter__(self) -> StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def is_set(self) -> bool:
        """:attr:`requested` (``threading.Event``'s name, for :func:`lorarl.chat.streaming.stopping_criteria`)."""
        return self.requested

    @contextlib.contextmanager
    def observed(self):
        """Inside: the rollout engines watch this flag (:func:`observed_stop`) and end a generation the moment it
        is raised, with :class:`StepAbandoned`. The loop enters it around each step's work only."""
        global _OBSERVED
        previous, _OBSERVED = _OBSERVED, self
        try:
            yield self
        finally:
            _OBSERVED = previous


_OBSERVED: StopRequest | None = None  # the flag generation watches (StopRequest.observed); None outside a step


class StepAbandoned(BaseException):
    """A stop was requested while a step was generating: the generation ended early and the step is abandoned
    (nothing trains on its partial rollout; the loop saves the last complete step's state, as ``stopped``).

    A ``BaseException``, like ``KeyboardInterrupt``: code that isolates failures with ``except Exception`` (reward
    functions, an LLM judge's answers) lets it through to the loop."""


def observed_stop() -> StopRequest | None:
    """The stop flag the current step's generation watches, or None (outside a training step: evaluation, chat,
    ``lorarl generate``, a program calling the engines itself)."""
    return _OBSERVED


def abandon_if_stopped(where: str = "generation") -> None:
    """Raise :class:`StepAbandoned` if the observed stop flag (:func:`observed_stop`) is raised. The decode loops
    call it between tokens: a Python attribute read, no device synchronisation."""
    if _OBSERVED is not None and _OBSERVED.requested:
        raise StepAbandoned(f"stop requested during {where}")


# --- completions.jsonl --------------------------------------------------------------------------------------------

COMPLETIONS_FILE = "completions.jsonl"


class CompletionsLog:
    """``DIR/completions.jsonl``: a few sampled completions per step (``train.log_completions``), one JSON object
    a line: ``{"step", "prompt", "completion", "reward", "advantage"?}`` (written by the run loop, flushed each step).

    A fresh run starts the file over; ``resume_step`` (resuming) keeps only the rows of steps up to it, as
    :class:`lorarl.metrics.MetricsLogger` does with ``metrics.jsonl``, so a resumed run's file reads as one run."""

    def __init__(self, run_dir: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(run_dir) / COMPLETIONS_FILE
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if _row_step(line) is not None]
            kept = [line for line in kept if _row_step(line) <= resume_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))
        elif resume_step is None:
            self.path.unlink(missing_ok=True)
        self._file = None

    def log(self, step: int, rows: list[dict]) -> None:
        """Append ``rows`` (each gets ``"step": step`` first) and flush."""
        if not rows:
            return
        if self._file is None:
            self._file = open_nofollow(self.path, "a")
        for row in rows:
            self._file.write(json.dumps({"step": int(step), **row}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _row_step(line: str) -> int | None:
    """The ``step`` of a JSONL line; None for a blank or half-written line (a process killed mid-write)."""
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def mark_crashed(run_dir: str | os.PathLike, exc: BaseException, default_last_step: int) -> dict:
    """State ``crashed`` with ``exc``'s one line (:func:`error_line`), at the step the last state file recorded."""
    try:
        previous = read_json(Path(run_dir) / STATE_FILE) or {}
    except LorarlError:
        previous = {}
    step, last = previous.get("step", 0), previous.get("last_step", default_last_step)
    return write_state(run_dir, "crashed", step, last, error_line(exc))
