"""The Python door (lorarl.api): train / evaluate / export / Run over the CLI's loader and run loop, with Python
reward callables and in-memory datasets (tiny random-init model)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file

import lorarl
from lorarl import LorarlError, Run, load_recipe, train
from lorarl.cli import main as cli_main

PROMPTS = [f"Count to {i}:" for i in range(8)]


def make_reward(calls: list):
    """A TRL-signature reward (named reward_len) that records each batch of values it returns in ``calls``."""

    def reward_len(prompts, completions, completion_ids=None, **kwargs):
        values = [len(c) / 50.0 for c in completions]
        calls.append(values)
        return values

    return reward_len


def grpo_dict(model_dir) -> dict:
    return {
        "algo": "grpo",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "generation": {"max_new_tokens": 4, "temperature": 1.0},
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "learning_rate": 1e-2, "seed": 0},
        "grpo": {"group_size": 2},
        "eval": {"n": 2, "batch_size": 2},
    }


def grpo_data() -> DatasetDict:
    return DatasetDict(
        {
            "train": Dataset.from_list([{"prompt": p} for p in PROMPTS]),
            "test": Dataset.from_list([{"prompt": "Hi"}] * 2),
        }
    )


def adapter(run_dir):
    return load_file(str(run_dir / "policy" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory):
    calls: list = []
    out = tmp_path_factory.mktemp("api") / "grpo"
    run = train(
        grpo_dict(tiny_model_dir),
        out,
        reward_funcs=[make_reward(calls)],
        train_dataset=grpo_data(),
        train={"save_every": 1, "log_every": 1},
        progress=False,
    )
    return run, calls


def test_grpo_python_reward_metrics_are_the_callables_means(grpo_run):
    run, calls = grpo_run
    rows = run.metrics
    assert [r["step"] for r in rows] == [1, 2]
    assert len(calls) == 2  # one scoring call per step (2 prompts x group 2)
    for row, values in zip(rows, calls):
        assert len(values) == 4 and len(set(values)) > 1  # the random model's completions differ in length
        assert row["rewards/reward_len/mean"] == pytest.approx(sum(values) / len(values), abs=1e-6)
    saved = yaml.safe_load((run.path / "recipe.yaml").read_text())
    assert saved["reward"]["functions"][0]["name"] == "python:reward_len"
    assert saved["data"]["source"] == "python:train_dataset"
    recorded = json.loads((run.path / "python_objects.json").read_text())
    assert recorded["python:train_dataset"]["rows"] == {"train": 8, "test": 2}


def test_run_open_summary_evaluate_export(grpo_run, tmp_path):
    run, calls = grpo_run
    opened = Run.open(run.path)
    assert opened.metrics == run.metrics
    assert opened.recipe.algo == "grpo"
    summary = run.summary
    assert summary["steps"] == 2 and summary["run_dir"] == str(run.path)
    assert run.state["state"] == "finished"

    before = len(calls)
    result = run.evaluate(n=2)  # the DatasetDict's test split: 2 rows, no answer column
    assert result["n"] == 2
    assert result["accuracy"] is None and "answer" in result["note"]
    eval_values = [v for batch in calls[before:] for v in batch]
    assert len(eval_values) == 2
    assert result["reward/reward_len"] == pytest.approx(sum(eval_values) / 2, abs=1e-6)

    exported = run.export(tmp_path / "adapter", format="adapter", gate_n=0)
    assert exported["format"] == "adapter"
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    want = adapter(run.path)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_resume_from_python_equals_uninterrupted_and_cli_refuses(
    grpo_run, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run, _ = grpo_run
    out = tmp_path / "resumed"
    kw = dict(train_dataset=grpo_data(), train={"save_every": 1, "log_every": 1}, progress=False)
    train(grpo_dict(tiny_model_dir), out, reward_funcs=[make_reward([])], max_steps=1, **kw)

    other = DatasetDict({"train": Dataset.from_list([{"prompt": "x"}] * 8), "test": grpo_data()["test"]})
    with pytest.raises(LorarlError, match="'python:train_dataset' is not the dataset the run started with"):
        train(
            grpo_dict(tiny_model_dir),
            out,
            reward_funcs=[make_reward([])],
            resume=True,
            **{**kw, "train_dataset": other},
        )

    # the CLI has no Python objects: one line, exit code 2
    import lorarl.inmemory

    monkeypatch.setattr(lorarl.inmemory, "_objects", {})
    assert cli_main(["train", str(out / "recipe.yaml"), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lorarl: error: data.source 'python:train_dataset': no Python object of that name")
    monkeypatch.undo()

    resumed = train(grpo_dict(tiny_model_dir), out, reward_funcs=[make_reward([])], resume=True, **kw)
    got, want = adapter(resumed.path), adapter(run.path)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [r["step"] for r in resumed.metrics] == [1, 2]


def test_bad_column_and_bad_arguments_raise_one_line(tiny_model_dir, tmp_path):
    bad = Dataset.from_list([{"question": p} for p in PROMPTS])
    with pytest.raises(LorarlError) as e:
        train(
            grpo_dict(tiny_model_dir),
            tmp_path / "bad",
            reward_funcs=[make_reward([])],
            train_dataset=bad,
            progress=False,
        )
    line = str(e.value)
    assert "\n" not in line and "python:train_dataset" in line and "row 0" in line and "prompt" in line
    with pytest.raises(LorarlError, match="reward_weights: 1 weights for 2 reward_funcs"):
        train(grpo_dict(tiny_model_dir), tmp_path / "w", reward_funcs=[make_reward([]), "format"], reward_weights=[1])
    with pytest.raises(LorarlError, match="train_dataset: row 1 is a str, not a dict of columns"):
        train(grpo_dict(tiny_model_dir), tmp_path / "r", train_dataset=[{"prompt": "a"}, "b"])
    with pytest.raises(LorarlError, match=r"<recipe dict>: .*train\.steps"):
        train({**grpo_dict(tiny_model_dir)}, tmp_path / "s", train={"steps": 0})


def test_load_recipe_path_overrides_sections_match_the_cli():
    from lorarl.config import load_recipe as cli_load_recipe
    from lorarl.config import recipe_to_dict

    path = "recipes/grpo_arithmetic.yaml"
    want = cli_load_recipe(path, ["train.steps=5", "grpo.group_size=4"])
    got = load_recipe(path, ["train.steps=5", "grpo.group_size=4"])
    assert recipe_to_dict(got) == recipe_to_dict(want) and got.source_path == want.source_path
    by_sections = load_recipe(path, train={"steps": 5}, grpo={"group_size": 4})
    assert recipe_to_dict(by_sections) == recipe_to_dict(want)
    assert recipe_to_dict(load_recipe(want)) == recipe_to_dict(want)
    with pytest.raises(LorarlError, match="override 'train' must look like section.key=value"):
        load_recipe(path, ["train"])
    assert lorarl.train is train


def test_evaluate_and_export_imported_after_their_submodules_are_the_api(tmp_path):
    import lorarl.evaluate  # noqa: F401  (binds the package attributes to the submodules)
    import lorarl.export  # noqa: F401
    from lorarl import evaluate, export

    with pytest.raises(LorarlError, match="<recipe dict>: .*algo"):
        evaluate({"algo": "nope"})  # lorarl.api.evaluate's recipe check, through the module object
    with pytest.raises(LorarlError, match="missing: run directory not found"):
        export(tmp_path / "missing", tmp_path / "out", format="adapter")


SFT_ROWS = [{"prompt": f"{a} - 1 =", "completion": f" {a - 1}"} for a in range(2, 10)]


def test_sft_from_a_list_equals_the_same_rows_from_a_file(tiny_model_dir, tmp_path):
    recipe = {
        "algo": "sft",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "sft": {"batch_size": 4},
        "train": {"steps": 2, "learning_rate": 1e-2, "micro_batch_size": 4, "seed": 0},
        "eval": {"n": 2, "batch_size": 2},
    }
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    from_list = train(recipe, tmp_path / "list", train_dataset=SFT_ROWS, progress=False)
    from_file = train(recipe, tmp_path / "file", train_dataset=str(file), progress=False)
    a, b = from_list.metrics, from_file.metrics
    assert len(a) == 2 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert all(torch.equal(adapter(from_list.path)[k], adapter(from_file.path)[k]) for k in adapter(from_file.path))


def test_dpo_from_an_in_memory_dataset(tiny_model_dir, tmp_path):
    pairs = [{"prompt": f"{a} + {a} =", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(8)]
    recipe = {
        "algo": "dpo",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "dpo": {"beta": 0.5, "batch_size": 4},
        "train": {"steps": 2, "learning_rate": 1e-2, "micro_batch_size": 4, "seed": 0},
        "eval": {"n": 4, "batch_size": 4},
    }
    run = train(
        recipe,
        tmp_path / "dpo",
        train_dataset=Dataset.from_list(pairs),
        eval_dataset=Dataset.from_list(pairs[:4]),
        progress=False,
    )
    rows = run.metrics
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    # before any update the policy equals the reference: TRL's implicit rewards are 0 and the loss is log 2
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert run.summary["steps"] == 2
