"""The workbench's job runner: one ``lorarl train`` subprocess at a time, stop, resume.

A run launched from the page is exactly ``lorarl train RECIPE --out RUNS/NAME [overrides]`` (``python -m lorarl.cli``,
never a shell): the same code path and run folder as the terminal. The process gets its own session
(``start_new_session``), so closing the page or the app never stops it; its stdout and stderr go to
``RUNS/NAME/train.log`` (unbuffered, so the log grows as it trains). The runner keeps its own record of the
processes it started (their ``Popen``): only those are ever signalled. A run folder's ``train.pid``
(:mod:`lorarl.runstate`) is a file anyone who can write the folder can forge -- pid, start time, group and host --
so it is only read: a run started from a terminal (or another app) is named when a launch or resume is pressed, and
goes ahead when pressed again; Stop refuses it with a line saying what the file names.

Each launch records ``RUNS/NAME/launch.json`` (:data:`lorarl.runstate.LAUNCH_FILE`): the recipe file, the overrides
and the working folder, so a resume reads the recipe's relative paths (data, reward modules, tools) exactly as the
launch did.

The one-job rule: a launch or resume is refused, naming the live run, while a process this runner started trains;
a live process that a run's (or a pipeline stage's, ``RUNS/NAME/STAGE``) ``train.pid`` names refuses it once
(:meth:`JobRunner._refuse_if_live`). Stop sends SIGTERM to the runner's own child: the loop finishes its step,
writes a checkpoint and exits 0. Resume
(:func:`resume_source`) runs ``lorarl train RECIPE --out RUNS/NAME --resume [overrides]`` with the launch's recipe and
overrides when they still give the run's saved ``recipe.yaml``, else ``RUNS/NAME/recipe.yaml`` itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lorarl.app.paths import check_run_name, checked_recipe, checked_run, is_inside, is_pipeline_dir, run_label
from lorarl.config import load_recipe, parse_override
from lorarl.errors import LorarlError
from lorarl.runfiles import check_run_folder, open_nofollow
from lorarl.runs import is_adapter
from lorarl.runstate import (
    LAUNCH_FILE,
    LOG_FILE,
    PID_FILE,
    PRE_RUN_FILES,
    STATE_FILE,
    describe_process,
    live_pid,
    now_iso,
    proc_start_ticks,
    process_owner,
    read_json,
    read_state,
    write_json_atomic,
    write_pid,
    write_state,
)

LAUNCH_LOCK = ".launch.lock"
# override keys that would run code chosen on the page (a tool, an environment, a reward function): refused
CODE_KEYS = ("agent",)
FINAL_ADAPTERS = ("policy", "reward")


@contextlib.contextmanager
def launch_lock(runs_dir: Path):
    """Hold ``RUNS/.launch.lock`` (an exclusive ``flock``) while a launch checks the one-job rule and starts its
    process: two apps on one runs folder cannot both find it free at the same moment."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open_nofollow(runs_dir / LAUNCH_LOCK, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def train_argv(recipe: Path, run_dir: Path, overrides: list[str], resume: bool = False) -> list[str]:
    """The command a launch runs: ``python -m lorarl.cli train RECIPE --out RUN_DIR [--resume] [overrides]``."""
    argv = [sys.executable, "-m", "lorarl.cli", "train", str(recipe), "--out", str(run_dir)]
    return argv + (["--resume"] if resume else []) + list(overrides)


def check_overrides(recipe: Path, overrides: list[str]) -> None:
    """Refuse overrides that would run code named on the page: ``agent.*`` (tools, environments), and a
    ``reward.functions`` list whose entries, as the loader reads them, differ from the recipe's in anything but
    their weights (a judge's or remote reward's settings ride along unchanged)."""
    import dataclasses

    base = None
    for text in overrides:
        if not isinstance(text, str):
            raise LorarlError(f"override {text!r} must be a section.key=value string")
        path, value = parse_override(text)
        if path[0] in CODE_KEYS:
            raise LorarlError(f"override {text}: {path[0]} settings name code; change them in the recipe file")
        if path[:2] == ["reward", "functions"]:
            refused = LorarlError(f"override {text}: only the weights of the recipe's reward functions may change")
            if base is None:
                base = load_recipe(recipe, strict=False).reward.functions
            if len(path) > 2 or not isinstance(value, list) or len(value) != len(base):
                raise refused
            try:
                new = load_recipe(recipe, [text], strict=False).reward.functions
            except LorarlError:
                raise refused from None
            if any(dataclasses.replace(n, weight=b.weight) != b for n, b in zip(new, base)):
                raise refused


def write_launch(run_dir: Path, recipe: Path, overrides: list[str]) -> None:
    """``RUN/launch.json``: the recipe file (absolute), the overrides and the working folder of a launch."""
    info = {"recipe": os.path.abspath(recipe), "overrides": list(overrides), "cwd": os.getcwd(), "launched": now_iso()}
    write_json_atomic(run_dir / LAUNCH_FILE, info)


def read_launch(run_dir: Path) -> dict | None:
    """``RUN/launch.json`` when it is there and well-formed (``recipe`` a string, ``overrides`` strings), else None."""
    try:
        info = read_json(run_dir / LAUNCH_FILE)
    except LorarlError:
        return None
    if not info or not isinstance(info.get("recipe"), str):
        return None
    overrides = info.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return None
    return info


def _same_recipe(recipe: Path, overrides: list[str], saved: Path) -> bool:
    """``recipe`` with ``overrides`` resolves to what the run saved in ``saved`` (``RUN/recipe.yaml``, written by the
    run loop as ``yaml.safe_dump(recipe_to_dict(recipe))``)."""
    import yaml

    from lorarl.config import recipe_to_dict, yaml_load

    try:
        now = yaml.safe_load(yaml.safe_dump(recipe_to_dict(load_recipe(recipe, overrides)), sort_keys=False))
        return now == yaml_load(saved.read_text(encoding="utf-8"))
    except Exception:  # unreadable or no longer valid: not the same
        return False


def resume_source(run: Path, recipe_dirs: list[Path], runs_dir: Path) -> tuple[Path, list[str], Path | None]:
    """``(recipe, overrides, cwd)`` that resume run folder ``run``: the launch's recipe file and overrides
    (``RUN/launch.json``, the recipe still inside the configured folders) when they give the run's saved
    ``recipe.yaml`` -- relative data, reward and tool paths then resolve beside the original recipe as at launch --
    else ``RUN/recipe.yaml`` with no overrides; ``cwd`` the launch's working folder (None: this one). Raises
    LorarlError when there is neither (the process never started training).

    ``launch.json`` is a file in a run folder (copied from anywhere, or edited), so it gets Launch's checks: its
    overrides pass :func:`check_overrides` (none names code), and its working folder must be this process's own
    (a resume never runs in a folder a run folder names); either refused with one line naming the file."""
    saved, info = run / "recipe.yaml", read_launch(run)
    cwd = Path(info["cwd"]) if info and isinstance(info.get("cwd"), str) else None
    if cwd is not None and os.path.abspath(cwd) != os.getcwd():
        raise LorarlError(
            f"{run / LAUNCH_FILE}: launched in the working folder {cwd}, not this app's ({os.getcwd()}); refused: "
            "start the app in that folder to resume, or resume from a terminal there"
        )
    if info:
        try:
            original = checked_recipe(info["recipe"], recipe_dirs, runs_dir)
        except LorarlError:
            original = None
        if original is not None and (not saved.is_file() or _same_recipe(original, info["overrides"], saved)):
            try:
                check_overrides(original, list(info["overrides"]))
            except LorarlError as e:
                raise LorarlError(f"{run / LAUNCH_FILE}: {e}") from None
            return original, list(info["overrides"]), cwd
    if saved.is_file():
        return saved, [], cwd
    raise LorarlError(f"run {run.name} has no recipe.yaml (it never started training); launch it again")


def resume_refusal(run: Path) -> str | None:
    """Why run folder ``run`` cannot be resumed (the one-job rule aside), or None: it finished, it is a pipeline's
    stage (the pipeline resumes it), its state file is unreadable, or it never got as far as a recipe (no
    ``recipe.yaml`` and no ``launch.json``)."""
    if is_pipeline_dir(run.parent):
        return (
            f"{run.parent.name}/{run.name} is a stage of pipeline {run.parent.name}; resume the pipeline: "
            f"lorarl pipeline RECIPE --out {run.parent} --resume"
        )
    try:
        finished = is_finished(run)
    except LorarlError as e:
        return str(e)
    if finished:
        return f"run {run.name} has finished (final adapters written); nothing to resume"
    if not (run / "recipe.yaml").is_file() and read_launch(run) is None:
        return f"run {run.name} has no recipe.yaml (it never started training); launch it again"
    return None


def check_real_folder(run_dir: Path, name: str) -> None:
    """Refuse a new run's ``RUNS/NAME`` that is a symlink (live or dangling: a launch would write wherever it
    leads) or something other than a folder."""
    if run_dir.is_symlink():
        target = os.readlink(run_dir)
        dangling = "" if run_dir.exists() else ", which does not exist"
        raise LorarlError(
            f"run {name}: {run_dir} is a symlink to {target}{dangling}; a run must be a real folder inside "
            f"{run_dir.parent}: pick another name"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise LorarlError(f"run {name}: {run_dir} is a file, not a folder; pick another name")


def is_unstarted(run_dir: Path) -> bool:
    """A folder a launch may (re)use: missing, empty, or holding only what a launch writes before ``lorarl train``
    starts (:data:`lorarl.runstate.PRE_RUN_FILES`: a launch stopped or failed before training), and maybe the state
    ``stopped`` at step 0 that :meth:`JobRunner.stop` gives such a folder."""
    if not run_dir.exists():
        return True
    allowed = (*PRE_RUN_FILES, STATE_FILE) + ((PID_FILE,) if live_pid(run_dir) is None else ())  # (a dead launch's)
    if not run_dir.is_dir() or not all(p.name in allowed for p in run_dir.iterdir()):
        return False
    if not (run_dir / STATE_FILE).exists():
        return True
    try:
        state = read_json(run_dir / STATE_FILE) or {}
    except LorarlError:
        return False
    return state.get("state") == "stopped" and state.get("step") == 0


def run_dirs(runs_dir: Path):
    """Every folder that may hold a run: ``RUNS/NAME`` and one level below (``RUNS/PIPELINE/STAGE``), hidden ones
    and symlinks that lead outside the runs folder left out."""
    try:
        top = sorted(
            p
            for p in Path(runs_dir).iterdir()
            if p.is_dir() and not p.name.startswith(".") and is_inside(p, runs_dir)  # a symlink out is no run
        )
    except OSError:
        return
    for run in top:
        yield run
        try:
            subs = sorted(p for p in run.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            continue
        yield from subs


def is_finished(run_dir: Path) -> bool:
    """The run wrote its final adapters: state ``finished``, or (a run from before ``state.json``) a final adapter
    folder and no live process."""
    state = read_state(run_dir).get("state")
    if state == "finished":
        return True
    return state == "new" and any(is_adapter(run_dir / role) for role in FINAL_ADAPTERS)


class JobRunner:
    """Launch, stop and resume training runs under ``runs_dir``, recipes from ``recipe_dirs`` (and run folders)."""

    def __init__(self, runs_dir: str | os.PathLike, recipe_dirs: list[str | os.PathLike]):
        self.runs_dir = Path(runs_dir)
        self.recipe_dirs = [Path(d) for d in recipe_dirs]
        self._procs: dict[Path, subprocess.Popen] = {}
        self._started: dict[Path, float] = {}  # when this runner started each run's current process
        self._passed: set[tuple] = set()  # train.pid files of processes not started here, shown once and pressed on
        self._lock = threading.Lock()

    # ---- who is training -------------------------------------------------------------------------------------
    def own_live(self) -> Path | None:
        """The run folder a process this runner started (its own record, not a run folder's file) is training."""
        for run, proc in list(self._procs.items()):
            if proc.poll() is None:
                return run
        return None

    def others(self) -> list[tuple[Path, int, tuple]]:
        """``(run, pid, key)`` of each run or pipeline stage under the runs folder whose ``train.pid`` names a live
        process this runner did not start (a run from a terminal, another app, or a forged file: a pid, its start
        time and group can all be read and written by anyone who can write the folder), owned by this user; ``key``
        tells that file apart from a later one."""
        mine = {proc.pid for proc in self._procs.values() if proc.poll() is None} | {os.getpid()}  # (the app: no run)
        found = []
        for run in run_dirs(self.runs_dir):
            pid = live_pid(run) if (run / PID_FILE).exists() else None
            if pid is not None and pid not in mine and process_owner(pid) in (None, os.getuid()):
                found.append((run, pid, (run, pid, proc_start_ticks(pid))))
        return found

    def live(self) -> Path | None:
        """The run folder a live process is training: this runner's child, else a run of :meth:`others` not yet
        pressed on (:meth:`_refuse_if_live`); None when none."""
        own = self.own_live()
        if own is not None:
            return own
        return next((run for run, _, key in self.others() if key not in self._passed), None)

    def label(self, run_dir: Path) -> str:
        """``NAME`` or ``PIPELINE/STAGE`` (:func:`lorarl.app.paths.run_label`)."""
        return run_label(run_dir, self.runs_dir)

    def _run(self, run_dir: str | os.PathLike) -> Path:
        """``RUNS/NAME`` (or ``RUNS/PIPELINE/STAGE``) for a run name or path inside the runs folder
        (:func:`lorarl.app.paths.checked_run`)."""
        c = checked_run(run_dir, self.runs_dir)
        return self.runs_dir / self.label(c)

    def _refuse_if_live(self) -> None:
        """The one-job rule. A process this runner started refuses; a ``train.pid`` of a process it did not start
        refuses once, saying what it names: pressed again, the launch or resume goes ahead (such a file never blocks
        for good: it may be forged, or name a process that has nothing to do with training)."""
        run = self.own_live()
        if run is not None:
            raise LorarlError(
                f"run {self.label(run)} is training now (one run at a time on this machine); stop it or wait for it "
                "to end"
            )
        for run, pid, key in self.others():
            if key not in self._passed:
                self._passed.add(key)
                raise LorarlError(
                    f"run {self.label(run)}: its train.pid names {describe_process(pid)}, which this workbench did "
                    "not start; one run at a time: if it trains that run, wait for it or stop it where it was "
                    "started; if not, press the button again to go ahead"
                )

    def returncode(self, run_dir: str | os.PathLike) -> int | None:
        """The exit code of the process this runner started for ``run_dir`` (None: running, or not started here)."""
        proc = self._procs.get(self._run(run_dir))
        return None if proc is None else proc.poll()

    # ---- launch / stop / resume ------------------------------------------------------------------------------
    def launch(self, recipe_path: str | os.PathLike, run_name: str, overrides: list[str] | None = None) -> Path:
        """Start ``lorarl train RECIPE --out RUNS/run_name [overrides]``; returns the run folder. Refused (one line):
        a recipe outside the folders, a run name that is not a plain new folder name, overrides the loader rejects
        or that name code, a live run."""
        overrides = list(overrides or [])
        recipe = checked_recipe(recipe_path, self.recipe_dirs, self.runs_dir)
        check_run_name(run_name)
        run_dir = self.runs_dir / run_name
        check_overrides(recipe, overrides)
        load_recipe(recipe, overrides)  # the loader's one line, before any process starts
        with self._lock, launch_lock(self.runs_dir):
            self._refuse_if_live()
            check_real_folder(run_dir, run_name)
            if not is_unstarted(run_dir):
                raise LorarlError(f"run {run_name} already exists in {self.runs_dir}; pick another name or resume it")
            check_run_folder(run_dir)  # a link left where the launch writes (train.log...): one line, nothing written
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / STATE_FILE).unlink(missing_ok=True)  # a launch stopped before training: started over
            write_launch(run_dir, recipe, overrides)
            return self._spawn(run_dir, train_argv(recipe, run_dir, overrides), fresh_log=True)

    def stop(self, run_dir: str | os.PathLike, wait_s: float = 10.0) -> str:
        """Ask the run to stop after its current step (it saves a checkpoint and exits 0); returns what was done.
        Only a process this runner started is signalled (SIGTERM through its ``Popen``); a run whose ``train.pid``
        names another process is refused with one line naming it. A process this runner started that has not begun
        training yet (it has written no ``state.json`` of its own:
        it still loads, and SIGTERM would end it before its handler is installed) is terminated; once it
        has exited (waited up to ``wait_s``) a folder without a state file gets state ``stopped`` at step 0, so
        Resume starts it (from its launch's recipe) and Launch may reuse the name."""
        run = self._run(run_dir)
        name = self.label(run)
        proc = self._procs.get(run)
        if proc is None or proc.poll() is not None:  # signal only what this runner started: a train.pid is anyone's
            pid = live_pid(run)
            if pid is not None:
                raise LorarlError(
                    f"run {name}: not stopped: its train.pid names {describe_process(pid)}, which this workbench did "
                    f"not start (it signals only its own processes); stop it where it was started, or remove "
                    f"{run / PID_FILE} if nothing trains this run"
                )
            raise LorarlError(f"run {name} is not training; nothing to stop")
        # still loading: no state.json yet, or (a resume) only the one from before this process started
        state_mtime = (run / STATE_FILE).stat().st_mtime if (run / STATE_FILE).exists() else None
        loading = state_mtime is None or state_mtime < self._started.get(run, float("inf"))
        proc.send_signal(signal.SIGTERM)  # (Popen signals nothing once it has reaped its child: no reused pid)
        if not loading:
            return f"asked run {name} to stop: it finishes its step, saves a checkpoint and exits"
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return f"run {name} had not started training yet; its process was sent SIGTERM and has not exited yet"
        if live_pid(run) is None:
            (run / PID_FILE).unlink(missing_ok=True)  # the pid this runner wrote for the child
        if not (run / STATE_FILE).exists() and (run / LAUNCH_FILE).exists():
            write_state(run, "stopped", 0, self._planned_steps(run))
        return f"run {name} had not started training yet; its process was terminated (nothing to save)"

    def _planned_steps(self, run: Path) -> int:
        """``train.steps`` of the run's launch (0 when it cannot be read)."""
        try:
            recipe, overrides, _ = resume_source(run, self.recipe_dirs, self.runs_dir)
            return int(load_recipe(recipe, overrides, strict=False).train.steps)
        except (LorarlError, TypeError, ValueError):
            return 0

    def resume(self, run_dir: str | os.PathLike) -> Path:
        """``lorarl train RECIPE --out RUN --resume [overrides]`` (:func:`resume_source`): continue from the newest
        complete checkpoint. Refused while any run is live, and when :func:`resume_refusal` says why not."""
        run = self._run(run_dir)
        with self._lock, launch_lock(self.runs_dir):
            self._refuse_if_live()
            why = resume_refusal(run)
            if why:
                raise LorarlError(why)
            recipe, overrides, cwd = resume_source(run, self.recipe_dirs, self.runs_dir)
            check_run_folder(run)
            return self._spawn(run, train_argv(recipe, run, overrides, resume=True), cwd=cwd)

    def _spawn(self, run_dir: Path, argv: list[str], cwd: Path | None = None, fresh_log: bool = False) -> Path:
        """Start ``argv`` in its own session with its output in ``RUN/train.log`` (started over for a fresh launch,
        appended to on resume)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        with open_nofollow(run_dir / LOG_FILE, "wb" if fresh_log else "ab") as log:
            where = f" (in {cwd})" if cwd is not None and Path(cwd) != Path.cwd() else ""
            log.write(f"[{now_iso()}] $ {shlex.join(argv)}{where}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )
        self._procs[run_dir] = proc
        self._started[run_dir] = time.time()
        # live from now on for every runner on this folder (another app too), not only once the child has loaded
        write_pid(run_dir, argv, pid=proc.pid)
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()  # no zombie left behind
        return run_dir
