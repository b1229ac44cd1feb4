"""The fidelity gate (tiny model, CPU): what it measures on exports that match the training model and on one that
does not (the NF4 training model against its merged fp32 export), how --gate fails an export without leaving a
folder, the default warning, and the definitions (text agreement, EOS, whitespace, accuracy, log-prob deltas)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from export_runs import make_loud_model, make_run

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.export import export
from lorarl.export.gate import _accuracy, _logprob_deltas, _tally, check_gate, summary_line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return make_run(tmp_path_factory.mktemp("gate-run") / "run", tiny_model_dir)


@pytest.fixture(scope="module")
def merged(run_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gate-exports") / "merged"
    return out, export(run_dir, out, fmt="merged", dtype="fp32", gate_n=8, gate=1.0)


def test_merged_and_adapter_exports_agree_with_the_training_model(merged, run_dir, tmp_path):
    out, result = merged
    gate = json.loads((out / "gate.json").read_text())
    assert result["gate"]["passed"] is True and gate["threshold"] == 1.0
    assert gate["prompts"] == 8 and gate["greedy_agreement"] == 1.0 and gate["token_agreement"] == 1.0
    assert gate["tokens_compared"] >= 8 and gate["logprob_max_abs_delta"] < 1e-4 and gate["top1_agreement"] == 1.0
    assert gate["accuracy_trained"] == gate["accuracy_export"] is not None and gate["disagreements"] == []
    assert gate["prompt_source"] == "held-out split" and gate["max_new_tokens"] == 8
    assert gate["export_runtime"] == "transformers (float32)" and "float32 base" in gate["training_model"]
    card = (out / "README.md").read_text()
    assert "## Fidelity gate" in card and "| greedy agreement (identical completion text) | 100.0% (8/8) |" in card

    adapter = export(run_dir, tmp_path / "adapter", fmt="adapter", gate_n=8)
    assert adapter["gate"]["export_runtime"] == "PEFT adapter on its base (fp32)"
    assert adapter["gate"]["greedy_agreement"] == 1.0 and adapter["gate"]["logprob_max_abs_delta"] < 1e-4

    skipped = export(run_dir, tmp_path / "skipped", fmt="adapter", gate_n=0)
    assert skipped["gate"] is None and "gate.json" not in skipped["files"]
    assert "Skipped (`--gate-n 0`)" in (tmp_path / "skipped" / "README.md").read_text()


def test_nf4_training_model_fails_a_strict_gate_and_warns_by_default(tiny_model_dir, tmp_path, capsys):
    """Against the run's policy on an NF4 base, the fp32 merge is a different model: --gate fails, nothing is
    written; without --gate the export is written and warns."""
    pytest.importorskip("bitsandbytes")
    run_dir = make_run(tmp_path / "run", make_loud_model(tiny_model_dir, tmp_path / "loud"))
    out = tmp_path / "strict"
    with pytest.raises(LorarlError) as err:
        export(run_dir, out, fmt="merged", dtype="fp32", gate_n=8, gate=0.99, train_quantization="nf4")
    msg = str(err.value)
    assert msg.startswith("fidelity gate failed: greedy agreement") and "\n" not in msg and "below --gate 0.99" in msg
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    err_text = capsys.readouterr().err
    assert "fidelity gate warning" not in err_text  # a failed gate raises; it does not also warn
    assert "lorarl: fidelity gate: the merged export and the training model each decode" in err_text  # (its start)

    warned = export(run_dir, tmp_path / "warned", fmt="merged", dtype="fp32", gate_n=8, train_quantization="nf4")
    gate = warned["gate"]
    print("nf4 vs merged fp32 (tiny random model):", json.dumps(gate))
    assert gate["greedy_agreement"] < 0.95 and gate["passed"] is None and "nf4 base" in gate["training_model"]
    assert gate["logprob_max_abs_delta"] > 1e-3
    assert any(n.startswith("fidelity gate warning") for n in warned["notes"])
    assert "lorarl: warning: fidelity gate warning" in capsys.readouterr().err
    saved = json.loads((tmp_path / "warned" / "gate.json").read_text())
    assert saved["disagreements"] and saved["disagreements"][0]["trained"] != saved["disagreements"][0]["export"]


def test_default_gate_n_is_the_gates():
    import inspect

    from lorarl.export.gate import DEFAULT_N

    assert inspect.signature(export).parameters["gate_n"].default == DEFAULT_N == 64


def test_agreement_definition():
    """Text agreement: special tokens (which EOS ended it) dropped, every other character counts; token agreement
    is exact ids."""
    got = _tally(["85", "85 ", "85"], ["85", "85", "85"], [[1, 2], [1, 3], [1, 2]], [[1, 2], [1], [1, 4]])
    assert got == {"greedy_agreement": 2 / 3, "agreed": 2, "token_agreement": 1 / 3}


def test_accuracy_and_logprob_deltas():
    class Rows:
        def columns(self, idx):
            return {"answer": ["85", "12", None][: len(idx)]}

    acc = _accuracy(Recipe(), Rows(), {"trained": ["85", "13", "x"], "export": ["It is 85", "12", "y"]})
    assert acc == {"accuracy_trained": 0.5, "accuracy_export": 1.0, "accuracy_delta": 0.5}  # None answers left out
    deltas = _logprob_deltas(([[-0.1, -2.0], [-0.5]], [[3, 4], [5]]), ([[-0.1, -2.5], [-0.2]], [[3, 9], [5]]))
    assert deltas["tokens_compared"] == 3 and deltas["top1_agreement"] == pytest.approx(2 / 3)
    assert deltas["logprob_mean_abs_delta"] == pytest.approx(0.8 / 3) and deltas["logprob_max_abs_delta"] == 0.5


def test_check_gate_threshold():
    report = {
        "format": "gguf",
        "quant": "q4_k_m",
        "greedy_agreement": 0.9,
        "agreed": 9,
        "prompts": 10,
        "export_runtime": "llama.cpp",
        "accuracy_trained": 0.8,
        "accuracy_export": 0.7,
        "logprob_mean_abs_delta": 0.1,
        "logprob_max_abs_delta": 2.0,
    }
    assert check_gate(dict(report), 0.9, Path("/x")) == []
    with pytest.raises(
        LorarlError,
        match=r"greedy agreement 90.0% \(9/10\) for gguf q4_k_m .*below --gate 0.95, so "
        r"nothing was written to /x",
    ):
        check_gate(dict(report), 0.95, Path("/x"))
    assert "accuracy 70.0% export vs 80.0% trained" in summary_line(report)


def test_cli_gate_flags(run_dir, tmp_path, capsys):
    from lorarl.cli import main

    out = tmp_path / "cli"
    assert (
        main(["export", str(run_dir), "--out", str(out), "--format", "adapter", "--gate", "0.5", "--gate-n", "4"]) == 0
    )
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["gate"]["prompts"] == 4 and last["gate"]["passed"] is True and last["gate"]["threshold"] == 0.5
    start = "lorarl: fidelity gate: the adapter export and the training model each decode (greedy completion) and "
    assert f"{start}score up to 4 held-out prompts (--gate-n N to change, 0 skips the gate)" in captured.err
    assert main(["export", str(run_dir), "--out", str(tmp_path / "h"), "--format", "verl", "--gate", "0.5"]) == 2
    assert "--gate needs the gate to run" in capsys.readouterr().err


def test_gate_command_against_a_merged_reference(run_dir, merged, capsys):
    """`python -m lorarl.export.gate RUN EXPORT --reference MERGED` compares two exports (here a merged export with
    itself: identical)."""
    from lorarl.export.gate import main

    assert main([str(run_dir), str(merged[0]), "--reference", str(merged[0]), "--n", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["training_model"].startswith(f"merged export {merged[0]}") and report["format"] == "merged"
    assert report["prompts"] == 3 and report["greedy_agreement"] == 1.0 and report["logprob_max_abs_delta"] == 0.0
