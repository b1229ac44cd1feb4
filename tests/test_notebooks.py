"""The examples/ notebooks run top to bottom (nbclient, a fresh kernel each) on the tiny random model: every cell
executes without an error, and the figures a notebook prints come from the run it trained."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["grpo_python_reward", "agent_python_tool", "dpo_from_votes"]


def run_notebook(name: str, model_dir: Path, runs: Path) -> nbformat.NotebookNode:
    book = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    env = {"LORARL_EXAMPLE_MODEL": str(model_dir), "LORARL_EXAMPLE_RUNS": str(runs), "OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(runs)}})
        client.execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return book


def outputs(book: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in book.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tiny_model_dir, tmp_path):
    assert sys.executable  # the kernel is this environment's python3 (ipykernel)
    book = run_notebook(name, tiny_model_dir, tmp_path)
    run_dir = tmp_path / name
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    text = outputs(book)
    assert summary["steps"] == len(metrics) >= 2
    if name == "grpo_python_reward":  # the printed per-step figures are the metrics the run logged
        for row in metrics:
            assert f"{row['step']} correct {round(row['rewards/correct/mean'], 3)}" in text
        assert (tmp_path / "grpo_python_reward_adapter" / "adapter_model.safetensors").is_file()
    if name == "agent_python_tool":
        assert "python:multiply" in (run_dir / "recipe.yaml").read_text()
        assert all("tools/call_frequency" in row for row in metrics)
    if name == "dpo_from_votes":
        assert len((tmp_path / "votes" / "preferences.jsonl").read_text().splitlines()) == 32
        assert any(k.startswith("eval/") for k in metrics[-1])
