"""Online DPO (TRL's OnlineDPOTrainer) on the tiny model: the ranking of two samples per prompt by hand; the pairs
keep the sampled token ids; step 1's loss is log 2 (policy = reference) and a learnable reward rises; every prompt
tied is no update; resume is bit-identical; the recipe's checks; `lorarl plan` and `lorarl eval` on it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_grpo import TARGET_REWARD, peaky_model_dir  # noqa: F401  (the learnable reward and its model fixture)

from lorarl.algos.loop import train
from lorarl.algos.online_dpo import objective_metrics, rank_pairs, sampled_pairs
from lorarl.cli import main
from lorarl.config import recipe_from_dict
from lorarl.errors import RecipeError
from lorarl.rollout import Rollout
from lorarl.runs import read_metrics

ROUNDING = 1e-5  # policy == reference up to fp32 rounding of two float paths (tests/test_dpo.py says why)


# ---- the ranking (pure) ---------------------------------------------------------------------------------------
def test_rank_pairs_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 2.0])
    cut = torch.tensor([False, False, False, False, False, True])
    # scores with penalty 3: [1, 0, 0.5, 0.5, 0, -1] -> prompt 0: row 0 > row 1; prompt 1 tie; prompt 2: 4 > 5
    assert rank_pairs(rewards, cut, 3.0) == ([0, 4], [1, 5], 1)
    # no penalty: prompt 2 is row 5 over row 4
    assert rank_pairs(rewards, cut, None) == ([0, 5], [1, 4], 1)
    # a NaN (no reward value) is no pair either; the lower of two is rejected whatever its position
    nan = torch.tensor([float("nan"), 1.0, -2.0, -1.0])
    assert rank_pairs(nan, torch.zeros(4, dtype=torch.bool)) == ([3], [2], 1)
    # a penalty only matters where it changes the order: 0.2 cut vs 0.1 not cut, penalty 0.05 -> 0.15 still wins
    assert rank_pairs(torch.tensor([0.2, 0.1]), torch.tensor([True, False]), 0.05) == ([0], [1], 0)
    assert rank_pairs(torch.tensor([0.2, 0.1]), torch.tensor([True, False]), 0.5) == ([1], [0], 0)


def test_rank_pairs_best_against_worst_of_a_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 2.0])
    cut = torch.zeros(6, dtype=torch.bool)
    # 3 per prompt: [1, 0, 0.5] -> best row 0, worst row 1; [0.5, 0, 2] -> best row 5, worst row 4
    assert rank_pairs(rewards, cut, None, group_size=3) == ([0, 5], [1, 4], 0)
    # 4 per prompt (one group, the last 2 rows left over are not a group): best 0 (1.0), worst 1 (0.0)
    assert rank_pairs(rewards[:4], cut[:4], None, group_size=4) == ([0], [1], 0)
    # equal scores: the first sampled is chosen, the first sampled among the lowest rejected
    assert rank_pairs(torch.tensor([2.0, 1.0, 2.0, 1.0]), cut[:4], None, group_size=4) == ([0], [1], 0)
    # NaN rows are left out: [nan, 3, nan, 1] -> 1 over 3; a group with one scored row is no pair
    nan = float("nan")
    assert rank_pairs(torch.tensor([nan, 3.0, nan, 1.0]), cut[:4], None, group_size=4) == ([1], [3], 0)
    assert rank_pairs(torch.tensor([nan, 3.0, nan, nan]), cut[:4], None, group_size=4) == ([], [], 1)
    # all equal: a tie; the penalty applies before the ranking: row 2 (5, cut, penalty 4 -> 1) is the worst
    assert rank_pairs(torch.ones(4), cut[:4], None, group_size=4) == ([], [], 1)
    cut3 = torch.tensor([False, False, True, False])
    assert rank_pairs(torch.tensor([2.0, 3.0, 5.0, 2.5]), cut3, 4.0, group_size=4) == ([1], [2], 0)
    with pytest.raises(ValueError, match="group_size"):
        rank_pairs(rewards, cut, None, group_size=1)


def test_objective_metrics_by_hand():
    stats = {"rewards/chosen": 0.2, "rewards/rejected": -0.1, "logps/chosen": -3.0, "logps/rejected": -5.0}
    got = objective_metrics(stats, beta=0.1, pair_score=1.5)
    # kl = (0.2 - 0.1) / (2 * 0.1) = 0.5; entropy = (3 + 5) / 2; non-score = -0.1 * 0.5; rlhf = 1.5 - 0.05
    assert got == pytest.approx(
        {
            "objective/kl": 0.5,
            "objective/entropy": 4.0,
            "objective/non_score_reward": -0.05,
            "objective/rlhf_reward": 1.45,
        }
    )


def test_sampled_pairs_keep_the_sampled_ids_through_eos():
    """Prompts left padded (0), completions right padded; pad == EOS (7) here, so only the mask tells the EOS from
    padding: the pair's ids end with the sampled EOS and carry no padding."""
    ro = Rollout(
        prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6], [8, 9, 10], [8, 9, 10]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool),
        completion_ids=torch.tensor([[11, 7, 7], [12, 13, 7], [14, 15, 16], [17, 7, 7]]),
        completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool),
        truncated=torch.tensor([False, False, True, False]),
        completions=["a", "b", "c", "d"],
        prompt_index=[3, 3, 9, 9],
        group_size=2,
    )
    pairs = sampled_pairs(ro, chosen=[1, 3], rejected=[0, 2])
    assert pairs.prompt_ids == [[5, 6], [8, 9, 10]]
    assert pairs.chosen_ids == [[12, 13, 7], [17, 7]]
    assert pairs.rejected_ids == [[11, 7], [14, 15, 16]]  # the cut one has no EOS: exactly what was sampled
    assert [p["prompt_index"] for p in pairs.pairs] == [3, 9] and len(pairs) == 2


# ---- training on the tiny model -------------------------------------------------------------------------------
def online_recipe(model_dir, reward_file, **sections):
    d = {
        "algo": "online_dpo",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_size": 64, "eval_size": 8},
        "reward": {"functions": [{"name": f"{reward_file}:in_target", "kwargs": {"model_dir": str(model_dir)}}]},
        "generation": {"max_new_tokens": 4, "temperature": 1.0},
        "train": {"steps": 16, "prompts_per_step": 8, "micro_batch_size": 8, "learning_rate": 1e-2, "seed": 0},
        "online_dpo": {"beta": 0.1},
        "eval": {"n": 8, "batch_size": 8},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    d["train"]["report_to"] = []
    return recipe_from_dict(d)


@pytest.fixture()
def reward_file(tmp_path):
    f = tmp_path / "tiny_rewards.py"
    f.write_text(TARGET_REWARD)
    return f


def test_loss_starts_at_log2_and_the_reward_rises(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    summary = train(online_recipe(peaky_model_dir, reward_file), out)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 17))
    first = rows[0]
    # step 1: the policy is the reference (LoRA B = 0): every implicit reward 0, the DPO loss log 2 -- up to fp32
    # rounding, as policy (adapters on, B = 0) and reference (adapters off) may take different float paths on
    # another CPU (tests/test_dpo.py says why 1e-5; ties counted wrong are checked in tests/test_dpo_losses.py)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=ROUNDING)
    assert first["pairs"] + first["pairs/ties"] == 8  # 8 prompts, each a pair or a tie
    assert first["objective/scores_margin"] > 0  # chosen scored above rejected, by construction
    early = sum(r["reward"] for r in rows[:5]) / 5
    late = sum(r["reward"] for r in rows[-5:]) / 5
    assert early < 0.15 and late > early + 0.15, (early, late)  # ~10% of tokens in the target set at the start
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "val/contain_eos_token"):
        assert key in first, key
    # TRL's objective/*: no KL while policy == reference; the entropy estimate is minus the rows' mean log-prob
    assert first["objective/kl"] == pytest.approx(0.0, abs=ROUNDING)
    assert first["objective/non_score_reward"] == pytest.approx(0.0, abs=ROUNDING)
    assert first["objective/entropy"] == pytest.approx(-(first["logps/chosen"] + first["logps/rejected"]) / 2)
    assert first["objective/entropy"] > 0
    assert any(r["objective/kl"] != 0.0 for r in rows[1:])  # the policy moved away from the reference
    assert summary["reward_last10"] > summary["reward_first10"]
    assert (out / "policy" / "adapter_model.safetensors").is_file() and (out / "plot.png").is_file()
    assert "eval/accuracy" in rows[-1]  # the held-out task evaluation at the end


def test_every_prompt_tied_is_no_update(peaky_model_dir, tmp_path):  # noqa: F811
    """A reward that never prefers (constant): no pair, the adapter stays at its initial values."""
    f = tmp_path / "flat.py"
    f.write_text("def flat(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    recipe = online_recipe(peaky_model_dir, tmp_path, reward={"functions": [{"name": f"{f}:flat"}]}, train={"steps": 2})
    out = tmp_path / "run"
    train(recipe, out)
    rows = read_metrics(out)
    assert all(r["pairs"] == 0 and r["pairs/ties"] == 8 and r["loss"] is None for r in rows)  # NaN: written null
    lora_b = [v for k, v in load_file(str(out / "policy" / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert lora_b and all(torch.count_nonzero(v) == 0 for v in lora_b)  # B starts at 0 and never moved


def test_resume_is_bit_identical(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    recipe = online_recipe(
        peaky_model_dir,
        reward_file,
        lora={"dropout": 0.1},  # dropout draws from the RNG: the resume must restore it too
        train={"steps": 6, "save_every": 2, "lr_scheduler": "cosine", "warmup_steps": 1},
        eval={"every": 0},
    )
    train(recipe, tmp_path / "full")
    train(recipe, tmp_path / "cut", max_steps=4)
    train(recipe, tmp_path / "cut", resume=True)
    want = load_file(str(tmp_path / "full" / "policy" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "cut" / "policy" / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [r["loss"] for r in full] == [r["loss"] for r in cut] and [r["pairs"] for r in full] == [
        r["pairs"] for r in cut
    ]


def test_recipe_checks(tmp_path):
    for section, bad, key in [
        ({"loss_type": ["sft"]}, "sft needs a preference loss", "online_dpo.loss_type"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "1 weight", "online_dpo.loss_weights"),
        ({"beta": 0}, "must be > 0", "online_dpo.beta"),
        ({"missing_eos_penalty": -1.0}, "must be >= 0", "online_dpo.missing_eos_penalty"),
        ({"loss_type": "simpo"}, "simpo", "online_dpo.loss_type"),
        ({"group_size": 1}, "must be >= 2", "online_dpo.group_size"),
    ]:
        with pytest.raises(RecipeError, match=key) as e:
            recipe_from_dict({"algo": "online_dpo", "online_dpo": section})
        assert bad in str(e.value), (section, str(e.value))
    with pytest.raises(RecipeError, match="dpo"):  # offline DPO's section is not online DPO's
        recipe_from_dict({"algo": "online_dpo", "dpo": {"beta": 0.2}})


def test_plan_and_eval_cli(peaky_model_dir, reward_file, tmp_path, capsys):  # noqa: F811
    """`lorarl plan` models an online DPO step as a GRPO step of two samples per prompt with a reference pass;
    `lorarl eval` runs the task evaluation on the run's policy."""
    import yaml

    from lorarl.config import recipe_to_dict

    recipe = online_recipe(peaky_model_dir, reward_file, train={"steps": 1})
    path = tmp_path / "online.yaml"
    path.write_text(yaml.safe_dump(recipe_to_dict(recipe)))
    assert main(["plan", str(path), "--model-config", "llama-3.1-8b"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["settings"]["algo"] == "grpo" and plan["settings"]["group_size"] == 2
    assert plan["settings"]["kl_coef"] > 0  # the reference pass is planned
    train(recipe, tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "run"), "--n", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == 4 and "accuracy" in out


def test_from_an_adapter_it_is_also_the_frozen_reference(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    """Iterative DPO: starting from a trained adapter (here a 3-step online run), step 1's policy equals its
    reference (that adapter, loaded again frozen), so every implicit reward is 0 and the loss is log 2 again; then
    the policy moves away from it."""
    train(online_recipe(peaky_model_dir, reward_file, train={"steps": 3}), tmp_path / "first")
    start = tmp_path / "first" / "policy"
    assert any(torch.count_nonzero(v) for k, v in load_file(str(start / "adapter_model.safetensors")).items())
    recipe = online_recipe(
        peaky_model_dir, reward_file, model={"init_adapter": str(start)}, train={"steps": 2}, eval={"every": 0}
    )
    train(recipe, tmp_path / "second")
    first = read_metrics(tmp_path / "second")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=ROUNDING)
    assert first["rewards/rejected"] == pytest.approx(0.0, abs=ROUNDING)
    before = load_file(str(start / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "second" / "policy" / "adapter_model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved away from it


def test_a_failing_reward_is_counted_and_bounded(peaky_model_dir, reward_file, tmp_path):  # noqa: F811
    """A reward function that raises every call: its values are NaN (no pair, no update), and the run stops with
    one line at the second step in a row without a value (reward.max_failed_steps), as GRPO does."""
    from lorarl.errors import LorarlError

    recipe = online_recipe(
        peaky_model_dir, reward_file, reward={"functions": [{"name": f"{reward_file}:boom"}]}, train={"steps": 10}
    )
    with pytest.raises(LorarlError, match=r"^reward boom failed on every call of 2 steps in a row .*service down$"):
        train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 1 and all(r["pairs"] == 0 and r["pairs/ties"] == 8 for r in rows)  # NaN rewards: no pair


def test_a_group_of_four_trains_its_best_against_its_worst(peaky_model_dir, tmp_path):  # noqa: F811
    """online_dpo.group_size 4: 4 samples per prompt scored (the reward sees 32 rows for 8 prompts); step 1's
    ``objective/scores_margin`` is the mean of (best - worst) over the prompts that are not ties and its
    ``objective/rlhf_reward`` the mean of their best and worst, computed here from the scores the reward function
    wrote down."""
    f = tmp_path / "logged.py"
    f.write_text(
        TARGET_REWARD
        + "\nimport json\n"
        + "def logged(prompts, completions, completion_ids, model_dir, log, **kwargs):\n"
        + "    out = in_target(prompts, completions, completion_ids, model_dir)\n"
        + "    with open(log, 'a') as fh:\n"
        + "        fh.write(json.dumps(out) + '\\n')\n"
        + "    return out\n"
    )
    log = tmp_path / "scores.jsonl"
    recipe = online_recipe(
        peaky_model_dir,
        f,
        reward={"functions": [{"name": f"{f}:logged", "kwargs": {"model_dir": str(peaky_model_dir), "log": str(log)}}]},
        online_dpo={"group_size": 4},
        train={"steps": 1},
        eval={"every": 0, "n": 1},
    )
    train(recipe, tmp_path / "run")
    step1 = json.loads(log.read_text().splitlines()[0])
    assert len(step1) == 32  # 8 prompts x 4 samples, scored in one call
    margins, trained, ties = [], [], 0
    for g in range(8):
        group = step1[4 * g : 4 * g + 4]
        if max(group) == min(group):
            ties += 1
        else:
            margins.append(max(group) - min(group))
            trained += [max(group), min(group)]
    row = read_metrics(tmp_path / "run")[0]
    assert row["pairs"] == len(margins) and row["pairs/ties"] == ties and margins
    assert row["objective/scores_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-5)
    # step 1: policy == reference, no KL: TRL's rlhf_reward is the mean reward of the trained rows (best and worst)
    assert row["objective/kl"] == pytest.approx(0.0, abs=ROUNDING)
    assert row["objective/rlhf_reward"] == pytest.approx(sum(trained) / len(trained), rel=1e-5)
