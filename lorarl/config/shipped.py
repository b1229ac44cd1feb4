"""The shipped recipes, and the one way from what a user types to a recipe file.

The repository's ``recipes/*.yaml`` are the source; an installed wheel carries them as ``lorarl/recipes/`` (setup.py
maps the folder into the package), a checkout or an editable install reads them where they are. Every ``*.yaml`` in
that folder is a shipped recipe, named by its file name without ``.yaml`` (``grpo_arithmetic``), so a recipe added
there is picked up as it is. :func:`resolve_recipe` is what ``lorarl train / eval / plan / pipeline``, the Python API
(:func:`lorarl.config.load_recipe`) and the benchmarks call; the workbench lists :func:`shipped_recipes_dir`.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from lorarl.errors import RecipeError

PACKAGE = Path(__file__).resolve().parents[1]  # the lorarl package folder
SUMMARY_CHARS = 100  # a recipe's one-line description in `lorarl recipes` is cut to this many characters


def shipped_recipes_dir() -> Path:
    """``lorarl/recipes/`` in an installed wheel, else the checkout's ``recipes/`` beside the package."""
    inside = PACKAGE / "recipes"
    return inside if inside.is_dir() else PACKAGE.parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Name -> file of every shipped recipe, by name."""
    folder = shipped_recipes_dir()
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    return {f.stem: f for f in files if f.is_file()}


def shipped_recipe(name: str) -> Path | None:
    """The shipped recipe called ``name`` (``grpo_arithmetic`` or ``grpo_arithmetic.yaml``), or None."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    return shipped_recipes().get(stem) if stem and "/" not in stem and os.sep not in stem else None


def resolve_recipe(recipe: str | os.PathLike) -> Path:
    """The recipe file ``recipe`` names, the first of:

    1. an existing file at that path (absolute, or relative to the current directory);
    2. a shipped recipe of that name (``grpo_arithmetic``, ``grpo_arithmetic.yaml``), or, for a path that does not
       exist of the form ``recipes/NAME.yaml`` (how the README and docs write the shipped ones), the shipped ``NAME``:
       the docs' commands work outside a checkout too.

    Else RecipeError, one line, with the shipped names closest to it (``lorarl recipes`` lists them all)."""
    text = os.fspath(recipe)
    path = Path(text)
    if path.is_file():
        return path
    found = shipped_recipe(text)
    if found is None and len(path.parts) == 2 and path.parts[0] == "recipes":
        found = shipped_recipe(path.name)
    if found is not None:
        return found
    stem = path.name[: -len(path.suffix)] if path.suffix in (".yaml", ".yml") else path.name
    close = difflib.get_close_matches(stem, list(shipped_recipes()), n=3, cutoff=0.6)
    hint = f"; closest shipped recipes: {', '.join(close)}" if close else ""
    raise RecipeError(
        f"{text}: recipe file not found, and no shipped recipe has that name{hint} (`lorarl recipes` lists them)"
    )


def summary(path: Path) -> str:
    """A recipe's one-line description: the first sentence of its opening comment (recipes begin with one: what it
    trains, memory, result, command), cut to :data:`SUMMARY_CHARS` characters at a word; ``""`` without one."""
    words: list[str] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or not line.strip("# "):
            break
        words.append(line.lstrip("#").strip())
    text = re.split(r"(?<=[.!?])\s", " ".join(words), maxsplit=1)[0]
    if len(text) <= SUMMARY_CHARS:
        return text
    cut = text.rfind(" ", 0, SUMMARY_CHARS - 3)
    return text[: cut if cut > 0 else SUMMARY_CHARS - 3].rstrip(",;:(") + "..."
