"""lorarl.config.shipped: the shipped recipes by name, the one resolver every door uses (CLI, Python API, pipelines,
workbench, benchmarks), and ``lorarl recipes``. The installed wheel: tests/test_packaging.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.config import load_recipe
from lorarl.config import shipped as shipped_mod
from lorarl.config.shipped import resolve_recipe, shipped_recipe, shipped_recipes, shipped_recipes_dir, summary
from lorarl.errors import RecipeError

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_ships_its_recipes_folder():
    assert shipped_recipes_dir() == REPO / "recipes"
    assert shipped_recipes() == {p.stem: p for p in sorted((REPO / "recipes").glob("*.yaml"))}


def test_the_package_folder_wins_and_new_files_are_picked_up(tmp_path, monkeypatch):
    """An installed wheel has ``lorarl/recipes/`` inside the package: it is read in place of the checkout's; a
    ``.yaml`` added to the folder is a shipped recipe at once, other files are not."""
    package = tmp_path / "site" / "lorarl"
    (package / "recipes").mkdir(parents=True)
    (package / "recipes" / "a.yaml").write_text("# A: one.\nalgo: grpo\n")
    (package / "recipes" / "notes.txt").write_text("not a recipe")
    monkeypatch.setattr(shipped_mod, "PACKAGE", package)
    assert shipped_recipes_dir() == package / "recipes"
    assert list(shipped_recipes()) == ["a"]
    (package / "recipes" / "b_new.yaml").write_text("algo: sft\n")
    assert list(shipped_recipes()) == ["a", "b_new"]
    shutil.rmtree(package / "recipes")
    assert shipped_recipes_dir() == tmp_path / "site" / "recipes"  # no folder inside: the checkout's place


def test_resolve_by_path_name_and_docs_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: recipes/... paths do not exist here
    want = REPO / "recipes" / "grpo_arithmetic.yaml"
    for text in ("grpo_arithmetic", "grpo_arithmetic.yaml", "recipes/grpo_arithmetic.yaml", str(want)):
        assert resolve_recipe(text) == want, text
    own = tmp_path / "grpo_arithmetic.yaml"  # a file of that name where the user is wins over the shipped one
    own.write_text("algo: grpo\n")
    assert resolve_recipe("grpo_arithmetic.yaml") == Path("grpo_arithmetic.yaml")
    assert resolve_recipe("grpo_arithmetic") == want  # a bare name is not a file here
    assert shipped_recipe("x/grpo_arithmetic") is None and shipped_recipe("") is None


def test_an_unknown_name_is_one_line_with_the_closest_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as e:
        resolve_recipe("grpo_arithmetc")
    line = str(e.value)
    assert "\n" not in line and line.startswith("grpo_arithmetc: recipe file not found")
    assert "closest shipped recipes: grpo_arithmetic" in line and "`lorarl recipes`" in line
    with pytest.raises(RecipeError, match=r"^zzz\.yaml: recipe file not found, and no shipped recipe has that name \("):
        load_recipe("zzz.yaml")


def test_every_door_takes_a_name(tmp_path, monkeypatch):
    """The loader (CLI train / eval / plan, ``lorarl.load_recipe``), pipelines (the file and the stage recipes it
    names), ``lorarl train`` on a pipeline's name, and the benchmarks' recipe argument."""
    import lorarl
    from lorarl.api import refuse_pipeline_recipe
    from lorarl.bench.gpu_parts import recipe_path
    from lorarl.errors import LorarlError
    from lorarl.pipeline import load_pipeline

    monkeypatch.chdir(tmp_path)
    r = load_recipe("grpo_subtraction", ["train.steps=3"])
    assert r.train.steps == 3 and r.source_path == str(REPO / "recipes" / "grpo_subtraction.yaml")
    assert lorarl.load_recipe("dpo").algo == "dpo"
    pipe = load_pipeline("pipeline_rs_subtraction", tmp_path / "out")
    assert [s.name for s in pipe.stages] == ["rs", "rs_sft", "rl"]
    with pytest.raises(LorarlError, match="pipeline_rs_subtraction is a pipeline recipe .*lorarl pipeline"):
        refuse_pipeline_recipe("pipeline_rs_subtraction")
    assert recipe_path("grpo_arithmetic.yaml") == REPO / "recipes" / "grpo_arithmetic.yaml"
    # a pipeline of the user's own naming a shipped recipe by name, with nothing beside it
    (tmp_path / "mine.yaml").write_text(
        "defaults: {recipe: grpo_subtraction}\nstages:\n  - {name: rl, recipe: grpo_subtraction, train: {steps: 2}}\n"
    )
    (stage,) = load_pipeline(tmp_path / "mine.yaml", tmp_path / "out2").stages
    assert stage.recipe.train.steps == 2 and stage.recipe.data.arithmetic.operations == ["-"]


def test_the_workbench_reads_the_shipped_folder():
    from lorarl.app import paths

    assert paths.shipped_recipes_dir is shipped_recipes_dir
    assert paths.recipe_folders(None)[0] == shipped_recipes_dir().resolve()


def test_summaries_and_the_recipes_command(capsys):
    """Each shipped recipe opens with a comment (the repository's rule): its first sentence is the recipe's line in
    ``lorarl recipes``, cut at a word to 100 characters; the command lists every name and marks pipelines."""
    for name, path in shipped_recipes().items():
        line = summary(path)
        assert 10 < len(line) <= 100 and "\n" not in line, (name, line)
    assert (
        summary(REPO / "recipes" / "online_dpo.yaml")
        == "Online DPO (TRL's OnlineDPOTrainer) after offline DPO: iterative DPO."
    )
    res = subprocess.run([sys.executable, "-m", "lorarl.cli", "recipes"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert set(rows) == set(shipped_recipes())
    assert "pipeline:" in rows["pipeline_rs_subtraction"] and "pipeline:" not in rows["grpo_arithmetic"]
    assert rows["grpo_arithmetic"].split(None, 1)[1] == summary(REPO / "recipes" / "grpo_arithmetic.yaml")
    from lorarl.cli import main

    assert main(["recipes", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert listed["recipes"] == {n: str(p) for n, p in shipped_recipes().items()}
