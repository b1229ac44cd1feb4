"""Imports inside lorarl point one way: no circle between its modules (design notes: core -> model -> runtime ->
algos -> entry points, kept honest by a test).

The graph is built from the source with ``ast``: every ``import`` / ``from ... import`` of a lorarl module counts,
at module level, inside a function (a deferred import is still a dependency) and under ``if TYPE_CHECKING:`` (a
type is a dependency too). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. An import of one of the module's own ancestor packages (``from lorarl import __version__``) is not an
edge: Python imports every ancestor of a module before the module itself, whatever it names.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lorarl"


def module_files() -> dict[str, Path]:
    """``lorarl.a.b`` -> its file (a package is its ``__init__.py``)."""
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    """The lorarl modules one import statement of ``module`` names (the longest known module of each name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: the package of ``module``, up level - 1 more
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):  # not itself, not an ancestor
            out.add(name)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for module, f in modules.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[module] = set().union(*(imported(module, f.name == "__init__.py", n, modules) for n in nodes))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_type_checking_imports():
    graph = import_graph()
    assert "lorarl.model.shared" in graph["lorarl.model.logprobs"]  # under TYPE_CHECKING
    assert "lorarl.agents.loop" in graph["lorarl.export.agent_gate"]  # inside a method
    assert "lorarl" not in graph["lorarl.env_report"]  # an ancestor package is not an edge


def test_no_import_circle_within_lorarl():
    found = circles(import_graph())
    assert found == [], "import circles (make each one way: move the shared type down, or the function to the "
    "module that owns it): " + "; ".join(" <-> ".join(c) for c in found)
