"""The package's import direction (issue 13): foundations -> model -> runtime -> algorithms -> entry points.

Every ``lorarl`` import in every module (top-level and inside functions, read from the source with ``ast``) must
point at the module's own layer or a lower one, so e.g. the math in ``lorarl.core`` never reaches into a model,
and nothing below the algorithms knows an algorithm exists."""

import ast
from pathlib import Path

import lorarl

ROOT = Path(lorarl.__file__).parent

LAYERS = {
    # 0: foundations, no model and no torch state
    "errors": 0,
    "user_code": 0,
    "runfiles": 0,  # writing in a run folder without following links
    "inmemory": 0,  # the Python door's objects by python:NAME, looked up by user_code and data
    "core": 0,
    "config": 0,
    "phases": 0,
    "sandbox": 0,
    "shapes": 0,  # the model shapes table (the planner, the benchmarks and the loader read it)
    # 1: the shared base and its roles
    "model": 1,
    "kernels": 1,  # hand-written GPU kernels the fast engine puts in front of the base's layers
    # 2: runtime: data, rewards, rollouts, checkpoints, metrics, evaluation, memory planning
    "tasks": 2,
    "data": 2,
    "rewards": 2,
    "rollout": 2,
    "agents": 2,
    "runs": 2,
    "runstate": 2,
    "checkpoint": 2,
    "update": 2,
    "metrics": 2,
    "health": 2,
    "evaluate": 2,
    "plan": 2,
    # 3: the algorithms and the one run loop
    "algos": 3,
    # 4: entry points
    "pipeline": 4,
    "bench": 4,
    "chat": 4,
    "app": 4,
    "export": 4,
    "doctor": 4,
    "env_report": 4,
    "api": 4,
    "trl": 4,  # TRL's trainer classes over the Python API
    "cli": 5,
}


def lorarl_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The top-level ``lorarl`` subpackages a module imports (absolute or relative)."""
    module = path.relative_to(root.parent).with_suffix("").parts  # ('lorarl', 'algos', 'grpo') or (..., '__init__')
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module[: len(module) - node.level]  # level 1: the module's package
                parts = list(base) + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            if parts[0] != "lorarl":
                continue
            if len(parts) > 1:
                out.add(parts[1])
            else:  # from lorarl import x
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "lorarl" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_every_module_has_a_layer():
    tops = {
        p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    tops.discard("__init__")
    assert tops == set(LAYERS), f"new or removed top-level modules: {tops ^ set(LAYERS)}"


def test_imports_point_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts == ("__init__.py",):
            continue
        own = rel.parts[0].removesuffix(".py")
        for target in lorarl_imports(path):
            if target in LAYERS and LAYERS[target] > LAYERS[own]:
                wrong.append(f"{rel} (layer {LAYERS[own]}) imports lorarl.{target} (layer {LAYERS[target]})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_wrong_imports(tmp_path):
    pkg = tmp_path / "lorarl" / "core"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("import torch\nfrom lorarl.algos import grpo\nfrom ..model import SharedBase\n")
    (pkg / "__init__.py").write_text(
        "from .ops import gather\nfrom .. import runs\n\ndef f():\n    import lorarl.chat.app\n"
    )
    assert lorarl_imports(pkg / "x.py", tmp_path / "lorarl") == {"algos", "model"}
    assert lorarl_imports(pkg / "__init__.py", tmp_path / "lorarl") == {"core", "runs", "chat"}
