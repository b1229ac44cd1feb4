"""The export folder: checked before any work, written into a temporary folder beside it and renamed into place.

A failed or killed export therefore leaves nothing half-written at ``--out``; replacing an existing, non-empty folder
needs ``force``; exporting over the run being exported is refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorarl.errors import LorarlError
from lorarl.runs import check_output_folder


def is_within(child: Path, parent: Path) -> bool:
    """Is ``child`` ``parent`` itself or inside it (links resolved)?"""
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_out(out: Path, force: bool, protected: list[Path | None]) -> None:
    """Refuse an ``out`` that holds any of ``protected`` (the run, the adapter), or that exists, is not an empty
    folder and ``force`` is not given, or one lorarl cannot write (:func:`lorarl.runs.check_output_folder`). Called
    before the (slow) export starts."""
    check_output_folder(out, "--out")
    for folder in filter(None, protected):
        if is_within(folder, out):
            raise LorarlError(f"{out}: refusing to export over the run itself ({folder} is inside it)")
    if out.exists() and not _is_empty_dir(out) and not force:
        raise LorarlError(f"{out}: already exists; pass --force to replace it")


def commit(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished temp folder to ``out`` (replacing an existing one only with ``force``)."""
    if out.exists():
        if _is_empty_dir(out):
            out.rmdir()
        elif not force:
            raise LorarlError(f"{out}: already exists; pass --force to replace it")
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "x")
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextmanager
def staging_folder(out: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``out`` to write the export into; renamed to ``out`` when the body finishes, removed
    when it raises (or is interrupted)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        commit(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
