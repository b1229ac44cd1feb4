"""DAPO's dynamic sampling: the group bookkeeping with hand-made reward tables; the extra prompts and the joined
rollout; GRPO steps that drop uninformative groups and fill the batch, through the run loop; a bit-identical
resume with it on."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.algos.grpo_sampling import group_rows, join_rollouts, round_prompts
from lorarl.core.dynamic_sampling import GroupTally, informative_groups, take_groups
from lorarl.rollout import Rollout

nan = math.nan


# ---- bookkeeping by hand ----------------------------------------------------------------------------------------


def test_informative_groups_hand_table_with_failed_rewards():
    table = torch.tensor(
        [
            [1.0, 0.0, 1.0, 1.0],  # spread: kept
            [1.0, 1.0, 1.0, 1.0],  # all equal: dropped
            [nan, 2.0, nan, 2.0],  # the valid ones equal: dropped
            [nan, 0.0, nan, 1.0],  # two valid, different: kept
            [nan, nan, nan, nan],  # every reward failed: dropped
            [nan, nan, 0.5, nan],  # one valid reward: no spread, dropped
            [0.0, 0.0, 0.0, 1e-6],  # any difference counts
            [-1.0, -1.0, -1.0, -1.0],
        ]
    )
    got = informative_groups(table.flatten(), 4)
    assert got.tolist() == [True, False, False, True, False, False, True, False]
    # the same groups get a non-zero advantage in GRPO (zero_std is the complement)
    from lorarl.core.advantages import group_advantages

    assert (~group_advantages(table.flatten(), 4).zero_std).tolist() == got.tolist()
    with pytest.raises(ValueError, match="multiple of group_size"):
        informative_groups(torch.zeros(6), 4)


def test_take_groups_across_rounds_hand_counts():
    tally = GroupTally()
    need = 3
    assert take_groups(torch.tensor([True, False, True, False]), need, tally) == [0, 2]
    assert (tally.drawn, tally.dropped, tally.kept, tally.surplus, tally.rounds) == (4, 2, 2, 0, 1)
    assert tally.short(need) == 1
    assert take_groups(torch.tensor([False, True, True, True]), need, tally) == [1]
    assert (tally.drawn, tally.dropped, tally.kept, tally.surplus, tally.rounds) == (8, 3, 3, 2, 2)
    assert tally.short(need) == 0 and tally.drawn == tally.dropped + tally.kept + tally.surplus
    empty = GroupTally()
    for _ in range(3):  # nothing informative in any round: the step is short of everything
        assert take_groups(torch.tensor([False, False]), 2, empty) == []
    assert (empty.drawn, empty.dropped, empty.kept, empty.rounds, empty.short(2)) == (6, 6, 0, 3, 2)


def test_round_prompts_are_derived_from_seed_step_round_and_avoid_drawn_rows():
    a = round_prompts(20, 4, seed=3, step=5, round_=1, exclude={0, 1, 2})
    assert a == round_prompts(20, 4, seed=3, step=5, round_=1, exclude={0, 1, 2})
    assert len(set(a)) == 4 and not set(a) & {0, 1, 2}
    assert a != round_prompts(20, 4, seed=3, step=5, round_=2, exclude={0, 1, 2})
    assert a != round_prompts(20, 4, seed=3, step=6, round_=1, exclude={0, 1, 2})
    assert a != round_prompts(20, 4, seed=4, step=5, round_=1, exclude={0, 1, 2})
    # fewer fresh rows than asked: the drawn ones fill in
    assert sorted(round_prompts(5, 4, 0, 1, 1, exclude={0, 1, 2})[:2]) == [3, 4]
    assert group_rows([0, 2], 2) == [0, 1, 4, 5]


def _rollout(P, T, n, pad, fill):
    return Rollout(
        prompt_ids=torch.full((n, P), fill),
        prompt_mask=torch.ones(n, P, dtype=torch.bool),
        completion_ids=torch.full((n, T), fill + 1),
        completion_mask=torch.ones(n, T, dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
        completions=[f"c{fill}"] * n,
        prompt_index=[fill] * n,
        old_logprobs=torch.full((n, T), -1.0),
        group_size=2,
    )


def test_join_rollouts_pads_prompts_left_and_completions_right():
    a, b = _rollout(3, 4, 2, 0, 10), _rollout(5, 2, 2, 0, 20)
    j = join_rollouts([a, b], pad_id=0)
    assert j.prompt_ids.shape == (4, 5) and j.completion_ids.shape == (4, 4)
    assert j.prompt_ids[0].tolist() == [0, 0, 10, 10, 10] and j.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert j.completion_ids[2].tolist() == [21, 21, 0, 0] and j.completion_mask[2].tolist() == [1, 1, 0, 0]
    assert j.old_logprobs[2].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert j.completions == ["c10", "c10", "c20", "c20"] and j.prompt_index == [10, 10, 20, 20]
    assert j.group_size == 2 and j.sampler_logprobs is None
    b.old_logprobs = None
    with pytest.raises(ValueError, match="old_logprobs is recorded in some rounds only"):
        join_rollouts([a, b], pad_id=0)


# ---- GRPO with dynamic sampling through the run loop ------------------------------------------------------------

REWARDS = """
def even_answers_only(prompts, completions, completion_ids, answer, **kw):
    # a spread only for prompts whose answer is even: the other groups are all 0 (dropped by dynamic sampling)
    return [float(ids[0] % 2 == 0) if ids and int(a) % 2 == 0 else 0.0 for ids, a in zip(completion_ids, answer)]

def constant(prompts, completions, **kw):
    return [1.0] * len(completions)
"""


def _recipe(model_dir, tmp_path, reward="even_answers_only", **sections):
    from lorarl.config import recipe_from_dict

    (tmp_path / "ds_rewards.py").write_text(REWARDS)
    data = {
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 32, "eval_size": 8},
        "reward": {"functions": [{"name": f"{tmp_path / 'ds_rewards.py'}:{reward}"}]},
        "generation": {"max_new_tokens": 3, "temperature": 1.0},
        "train": {"steps": 3, "prompts_per_step": 3, "micro_batch_size": 12, "learning_rate": 1e-2, "seed": 1},
        "grpo": {"group_size": 4, "dynamic_sampling": {"enabled": True, "max_rounds": 4}},
        "eval": {"n": 4, "batch_size": 4},
        "health": {"parity_every": 0},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return recipe_from_dict(data)


def test_dynamic_sampling_keeps_only_informative_groups_and_counts(tiny_model_dir, tmp_path, monkeypatch):
    from lorarl.algos import grpo
    from lorarl.algos.loop import train
    from lorarl.runs import read_metrics

    seen = []
    real = grpo.group_advantages

    def spy(rewards, G, *a, **kw):
        seen.append(rewards.clone())
        return real(rewards, G, *a, **kw)

    monkeypatch.setattr(grpo, "group_advantages", spy)
    recipe = _recipe(tiny_model_dir, tmp_path)
    train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3 and len(seen) == 3
    for r, rewards in zip(rows, seen):
        drawn, dropped, kept = (r[f"dynamic_sampling/groups_{k}"] for k in ("drawn", "dropped", "kept"))
        surplus, rounds, short = (
            r["dynamic_sampling/groups_surplus"],
            r["dynamic_sampling/rounds"],
            r["dynamic_sampling/groups_short"],
        )
        assert drawn == 3 * rounds and drawn == dropped + kept + surplus and 1 <= rounds <= 4
        assert kept + short == 3 and (short == 0 or rounds == 4)
        assert rounds == 1 or dropped > 0  # another round only when a group was dropped
        # what the loss saw: exactly the kept groups, each with a reward spread
        assert rewards.numel() == 4 * kept
        if kept:
            assert informative_groups(rewards, 4).all()
            assert r["frac_reward_zero_std"] == 0.0 and r["trained_rows"] > 0
    assert sum(r["dynamic_sampling/groups_dropped"] for r in rows) > 0  # odd answers: dropped
    assert all(
        0.0 <= r["dynamic_sampling/reward_drawn"] <= r["reward"] + 1e-9 for r in rows if r["reward"] == r["reward"]
    )


def test_dynamic_sampling_short_of_groups_trains_on_nothing_and_says_so(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train
    from lorarl.runs import read_metrics

    recipe = _recipe(
        tiny_model_dir, tmp_path, reward="constant", grpo={"dynamic_sampling": {"enabled": True, "max_rounds": 2}}
    )
    train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    for r in rows:
        assert r["dynamic_sampling/rounds"] == 2 and r["dynamic_sampling/groups_drawn"] == 6
        assert r["dynamic_sampling/groups_kept"] == 0 and r["dynamic_sampling/groups_short"] == 3
        assert r["trained_rows"] == 0 and r["loss"] is None


def test_dynamic_sampling_off_is_plain_grpo(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train
    from lorarl.runs import read_metrics

    recipe = _recipe(tiny_model_dir, tmp_path, grpo={"dynamic_sampling": {"enabled": False}}, train={"steps": 1})
    train(recipe, tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    assert not any(k.startswith("dynamic_sampling/") for k in row)
    assert row["frac_reward_zero_std"] > 0  # the odd-answer groups stay in the batch


def test_resume_with_dynamic_sampling_is_bit_identical(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from lorarl.algos.loop import train
    from lorarl.runs import read_metrics

    recipe = _recipe(tiny_model_dir, tmp_path, train={"steps": 4, "save_every": 2, "keep_last": 2})
    train(recipe, tmp_path / "straight")
    train(recipe, tmp_path / "split", max_steps=2)
    train(recipe, tmp_path / "split", resume=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert sum(r["dynamic_sampling/rounds"] for r in a[2:]) > 2  # the resumed steps did draw extra rounds
    keys = ("reward", "loss", "grad_norm", "dynamic_sampling/groups_drawn", "dynamic_sampling/groups_kept")
    for ra, rb in zip(a, b):
        for k in keys + ("dynamic_sampling/rounds", "dynamic_sampling/reward_drawn"):
            assert ra[k] == rb[k], (k, ra["step"])
    wa = load_file(str(tmp_path / "straight" / "policy" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "split" / "policy" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
