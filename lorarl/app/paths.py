"""The workbench's only way from a name the browser sends to a file: recipes from the configured recipe folders
(and ``RUNS/NAME/recipe.yaml``), runs from the runs folder (``RUNS/NAME``, or ``RUNS/PIPELINE/STAGE`` for a
``lorarl pipeline`` output folder's stages), exports into ``RUNS/exports/``.

A path is refused (:class:`lorarl.errors.LorarlError`, one line naming it) when it has a ``..`` part, when it is
absolute and not under one of the folders, or when it resolves (symlinks followed) outside them. A run or export
name is a plain folder name: letters, digits, ``.``, ``_``, ``-``, not starting with a dot.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lorarl.config.shipped import shipped_recipes_dir
from lorarl.errors import LorarlError

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
RECIPE_SUFFIXES = (".yaml", ".yml")
EXPORTS = "exports"  # RUNS/exports/NAME: where the page's exports go
PIPELINE_FILE = "pipeline.yaml"  # written by `lorarl pipeline` into its output folder (lorarl.pipeline.run)


def is_inside(path: Path, folder: Path) -> bool:
    """True when ``path`` resolves (symlinks followed) to ``folder`` itself or a place inside it."""
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def check_name(name: str, what: str = "run name") -> str:
    """A plain folder name (see the module docstring), else LorarlError."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):  # (no "\n" after $)
        raise LorarlError(
            f"{what} {name!r} must be a plain folder name (letters, digits, . _ -; no / and not starting with .)"
        )
    return name


def check_run_name(name: str) -> str:
    """A new run's name: a plain folder name (:func:`check_name`) that is not the exports folder ``exports``."""
    check_name(name)
    if name == EXPORTS:
        raise LorarlError(f"run name {name!r} is taken: RUNS/{EXPORTS}/ holds the page's exports; pick another")
    return name


def _abs(path: Path) -> Path:
    """``path`` made absolute without following symlinks."""
    return Path(os.path.abspath(path))


def _home(path: Path, folders: list[Path]) -> Path | None:
    """The first folder ``path`` lies under, lexically (absolute or relative, before or after resolving the folder)."""
    for f in folders:
        if _abs(path).is_relative_to(_abs(f)) or _abs(path).is_relative_to(f.resolve()):
            return f
    return None


def _candidates(path: str | os.PathLike, folders: list[Path], what: str) -> list[Path]:
    """Where ``path`` may be: itself when it lies under a folder (absolute, or relative to the current directory),
    then (relative paths) under each folder in turn. An absolute path under no folder is refused."""
    text = str(path).strip()
    if not text:
        raise LorarlError(f"{what}: no path given")
    p = Path(text)
    if ".." in p.parts:
        raise LorarlError(f"{what} {text}: '..' is not allowed")
    if p.is_absolute():
        if _home(p, folders) is None:
            raise LorarlError(f"{what} {text}: outside {', '.join(str(f) for f in folders)}; refused")
        return [p]
    return ([p] if _home(p, folders) is not None else []) + [f / p for f in folders]


def checked_recipe(path: str | os.PathLike, recipe_dirs: list[Path], runs_dir: Path) -> Path:
    """The recipe file ``path`` names: a ``.yaml`` file in a recipe folder, or ``RUNS/NAME/recipe.yaml``; checked to
    stay inside its folder after symlinks. Returns the path as found (not resolved)."""
    runs_dir = Path(runs_dir)
    folders = [Path(d) for d in recipe_dirs] + [runs_dir]
    for c in _candidates(path, folders, "recipe"):
        home = _home(c, folders)
        if home is None or not c.is_file():
            continue
        if not is_inside(c, home):
            raise LorarlError(f"recipe {path}: resolves outside {home} (a symlink?); refused")
        if c.suffix not in RECIPE_SUFFIXES:
            raise LorarlError(f"recipe {path}: not a .yaml file")
        if home == runs_dir and (c.name != "recipe.yaml" or _abs(c.parent.parent) != _abs(runs_dir)):
            raise LorarlError(f"recipe {path}: in the runs folder only RUN/recipe.yaml files are recipes")
        return c
    raise LorarlError(f"recipe {path}: no such file in {', '.join(str(f) for f in folders)}")


def _same(a: Path, b: Path) -> bool:
    """The same folder, lexically or after resolving symlinks."""
    return _abs(a) == _abs(b) or a.resolve() == b.resolve()


def is_pipeline_dir(path: Path) -> bool:
    """A ``lorarl pipeline`` output folder: it holds ``pipeline.yaml``; its stages are ``NN-name/`` run folders."""
    return (Path(path) / PIPELINE_FILE).is_file()


def checked_run(run: str | os.PathLike, runs_dir: Path, *, must_exist: bool = True) -> Path:
    """The run folder ``run`` names: ``NAME`` (a folder name, or a path to a folder directly inside ``runs_dir``)
    or ``PIPELINE/STAGE`` (a stage folder of a pipeline's output folder in ``runs_dir``, :func:`is_pipeline_dir`),
    checked to stay inside ``runs_dir`` after symlinks."""
    runs_dir = Path(runs_dir)
    c = _candidates(run, [runs_dir], "run")[0]
    if not _same(c.parent, runs_dir):
        if not (_same(c.parent.parent, runs_dir) and is_pipeline_dir(c.parent)):
            raise LorarlError(
                f"run {run}: must be a folder directly inside {runs_dir} (or a stage of a pipeline there)"
            )
        check_name(c.parent.name)
    check_name(c.name)
    if c.exists() and not is_inside(c, runs_dir):
        raise LorarlError(f"run {run}: resolves outside {runs_dir} (a symlink?); refused")
    if must_exist and not c.is_dir():
        raise LorarlError(f"run {run}: no such run folder in {runs_dir}")
    return c


def run_label(run_dir: Path, runs_dir: Path) -> str:
    """How the page names a run folder: ``NAME``, or ``PIPELINE/STAGE`` for a pipeline's stage."""
    run_dir, runs_dir = Path(run_dir), Path(runs_dir)
    return run_dir.name if _same(run_dir.parent, runs_dir) else f"{run_dir.parent.name}/{run_dir.name}"


def recipe_folders(user_dirs: list[str | os.PathLike] | None) -> list[Path]:
    """The Train tab's recipe folders: the shipped ``recipes/`` always (the retrain buttons use its ``dpo.yaml`` and
    ``reward_model.yaml``), then the user's ``--recipes`` folders; a folder named twice is kept once."""
    out: list[Path] = []
    for d in [shipped_recipes_dir(), *(Path(u).expanduser() for u in user_dirs or [])]:
        d = d.resolve()
        if d not in out:
            out.append(d)
    return out


def export_folder(name: str, runs_dir: Path) -> Path:
    """``RUNS/exports/NAME`` for a plain export name; refused when ``RUNS/exports`` leads elsewhere."""
    check_name(name, "export name")
    root = Path(runs_dir) / EXPORTS
    if root.exists() and not is_inside(root, runs_dir):
        raise LorarlError(f"{root}: resolves outside {runs_dir} (a symlink?); refused")
    out = root / name
    if out.exists() and not is_inside(out, root):
        raise LorarlError(f"export {name}: resolves outside {root} (a symlink?); refused")
    return out
