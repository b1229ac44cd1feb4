"""``RUN/step.json`` (lorarl.stepprogress): a real step of the tiny model on each rollout engine reports its phases
in order, the tokens of its generation as they grow and each micro-batch of its update, and the file is gone once
the run ends (the Watch tab reads it while a run trains)."""

from __future__ import annotations

import pytest
from test_run_control import tiny

from lorarl import stepprogress
from lorarl.algos.loop import train
from lorarl.config import recipe_from_dict


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_a_step_reports_its_phases_and_tokens(tiny_model_dir, tmp_path, monkeypatch, engine):
    seen: list[dict] = []
    real = stepprogress.StepProgress._write

    def record(self):
        real(self)
        seen.append(stepprogress.read_step(self.path.parent))

    monkeypatch.setattr(stepprogress.StepProgress, "_write", record)
    monkeypatch.setattr(stepprogress, "TOKEN_GAP_S", 0.0)  # every token written, so the test sees them all
    data = tiny(tiny_model_dir, tmp_path, generation={"engine": engine, "max_new_tokens": 6}, train={"steps": 1})
    data["train"]["micro_batch_size"] = 2  # 2 prompts x 4 completions: 4 micro-batches of 2 rows
    data["eval"]["every"] = 1
    train(recipe_from_dict(data), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / stepprogress.STEP_FILE).exists()  # the run ended: no step is running
    phases = [s["phase"] for s in seen]
    assert phases[0] is None and all(s["step"] == 1 for s in seen)  # the step began, before its first phase
    # the step's phases, in order (consecutive repeats folded): generation, scoring, rewards, training (with the
    # optimizer inside it), then the held-out evaluation, which generates too
    folded = [p for i, p in enumerate(phases) if p is not None and (i == 0 or p != phases[i - 1])]
    assert folded[:2] == ["generation", "scoring"], folded
    assert "training" in folded and "optimizer" in folded and folded.index("training") < folded.index("optimizer")
    assert folded.index("evaluation") > folded.index("optimizer")
    first = [s for s in seen[: phases.index("scoring")] if "tokens" in s]  # the step's own generation
    counts = [s["tokens"] for s in first]
    assert counts and counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= 6
    assert {s["max_tokens"] for s in first} == {6}
    assert all(isinstance(s["phase_started"], float) for s in seen if s["phase"])
    trained = [(s["micro_batch"], s["micro_batches"]) for s in seen if s["phase"] == "training" and "micro_batch" in s]
    assert sorted(set(trained)) == [(1, 4), (2, 4), (3, 4), (4, 4)]  # each micro-batch as it begins
