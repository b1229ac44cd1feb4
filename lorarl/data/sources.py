"""Where rows come from: one rule for prompt sets and preference pairs alike.

``data.source`` / ``data.eval_source`` may name, tried in this order:

* ``pkg:NAME`` -- a file shipped in ``lorarl/data/``;
* ``python:NAME`` -- a ``datasets.Dataset`` / ``DatasetDict`` / list of dicts handed to :func:`lorarl.train`
  (:mod:`lorarl.inmemory`; a list is one split, ``train``);
* a path (:func:`lorarl.runs.resolve_path`: the current directory, then beside the recipe):

  - a ``.jsonl`` file, read line by line (:func:`lorarl.data.files.read_jsonl`: a bad line is named);
  - a ``.json`` / ``.parquet`` / ``.csv`` / ``.tsv`` file, read with ``datasets.load_dataset`` (one split, ``train``);
  - a folder written by ``save_to_disk`` (``datasets.load_from_disk``);
  - any other folder: read with ``datasets.load_dataset(folder, name=data.subset)``, like a hub dataset repository
    (``main/train-00000-of-00001.parquet`` plus a README declaring its configurations, or ``data/train.jsonl``, ...);

* otherwise a hub dataset name (``openai/gsm8k``), only when the text is not an existing path:
  ``datasets.load_dataset(name, name=data.subset)``. Offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``, or the hub
  unreachable) it is read from the ``datasets`` cache, and when it is not there the error says how to get a copy.

Splits (:func:`pick_split`): training reads ``data.split``, else ``train``, else the only split; evaluation reads
``data.eval_split``, else the first of ``test`` / ``validation`` / ``eval``; a source given as ``data.eval_source``
that has none of these is read whole when it has one split.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from lorarl.data.files import read_jsonl
from lorarl.errors import DataError, LorarlError
from lorarl.inmemory import dataset_rows, is_python_name, lookup
from lorarl.runs import PKG_PREFIX, resolve_path

Kind = Literal["train", "eval"]
EVAL_SPLITS = ("test", "validation", "eval")
TABLE_FILES = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_PATH_SUFFIXES = (".jsonl", *TABLE_FILES)


def pick_split(splits: list[str], kind: Kind, name: str | None, where: str, whole: bool = False) -> str | None:
    """The split to read from a dataset with ``splits``: ``name`` when given (``data.split`` / ``data.eval_split``);
    for training ``train`` or the only split; for evaluation the first of :data:`EVAL_SPLITS`, or (``whole``: the
    source is the held-out set itself) its only split. None when evaluation finds no held-out split."""
    key = "data.split" if kind == "train" else "data.eval_split"
    if name is not None:
        if name not in splits:
            raise DataError(f"{where}: {key} {name!r}: no such split (has: {', '.join(splits)})")
        return name
    if kind == "train":
        if "train" in splits:
            return "train"
        if len(splits) == 1:
            return splits[0]
        raise DataError(f"{where}: no train split (has: {', '.join(splits)}); set {key}")
    found = next((s for s in EVAL_SPLITS if s in splits), None)
    if found is None and whole and len(splits) == 1:
        return splits[0]
    return found


def is_hub_name(text: str) -> bool:
    """Could ``text`` be a hub dataset id (``name`` or ``owner/name``, no file suffix, not a relative path)?"""
    return bool(_HUB_ID.match(text)) and not text.lower().endswith(_PATH_SUFFIXES)


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Can a TCP connection to the hub (``HF_ENDPOINT``) be opened? Behind a proxy the library is left to decide."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline_mode():
    """``datasets`` and ``huggingface_hub`` in offline mode (cache only) for the duration of the block."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = saved[0]
        hub_constants.HF_HUB_OFFLINE = saved[1]


def _offline_hint(name: str, subset: str | None, key: str, why: str) -> str:
    args = f"{name!r}" + (f", {subset!r}" if subset else "")
    return (
        f"{key} {name}: not available offline ({why} and not in the datasets cache); download it once where "
        f'there is network (python -c "import datasets; datasets.load_dataset({args})") or point {key} at a local '
        "copy (a folder, a parquet or jsonl file)"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _config_error(e: BaseException, key: str, source: object) -> DataError:
    """datasets' "config name is missing / not found" (with the configurations there are) as one line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip() and not ln.startswith(("Example", "\t"))]
    return DataError(f"data.subset for {key} {source}: {' '.join(lines)}")


def load_hub(name: str, subset: str | None, key: str = "data.source") -> Any:
    """``datasets.load_dataset(name, name=subset)`` -> a DatasetDict. Offline (set by the environment, or the hub
    unreachable) it reads the ``datasets`` cache only; every failure becomes one DataError line naming ``key``."""
    import datasets
    import datasets.config

    set_offline = bool(datasets.config.HF_HUB_OFFLINE)
    offline = set_offline or not _hub_reachable()
    why = "offline mode is set: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE" if set_offline else "no network"
    try:
        with _offline_mode() if offline else contextlib.nullcontext():
            return datasets.load_dataset(name, name=subset)
    except ValueError as e:  # a missing or unknown configuration: datasets lists the ones there are
        if "config" in str(e).lower():
            raise _config_error(e, key, name) from None
        raise DataError(f"{key} {name}: cannot load ({_first_line(e)})") from None
    except (ConnectionError, FileNotFoundError, OSError) as e:
        if offline or "offline" in str(e).lower() or "couldn't reach" in str(e).lower():
            raise DataError(_offline_hint(name, subset, key, why)) from None
        raise DataError(f"{key} {name}: not found on the hub or locally ({_first_line(e)})") from None
    except Exception as e:  # datasets raises many types (DatasetNotFoundError, DataFilesNotFoundError, ...)
        raise DataError(f"{key} {name}: cannot load ({_first_line(e)})") from None


def _load_folder(path: Path, subset: str | None, key: str) -> Any:
    """A save_to_disk folder, or a folder of data files laid out like a hub dataset repository."""
    import datasets

    if is_saved_dataset(path):
        if subset:
            raise DataError(
                f"{key} {path}: data.subset applies to hub datasets and folders of data files, not to "
                "a folder saved with save_to_disk"
            )
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several types for a damaged folder
            raise DataError(f"{key} {path}: not a readable save_to_disk folder ({_first_line(e)})") from None
    try:
        return datasets.load_dataset(str(path), name=subset)
    except ValueError as e:
        if "config" in str(e).lower():
            raise _config_error(e, key, path) from None
        raise DataError(_not_a_dataset_folder(path, key, e)) from None
    except Exception as e:  # no data files, unreadable files, ...
        raise DataError(_not_a_dataset_folder(path, key, e)) from None


def _not_a_dataset_folder(path: Path, key: str, e: BaseException) -> str:
    return (
        f"{key} {path}: not a folder saved with datasets' save_to_disk, nor a folder of data files (parquet, "
        f"json(l), csv) datasets can read ({_first_line(e)})"
    )


def _load_table_file(path: Path, key: str) -> Any:
    import datasets

    builder = TABLE_FILES[path.suffix.lower()]
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files={"train": str(path)}, **kwargs)
    except Exception as e:  # a malformed file: datasets names the problem
        raise DataError(f"{key} {path}: cannot read it as {builder} ({_first_line(e)})") from None


def _rows_of(ds: Any, kind: Kind, split: str | None, where: str, whole: bool) -> list[dict] | None:
    """The rows of the picked split of a Dataset / DatasetDict (a lone Dataset is a dict with one ``train`` split)."""
    import datasets

    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({"train": ds})
    name = pick_split(list(ds), kind, split, where, whole)
    if name is None:
        return None
    return ds[name].to_list()


def read_source(
    source: str,
    kind: Kind = "train",
    *,
    subset: str | None = None,
    split: str | None = None,
    recipe_path: str | os.PathLike | None = None,
    key: str = "data.source",
    whole: bool = False,
    objects: bool = True,
) -> tuple[list[Any] | None, str]:
    """The rows of ``source`` for ``kind`` (see the module docstring) and a description of where they came from.

    ``split`` is the split name asked for (``data.split`` / ``data.eval_split``); ``whole``: ``source`` is the
    held-out set itself (``data.eval_source``); ``objects``: a JSON Lines line that is not an object is an error here
    (off: the caller names it). Rows are None for an evaluation when the source has no held-out split (a single file
    read as ``data.source``). Raises DataError naming ``key`` when the source cannot be read.
    """
    text = str(source)
    if is_python_name(text):  # a Dataset / DatasetDict / list of dicts handed to lorarl.train (lorarl.inmemory)
        where = f"{key} {text}"
        ds = dataset_rows(lookup(text, key), where)
        if isinstance(ds, list):  # one split, `train`, like a JSON Lines file
            return (ds if _rows_wanted(kind, split, where, whole) else None), text
        return _rows_of(ds, kind, split, where, whole), text
    try:
        path = resolve_path(text, recipe_path, key)
    except LorarlError as e:
        if text.startswith(PKG_PREFIX) or not is_hub_name(text):
            raise DataError(str(e)) from None
        try:
            ds = load_hub(text, subset, key)
        except DataError as hub_error:  # a mistyped local folder reads like a hub name: say both were tried
            raise DataError(
                f"{hub_error}; nor is it a local file or folder{str(e).partition('no such file or folder')[2]}"
            ) from None
        return _rows_of(ds, kind, split, f"{key} {text}", whole), f"{text} (hub)"
    where = f"{key} {path}"
    if path.is_dir():
        return _rows_of(_load_folder(path, subset, key), kind, split, where, whole), str(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return (read_jsonl(path, objects=objects) if _rows_wanted(kind, split, where, whole) else None), str(path)
    if suffix in TABLE_FILES:
        return _rows_of(_load_table_file(path, key), kind, split, where, whole), str(path)
    raise DataError(
        f"{key} {source}: expected `arithmetic`, a hub dataset name, a .jsonl / .json / .parquet / .csv file, or a "
        "folder (save_to_disk or data files)"
    )


def read_data_source(
    data: Any,
    source: str,
    kind: Kind,
    *,
    recipe_path: str | os.PathLike | None = None,
    whole: bool = False,
    objects: bool = True,
) -> tuple[list[Any] | None, str]:
    """:func:`read_source` with a recipe's ``data`` section (a :class:`lorarl.config.DataConfig`): its subset, the
    split name of ``kind`` (``data.split`` / ``data.eval_split``), errors naming ``data.eval_source`` when ``whole``
    (else ``data.source``); the columns ``data.columns`` maps from are checked against the first row."""
    rows, where = read_source(
        source,
        kind,
        subset=data.subset,
        split=data.split if kind == "train" else data.eval_split,
        recipe_path=recipe_path,
        key="data.eval_source" if whole else "data.source",
        whole=whole,
        objects=objects,
    )
    if rows is not None:
        check_columns(rows, data.columns, where)
    return rows, where


def _rows_wanted(kind: Kind, split: str | None, where: str, whole: bool) -> bool:
    """A JSON Lines file is one split, ``train``: is it the split asked for?"""
    return pick_split(["train"], kind, split, where, whole) is not None


# ---------------------------------------------------------------------------------------------------------------
# Column mapping and answer extraction (data.columns, data.answer_pattern)
# ---------------------------------------------------------------------------------------------------------------


def check_columns(rows: list[Any], columns: dict[str, str], where: str) -> None:
    """Every column ``data.columns`` maps from must exist in the first row; else DataError naming the key, the
    column and the columns there are (a wrong mapping is the recipe's error, never a skippable bad row)."""
    if not columns or not rows or not isinstance(rows[0], dict):
        return
    have = list(rows[0])
    for name, column in columns.items():
        if column not in rows[0]:
            raise DataError(f"{where}: data.columns.{name}: no column {column!r} (columns: {', '.join(have)})")


def map_columns(row: dict, columns: dict[str, str], i: int) -> dict:
    """Row ``i`` under lorarl's names: each ``name: column`` of ``columns`` copies ``row[column]`` to ``name``;
    mapped-from columns are dropped (renamed), other columns kept. A column may be mapped twice
    (``{answer: answer, solution: answer}`` keeps the full text as ``solution``).

    Example: ``{"question": "q", "answer": "a", "id": 3}`` with ``{prompt: question}`` -> ``{"answer": "a", "id": 3,
    "prompt": "q"}``."""
    if not columns:
        return row
    missing = [f"data.columns.{n}: column {c!r}" for n, c in columns.items() if c not in row]
    if missing:
        raise DataError(f"row {i}: {missing[0]} is missing (columns: {', '.join(row)})")
    out = {k: v for k, v in row.items() if k not in set(columns.values())}
    out.update({name: row[column] for name, column in columns.items()})
    return out


def answer_regex(pattern: str | None) -> re.Pattern | None:
    """``data.answer_pattern`` (a preset name or a regex with one group) compiled with ``re.MULTILINE``."""
    from lorarl.config.schema import ANSWER_PATTERNS

    if pattern is None:
        return None
    return re.compile(ANSWER_PATTERNS.get(pattern, pattern), re.MULTILINE)


def extract_answer_column(value: Any, regex: re.Pattern, i: int, column: str = "answer") -> str | None:
    """The group of the last match of ``regex`` in row ``i``'s ``column`` (stripped); None stays None (the rewards
    skip such a row). No match raises DataError naming the row, the column and the pattern.

    Example: ``"48 + 24 = 72 clips.\\n#### 72"`` with the ``gsm8k`` preset ``####\\s*(.+?)\\s*$`` -> ``"72"``."""
    if value is None:
        return None
    text = str(value)
    matches = list(regex.finditer(text))
    if not matches or not matches[-1].group(1) or not matches[-1].group(1).strip():
        shown = text if len(text) <= 60 else "..." + text[-57:]
        raise DataError(f"row {i}: column '{column}' does not match data.answer_pattern {regex.pattern!r}: {shown!r}")
    return matches[-1].group(1).strip()
