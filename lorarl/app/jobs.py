"""The workbench's job runner: one ``lorarl train`` subprocess at a time, stop, resume.

A run launched from the page is exactly ``lorarl train RECIPE --out RUNS/NAME [overrides]`` (``python -m lorarl.cli``,
never a shell): the same code path and run folder as the terminal. The process gets its own session
(``start_new_session``), so closing the page or the app never stops it; its stdout and stderr go to
``RUNS/NAME/train.log`` (unbuffered, so the log grows as it trains). Who is training what is read from the run
folders (:mod:`lorarl.runstate`: ``train.pid``), so a run started from a terminal counts too; a process this runner
started is also counted before it has written its ``train.pid`` (while it loads the model).

The one-job rule: a launch or resume is refused, naming the live run, while any run under the runs folder has a
live process. Stop sends SIGTERM (:func:`lorarl.runstate.request_stop`): the loop finishes its step, writes a
checkpoint and exits 0; resume runs ``lorarl train RUNS/NAME/recipe.yaml --out RUNS/NAME --resume``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from lorarl.app.paths import check_name, checked_recipe, checked_run
from lorarl.config import load_recipe, parse_override
from lorarl.errors import LorarlError
from lorarl.runs import is_adapter
from lorarl.runstate import live_pid, now_iso, read_state, request_stop

LOG_FILE = "train.log"
# override keys that would run code chosen on the page (a tool, an environment, a reward function): refused
CODE_KEYS = ("agent",)
FINAL_ADAPTERS = ("policy", "reward")


def train_argv(recipe: Path, run_dir: Path, overrides: list[str], resume: bool = False) -> list[str]:
    """The command a launch runs: ``python -m lorarl.cli train RECIPE --out RUN_DIR [--resume] [overrides]``."""
    argv = [sys.executable, "-m", "lorarl.cli", "train", str(recipe), "--out", str(run_dir)]
    return argv + (["--resume"] if resume else []) + list(overrides)


def check_overrides(recipe: Path, overrides: list[str]) -> None:
    """Refuse overrides that would run code named on the page: ``agent.*`` (tools, environments), and a
    ``reward.functions`` list whose entries differ from the recipe's in anything but their weights."""
    base = None
    for text in overrides:
        if not isinstance(text, str):
            raise LorarlError(f"override {text!r} must be a section.key=value string")
        path, value = parse_override(text)
        if path[0] in CODE_KEYS:
            raise LorarlError(f"override {text}: {path[0]} settings name code; change them in the recipe file")
        if path[:2] == ["reward", "functions"]:
            if base is None:
                base = load_recipe(recipe, strict=False).reward.functions
            if len(path) > 2 or not isinstance(value, list) or len(value) != len(base):
                raise LorarlError(f"override {text}: only the weights of the recipe's reward functions may change")
            for spec, new in zip(base, value):
                if not isinstance(new, dict) or new.get("name") != spec.name or set(new) - {"name", "weight", "kwargs"}:
                    raise LorarlError(f"override {text}: only the weights of the recipe's reward functions may change")
                if (new.get("kwargs") or {}) != spec.kwargs:
                    raise LorarlError(f"override {text}: only the weights of the recipe's reward functions may change")


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
        self._lock = threading.Lock()

    # ---- who is training -------------------------------------------------------------------------------------
    def live(self) -> Path | None:
        """The run folder a live process is training (this runner's child or any ``train.pid``), else None."""
        for run, proc in list(self._procs.items()):
            if proc.poll() is None:
                return run
        if not self.runs_dir.is_dir():
            return None
        for run in sorted(p for p in self.runs_dir.iterdir() if p.is_dir()):
            if live_pid(run) is not None:
                return run
        return None

    def _run(self, run_dir: str | os.PathLike) -> Path:
        """``RUNS/NAME`` for a run name or path inside the runs folder (:func:`lorarl.app.paths.checked_run`)."""
        return self.runs_dir / checked_run(run_dir, self.runs_dir).name

    def _refuse_if_live(self) -> None:
        run = self.live()
        if run is not None:
            raise LorarlError(
                f"run {run.name} is training now (one run at a time on this machine); stop it or wait for it to end"
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
        check_name(run_name)
        run_dir = self.runs_dir / run_name
        check_overrides(recipe, overrides)
        load_recipe(recipe, overrides)  # the loader's one line, before any process starts
        with self._lock:
            self._refuse_if_live()
            if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
                raise LorarlError(f"run {run_name} already exists in {self.runs_dir}; pick another name or resume it")
            return self._spawn(run_dir, train_argv(recipe, run_dir, overrides))

    def stop(self, run_dir: str | os.PathLike) -> str:
        """Ask the run to stop after its current step (it saves a checkpoint and exits 0); returns what was done.
        A process this runner started that has not begun training yet (no ``train.pid``) is terminated."""
        run = self._run(run_dir)
        if request_stop(run):
            return f"asked run {run.name} to stop: it finishes its step, saves a checkpoint and exits"
        proc = self._procs.get(run)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            return f"run {run.name} had not started training yet; its process was terminated (nothing to save)"
        raise LorarlError(f"run {run.name} is not training; nothing to stop")

    def resume(self, run_dir: str | os.PathLike) -> Path:
        """``lorarl train RUN/recipe.yaml --out RUN --resume``: continue from the newest complete checkpoint.
        Refused while any run is live, and for a finished run."""
        run = self._run(run_dir)
        recipe = run / "recipe.yaml"
        if not recipe.is_file():
            raise LorarlError(f"run {run.name} has no recipe.yaml (it never started training); launch it again")
        with self._lock:
            self._refuse_if_live()
            if is_finished(run):
                raise LorarlError(f"run {run.name} has finished (final adapters written); nothing to resume")
            return self._spawn(run, train_argv(recipe, run, [], resume=True))

    def _spawn(self, run_dir: Path, argv: list[str]) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        with open(run_dir / LOG_FILE, "ab") as log:
            log.write(f"[{now_iso()}] $ {shlex.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self._procs[run_dir] = proc
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()  # no zombie left behind
        return run_dir
