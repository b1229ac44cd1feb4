"""recipes/grpo_gsm8k.yaml: it loads, plans for 24 GB offline, and its data path (a local folder laid out like the
openai/gsm8k hub repository), rewards and accuracy work; one GRPO step runs on a tiny model (no hub, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gsm8k_data import GSM_TEST, GSM_TRAIN, make_gsm8k_repo

from lorarl.config import load_recipe
from lorarl.data import load_prompts
from lorarl.rewards import RewardScorer
from lorarl.tasks import accuracy

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_gsm8k.yaml"


@pytest.fixture(scope="module")
def gsm8k_repo(tmp_path_factory) -> Path:
    return make_gsm8k_repo(tmp_path_factory.mktemp("hub") / "gsm8k")


def test_recipe_as_shipped_names_the_hub_model_and_dataset():
    r = load_recipe(RECIPE)
    assert (r.model.name, r.data.source, r.data.subset, r.data.eval_split) == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        "openai/gsm8k",
        "main",
        "test",
    )
    assert r.data.columns["prompt"] == "question" and r.data.answer_pattern == "gsm8k" and r.data.as_chat
    assert [f.name for f in r.reward.functions] == ["math_match", "format"] and r.data.verifier == "math"
    assert r.train.micro_batch_size == "auto"


def test_plan_for_24_gb_works_offline_and_fits(capsys):
    from lorarl.plan import plan_recipe

    out = plan_recipe(RECIPE, budget_gb=24)
    assert out["model"] == "qwen2.5-1.5b" and out["fits"] and out["picked_micro_batch_size"] >= 1
    assert out["peak_total_gb"] <= 24
    for model in ("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"):  # the header's 7B / 8B overrides
        assert plan_recipe(RECIPE, budget_gb=24, overrides=[f"model.name={model}"])["fits"], model


def test_data_path_rewards_and_accuracy_on_a_gsm8k_shaped_folder(gsm8k_repo, tiny_model_dir):
    from lorarl.model import load_tokenizer

    r = load_recipe(RECIPE, [f"data.source={gsm8k_repo}", f"model.name={tiny_model_dir}"])
    tok = load_tokenizer(str(tiny_model_dir))
    train = load_prompts(r.data, tok, "train")
    evals = load_prompts(r.data, tok, "eval")
    assert [row["answer"] for row in train.rows] == ["72", "10", "50"] and len(evals) == len(GSM_TEST)
    assert train.rows[0]["solution"] == GSM_TRAIN[0]["answer"]  # the worked solution kept under its own name
    text = train.texts[0]
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert f"<|im_start|>user\n{GSM_TRAIN[0]['question']}<|im_end|>" in text and not train.skipped

    completions = [
        "<think>48 / 2 = 24 and 48 + 24 = 72</think><answer>72</answer>",  # right and well formed
        "<answer>72</answer>",  # right, not the R1 format
        "<think>48 + 12 = 60</think><answer>60</answer>",  # well formed, wrong
        "The total is $72$ clips.",  # right (no tags: the whole text is read), not formatted
    ]
    scorer = RewardScorer(r.reward.functions, timeout_s=r.reward.timeout_s)
    scored = scorer(["p"] * 4, [[{"role": "assistant", "content": c}] for c in completions], {"answer": ["72"] * 4})
    assert scored.names == ["math_match", "format"]
    assert scored.per_function.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert scored.total.tolist() == [1.5, 1.0, 0.5, 1.0]  # weights 1.0 and 0.5
    assert accuracy(r, completions, {"answer": ["72"] * 4}) == 0.75


def test_one_grpo_step_of_the_recipe_on_a_tiny_model(gsm8k_repo, tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train

    overrides = [
        f"data.source={gsm8k_repo}",
        f"model.name={tiny_model_dir}",
        "train.steps=1",
        "train.prompts_per_step=2",
        "grpo.group_size=2",
        "generation.max_new_tokens=8",
        "train.save_every=0",
    ]
    torch.manual_seed(0)
    result = train(load_recipe(RECIPE, overrides), tmp_path / "run")
    from lorarl.runs import read_metrics

    (row,) = read_metrics(tmp_path / "run")
    assert row["step"] == 1 and "rewards/math_match/mean" in row and "rewards/format/mean" in row
    assert row["accuracy"] is not None and 0.0 <= row["accuracy"] <= 1.0
    assert result["data_rows"] == len(GSM_TRAIN) and (tmp_path / "run" / "policy" / "adapter_config.json").is_file()
