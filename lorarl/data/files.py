"""Reading rows from JSON Lines files (other files, folders and hub datasets: :mod:`lorarl.data.sources`)."""

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
            except (ValueError, RecursionError) as e:  # an int past 4,300 digits, brackets nested past the stack
                why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
                raise DataError(f"{path}: line {line_no} (row {len(rows)}) cannot be read ({why})") from None
            if objects and not isinstance(row, dict):
                raise DataError(f"{path}: line {line_no} (row {len(rows)}) is not a JSON object")
            rows.append(row)
    return rows
