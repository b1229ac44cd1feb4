"""Absurd values that used to pass (issue 42, item 7): each is one line, exit 2 on the CLI, a LorarlError in Python,
refused before anything is loaded or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import lorarl
from lorarl.cli import main
from lorarl.config import recipe_from_dict
from lorarl.config.schema import MAX_GENERATED_ROWS
from lorarl.errors import LorarlError

ROOT = Path(__file__).resolve().parents[1]
ARITH = str(ROOT / "recipes" / "grpo_arithmetic.yaml")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorarl: error: "), err
    return err


@pytest.mark.parametrize("key", ["train_size", "eval_size"])
def test_generated_rows_are_bounded(key):
    """2**31 rows took 8.8 GB and ended in a MemoryError traceback; the bound is checked when the recipe loads."""
    assert recipe_from_dict({"data": {key: MAX_GENERATED_ROWS}}).data.train_size >= 1
    with pytest.raises(LorarlError, match=rf"^<recipe>: data\.{key} must be in \[1, 100000\] \(rows generated"):
        recipe_from_dict({"data": {key: 2147483647}})


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_steps_below_one_is_refused_before_the_run_folder(value, tmp_path, capsys):
    """--max-steps 0 trained every step; -1 wrote an untrained adapter and exited 0."""
    out = tmp_path / "run"
    assert main(["train", ARITH, "--out", str(out), "--max-steps", value]) == 2
    assert f"--max-steps (max_steps) must be an int >= 1, the step to stop after; got {value}" in _one_line(capsys)
    assert not out.exists()
    for bad in (int(value), 2.0, True):
        with pytest.raises(LorarlError, match=r"^--max-steps \(max_steps\) must be an int >= 1"):
            lorarl.train({"algo": "grpo"}, tmp_path / "py", max_steps=bad)
    assert not (tmp_path / "py").exists()


def test_the_python_door_refuses_what_is_not_a_recipe(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        ({"overrides": [1]}, r"^override 1: expected a section\.key=value string, got a value of type int"),
        ({"overrides": 1}, r"^overrides: expected a list of section\.key=value strings, got 1"),
        ({"train": {"steps": object()}}, r"^train\.steps: a value of type object is not a recipe value"),
        ({"train": object()}, r"^train: a value of type object is not a recipe value"),
        ({"out": a_file}, rf"^run directory {a_file}: exists and is not a folder"),
        ({"out": a_file / "run"}, rf"^run directory {a_file / 'run'}: {a_file} is a file, not a folder"),
    ]
    for kwargs, line in cases:
        kwargs = {"out": tmp_path / "run", **kwargs}
        with pytest.raises(LorarlError, match=line) as e:
            lorarl.train({"algo": "grpo"}, **kwargs)
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.fixture
def run_dir(tmp_path, default_model_dir) -> Path:
    """A run folder as far as the export's checks read it (they refuse before the adapter is opened)."""
    run = tmp_path / "run"
    (run / "policy").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (run / "policy" / name).write_text("{}")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name": str(default_model_dir)}}))
    return run


def test_export_out_that_cannot_be_written_is_one_line(run_dir, tmp_path, capsys):
    """A dangling link, a path under /proc, a path below a file: tracebacks before, after the slow merge."""
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere" / "x", dangling)
    (tmp_path / "a_file").write_text("x")
    cases = {
        dangling: f"a link to {tmp_path / 'nowhere' / 'x'}, which does not exist",
        Path("/proc/lorarl-export"): "under /proc, a kernel file system; choose a folder on a disk",
        Path("/proc/self/lorarl-export"): "under /proc, a kernel file system",
        tmp_path / "a_file" / "out": f"{tmp_path / 'a_file'} is a file, not a folder",
    }
    for out, why in cases.items():
        assert main(["export", str(run_dir), "--out", str(out), "--format", "adapter", "--gate-n", "0"]) == 2
        assert f"lorarl: error: --out {out}: {why}" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "dangling", "run"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_trl_config_numbers_must_be_finite(value, default_model_dir, tmp_path):
    """num_train_epochs=nan escaped as a ValueError from math.ceil; every float field is checked."""
    import trl

    from lorarl.trl import GRPOTrainer
    from lorarl.trl.fields import Refused, default_config

    for field in ("num_train_epochs", "learning_rate", "beta"):
        args = default_config(trl.GRPOConfig, str(tmp_path / "out"))
        setattr(args, field, value)
        with pytest.raises(Refused, match=rf"^GRPOConfig\.{field}={value!r}: must be a finite number$"):
            GRPOTrainer(
                model=str(default_model_dir),
                reward_funcs=lambda completions, **_: [0.0] * len(completions),
                args=args,
                train_dataset=[{"prompt": "hi"}] * 4,
            )
