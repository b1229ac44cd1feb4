"""Reading recipes: YAML into the dataclasses of :mod:`lorarl.config.schema`, checked key by key.

Every key is checked when the recipe loads: unknown keys (with a did-you-mean), wrong types and out-of-range values
raise :class:`RecipeError` naming the key and the file. Command-line overrides ``section.key=value`` are applied
before validation; the value is parsed as YAML (``train.steps=10``, ``lora.target_modules=[q_proj,v_proj]``).
Keys that moved (older recipes) are read under their new names with a one-line notice (:mod:`lorarl.config.migrate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
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
from lorarl.errors import RecipeError, quote

_NOT_YAML_KEYS = {"source_path"}


MAX_YAML_NODES = 20_000  # values a YAML document may hold once its aliases are expanded (recipes hold < 1,000)
MAX_YAML_DEPTH = 100  # collections nested in collections (recipes nest < 10; PyYAML recurses once per level)
MAX_INT = 2**31 - 1  # |int| of any recipe key
MAX_FLOAT = 1e12  # |float| of any recipe key


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.2), not as the string PyYAML's YAML 1.1 gives; refuses a
    document whose aliases expand past :data:`MAX_YAML_NODES` values (an "alias bomb": a few lines of nested
    aliases that expand to billions of values), a recursive alias, a key written twice in one mapping, and nesting
    deeper than :data:`MAX_YAML_DEPTH` (which would take PyYAML seconds to reach Python's recursion limit)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        expanded_size(node)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {quote(key_node.value)} is written twice in one mapping (first on line "
                        f"{seen[key_node.value] + 1}); the second would replace the first",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def expanded_size(root: yaml.Node, limit: int = MAX_YAML_NODES) -> int:
    """The number of values in a composed YAML document once every alias is expanded (an alias counts what its
    anchor holds, each time it is used), computed without expanding: each node's size once, memoised, in time linear
    in the document's text. Raises ``yaml.composer.ComposerError`` past ``limit`` or on a recursive alias. Example: ``a: &x [1, 2]``
    / ``b: [*x, *x]`` -> 1 (the top mapping) + 2 keys + 3 ([1, 2]) + 7 ([*x, *x]) = 13."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > limit:
                raise yaml.composer.ComposerError(
                    None, None, f"its aliases expand to more than {limit} values (an alias bomb?)", node.start_mark
                )
            continue
        if id(node) in open_:
            raise _recursive(node)
        open_.add(id(node))
        stack.append((node, True))
        for c in children:
            if id(c) in open_:
                raise _recursive(node)
            if id(c) not in sizes:
                stack.append((c, False))
    return sizes[id(root)]


def _recursive(node: yaml.Node) -> yaml.YAMLError:
    return yaml.composer.ComposerError(None, None, "an alias refers to a collection that holds it", node.start_mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


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
        raise RecipeError(f"{where}: {key} must be one of {_type_name(tp)}, got {quote(value)}")
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
        raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {quote(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise RecipeError(f"{where}: {key} must be null, got {quote(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key} must be a list, got {quote(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key} must be a mapping, got {quote(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise RecipeError(f"{where}: {key} must be an int of at most {MAX_INT} in size, got {quote(value)}")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise RecipeError(f"{where}: {key} must be a finite number, got {value}")
            if abs(value) > MAX_FLOAT:
                raise RecipeError(
                    f"{where}: {key} must be a number of at most {MAX_FLOAT:g} in size, got {quote(value)}"
                )
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {quote(value)}")


def _build(cls: type, data: Any, prefix: str, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {prefix or 'the recipe'} must be a mapping, got {quote(data)}")
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
        raise RecipeError(f"override {quote(text)} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"override {quote(text)} has no key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {quote(text)}: value is not valid YAML ({getattr(e, 'problem', e)})") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[tuple[str, str]]]:
    """A copy of the raw recipe mapping with ``section.key=value`` overrides applied (an override naming a key that
    moved is applied under its new name), and the ``(old, new)`` names moved."""
    out = _deepcopy(data)
    moved: list[tuple[str, str]] = []
    for text in overrides:
        if not isinstance(text, str):
            raise RecipeError(
                f"override {quote(text)}: expected a section.key=value string, got a value of type {type(text).__name__}"
            )
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
                raise RecipeError(f"override {quote(text)}: {part} is not a section")
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
    """Read, override and validate a recipe: a file, or a shipped recipe's name
    (:func:`lorarl.config.shipped.resolve_recipe`). Raises RecipeError naming the file and key on any problem."""
    from lorarl.config.shipped import resolve_recipe

    path = resolve_recipe(path)
    where = str(path)
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
