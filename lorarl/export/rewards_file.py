"""The self-contained ``reward.py`` of the verl / OpenRLHF hand-offs: the recipe's rule rewards without lorarl.

verl and OpenRLHF clusters may not have lorarl installed, so the built-in rewards the recipe uses are copied, as
source, from :mod:`lorarl.rewards` with the helpers and constants they need (:func:`inline_source` follows them
across lorarl modules); user rewards are imported by name or loaded from their file. Everything else in the file
(its docstring, the file loader, the scoring functions verl and OpenRLHF call) is the real module
:mod:`lorarl.export.reward_template`, whose text is copied in pieces.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.runs import resolve_path

TEMPLATE = Path(__file__).with_name("reward_template.py")
VERSION_MARK = "{lorarl_version}"
SCORING_BANNER = "# Scoring"
BANNER = "# " + "-" * 113
# special tokens a decoded response may still end with (the tokenizer's own EOS / pad come first)
COMMON_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")


# ---------------------------------------------------------------------------------------------------------------
# Copying definitions as source
# ---------------------------------------------------------------------------------------------------------------


class _Names(ast.NodeVisitor):
    """Names a definition reads at run time (annotations are skipped: with postponed evaluation they never run)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        self.names.add(node.id)

    def visit_arg(self, node: ast.arg) -> None:  # parameter annotations
        return

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for d in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)


@dataclass
class _Module:
    """One module's top level: its source lines, definitions by name, and where each imported name comes from."""

    lines: list[str]
    defs: dict[str, ast.stmt]
    imports: dict[str, str]  # bound name -> the import statement (other packages)
    lorarl_names: dict[str, tuple[str, str]]  # bound name -> (lorarl module, name there)


def _is_lorarl(module: str) -> bool:
    return module == "lorarl" or module.startswith("lorarl.")


def _bound_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds: ``A`` -> [A]; ``A, (B, *C)`` -> [A, B, C]; ``D[k]``, ``obj.attr`` ->
    [] (they bind nothing: the statement changes ``D`` / ``obj``, which is defined elsewhere)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_names(elt)]
    return []


def _read_module(name: str) -> _Module:
    """Parse module ``name``'s top level (``from __future__`` imports are left out: reward.py has its own)."""
    module = importlib.import_module(name)
    source = inspect.getsource(module)
    tree = ast.parse(source)
    mod = _Module(source.splitlines(), {}, {}, {})
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in _bound_names(t):
                    mod.defs[name] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                mod.imports[bound] = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            origin = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
            for a in node.names:
                if _is_lorarl(origin):
                    mod.lorarl_names[a.asname or a.name] = (origin, a.name)
                else:
                    stmt = f"from {'.' * node.level}{node.module or ''} import {a.name}"
                    mod.imports[a.asname or a.name] = stmt + (f" as {a.asname}" if a.asname else "")
    return mod


class _Inliner:
    """Collects the definitions (and imports) a set of functions needs, following names imported from other lorarl
    modules into those modules."""

    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        self.needed: dict[str, set[str]] = {}  # module -> names defined there that are needed
        self.imports: set[str] = set()
        self.after: dict[str, set[str]] = {}  # module -> lorarl modules whose definitions it uses

    def module(self, name: str) -> _Module:
        if name not in self.modules:
            self.modules[name] = _read_module(name)
            self.needed[name], self.after[name] = set(), set()
        return self.modules[name]

    def need(self, module: str, name: str) -> None:
        todo = [(module, name)]
        while todo:
            module, name = todo.pop()
            mod = self.module(module)
            if name in self.needed[module]:
                continue
            if name in mod.defs:
                self.needed[module].add(name)
                visitor = _Names()
                visitor.visit(mod.defs[name])
                todo.extend((module, n) for n in visitor.names if n not in self.needed[module])
            elif name in mod.lorarl_names:
                origin, attr = mod.lorarl_names[name]
                source = self.module(origin)
                if attr != name or (attr not in source.defs and attr not in source.lorarl_names):
                    stmt = f"from {origin} import {attr}" + (f" as {name}" if attr != name else "")
                    raise LorarlError(f"cannot inline {name!r} for reward.py: it comes from `{stmt}`")
                self.after[module].add(origin)
                todo.append((origin, attr))
            elif name in mod.imports:
                stmt = mod.imports[name]
                if " lorarl" in stmt:
                    raise LorarlError(f"cannot inline {name!r} for reward.py: it comes from `{stmt}`")
                self.imports.add(stmt)

    def module_order(self) -> list[str]:
        """The modules read, each after the lorarl modules whose definitions it uses."""
        order: list[str] = []

        def visit(m: str, path: frozenset[str]) -> None:
            if m in order or m in path:  # done, or an import cycle
                return
            for dep in sorted(self.after[m]):
                visit(dep, path | {m})
            order.append(m)

        for m in self.modules:
            visit(m, frozenset())
        return order

    def chunks(self) -> list[str]:
        """The needed definitions as source, dependencies' modules first, each module in source order. Raises
        LorarlError when two modules define a needed name each (one file cannot hold both)."""
        out, seen = [], {}
        for m in self.module_order():
            mod = self.modules[m]
            for name in self.needed[m]:
                if seen.setdefault(name, m) != m:
                    raise LorarlError(f"cannot inline {name!r} for reward.py: both {seen[name]} and {m} define it")
            nodes = sorted({id(mod.defs[n]): mod.defs[n] for n in self.needed[m]}.values(), key=lambda n: n.lineno)
            for node in nodes:
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                out.append("\n".join(mod.lines[start - 1 : node.end_lineno]))
        return out


def inline_source(functions: list, module: ModuleType | None = None) -> tuple[list[str], list[str]]:
    """The source needed to run ``functions`` (defined in ``module``, default: the first function's) without
    importing lorarl.

    Returns ``(imports, definitions)``: the import statements and the top-level definitions (functions and
    constants) that the functions use, transitively, dependencies' modules first and each module in source order.
    Names imported from another lorarl module are copied from that module. Raises LorarlError for a name that comes
    from a lorarl import it cannot copy (a module, or a renamed import).
    """
    module = module or inspect.getmodule(functions[0])
    inliner = _Inliner()
    for fn in functions:
        inliner.need(module.__name__, fn.__name__)
    return sorted(inliner.imports), inliner.chunks()


# ---------------------------------------------------------------------------------------------------------------
# reward.py
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Template:
    """The pieces of :mod:`lorarl.export.reward_template` reward.py is assembled from."""

    header: str  # the docstring and ``from __future__ import annotations``
    file_loader: str  # ``_load_file_function``
    scoring: str  # from the "Scoring" banner to the end of ``reward_func``


def _template() -> _Template:
    source = TEMPLATE.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    future = next(n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    loader, last = functions["_load_file_function"], functions["reward_func"]
    banner = lines.index(SCORING_BANNER) - 1  # the dashed line above it
    return _Template(
        header="\n".join(lines[: future.end_lineno]) + "\n",
        file_loader="\n".join(lines[loader.lineno - 1 : loader.end_lineno]),
        scoring="\n".join(lines[banner : last.end_lineno]),
    )


def join_definitions(chunks: list[str]) -> str:
    """Top-level definitions as source: functions two blank lines apart, consecutive constants together."""
    out = ""
    for i, chunk in enumerate(chunks):
        if i:
            is_def = chunk.lstrip().startswith(("def ", "async def ", "class ", "@"))
            was_def = chunks[i - 1].lstrip().startswith(("def ", "async def ", "class ", "@"))
            out += "\n\n\n" if is_def or was_def else "\n"
        out += chunk
    return out


def _reward_table(recipe: Recipe, user_files: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(REWARDS rows, user-reward loading lines)``: one row per recipe reward (metric name, function, weight,
    kwargs); built-ins by their copied name, user rewards bound to ``_user_reward_<i>`` by import or from a file."""
    from lorarl.rewards import BUILTIN_REWARDS
    from lorarl.rewards.registry import _metric_names

    table, user_loads = [], []
    for i, (spec, metric) in enumerate(zip(recipe.reward.functions, _metric_names(recipe.reward.functions))):
        if spec.name in BUILTIN_REWARDS:
            fn = BUILTIN_REWARDS[spec.name].__name__
        else:
            fn = f"_user_reward_{i}"
            module_name, _, attr = spec.name.rpartition(":")
            if module_name.endswith(".py"):
                path = user_files.get(spec.name, module_name)
                user_loads.append(f"{fn} = _load_file_function({path!r}, {attr!r})")
            else:
                user_loads.append(f"{fn} = getattr(importlib.import_module({module_name!r}), {attr!r})")
        table.append(f"    ({metric!r}, {fn}, {float(spec.weight)!r}, {dict(spec.kwargs)!r}),")
    return table, user_loads


def _section(title: str) -> list[str]:
    return [BANNER, f"# {title}", BANNER, ""]


def reward_module_source(
    recipe: Recipe,
    *,
    ground_truth_column: str | None = "answer",
    conversational: bool = True,
    strip_suffixes: list[str] | None = None,
    user_files: dict[str, str] | None = None,
    openrlhf_label: str = "answer",
) -> str:
    """The text of a self-contained ``reward.py`` scoring completions like ``recipe.reward.functions`` does in lorarl.

    Built-in rewards are copied from :mod:`lorarl.rewards` (with the helpers and constants they use); user rewards
    (``module:function``) are imported by name, and ``file.py:function`` from ``user_files[name]`` (a path relative
    to reward.py) or the original path. Exposes ``score`` (all values), verl's ``compute_score`` and OpenRLHF's
    ``reward_func``.
    """
    from lorarl import __version__
    from lorarl.rewards import BUILTIN_REWARDS

    template = _template()
    builtins = list(
        dict.fromkeys(BUILTIN_REWARDS[s.name] for s in recipe.reward.functions if s.name in BUILTIN_REWARDS)
    )
    imports, definitions = inline_source(builtins) if builtins else ([], [])
    table, user_loads = _reward_table(recipe, user_files or {})
    fixed = {"import importlib", "import importlib.util", "import json", "import os", "import sys"}
    uses_loader = any("_load_file_function" in u for u in user_loads)
    parts = [
        template.header.replace(VERSION_MARK, __version__),
        "\n".join(sorted(set(imports) | fixed)),
        "",
        f"CONVERSATIONAL = {conversational!r}  # completions are passed as [{{'role': 'assistant', 'content': text}}] (TRL)",
        f"GROUND_TRUTH_COLUMN = {ground_truth_column!r}  # the dataset column ground_truth / labels stand for",
        f"OPENRLHF_LABEL = {openrlhf_label!r}  # 'lorarl_columns': OpenRLHF labels are JSON rows of every column",
        f"STRIP_SUFFIXES = {list(strip_suffixes or [])!r}  # special tokens left at the end of decoded text",
        "",
        *_section("Built-in rewards (copied from lorarl.rewards)"),
        join_definitions(definitions) if definitions else "# (none used by this recipe)",
        "",
        "",
        *_section("User rewards (imported by name)"),
        *([template.file_loader, "", ""] if uses_loader else []),
        "\n".join(user_loads) if user_loads else "# (none in this recipe)",
        "",
        "# (metric name, function, weight, kwargs from the recipe)",
        "REWARDS = [",
        *table,
        "]",
        "",
        template.scoring,
    ]
    return "\n".join(parts)


def strip_suffixes(tokenizer: Any) -> list[str]:
    """The special tokens reward.py strips from the end of a decoded response: the tokenizer's EOS and pad, then the
    usual end-of-turn / end-of-text tokens (OpenRLHF hands the reward function text with them left in)."""
    found: list[str] = []
    for t in (tokenizer.eos_token, tokenizer.pad_token, *COMMON_END_TOKENS):
        if t and t not in found:
            found.append(t)
    return found


def user_reward_file(name: str, recipe: Recipe) -> Path | None:
    """The Python file of a ``file.py:function`` reward, looked up like lorarl looks up recipe paths (the working
    directory first, then beside the recipe); None for ``module:function`` rewards and files not found."""
    module_name = name.rpartition(":")[0]
    if not module_name.endswith(".py"):
        return None
    try:
        path = resolve_path(module_name, recipe.source_path, "reward")
    except LorarlError:
        return None
    return path if path.is_file() else None
