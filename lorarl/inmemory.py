"""Python objects handed to :func:`lorarl.train` (reward functions, datasets, tools, an environment class) under
names a recipe can hold: ``python:NAME``.

A recipe is YAML, so it cannot hold a function or a ``datasets.Dataset``. The Python door registers each object here
under ``python:NAME`` (a callable's ``__name__``; ``train_dataset`` / ``eval_dataset`` for data) and writes that name
into the recipe, where a file path or ``module:function`` would stand; the loaders that read those keys
(:func:`lorarl.user_code.load_object` for functions, tools and environments, :func:`lorarl.data.sources.read_source`
for rows) look ``python:`` names up here. So ``recipe.yaml`` in the run folder stays valid YAML naming what was
passed (``reward.functions: [{name: "python:reward_len"}]``, ``data.source: "python:train_dataset"``), and the run
folder's ``python_objects.json`` records each object's kind and, for data, a fingerprint of its rows: resuming from
Python checks the same data came back; the command line, which has no such objects, refuses with one line.

The registry is this process's: names are looked up when a run (or its evaluation) sets up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

PREFIX = "python:"
OBJECTS_FILE = "python_objects.json"  # in the run folder: what each python: name was

_objects: dict[str, Any] = {}


def is_python_name(spec: Any) -> bool:
    """Whether a recipe value names a registered Python object (``python:NAME``)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def register(name: str, obj: Any) -> str:
    """Keep ``obj`` under ``python:name`` (replacing an earlier object of that name) and return that name."""
    name = name.removeprefix(PREFIX)
    if not name or any(c in name for c in "\n\r\"'"):
        raise LorarlError(f"python object name {name!r}: must be a non-empty name on one line without quotes")
    _objects[name] = obj
    return PREFIX + name


def lookup(spec: str, what: str) -> Any:
    """The object registered as ``spec`` (``python:NAME``); one :class:`LorarlError` line naming ``what`` when no
    object of that name was handed over in this process (a recipe written by the Python door, run from the CLI)."""
    name = spec.removeprefix(PREFIX)
    if name not in _objects:
        raise LorarlError(
            f"{what} {spec!r}: no Python object of that name in this process; a run given Python objects runs (and "
            "resumes) only from Python: lorarl.train(..., resume=True) with the same objects"
        )
    return _objects[name]


def callable_name(fn: Any, what: str) -> str:
    """The name a callable is registered under: its ``__name__`` (TRL names a reward function's metrics by it), or
    its class's name for a callable object."""
    if not callable(fn):
        raise LorarlError(f"{what}: {type(fn).__name__} is not callable")
    return getattr(fn, "__name__", None) or type(fn).__name__


def dataset_rows(obj: Any, what: str) -> Any:
    """``obj`` as :func:`lorarl.data.sources.read_source` reads it: a ``datasets.Dataset`` / ``DatasetDict`` as it is,
    a list (or tuple) of dicts as a list. Anything else: one line naming ``what``."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(obj, (datasets.Dataset, datasets.DatasetDict)):
        return obj
    if isinstance(obj, (list, tuple)):
        for i, row in enumerate(obj):
            if not isinstance(row, dict):
                raise LorarlError(f"{what}: row {i} is a {type(row).__name__}, not a dict of columns")
        return list(obj)
    raise LorarlError(
        f"{what}: expected a datasets.Dataset, a DatasetDict or a list of dicts, got {type(obj).__name__}"
    )


def fingerprint(obj: Any) -> str:
    """A SHA-256 of a dataset's rows (every split of a DatasetDict, in order, with its name), as canonical JSON:
    the same rows give the same fingerprint whether they came as a list or a Dataset."""
    h = hashlib.sha256()
    splits = obj.items() if hasattr(obj, "items") and not isinstance(obj, list) else [("train", obj)]
    for split, rows in splits:
        h.update(f"split:{split}\n".encode())
        for row in rows:
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
            h.update(b"\n")
    return h.hexdigest()[:16]


def describe(obj: Any) -> dict:
    """What ``python_objects.json`` records of an object: its kind, for a callable its module and qualified name,
    for data its split sizes and :func:`fingerprint`."""
    if callable(obj) and not isinstance(obj, (list, tuple)) and not hasattr(obj, "column_names"):
        return {
            "kind": "callable",
            "qualname": f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}",
        }
    if hasattr(obj, "items") and not isinstance(obj, list):
        rows = {split: len(ds) for split, ds in obj.items()}
    else:
        rows = {"train": len(obj)}
    return {"kind": "dataset", "rows": rows, "fingerprint": fingerprint(obj)}


def check_same_objects(run_dir: Path, names: dict[str, Any]) -> None:
    """On resume from Python: each dataset handed over now must have the fingerprint the run recorded; a name the run
    recorded must be handed over again (one line each, naming the object)."""
    path = Path(run_dir) / OBJECTS_FILE
    if not path.is_file():
        return
    recorded = json.loads(path.read_text(encoding="utf-8"))
    for name, was in recorded.items():
        if name not in names:
            raise LorarlError(f"resume {run_dir}: the run was started with python object {name!r}; pass it again")
        now = describe(names[name])
        if was.get("kind") == "dataset" and now.get("fingerprint") != was.get("fingerprint"):
            raise LorarlError(
                f"resume {run_dir}: {name!r} is not the dataset the run started with (fingerprint "
                f"{now.get('fingerprint')} vs {was.get('fingerprint')}); pass the same rows, or start over with "
                "force=True"
            )


def registered_names(recipe: Any) -> list[tuple[str, str]]:
    """Every ``(key, python:NAME)`` a recipe holds: data sources, reward functions, agent tools and environment."""
    found = [("data.source", recipe.data.source), ("data.eval_source", recipe.data.eval_source)]
    found += [(f"reward.functions[{i}].name", s.name) for i, s in enumerate(recipe.reward.functions)]
    for algo in ("dpo", "kto"):  # their held-out task prompts
        section = getattr(recipe, algo, None)
        if section is not None:
            found.append((f"{algo}.task_source", section.task_source))
    if recipe.agent is not None:
        found += [(f"agent.tools[{i}]", t) for i, t in enumerate(recipe.agent.tools)]
        found.append(("agent.environment", recipe.agent.environment))
    return [(k, v) for k, v in found if is_python_name(v)]


def check_registered(recipe: Any) -> None:
    """Every ``python:`` name in ``recipe`` is registered in this process; else one line naming the recipe key (what
    ``lorarl train`` says of a run folder the Python door wrote)."""
    for key, spec in registered_names(recipe):
        lookup(spec, key)
