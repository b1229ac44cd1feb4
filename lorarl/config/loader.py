"""Reading recipes: YAML into the dataclasses of :mod:`lorarl.config.schema`, checked key by key.

Every key is checked when the recipe loads: unknown keys (with a did-you-mean), wrong types and out-of-range values
raise :class:`RecipeError` naming the key and the file. Command-line overrides ``section.key=value`` are applied
before validation; the value is parsed as YAML (``train.steps=10``, ``lora.target_modules=[q_proj,v_proj]``).
Keys that moved (older recipes) are read under their new names with a one-line notice (:mod:`lorarl.config.migrate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from lorarl.config.algorithms import ALGO_SECTIONS, USES
from lorarl.config.migrate import migrate, migrate_path
from lorarl.config.schema import Recipe
from lorarl.errors import RecipeError

_NOT_YAML_KEYS = {"source_path"}


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.2), not as the string PyYAML's YAML 1.1 gives."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, mappings -> dataclasses)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise RecipeError(f"{where}: {key} must be one of {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):  # an optional section left unset stays unset
            return None
        section = _dataclass_of(tp)
        if section is not None and isinstance(value, dict):  # an optional section: its own errors name the key
            return _build(section, value, key, where)
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key, where)
            except RecipeError as e:
                errors.append(e)
        raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise RecipeError(f"{where}: {key} must be null, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key} must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, prefix: str, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {prefix or 'the recipe'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_YAML_KEYS]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]}?)" if close else ""
            if not close and prefix:
                elsewhere = _paths_with_key(str(key))
                hint = f" (did you mean {' or '.join(f'{s}.{key}' for s in elsewhere)}?)" if elsewhere else ""
            raise RecipeError(f"{where}: unknown key {full}{hint}")
        kwargs[key] = _coerce(value, hints[key], full, where)
    return cls(**kwargs)


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass in an annotation (``GRPOConfig | None`` -> GRPOConfig), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _paths_with_key(key: str, cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every section path that declares ``key`` (for a key put in the wrong section: train.gradient_checkpointing
    -> model.gradient_checkpointing)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _dataclass_of(hints[f.name])
        if sub is None:
            continue
        path = f"{prefix}{f.name}"
        if key in {g.name for g in dataclasses.fields(sub)}:
            out.append(path)
        out.extend(_paths_with_key(key, sub, path + "."))
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"grpo.kl_coef=0.04"`` -> (["grpo", "kl_coef"], 0.04). The value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"override {text!r} has no key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({e.problem})") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[tuple[str, str]]]:
    """A copy of the raw recipe mapping with ``section.key=value`` overrides applied (an override naming a key that
    moved is applied under its new name), and the ``(old, new)`` names moved."""
    out = _deepcopy(data)
    moved: list[tuple[str, str]] = []
    for text in overrides:
        path, value = parse_override(text)
        new = migrate_path(path)
        if new != path:
            moved.append((".".join(path), ".".join(new)))
            path = new
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"override {text!r}: {part} is not a section")
            node = nxt
        node[path[-1]] = value
    return out, moved


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def _split_sections(data: dict, where: str, strict: bool) -> dict:
    """Refuse (``strict``) or drop sections the recipe's algorithm does not read: another algorithm's section, or a
    shared section it ignores (``generation`` in a reward-model recipe)."""
    algo = data.get("algo", "grpo")
    if algo not in USES:
        return data  # the type check names the bad algo
    known = set(USES[algo]) | {"algo", algo}
    foreign = [k for k in data if k not in known and (k in ALGO_SECTIONS or k in Recipe.__dataclass_fields__)]
    if foreign and strict:
        raise RecipeError(
            f"{where}: section {foreign[0]} does not apply to algo {algo} (a {algo} recipe reads: "
            f"{', '.join(sorted(known - {'algo'}))}); remove it"
        )
    return {k: v for k, v in data.items() if k not in foreign}


def recipe_from_dict(
    data: dict, where: str = "<recipe>", overrides: list[str] | None = None, *, strict: bool = True
) -> Recipe:
    """A validated Recipe from a mapping (as read from YAML) and ``section.key=value`` overrides. Moved keys are read
    under their new names (one notice line on stderr); ``strict`` refuses sections the algorithm does not read (off:
    they are dropped, for recipes saved by older versions)."""
    data, moved = migrate(data or {}, where)
    data, moved_overrides = apply_overrides(data, overrides or [])
    renamed = moved + moved_overrides
    if renamed:
        print(f"{where}: read under new names: {', '.join(f'{a} -> {b}' for a, b in renamed)}", file=sys.stderr)
    data = _split_sections(data, where, strict)
    recipe = _build(Recipe, data, "", where)
    recipe.validate(where)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None, *, strict: bool = True) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError naming the file and key on any problem."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise RecipeError(f"{where}: recipe file not found")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{where}:{loc} unreadable YAML ({getattr(e, 'problem', e)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{where}: cannot read recipe ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping of sections")
    recipe = recipe_from_dict(data, where, overrides, strict=strict)
    recipe.source_path = str(path.resolve())
    return recipe


def load_run_recipe(path: str | Path) -> Recipe:
    """The resolved ``recipe.yaml`` a run (or a checkpoint) saved: read leniently, so runs written by older versions
    (which saved every algorithm's section) still load."""
    return load_recipe(path, strict=False)


def recipe_to_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain data (saved beside checkpoints as recipe.yaml): only the sections its algorithm
    reads."""
    d = dataclasses.asdict(recipe)
    keep = set(USES[recipe.algo]) | {"algo", recipe.algo}
    return {k: v for k, v in d.items() if k in keep}
