"""User code named in a recipe: ``package.module:name`` or ``path/to/file.py:name`` -> the object.

Reward functions (:mod:`lorarl.rewards.registry`) and tools and environments (:mod:`lorarl.agents.tools`) are named
this way; one loader serves both, so the rules and the one-line errors are the same everywhere. Inside
:func:`guarded` (the workbench's doors, :mod:`lorarl.chat.consent`) each load first asks a check, which may refuse.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

PYTHON_PREFIX = "python:"  # lorarl.inmemory.PREFIX (kept here so this module imports nothing of lorarl beyond errors)
LoadCheck = Callable[[str, str, "str | Path | None"], None]
_CHECK: contextvars.ContextVar[LoadCheck | None] = contextvars.ContextVar("lorarl_load_check", default=None)


@contextlib.contextmanager
def guarded(check: LoadCheck) -> Iterator[None]:
    """Inside (in this thread), every :func:`load_object` first calls ``check(spec, what, recipe_path)``, which
    raises to refuse the load: the workbench runs a run folder's code only where the user allowed it
    (:meth:`lorarl.chat.consent.CodeConsent.check_load`), whatever path inside a door reaches the loader."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


def load_object(spec: str, what: str, recipe_path: str | Path | None = None, noun: str = "") -> Any:
    """``package.module:attr`` or ``path/to/file.py:attr`` -> the object (a relative file path is looked up beside
    the recipe ``recipe_path`` that names it, then in the current directory: a recipe's code is its own folder's,
    whatever folder it is run from). Raises one-line :class:`LorarlError` naming ``what`` and ``spec``:
    no ``:``, a missing file, a module that fails to import (with its error), a module without ``attr`` (``noun``,
    e.g. "function", names what was expected).

    ``python:NAME`` is an object handed to :func:`lorarl.train` (:mod:`lorarl.inmemory`).

    Example: ``load_object("math:sqrt", "reward")`` is ``math.sqrt``; ``load_object("nope.py:f", "tool")`` raises
    ``tool 'nope.py:f': file nope.py not found``.
    """
    if spec.startswith(PYTHON_PREFIX):  # an object handed to lorarl.train from Python (lorarl.inmemory)
        from lorarl.inmemory import lookup

        return lookup(spec, what)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise LorarlError(f"{what} {spec!r}: expected module:name or path/to/file.py:name")
    check = _CHECK.get()
    if check is not None:  # inside a workbench door (guarded): refused unless the user allowed exactly this code
        check(spec, what, recipe_path)
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_absolute() and recipe_path is not None and (Path(recipe_path).parent / path).is_file():
                path = Path(recipe_path).parent / path
            if not path.is_file():
                raise LorarlError(f"{what} {spec!r}: file {module_name} not found")
            mod_spec = importlib.util.spec_from_file_location(f"lorarl_user_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except LorarlError:
        raise
    except Exception as e:  # the user's module failing to import is the user's to fix: say which
        raise LorarlError(f"{what} {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    if not hasattr(module, attr):
        raise LorarlError(f"{what} {spec!r}: {module_name} has no {noun + ' ' if noun else ''}{attr!r}")
    return getattr(module, attr)
