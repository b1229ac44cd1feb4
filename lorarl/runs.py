"""The run directory, and every rule that finds something in it: written once, used by train, eval, chat, export.

Layout of a run directory (``lorarl train RECIPE --out DIR``)::

    DIR/recipe.yaml                      the resolved recipe
    DIR/metrics.jsonl, DIR/tb/           one JSON row per logged step; TensorBoard events
    DIR/plot.png, DIR/eval.json          the plot; the last `lorarl eval` of the final adapter
    DIR/<role>/                          final adapters (policy/, critic/, reward/): PEFT folders (+ head.safetensors)
    DIR/checkpoints/step-NNNNNN/         step checkpoints (see lorarl.checkpoint), complete when COMPLETE exists
    DIR/best/                            with train.keep_best: a copy of the best checkpoint by the chosen metric
    DIR/completions.jsonl                a few sampled completions per step (train.log_completions)
    DIR/state.json, DIR/train.pid        how far the run got; the process training it (lorarl.runstate)

**Finding the adapter of a role** in a path given by a user (:func:`find_adapter`), in this order:

1. the path is itself an adapter folder (it holds ``adapter_config.json``);
2. ``PATH/<role>/`` (a run directory's final adapter, or a step checkpoint's);
3. ``PATH/checkpoints/<newest complete step>/<role>/`` (a run that stopped before writing its final adapter).

**Relative paths in recipes** (:func:`resolve_path`: data files, adapters, reward files) are looked up in the
current directory first, then beside the recipe file; ``pkg:NAME`` names a file shipped in ``lorarl/data/``.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path

from lorarl.errors import LorarlError

CHECKPOINTS = "checkpoints"
STEP_RE = re.compile(r"^step-(\d{6,})$")
MARKER = "COMPLETE"
PKG_PREFIX = "pkg:"
ADAPTER_CONFIG = "adapter_config.json"


def step_name(step: int) -> str:
    """``40`` -> ``"step-000040"``."""
    return f"step-{int(step):06d}"


def is_adapter(folder: Path) -> bool:
    """A PEFT adapter folder (holds ``adapter_config.json``)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def is_run_dir(folder: Path) -> bool:
    """A run directory written by ``lorarl train`` (holds ``recipe.yaml`` or ``metrics.jsonl``)."""
    folder = Path(folder)
    return (folder / "recipe.yaml").is_file() or (folder / "metrics.jsonl").is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders and folders without COMPLETE are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    cps = list_checkpoints(run_dir)
    return cps[-1] if cps else None


def checkpoint_step(folder: Path) -> int | None:
    """The step of a checkpoint folder (``state.json``; ``best.json`` for ``RUN/best``; else its name), or None."""
    for name in ("state.json", "best.json"):
        state = Path(folder) / name
        if not state.is_file():
            continue
        try:
            step = json.loads(state.read_text()).get("step")
            if isinstance(step, int):
                return step
        except json.JSONDecodeError:
            pass
    m = STEP_RE.match(Path(folder).name)
    return int(m.group(1)) if m else None


def named_checkpoint(run_dir: Path, name: str) -> Path:
    """A run's checkpoint by name: ``step-000040``, ``40``, ``latest`` or ``best`` (the adapters ``train.keep_best``
    kept in ``run_dir/best``). Raises LorarlError naming what exists."""
    root = Path(run_dir) / CHECKPOINTS
    if name == "best":
        best = Path(run_dir) / "best"
        if not (best / "best.json").is_file():
            raise LorarlError(f"{best}: no best checkpoint (train.keep_best names the metric that keeps one)")
        return best
    if name == "latest":
        cp = latest_checkpoint(run_dir)
        if cp is None:
            raise LorarlError(f"{root}: no complete checkpoint")
        return cp
    if name.isdigit():
        name = step_name(int(name))
    cp = root / name
    if not cp.is_dir():
        have = sorted(p.name for p in root.glob("step-*")) if root.is_dir() else []
        raise LorarlError(f"{cp}: no such checkpoint (have: {', '.join(have) or 'none'})")
    if not (cp / MARKER).is_file():
        raise LorarlError(f"{cp}: incomplete checkpoint (no {MARKER} file); pick another")
    return cp


def find_adapter(path: str | os.PathLike, role: str = "policy", what: str = "checkpoint") -> Path:
    """The adapter folder of ``role`` in ``path``, by the search order in the module docstring. ``what`` names the
    argument in the error (``"checkpoint"``, ``"ppo.reward.adapter"``, ...)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LorarlError(f"{what} {path}: no such folder (give a run directory or an adapter folder)")
    candidates = [p, p / role]
    newest = latest_checkpoint(p)
    if newest is not None:
        candidates.append(newest / role)
    for c in candidates:
        if is_adapter(c):
            return c
    raise LorarlError(f"{what} {path}: no PEFT adapter ({ADAPTER_CONFIG}) in it, in its {role}/ folder or checkpoints")


def run_dir_of(folder: Path) -> Path | None:
    """The run directory an adapter or checkpoint folder belongs to (None for a stand-alone adapter)."""
    folder = Path(folder)
    if STEP_RE.match(folder.name) and folder.parent.name == CHECKPOINTS:
        return folder.parent.parent
    if STEP_RE.match(folder.parent.name) and folder.parent.parent.name == CHECKPOINTS:
        return folder.parent.parent.parent
    if is_run_dir(folder):
        return folder
    if is_run_dir(folder.parent):
        return folder.parent
    return None


def checkpoint_of(folder: Path) -> Path | None:
    """The step checkpoint an adapter folder (or the checkpoint itself) is part of, else None."""
    folder = Path(folder)
    if STEP_RE.match(folder.name) or (folder / MARKER).is_file():
        return folder
    if STEP_RE.match(folder.parent.name):
        return folder.parent
    return None


KERNEL_TREES = ("/proc", "/sys", "/dev")  # file systems of the kernel: nothing lorarl writes belongs there


def check_output_folder(out: str | os.PathLike, what: str) -> None:
    """Refuse, with one line naming ``what`` (``--out``, ``run directory``), a folder lorarl cannot create or fill: a
    link that leads nowhere, something that is not a folder, a path below a file, one under /proc, /sys or /dev, or
    one whose nearest existing folder this process cannot write. Called before any slow work."""
    out = Path(out).expanduser()
    if out.is_symlink() and not out.exists():
        raise LorarlError(f"{what} {out}: a link to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise LorarlError(f"{what} {out}: exists and is not a folder")
    real = out.resolve()
    for tree in map(Path, KERNEL_TREES):
        if real == tree or tree in real.parents:
            raise LorarlError(f"{what} {out}: under {tree}, a kernel file system; choose a folder on a disk")
    existing = next(p for p in (real, *real.parents) if p.exists())
    if not existing.is_dir():
        raise LorarlError(f"{what} {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LorarlError(f"{what} {out}: {existing} is not writable by this user")


def shipped_file(name: str) -> Path:
    """A file shipped in ``lorarl/data/`` (``pkg:NAME``)."""
    root = Path(str(resources.files("lorarl") / "data"))
    path = root / name.lstrip("/")
    if not path.exists():
        shipped = sorted(p.name for p in root.glob("*.jsonl"))
        raise LorarlError(f"{PKG_PREFIX}{name}: no such file shipped with lorarl (shipped: {', '.join(shipped)})")
    return path


def resolve_path(value: str | os.PathLike, recipe_path: str | os.PathLike | None, what: str) -> Path:
    """A path from a recipe: ``pkg:NAME``; an absolute path; a relative path in the current directory, else beside
    the recipe file. Raises LorarlError naming ``what`` (the recipe key) when it exists in neither place."""
    text = str(value)
    if text.startswith(PKG_PREFIX):
        return shipped_file(text[len(PKG_PREFIX) :])
    p = Path(text).expanduser()
    if p.is_absolute() or p.exists():
        if not p.exists():
            raise LorarlError(f"{what} {value}: no such file or folder")
        return p
    if recipe_path is not None:
        beside = Path(recipe_path).parent / p
        if beside.exists():
            return beside
    where = f" (looked in {Path.cwd()} and {Path(recipe_path).parent})" if recipe_path else ""
    raise LorarlError(f"{what} {value}: no such file or folder{where}")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (a run dir or the file): a torn last line (a run killed mid-write) and
    lines that are not JSON objects are ignored; a missing file gives no rows."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
