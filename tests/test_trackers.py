"""Experiment trackers (train.report_to): each writes its own files offline, through the library itself; a resumed
run continues the same tracker run; a tracker that is not installed is named in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.errors import RecipeError
from lorarl.metrics import MetricsLogger, check_trackers
from lorarl.runs import read_metrics

REPO = Path(__file__).resolve().parents[1]
ROWS = [(1, {"reward_mean": 0.123456789, "reward/math_match": 0.25}), (2, {"reward_mean": 0.987654321})]

# Logs ROWS (then resumes at step 1 and logs step 2 again with another value) in a fresh process, so that the
# trackers read their environment (TRACKIO_DIR, WANDB_MODE) as a user's run would.
SCRIPT = """
import sys
from lorarl.metrics import MetricsLogger
run_dir, tracker, rows = sys.argv[1], sys.argv[2], ROWS
with MetricsLogger(run_dir, report_to=[tracker], project="lorarl-test", config={"train": {"steps": 2}}) as log:
    for step, values in rows:
        log.log(step, {**values, "accuracy": None, "example": "text is not a scalar"})
with MetricsLogger(run_dir, resume_step=1, report_to=[tracker], project="lorarl-test") as log:
    log.log(2, {"reward_mean": 0.5})
""".replace("ROWS", repr(ROWS))  # in the program text, not argv (wandb records argv in the run's metadata)


def _run(tmp_path: Path, tracker: str) -> Path:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(tmp_path / "trackio"), WANDB_SILENT="true", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-c", SCRIPT, str(run_dir), tracker],
        env=env,
        cwd=tmp_path,
        check=True,
        timeout=240,
        capture_output=True,
    )
    assert [r["reward_mean"] for r in read_metrics(run_dir)] == [0.123456789, 0.5]  # resumed: step 2 replaced
    return run_dir


def test_tensorboard_writes_event_files_with_the_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run(tmp_path, "tensorboard")
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")] == [(1, 0.123457), (2, 0.5)]
    assert [e.step for e in acc.Scalars("reward/math_match")] == [1]
    assert "accuracy" not in acc.Tags()["scalars"] and "example" not in acc.Tags()["scalars"]


def test_trackio_writes_its_local_store_offline(tmp_path):
    pytest.importorskip("trackio")
    _run(tmp_path, "trackio")
    assert (tmp_path / "trackio" / "lorarl-test.db").is_file()
    read = (
        "from trackio.sqlite_storage import SQLiteStorage as S; import json; "
        "print(json.dumps([S.get_runs('lorarl-test'), S.get_logs('lorarl-test', 'run')]))"
    )
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"))
    out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True, timeout=120)
    runs, logs = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs == ["run"]  # the resumed logger continued the same run
    assert [(r["step"], r["reward_mean"]) for r in logs] == [(1, 0.123456789), (2, 0.987654321), (2, 0.5)]
    assert logs[0]["reward/math_match"] == 0.25 and "accuracy" not in logs[0]


def test_wandb_writes_an_offline_run_without_an_account(tmp_path):
    pytest.importorskip("wandb")
    run_dir = _run(tmp_path, "wandb")
    ids = json.loads((run_dir / "trackers.json").read_text())
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    # the resume continued the same id (wandb adds "-1" to a folder name already taken within the same second)
    assert len(runs) == 2 and all(r.name.split("-", 3)[3].startswith(ids["wandb"]) for r in runs)
    history = [_wandb_history((r / f"run-{ids['wandb']}.wandb").read_bytes()) for r in runs]
    assert history[0] == [
        (1, {"reward_mean": 0.123456789, "reward/math_match": 0.25}),
        (2, {"reward_mean": 0.987654321}),
    ]
    assert history[1] == [(2, {"reward_mean": 0.5})]  # the resumed run: step 2 again
    assert b"lorarl-test" in (runs[0] / f"run-{ids['wandb']}.wandb").read_bytes()


def _wandb_history(blob: bytes) -> list[tuple[int, dict]]:
    """The (step, values) of the history records in a ``.wandb`` file, wandb's own keys (``_step``, ``_runtime``,
    ``_timestamp``) left out. The file is a LevelDB-style log (wandb-core's format: a 7-byte ``:W&B`` header, 32 KiB
    blocks of records, each a 7-byte header -- crc32, length, kind: 1 full, 2 first, 3 middle, 4 last -- and its
    bytes), each record a ``wandb_internal_pb2.Record``; wandb >= 0.19 has no Python reader for it."""
    import struct

    from wandb.proto import wandb_internal_pb2

    assert blob[:4] == b":W&B", blob[:7]
    out, pos, block, data = [], 7, 32768, b""
    while pos + 7 <= len(blob):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", blob[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        data += blob[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            data = b""
            if record.WhichOneof("record_type") == "history":
                items = [(i.key or "/".join(i.nested_key), i.value_json) for i in record.history.item]
                values = {k: json.loads(v) for k, v in items if not k.startswith("_")}
                out.append((record.history.step.num, values))
    return out


def test_a_tracker_that_is_not_installed_is_named_in_one_line(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError) as e:
        MetricsLogger(tmp_path / "run", report_to=["tensorboard", "wandb"])
    assert (
        str(e.value) == "train.report_to: wandb is not installed (pip install wandb, or pip install 'lorarl[trackers]')"
    )
    assert not (tmp_path / "run").exists()  # nothing was started
    with pytest.raises(RecipeError, match="unknown tracker 'mlflow'"):
        check_trackers(["mlflow"])


def test_for_recipe_uses_report_to_and_project(tmp_path):
    from lorarl.config import load_recipe

    recipe = load_recipe(REPO / "recipes" / "grpo_arithmetic.yaml", ["train.report_to=[]"])
    with MetricsLogger.for_recipe(tmp_path / "run", recipe) as log:
        assert log.trackers == {}
        log.log(1, {"reward_mean": 0.5})
    assert not (tmp_path / "run" / "tb").exists() and read_metrics(tmp_path / "run") == [
        {"step": 1, "reward_mean": 0.5}
    ]
    assert load_recipe(REPO / "recipes" / "grpo_arithmetic.yaml").train.report_to == ["tensorboard"]  # the default
