"""lorarl as a user installs it: the wheel built from this checkout, installed into a fresh virtualenv in which this
checkout's lorarl cannot be imported, lists the shipped recipes, trains one by name and gives the workbench its
recipe folder (issue 42, item 11). On the commit before, the same steps fail: the wheel had no recipes.

The virtualenv has no packages of its own but the wheel; torch, transformers, ... come from this environment's
site-packages through a ``.pth`` line (a plain path: Python adds the folder, but runs none of the ``.pth`` files in
it, so this environment's editable lorarl, whose finder is such a file, stays out), nothing is downloaded, and
``PYTHONPATH`` is unset. Cost: the wheel ~5 s, the environment ~1 s, one training step of the tiny model ~10 s on 2
quiet cores (imports mostly)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCE = ("lorarl", "recipes", "pyproject.toml", "setup.py", "README.md", "LICENSE")


def build_wheel(source: Path, work: Path) -> Path:
    """``pip wheel`` of a copy of ``source``'s package files (the checkout stays clean: no build/ or egg-info)."""
    src = work / "src"
    src.mkdir()
    for name in SOURCE:
        p = source / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.is_file():
            shutil.copy2(p, src / name)
    # no build isolation (nothing downloaded): pyproject's setuptools>=77 is here, torch 2.13 requires it too
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return next(work.glob("lorarl-*.whl"))


def fresh_env(wheel: Path, work: Path) -> tuple[Path, dict]:
    """A virtualenv holding only ``wheel``, this environment's site-packages behind it; ``(bin folder, env)``."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, text=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (Path(site) / "lorarl_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return venv / "bin", env


WORKBENCH = """
import json, sys
from pathlib import Path
import lorarl
from lorarl.app.paths import recipe_folders
from lorarl.app.recipes import list_recipes
folders = recipe_folders(None)
print(json.dumps({"lorarl": lorarl.__file__, "folders": [str(f) for f in folders],
                  "choices": [c.path for c in list_recipes(folders, Path(sys.argv[1]))]}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict, Path]:
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(REPO, work)
    bin_dir, env = fresh_env(wheel, work)
    return bin_dir, env, wheel


def test_the_wheel_ships_every_recipe_and_the_license(installed):
    _, _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"lorarl/recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    assert shipped and shipped <= names  # a recipe added to recipes/ ships as it is
    assert {"lorarl/data/prefs_arith_train.jsonl", "lorarl/data/prefs_arith_eval.jsonl"} <= names  # dpo.yaml's pkg:
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    assert zipfile.ZipFile(wheel).read(license_file) == (REPO / "LICENSE").read_bytes()


def test_installed_lorarl_lists_trains_by_name_and_feeds_the_workbench(installed, tiny_model_dir, tmp_path):
    bin_dir, env, _ = installed
    run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "timeout": 300}

    # the workbench's recipe folder, read by the installed package (not this checkout's)
    res = subprocess.run([bin_dir / "python", "-c", WORKBENCH, str(tmp_path / "runs")], **run)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    site = str(bin_dir.parent / "lib")
    assert seen["lorarl"].startswith(site), seen["lorarl"]
    folder = Path(seen["folders"][0])
    assert str(folder).startswith(site) and folder.parts[-2:] == ("lorarl", "recipes")
    assert {"dpo.yaml", "reward_model.yaml"} <= {p.name for p in folder.iterdir()}  # the retrain buttons' recipes
    assert {Path(p).name for p in seen["choices"]} >= {"grpo_arithmetic.yaml", "dpo.yaml", "ppo.yaml"}

    res = subprocess.run([bin_dir / "lorarl", "recipes"], **run)
    assert res.returncode == 0, res.stderr
    listed = {line.split()[0] for line in res.stdout.splitlines()[1:]}
    assert listed == {p.stem for p in (REPO / "recipes").glob("*.yaml")}

    out = tmp_path / "run"
    cmd = [bin_dir / "lorarl", "train", "grpo_arithmetic", "--out", str(out), "--max-steps", "1",
           f"model.name={tiny_model_dir}", "train.prompts_per_step=2", "grpo.group_size=2",
           "generation.max_new_tokens=4", "data.train_size=8", "data.eval_size=4"]  # fmt: skip
    res = subprocess.run(cmd, **run)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and (out / "policy" / "adapter_config.json").is_file()
    saved = yaml.safe_load((out / "recipe.yaml").read_text())  # the shipped recipe, with the overrides
    assert saved["data"]["arithmetic"]["operations"] == ["+"] and saved["model"]["name"] == str(tiny_model_dir)
