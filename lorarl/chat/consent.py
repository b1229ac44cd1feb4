"""Consent for code a run folder names: nothing from a run folder runs in the workbench's process (or is launched by
Resume) before the user has seen it and said yes.

A run's ``recipe.yaml`` may name code of its own (:func:`code_items`): reward functions and tools written
``module:function`` / ``path/to/file.py:function``, an ``agent.environment`` class, ``model.trust_remote_code``. A
run folder can come from anywhere (copied, downloaded, edited), so every door that would run such code -- the chat's
``rules:RUN`` reward, a chat pane of a run trained with ``agent.tools``, the Watch tab's Resume -- first asks
:meth:`CodeConsent.require`, which refuses with one line naming the code until :meth:`CodeConsent.allow` was called
for exactly that code: the Chat tab's "Allow run code" button (it allows what the chosen reward and panes name, and
says so), Resume pressed a second time after it listed the code (the Train tab's Launch is the same: the code is
shown above the recipe, and the click is the consent). Built-in rewards and tools (registered names, no ``:``) run
no code from the folder and need no consent.

What is allowed is a :class:`RunCode`'s ``digest``: the code's names and the bytes of each ``file.py`` they name
(found as :func:`lorarl.user_code.load_object` finds it: beside the recipe, then in the working folder), so editing a
file after it was allowed asks again. Consent lasts while the app runs (nothing is written to disk).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from lorarl.errors import LorarlError

KINDS = ("reward", "tool", "environment", "model")


def _section(recipe: dict | None, name: str) -> dict:
    value = (recipe or {}).get(name)
    return value if isinstance(value, dict) else {}


def code_items(recipe: dict | None, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """What in a recipe (plain data, as ``recipe.yaml`` holds it) runs code of its own, one entry each:
    ``reward SPEC`` / ``tool SPEC`` (a name with ``:``), ``environment SPEC``, and ``the model's own code
    (model.trust_remote_code, NAME)``; only the ``kinds`` asked for."""
    out: list[str] = []
    if "reward" in kinds:
        functions = _section(recipe, "reward").get("functions") or []
        out += [f"reward {f['name']}" for f in functions if isinstance(f, dict) and ":" in str(f.get("name", ""))]
    agent = _section(recipe, "agent")
    if "tool" in kinds:
        out += [f"tool {t}" for t in agent.get("tools") or [] if ":" in str(t)]
    if "environment" in kinds and agent.get("environment"):
        out.append(f"environment {agent['environment']}")
    model = _section(recipe, "model")
    if "model" in kinds and model.get("trust_remote_code"):
        out.append(f"the model's own code (model.trust_remote_code, {model.get('name')})")
    return out


def code_file(spec: str, recipe_path: str | Path | None) -> Path | None:
    """The file a ``path/to/file.py:name`` spec loads (beside the recipe first, then the working folder, as
    :func:`lorarl.user_code.load_object` looks), or None (a module name, or no such file)."""
    module = spec.rpartition(":")[0]
    if not module.endswith(".py"):
        return None
    p = Path(module).expanduser()
    if not p.is_absolute() and recipe_path is not None and (Path(recipe_path).parent / p).is_file():
        return Path(recipe_path).parent / p
    return p if p.is_file() else None


@dataclass(frozen=True)
class RunCode:
    """The code a run folder names, as shown and allowed: ``where`` (``run NAME``), ``items`` (:func:`code_items`)
    and ``digest`` (the items and the bytes of each file they name)."""

    where: str
    items: tuple[str, ...]
    digest: str

    def describe(self) -> str:
        """``reward `rew.py:fn`; tool `t.py:f` (sha256 1a2b3c4d5e6f)``: what the page shows before consent."""
        return "; ".join(f"`{i}`" for i in self.items) + f" (sha256 {self.digest[:12]})"


def run_code(recipe: dict | None, recipe_path: str | Path | None, where: str, kinds=KINDS) -> RunCode | None:
    """The :class:`RunCode` of ``recipe`` (read from ``recipe_path``), None when it names no code of ``kinds``."""
    items = code_items(recipe, kinds)
    if not items:
        return None
    h = hashlib.sha256()
    for item in items:
        h.update(item.encode() + b"\0")
        f = code_file(item.split(" ", 1)[1], recipe_path) if item.split(" ", 1)[0] in ("reward", "tool") else None
        h.update(f.read_bytes() if f is not None else b"(no file)")
        h.update(b"\0")
    return RunCode(where, tuple(items), h.hexdigest())


class CodeConsent:
    """The code the user allowed while this app runs (by :attr:`RunCode.digest`)."""

    def __init__(self) -> None:
        self._allowed: set[str] = set()
        self._lock = threading.Lock()

    def allow(self, code: RunCode | None) -> None:
        if code is not None:
            with self._lock:
                self._allowed.add(code.digest)

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
