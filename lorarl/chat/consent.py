"""Consent for code a run folder names: nothing from a run folder runs in the workbench's process (or is launched by
Resume) before the user has seen it and said yes.

A run's ``recipe.yaml`` may name code of its own (:func:`code_items`): reward functions and tools written
``module:function`` / ``path/to/file.py:function``, an ``agent.environment`` class, ``model.trust_remote_code``. A
run folder can come from anywhere (copied, downloaded, edited), so every door that would run such code -- the chat's
``rules:RUN`` reward, a chat pane of a run trained with ``agent.tools``, the Watch tab's Resume, the Export tab (its
fidelity gate runs an agent run's tools and environment, and loads a ``trust_remote_code`` model) -- first asks
:meth:`CodeConsent.require`, which refuses with one line naming the code until :meth:`CodeConsent.allow` was called
for exactly that code: the Chat tab's "Allow run code" button (it allows what the chosen reward and panes name, and
says so), Resume or Export pressed a second time after it listed the code (the Train tab's Launch is the same: the
code is shown above the recipe, and the click is the consent). Built-in rewards and tools (registered names, no
``:``) run no code from the folder and need no consent. Inside those doors :func:`lorarl.user_code.guarded` makes
every :func:`~lorarl.user_code.load_object` call ask :meth:`CodeConsent.check_load` too, so code a door did not list
(or a file changed since it was listed) is refused where it would be imported.

What is allowed is a :class:`RunCode`'s ``digest``: the code's names and the files loading each one runs
(:func:`code_files`: a ``file.py`` found as :func:`lorarl.user_code.load_object` finds it, beside the recipe, then in
the working folder; a module name's file and its packages' ``__init__.py``, found as ``import`` finds them without
importing anything), path and bytes, so editing or swapping a file after it was allowed asks again. Consent lasts
while the app runs (nothing is written to disk).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from lorarl.errors import LorarlError

KINDS = ("reward", "tool", "environment", "model")
LOADED = ("reward", "tool", "environment")  # the kinds loaded by lorarl.user_code.load_object (module:name specs)


def _section(recipe: dict | None, name: str) -> dict:
    value = (recipe or {}).get(name)
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def code_items(recipe: dict | None, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """What in a recipe (plain data, as ``recipe.yaml`` holds it) runs code of its own, one entry each:
    ``reward SPEC`` / ``tool SPEC`` (a name with ``:``), ``environment SPEC``, and ``the model's own code
    (model.trust_remote_code, NAME)``; only the ``kinds`` asked for."""
    out: list[str] = []
    if "reward" in kinds:
        functions = _list(_section(recipe, "reward").get("functions"))
        out += [f"reward {f['name']}" for f in functions if isinstance(f, dict) and ":" in str(f.get("name", ""))]
    agent = _section(recipe, "agent")
    if "tool" in kinds:
        out += [f"tool {t}" for t in _list(agent.get("tools")) if ":" in str(t)]
    if "environment" in kinds and agent.get("environment"):
        out.append(f"environment {agent['environment']}")
    model = _section(recipe, "model")
    if "model" in kinds and model.get("trust_remote_code"):
        out.append(f"the model's own code (model.trust_remote_code, {model.get('name')})")
    return out


def _find_spec(fullname: str, path: list[str] | None, finders=None):
    """``fullname``'s module spec from the import system's finders (``sys.meta_path``), ``path`` its parent
    package's folders: what ``import`` would load, found without importing anything (not even the parent). A finder
    that fails counts as finding nothing."""
    for finder in sys.meta_path if finders is None else finders:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(fullname, path) if find is not None else None
        except Exception:  # noqa: BLE001 - a name no finder takes (``a..b``), a finder's own failure: not found
            spec = None
        if spec is not None:
            return spec
    return None


def module_files(name: str) -> list[Path]:
    """The files ``import name`` runs: the ``__init__.py`` of each package on the way and the module's own file,
    found where this process's ``sys.path`` finds them and, for the top-level name, also in the working folder
    (``python -m``, as Resume runs a run, puts it first). [] for a built-in or frozen module, or one not found."""
    parts = name.split(".")
    tops = [_find_spec(parts[0], None), _find_spec(parts[0], [os.getcwd()], [importlib.machinery.PathFinder])]
    files: list[Path] = []
    for spec in tops:
        for i in range(len(parts)):
            if spec is None:
                break
            if spec.has_location and spec.origin:
                files.append(Path(spec.origin).resolve())
            folders = spec.submodule_search_locations
            spec = _find_spec(".".join(parts[: i + 2]), list(folders)) if folders and i + 1 < len(parts) else None
    return list(dict.fromkeys(files))


def code_files(spec: str, recipe_path: str | Path | None) -> list[Path]:
    """The files loading ``spec`` runs: a ``path/to/file.py:name`` spec's file (beside the recipe first, then the
    working folder, as :func:`lorarl.user_code.load_object` looks), a ``package.module:name`` spec's
    :func:`module_files`; [] when there is no such file (or ``python:NAME``, an object handed over in memory)."""
    module = spec.rpartition(":")[0]
    if spec.startswith("python:") or not module:
        return []
    if not module.endswith(".py"):
        return module_files(module)
    p = Path(module).expanduser()
    if not p.is_absolute() and recipe_path is not None and (Path(recipe_path).parent / p).is_file():
        return [(Path(recipe_path).parent / p).resolve()]
    return [p.resolve()] if p.is_file() else []


def load_fingerprint(spec: str, recipe_path: str | Path | None) -> str:
    """sha256 of ``spec`` and each of its :func:`code_files` (path and bytes): what loading it would run now."""
    h = hashlib.sha256(spec.encode() + b"\0")
    for f in code_files(spec, recipe_path):
        try:
            data = f.read_bytes()
        except OSError as e:
            data = f"(unreadable: {e})".encode()
        h.update(str(f).encode() + b"\0" + data + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class RunCode:
    """The code a run folder names, as shown and allowed: ``where`` (``run NAME``), ``items`` (:func:`code_items`),
    ``loads`` (the :func:`load_fingerprint` of each reward, tool and environment) and ``digest`` (the items and
    their fingerprints)."""

    where: str
    items: tuple[str, ...]
    digest: str
    loads: tuple[str, ...] = ()

    def describe(self) -> str:
        """``reward `rew.py:fn`; tool `t.py:f` (sha256 1a2b3c4d5e6f)``: what the page shows before consent."""
        return "; ".join(f"`{i}`" for i in self.items) + f" (sha256 {self.digest[:12]})"


def run_code(recipe: dict | None, recipe_path: str | Path | None, where: str, kinds=KINDS) -> RunCode | None:
    """The :class:`RunCode` of ``recipe`` (read from ``recipe_path``), None when it names no code of ``kinds``."""
    items = code_items(recipe, kinds)
    if not items:
        return None
    h, loads = hashlib.sha256(), []
    for item in items:
        kind, spec = item.split(" ", 1)
        if kind in LOADED:
            loads.append(load_fingerprint(spec, recipe_path))
        h.update(item.encode() + b"\0" + (loads[-1].encode() if kind in LOADED else b"(no file)") + b"\0")
    return RunCode(where, tuple(items), h.hexdigest(), tuple(loads))


class CodeConsent:
    """The code the user allowed while this app runs (by :attr:`RunCode.digest`)."""

    def __init__(self) -> None:
        self._allowed: set[str] = set()
        self._loads: set[str] = set()  # load_fingerprint of each spec allowed code names
        self._lock = threading.Lock()

    def allow(self, code: RunCode | None) -> None:
        if code is not None:
            with self._lock:
                self._allowed.add(code.digest)
                self._loads.update(code.loads)

    def check_load(self, spec: str, what: str, recipe_path: str | Path | None = None) -> None:
        """Raise one line unless loading ``spec`` now runs what the user allowed (:func:`load_fingerprint`): the
        check :func:`lorarl.user_code.guarded` puts in front of every load inside the workbench's doors."""
        if load_fingerprint(spec, recipe_path) not in self._loads:
            raise LorarlError(
                f"{what} {spec!r}: code named by a run folder that you have not allowed (or a file of it changed "
                "since); not run without your consent"
            )

    def allowed(self, code: RunCode | None) -> bool:
        """True when there is no code, or exactly this code was allowed."""
        return code is None or code.digest in self._allowed

    def require(self, code: RunCode | None, what: str, how: str = "press “Allow run code” in the Chat tab") -> None:
        """Raise the one line that names the code when it was not allowed."""
        if not self.allowed(code):
            raise LorarlError(
                f"{what} runs code from the {code.where} folder: {code.describe()}; not run without your consent: "
                f"read it, then {how}"
            )
