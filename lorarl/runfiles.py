"""Writing files in a run folder without following a link.

A run folder can be copied from anywhere, and on a shared machine someone else may be able to write in the runs
folder. A symlink planted where lorarl writes (``RUN/train.log`` -> ``~/.bashrc``, ``RUN/checkpoints`` -> a folder
elsewhere) would make an append or a truncating write land outside the runs folder. So every file lorarl writes or
appends in a run folder goes through this module, which never writes through a link:

- :func:`open_nofollow` opens with ``O_NOFOLLOW`` (the kernel refuses a link as the last component, with no window
  between a check and the open) and only a regular file (a FIFO or a device is refused too);
- :func:`write_atomic` writes a temporary file beside ``path`` and renames it over ``path`` (a rename replaces a
  link, it never writes through one), after refusing a link at ``path``;
- :func:`refuse_links` checks every folder between a run folder and the file (``RUN/checkpoints/...``);
- :func:`check_run_folder` refuses a run folder that holds a link where lorarl writes, before a run starts.

Each refusal is one :class:`~lorarl.errors.LorarlError` line naming the link and where it leads. The run folder
itself may be a link (``--out`` onto another disk is the user's choice); only what lies inside it is checked.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

from lorarl.errors import LorarlError

CHECKPOINTS = "checkpoints"  # lorarl.runs.CHECKPOINTS (kept here: this module imports nothing of lorarl but errors)
_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


def link_line(path: Path) -> str:
    """``PATH is a symlink to TARGET; lorarl never writes through a link in a run folder: remove it (or pick
    another run folder)``."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{path} is a symlink to {target}; lorarl never writes through a link in a run folder: remove it (or pick "
        "another run folder)"
    )


def refuse_links(path: str | os.PathLike, below: str | os.PathLike | None = None) -> Path:
    """Raise one line when ``path`` is a symlink, or (``below`` given, a folder ``path`` lies in) when any folder
    between ``below`` and ``path`` is one; ``below`` itself is not checked. Returns ``path``."""
    path = Path(path)
    chain = [path]
    if below is not None:
        below = Path(below)
        try:
            rel = path.relative_to(below)
        except ValueError:
            raise LorarlError(f"{path}: not inside the run folder {below}") from None
        chain = [below.joinpath(*rel.parts[: i + 1]) for i in range(len(rel.parts))]
    for p in chain:
        if p.is_symlink():
            raise LorarlError(link_line(p))
    return path


def open_nofollow(
    path: str | os.PathLike, mode: str = "a", below: str | os.PathLike | None = None, encoding: str = "utf-8"
) -> IO:
    """``open(path, mode)`` for writing (``w`` / ``a``, ``b`` for bytes) that refuses a link (``O_NOFOLLOW``, and
    :func:`refuse_links` for the folders below ``below``) and anything but a regular file, with one line."""
    path = refuse_links(path, below)
    flags = _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a link (planted after the check above, or just now)
            raise LorarlError(link_line(path)) from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK: refused rather than waited on)
            raise LorarlError(f"{path} is not a regular file; lorarl writes only plain files in a run folder") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LorarlError(f"{path} is not a regular file; lorarl writes only plain files in a run folder")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))


def write_atomic(path: str | os.PathLike, data: str | bytes, below: str | os.PathLike | None = None) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file in the same folder and a rename: a
    reader sees the old file or the new one, never half of one. A link at ``path`` (or below ``below``) is refused
    with one line rather than replaced. Returns ``path``."""
    path = refuse_links(path, below)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_run_folder(run_dir: str | os.PathLike) -> None:
    """Refuse, before a run starts or resumes, a run folder holding a link where lorarl writes: any entry of the
    folder itself or of its ``checkpoints/`` (the folders lorarl writes in; a tracker's own folder such as
    ``wandb/`` is its own). A missing folder passes."""
    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / CHECKPOINTS):  # (a link at checkpoints/ is an entry of the first)
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_symlink():
                raise LorarlError(link_line(Path(entry.path)))
