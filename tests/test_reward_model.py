"""Reward-model stage (tiny model): held-out pairwise accuracy rises well above chance on an easily separable set;
the run directory, the adapter + score head, checkpoints and `lorarl eval` output."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import yaml

from lorarl.algos import reward_model
from lorarl.algos.loop import train
from lorarl.algos.reward_model import pairwise_metrics
from lorarl.config import recipe_from_dict
from lorarl.errors import LorarlError
from lorarl.rewards.source import resolve_reward_adapter

GOOD = ["good", "great", "fine", "nice", "lovely", "superb"]
BAD = ["bad", "awful", "poor", "ugly", "nasty", "dreadful"]


def separable_pairs(n: int, seed: int, start: int) -> list[dict]:
    """Plain-format pairs: the chosen answer uses only positive words, the rejected one only negative words."""
    rng = random.Random(seed)
    return [
        {
            "prompt": f"Review {start + i}:",
            "chosen": " " + " ".join(rng.choices(GOOD, k=3)),
            "rejected": " " + " ".join(rng.choices(BAD, k=3)),
        }
        for i in range(n)
    ]


def rm_recipe(tiny_model_dir, tmp_path) -> dict:
    for name, rows in (("train.jsonl", separable_pairs(64, 0, 0)), ("eval.jsonl", separable_pairs(32, 1, 1000))):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "algo": "reward_model",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16.0},
        "data": {"source": "train.jsonl", "eval_source": "eval.jsonl"},  # relative: beside the recipe
        "reward_model": {"epochs": 3, "batch_size": 8, "center_coef": 0.001},
        "train": {"steps": 16, "learning_rate": 1e-2, "micro_batch_size": 4, "save_every": 8, "seed": 0},
        "eval": {"n": 32, "batch_size": 16, "every": 1},
    }


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    recipe_path = tmp / "reward_model.yaml"
    recipe_path.write_text(yaml.safe_dump(rm_recipe(tiny_model_dir, tmp)))
    from lorarl.config import load_recipe

    recipe = load_recipe(recipe_path)
    summary = train(recipe, tmp / "run")
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return recipe_path, tmp / "run", summary, rows


def test_heldout_pairwise_accuracy_rises_well_above_chance(rm_run):
    _, run_dir, summary, rows = rm_run
    acc = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    assert len(acc) == 16
    assert acc[-1] >= 0.9 and summary["pairwise_accuracy"] == acc[-1], acc
    assert acc[-1] > acc[0] or acc[0] >= 0.9
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert summary["n"] == 32
    for name in ("recipe.yaml", "metrics.jsonl", "plot.png", "tb", "eval.json"):
        assert (run_dir / name).exists(), name
    for name in ("adapter_config.json", "adapter_model.safetensors", "head.safetensors"):
        assert (run_dir / "reward" / name).is_file(), name
    ck = run_dir / "checkpoints" / "step-000016"
    assert (ck / "reward" / "head.safetensors").is_file()
    assert json.loads((ck / "state.json").read_text())["loop"]["step"] == 16


def test_eval_cli_prints_pairwise_accuracy_and_n_last(rm_run, capsys):
    from lorarl.cli import main

    recipe_path, run_dir, summary, _ = rm_run
    assert main(["eval", str(recipe_path), "--checkpoint", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["n"] == 32
    assert result["pairwise_accuracy"] == pytest.approx(summary["pairwise_accuracy"])
    # a step checkpoint and the adapter folder itself work too; `base` has no score head
    assert (
        main(["eval", str(recipe_path), "--checkpoint", str(run_dir / "checkpoints" / "step-000016"), "--n", "8"]) == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 8
    assert main(["eval", str(recipe_path), "--checkpoint", "base"]) == 2


def test_resolve_reward_adapter(rm_run, tmp_path):
    _, run_dir, _, _ = rm_run
    assert resolve_reward_adapter(run_dir) == run_dir / "reward"
    assert resolve_reward_adapter(run_dir / "reward") == run_dir / "reward"
    assert resolve_reward_adapter("run", recipe_path=run_dir.parent / "x.yaml") == run_dir / "reward"  # beside it
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "adapter_config.json").write_text("{}")
    with pytest.raises(LorarlError, match="head"):
        resolve_reward_adapter(tmp_path / "policy")
    with pytest.raises(LorarlError, match="no such folder"):
        resolve_reward_adapter(tmp_path / "nope")


def test_pairwise_metrics_ties_count_as_wrong_and_by_kind():
    rc = torch.tensor([1.0, 0.0, 2.0, -1.0])
    rr = torch.tensor([0.0, 0.0, 3.0, -2.0])
    m = pairwise_metrics(rc, rr)
    assert m["pairwise_accuracy"] == 0.5 and m["n"] == 4
    assert m["margin_mean"] == pytest.approx(0.25)  # (1 + 0 - 1 + 1) / 4

    class P:
        pairs = [{"columns": {"kind": k}} for k in ("a", "a", "b", "b")]

    assert pairwise_metrics(rc, rr, P())["accuracy_by_kind"] == {"a": 0.5, "b": 0.5}


def test_reward_model_needs_preference_data(tiny_model_dir, tmp_path):
    from lorarl.errors import DataError

    d = rm_recipe(tiny_model_dir, tmp_path)
    d["data"] = {"source": "arithmetic"}
    with pytest.raises(DataError, match="preference pairs"):
        train(recipe_from_dict(d), tmp_path / "run")


def test_length_groups_by_hand():
    # sorted by length: 2 (i=1), 3 (i=3), 5 (i=0), 9 (i=2); budget 10 padded tokens
    assert reward_model.length_groups([5, 2, 9, 3], 10) == [[1, 3], [0], [2]]
    assert reward_model.length_groups([5, 2, 9, 3], 0) == [[0, 1, 2, 3]]
    assert reward_model.length_groups([50], 10) == [[0]]  # a group always takes one sequence


def test_length_grouped_scores_and_gradients_equal_one_padded_forward(tiny_model_dir):
    """Scoring in length-sorted groups is an exact rewrite of one padded forward: same scores, same gradients."""
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("reward", LoraSettings(r=4), head=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in sb.adapter_parameters("reward"):
            p.add_(torch.randn_like(p) * 0.1)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in (3, 17, 5, 30, 9, 12)]
    params = sb.trainable_parameters("reward")
    results = []
    for budget in (40, 0):
        with sb.role("reward", train=True):
            s = reward_model.score_sequences(sb, seqs, budget)
            (s * torch.arange(1.0, 7.0)).sum().backward()
        results.append((s.detach(), [p.grad.clone() for p in params]))
        for p in params:
            p.grad = None
    (s_g, g_g), (s_1, g_1) = results
    assert len(reward_model.length_groups([len(x) for x in seqs], 40)) > 2
    torch.testing.assert_close(s_g, s_1, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_g, g_1):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_one_eos_rule_a_response_is_scored_at_the_end_of_turn_id(tiny_model_dir, tmp_path):
    """A model with two EOS ids (end-of-turn 2 and end-of-text 0): rollouts may stop at either; the reward model is
    trained on responses ending with end-of-turn and a rollout ended by end-of-text is scored at end-of-turn too."""
    import shutil

    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase
    from lorarl.model.tokens import end_finished_with, with_end_of_turn
    from lorarl.rewards.source import reward_model_scores

    folder = tmp_path / "two-eos"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg["eos_token_id"] = [2, 0]
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    sb = SharedBase.load(ModelConfig(name=str(folder), quantization="none", dtype="float32"))
    assert sb.eos_ids == [0, 2] and sb.end_of_turn_id == 2  # SmolLM2's template closes a turn with <|im_end|> (2)
    assert with_end_of_turn([5, 0], sb.eos_ids, 2) == [5, 2] and with_end_of_turn([5], sb.eos_ids, 2) == [5, 2]
    ids = torch.tensor([[7, 8, 0, 0], [7, 8, 9, 10]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    out = end_finished_with(ids, m, torch.tensor([False, True]), 2)
    assert out.tolist() == [[7, 8, 2, 0], [7, 8, 9, 10]]
    sb.add_adapter("reward", LoraSettings(r=4), head=True)
    prompt = torch.tensor([[11, 12, 13]])
    a = torch.cat([prompt, torch.tensor([[7, 8, 0]])], 1)
    b = torch.cat([prompt, torch.tensor([[7, 8, 2]])], 1)
    att = torch.ones_like(a)
    sa, sb_ = reward_model_scores(sb, a, att, 4), reward_model_scores(sb, b, att, 4)
    assert not torch.equal(sa, sb_)  # the raw scores differ: the reward model reads the final token
    # a rollout that stopped at end-of-text is scored as if it had ended with end-of-turn
    from lorarl.rewards.source import RewardSource
    from lorarl.rollout import Rollout

    saved = sb.save_adapter("reward", tmp_path / "rm" / "reward")
    source = RewardSource(sb, "reward_model", [], adapter=str(saved.parent))
    r = Rollout(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt).bool(),
        completion_ids=torch.tensor([[7, 8, 0]]),
        completion_mask=torch.ones(1, 3).bool(),
        truncated=torch.tensor([False]),
        completions=["x"],
        prompt_index=[0],
    )
    torch.testing.assert_close(source.score_rollout(None, r).reward_model, sb_, rtol=0, atol=0)


def test_reward_model_pairs_end_with_the_end_of_turn_id(rm_run, tiny_model_dir):
    from lorarl.algos.reward_model import load_pairs
    from lorarl.config import load_recipe
    from lorarl.model import SharedBase

    recipe_path, _, _, _ = rm_run
    recipe = load_recipe(recipe_path)
    sb = SharedBase.load(recipe.model)
    pairs = load_pairs(recipe, sb, "train")
    assert {ids[-1] for ids in pairs.chosen_ids + pairs.rejected_ids} == {sb.end_of_turn_id}


def test_reward_model_forms_script_scores_as_the_rl_loops_do(rm_run, tiny_model_dir, tmp_path, capsys):
    """scripts/reward_model_forms.py (the probe of docs/ppo_dpo_results.md): each form's mean over the prompts,
    with the right and a wrong sum; its batched, left-padded scores equal one unpadded row scored alone."""
    import importlib.util
    from pathlib import Path

    from lorarl.config import load_recipe
    from lorarl.data import load_prompts
    from lorarl.model import SharedBase
    from lorarl.rewards.source import add_reward_role, reward_model_scores

    _, run, _, _ = rm_run
    recipe_path = tmp_path / "arith.yaml"
    recipe_path.write_text(
        yaml.safe_dump(
            {
                "algo": "grpo",
                "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
                "data": {"source": "arithmetic", "train_size": 8, "eval_size": 3},
            }
        )
    )
    path = Path(__file__).resolve().parents[1] / "scripts" / "reward_model_forms.py"
    spec = importlib.util.spec_from_file_location("reward_model_forms", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(["--recipe", str(recipe_path), "--reward-adapter", str(run), "--n", "3", "--offset", "7"])
    assert out["n"] == 3 and set(out["forms"]) == set(script.FORMS)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["forms"].keys() == out["forms"].keys()

    recipe = load_recipe(recipe_path)
    shared = SharedBase.load(recipe.model)
    add_reward_role(shared, run)
    prompts = load_prompts(recipe.data, shared.tokenizer, "eval", size=3)
    want = {"right": [], "wrong": []}
    for i in range(3):
        ids = list(prompts.token_ids[i])
        a, b = (int(x) for x in re.findall(r"(\d+)\s*\+\s*(\d+)", shared.tokenizer.decode(ids))[0])
        for kind, c in (("right", a + b), ("wrong", a + b + 7)):
            row = ids + shared.tokenizer(f"{c} is the answer.", add_special_tokens=False)["input_ids"]
            row = torch.tensor([row + [shared.end_of_turn_id]])
            want[kind].append(float(reward_model_scores(shared, row, torch.ones_like(row), 1)[0]))
    got = out["forms"]["is the answer"]
    assert got["right"] == pytest.approx(sum(want["right"]) / 3, abs=1e-4)
    assert got["wrong"] == pytest.approx(sum(want["wrong"]) / 3, abs=1e-4)
    assert got["margin"] == pytest.approx(got["right"] - got["wrong"])
