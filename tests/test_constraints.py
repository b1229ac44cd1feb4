"""constraints.txt (the exact releases CI ran, torch excepted) against pyproject.toml's ranges and this environment;
the pins a user's torch rejects are dropped, not fought over (scripts/freeze_constraints.py, issue 22)."""

from __future__ import annotations

import importlib.util
import os
import re
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _freeze():
    spec = importlib.util.spec_from_file_location("freeze_constraints", REPO / "scripts" / "freeze_constraints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins() -> dict[str, str]:
    lines = [ln for ln in (REPO / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[^=\s]+", ln) for ln in lines), lines
    return dict(ln.split("==") for ln in lines)


def _dependencies() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = project["dependencies"] + extras["test"] + extras["kernels"]
    return [Requirement(r) for r in reqs]


def test_every_dependency_is_pinned_inside_its_range_and_torch_is_not():
    pins, canonical = _pins(), _freeze().canonical
    # (triton is pinned since lorarl.kernels needs it; where a CUDA torch pins its own, setup.sh drops this pin)
    assert not [n for n in pins if n in ("torch", "lorarl") or n.startswith("nvidia-")]
    for req in _dependencies():
        name = canonical(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} is a dependency but not in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(req.specifier))


def test_the_environment_runs_the_pinned_releases():
    """What runs the suite is what constraints.txt names (LORARL_NEWEST=1: the same or newer releases)."""
    pins, canonical = _pins(), _freeze().canonical
    newest = os.environ.get("LORARL_NEWEST") == "1"
    for req in _dependencies():
        name = canonical(req.name)
        if name == "torch":
            continue
        installed = Version(metadata.version(name).split("+")[0])
        if newest:
            assert installed >= Version(pins[name]), (name, str(installed), pins[name])
        else:
            assert installed == Version(pins[name]), f"{name} {installed} installed, {pins[name]} pinned"


def test_pins_the_users_torch_rejects_are_dropped():
    effective = _freeze().effective
    lines = ["sympy==1.14.0", "tqdm==4.67.1", "jinja2==3.1.6", "filelock==3.20.0"]
    torch_2_5 = ["sympy==1.13.1; python_version >= '3.9'", "jinja2", "filelock", "nvidia-cublas-cu12==12.4.5.8"]
    assert effective(lines, torch_2_5) == (["tqdm==4.67.1", "jinja2==3.1.6", "filelock==3.20.0"], ["sympy==1.14.0"])
    # a requirement behind a marker that does not hold here (another OS / an extra) constrains nothing
    assert effective(["sympy==1.14.0"], ['sympy==1.13.1; extra == "opt-einsum"']) == (["sympy==1.14.0"], [])
    assert effective(lines, []) == (lines, [])  # no torch installed yet: every pin is used
