"""Reading rows from files: JSON Lines and folders written by ``datasets``' ``save_to_disk``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from lorarl.errors import DataError

Split = Literal["train", "eval"]


def read_jsonl(path: Path, objects: bool = True) -> list:
    """The rows of a JSON Lines file (blank lines skipped). A line that is not JSON -- or, with ``objects``, not a
    JSON object -- raises :class:`DataError` naming the file, the line and the row."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {line_no} (row {len(rows)}) is not valid JSON ({e.msg})") from None
            if objects and not isinstance(row, dict):
                raise DataError(f"{path}: line {line_no} (row {len(rows)}) is not a JSON object")
            rows.append(row)
    return rows


def read_datasets_folder(path: Path, split: Split) -> list[dict]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise DataError(f"{path}: reading a datasets folder needs the `datasets` package") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for "not a saved dataset"
        raise DataError(f"{path}: not a folder saved with datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        wanted = ("train",) if split == "train" else ("test", "validation", "eval")
        name = next((s for s in wanted if s in ds), None)
        if name is None:
            if split == "train" and len(ds) == 1:
                name = next(iter(ds))
            else:
                raise DataError(f"{path}: no {' / '.join(wanted)} split (has: {', '.join(ds)})")
        ds = ds[name]
    return [dict(r) for r in ds]
