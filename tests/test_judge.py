"""LLM-as-judge rewards: prompt building and strict parsing (pure functions), the reward path with the judge's
generate replaced by fixed answers, one real call on the tiny model (garbage answers = counted failures), the
adapter state after judging, a judge adapter on the same base, and GRPO with a judge."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lorarl.config import LoraSettings, RewardSpec, recipe_from_dict
from lorarl.config.rewards import JudgeConfig
from lorarl.errors import LorarlError, RecipeError
from lorarl.rewards import RewardScorer
from lorarl.rewards.judge import JudgeModel
from lorarl.rewards.judge_prompts import (
    JudgeParseError,
    fill_rubric,
    group_prompt,
    parse_group,
    parse_pointwise,
    pointwise_prompt,
    prompt_text_of,
    to_unit,
)
from lorarl.rewards.registry import RewardContext

# ---- pure functions ---------------------------------------------------------------------------------------------


def test_prompts_fill_the_rubric_and_state_the_format():
    assert fill_rubric('Q {prompt} A {completion} {"k": 1} {{x}}', {"prompt": "p", "completion": "c", "x": 2}) == (
        'Q p A c {"k": 1} {2}'
    )
    with pytest.raises(ValueError, match=r"the rubric uses \{answer\}"):
        fill_rubric("{completion} vs {answer}", {"completion": "c"})
    assert pointwise_prompt("Q: {prompt}\nA: {completion}", {"prompt": "2+2?", "completion": "4"}, 0, 10) == (
        "Q: 2+2?\nA: 4\n\nReply with one line: Score: N, where N is a number from 0 to 10."
    )
    text = group_prompt("Task {prompt}\n{completions}", {"prompt": "2+2?"}, ["4", "5"], 1, 5)
    assert text == (
        'Task 2+2?\n<response id="1">\n4\n</response>\n<response id="2">\n5\n</response>\n\n'
        'Reply with only a JSON object {"scores": [{"id": 1, "score": S1}, {"id": 2, "score": S2}]}: one entry per '
        "response id, each score a number from 1 to 5."
    )
    assert prompt_text_of([{"role": "system", "content": "s"}, {"role": "user", "content": "What is 1 + 2?"}]) == (
        "What is 1 + 2?"
    )
    assert to_unit(7.5, 0, 10) == 0.75 and to_unit(2, 1, 5) == 0.25


@pytest.mark.parametrize(
    "answer, want",
    [
        ("Score: 7", 7.0),
        ("The answer is correct.\nScore: 10", 10.0),
        ("**Score:** 3", 3.0),
        ("score = 4.5", 4.5),
        ("Score: 7/10", 7.0),
        ("Score: 6\nScore: 6", 6.0),
        ("7", "no 'Score: N' line"),
        ("I give it a score of 7 out of 10", "no 'Score: N' line"),
        ("Score: 11", "outside [0, 10]"),
        ("Score: -1", "outside [0, 10]"),
        ("Score: 3\nScore: 8", "several different scores"),
        ("", "no 'Score: N' line"),
    ],
)
def test_parse_pointwise_is_strict(answer, want):
    if isinstance(want, float):
        assert parse_pointwise(answer, 0, 10) == want
    else:
        with pytest.raises(JudgeParseError, match=re.escape(want)):
            parse_pointwise(answer, 0, 10)


@pytest.mark.parametrize(
    "answer, want",
    [
        ('{"scores": [{"id": 1, "score": 9}, {"id": 2, "score": 2}, {"id": 3, "score": 5}]}', [9.0, 2.0, 5.0]),
        ('Sure! {"scores": [{"id": 3, "score": 1}, {"id": "1", "score": 0}, {"id": 2, "score": 10}]} done', [0, 10, 1]),
        ('{"scores": [{"id": 1, "score": 9}, {"id": 2, "score": 2}]}', "2 scores for 3"),
        ('{"scores": [{"id": 1, "score": 9}, {"id": 1, "score": 2}, {"id": 3, "score": 5}]}', "repeated id 1"),
        ('{"scores": [{"id": 1, "score": 9}, {"id": 2, "score": "high"}, {"id": 3, "score": 5}]}', "not a number"),
        ('{"scores": [{"id": 1, "score": 12}, {"id": 2, "score": 2}, {"id": 3, "score": 5}]}', "outside"),
        ('{"scores": [{"id": 4, "score": 1}]}', "bad or repeated id 4"),
        ('{"ranking": [1, 2, 3]}', "no 'scores' list"),
        ('{"scores": [{"id": 1, "score": 9}', "not valid JSON"),
        ("1: 9, 2: 2, 3: 5", "no JSON object"),
    ],
)
def test_parse_group_is_strict(answer, want):
    if isinstance(want, list):
        assert parse_group(answer, 3, 0, 10) == [float(w) for w in want]
    else:
        with pytest.raises(JudgeParseError, match=re.escape(want)):
            parse_group(answer, 3, 0, 10)


@pytest.mark.parametrize(
    "judge, message",
    [
        ({"rubric": "Is it good?"}, "judge.rubric must contain {completion} (where the judge sees the completion)"),
        ({"mode": "group", "rubric": "Rank {completion}"}, "judge.rubric must contain {completions}"),
        ({"model": "folder"}, "judge.path must be set for judge.model folder"),
        ({"path": "x"}, "judge.path is only read with model adapter | folder"),
        ({"min_score": 5, "max_score": 5}, "judge.max_score must be > min_score"),
        ({"mode": "ranked"}, "judge.mode must be one of 'pointwise' | 'group'"),
    ],
)
def test_bad_judge_entries_fail_at_load_with_one_line(judge, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        recipe_from_dict({"reward": {"functions": [{"name": "judge", "judge": judge}]}})


# ---- the reward path with fixed judge answers ------------------------------------------------------------------


def judge_scorer(shared, monkeypatch, answers, **cfg):
    """A scorer with a judge (+ numeric_match) whose generate returns ``answers`` and records its prompts."""
    seen = {}

    def fake_generate(self, texts, max_new_tokens, batch_size, answer_prefix=""):
        seen.update(texts=texts, max_new_tokens=max_new_tokens, role=self.role, prefix=answer_prefix)
        return [answer_prefix + a for a in answers[: len(texts)]]

    monkeypatch.setattr(JudgeModel, "generate", fake_generate)
    specs = [RewardSpec(name="judge", judge=JudgeConfig(**cfg)), RewardSpec(name="numeric_match")]
    return RewardScorer(specs, context=RewardContext(shared=shared)), seen


def test_pointwise_judge_scores_rows_and_counts_unparsed_answers(tiny_shared, monkeypatch, tmp_path):
    answers = ["Score: 10", "Score: 5", "I like it", "Score: 42"]
    scorer, seen = judge_scorer(tiny_shared, monkeypatch, answers, rubric="Q {prompt} ({answer}) A {completion}")
    scorer.fns[0].log_to(tmp_path)
    s = scorer(["1+1?"] * 4, ["2", "3", "2", "2"], {"answer": ["2"] * 4})
    assert seen["role"] == "base" and seen["max_new_tokens"] == 16
    assert seen["texts"][1].startswith("Q 1+1? (2) A 3\n\nReply with one line: Score: N")
    col = s.per_function[:, 0]
    assert col[:2].tolist() == [1.0, 0.5] and torch.isnan(col[2:]).all()  # unparsed: NaN, never 0
    assert s.total.tolist() == [2.0, 0.5, 1.0, 1.0]  # rows 2-3: only numeric_match has a value
    assert s.failures["judge"].startswith("2 of 4 values failed (judge answer did not parse: no 'Score: N' line")
    assert (scorer.calls, scorer.failures, scorer.values, scorer.failed_values) == (2, 0, [4, 4], [2, 0])
    assert s.extra["rewards/judge/failed_rows"] == 2.0 and s.extra["rewards/judge/prompts"] == 4.0
    logged = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    assert len(logged) == 4 and logged[2]["answer"] == "I like it" and logged[2]["scores"] == [None]
    assert logged[0]["scores"] == [1.0] and logged[0]["prompt"] == seen["texts"][0] and logged[3]["error"]
    scorer(["1+1?"] * 4, ["2"] * 4, {"answer": ["2"] * 4})  # the same answers: 2 more of 4 fail
    scorer.check_failure_budget(0.5)  # 4 of 8 judge values: 50%, not more
    monkeypatch.setattr(JudgeModel, "generate", lambda self, t, m, b, p: ["no"] * 3 + ["Score: 1"])
    scorer(["1+1?"] * 4, ["2"] * 4, {"answer": ["2"] * 4})
    scorer.check_failure_budget(0.5)  # 7 of 12, but a function is judged from its 4th call on
    scorer(["1+1?"] * 4, ["2"] * 4, {"answer": ["2"] * 4})
    with pytest.raises(LorarlError, match=r"reward judge: 10 of its 16 values failed \(62% > reward.max_failure"):
        scorer.check_failure_budget(0.5)


def test_group_judge_scores_each_group_in_one_prompt(tiny_shared, monkeypatch):
    answers = [
        '{"scores": [{"id": 1, "score": 8}, {"id": 2, "score": 2}, {"id": 3, "score": 5}]}',
        '{"scores": [{"id": 1, "score": 8}]}',  # one score for three responses: the whole group fails
    ]
    scorer, seen = judge_scorer(tiny_shared, monkeypatch, answers, mode="group")
    prompts = ["What is 1 + 1?"] * 3 + ["What is 2 + 2?"] * 3
    s = scorer(prompts, ["2", "3", "two", "4", "4", "5"], {"answer": ["2"] * 3 + ["4"] * 3}, group_size=3)
    assert len(seen["texts"]) == 2 and seen["max_new_tokens"] == 8 + 16 * 3
    assert '<response id="3">\ntwo\n</response>' in seen["texts"][0] and "What is 1 + 1?" in seen["texts"][0]
    assert s.per_function[:3, 0].tolist() == pytest.approx([0.8, 0.2, 0.5])
    assert torch.isnan(s.per_function[3:, 0]).all()
    assert "3 of 6 values failed (judge answer did not parse: 1 scores for 3 responses)" in s.failures["judge"]
    with pytest.raises(Exception):  # noqa: B017  not whole groups: the call fails (counted), never misaligned
        scorer.fns[0](prompts[:4], ["a"] * 4, group_size=3)


def test_judge_needs_the_shared_base():
    with pytest.raises(LorarlError, match="runs on the shared base"):
        RewardScorer([RewardSpec(name="judge", judge=JudgeConfig())])


# ---- real judges on the tiny model -----------------------------------------------------------------------------


def test_real_judge_call_on_the_tiny_model_counts_garbage_and_restores_the_policy(tiny_shared):
    shared = tiny_shared
    shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    shared.peft.set_adapter("policy")
    shared.module.train(True)
    flags = [p.requires_grad for p in shared.adapter_parameters("policy")]
    scorer = RewardScorer(
        [RewardSpec(name="judge", judge=JudgeConfig(max_new_tokens=6, batch_size=2))],
        context=RewardContext(shared=shared),
    )
    s = scorer(["What is 1 + 1?"] * 3, ["2", "3", "4"], {"answer": ["2"] * 3})
    assert torch.isnan(s.per_function).all()  # a random model's answers do not parse: failed values
    assert (scorer.calls, scorer.failures, scorer.failed_values) == (1, 0, [3])
    assert s.extra["rewards/judge/failed_rows"] == 3.0
    # the policy is what samples next: same active adapter, mode and trainable flags as before judging
    assert shared.peft.active_adapter == "policy" and shared.module.training
    assert [p.requires_grad for p in shared.adapter_parameters("policy")] == flags and all(flags)


def test_answer_prefix_is_written_into_the_prompt_and_read_back(tiny_shared, monkeypatch):
    from lorarl.rewards.judge import encode_judge_prompt

    tok = tiny_shared.tokenizer
    ids = encode_judge_prompt("Rate it", tok, "Score:")
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\nScore:") and "Rate it" in text
    scorer, seen = judge_scorer(tiny_shared, monkeypatch, [" 8", " 20"], answer_prefix="Score:")
    s = scorer(["q", "q"], ["a", "b"], {"answer": ["1", "1"]})
    assert seen["prefix"] == "Score:" and s.per_function[0, 0] == 0.8  # "Score:" + " 8"
    assert torch.isnan(s.per_function[1, 0])  # "Score: 20" is out of range


def test_judge_adapter_on_the_same_base(tiny_shared, tmp_path):
    shared = tiny_shared
    shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.normal_(0, 0.5)
    folder = shared.save_adapter("policy", tmp_path / "judge_adapter")
    cfg = JudgeConfig(model="adapter", path=str(folder), max_new_tokens=4)
    scorer = RewardScorer([RewardSpec(name="judge", judge=cfg)], context=RewardContext(shared=shared))
    assert sorted(shared.adapters) == ["judge", "policy"]
    assert not any(p.requires_grad for p in shared.adapter_parameters("judge"))
    judge = scorer.fns[0].model
    assert judge.role == "judge" and judge.shared is shared  # no second model
    base_answer = JudgeModel(shared, "base").generate(["Rate: 5"], 4, 1)
    judge_answer = judge.generate(["Rate: 5"], 4, 1)
    assert judge_answer != base_answer  # the adapter is what answers
    assert shared.peft.active_adapter == "policy"
    with pytest.raises(LorarlError, match="judge.path"):
        RewardScorer(
            [RewardSpec(name="judge", judge=JudgeConfig(model="adapter", path=str(tmp_path / "none")))],
            context=RewardContext(shared=shared),
        )


def test_judge_from_another_model_folder_is_loaded_once_beside_the_base(tiny_shared, tiny_model_dir):
    cfg = JudgeConfig(model="folder", path=str(tiny_model_dir), max_new_tokens=3)
    scorer = RewardScorer([RewardSpec(name="judge", judge=cfg)], context=RewardContext(shared=tiny_shared))
    judge = scorer.fns[0].model
    assert judge.shared is not tiny_shared and judge.role == "base" and not tiny_shared.adapters
    s = scorer(["q"] * 2, ["a", "b"])
    assert s.extra["rewards/judge/prompts"] == 2.0 and scorer.failures == 0


def test_grpo_with_a_judge_logs_its_failures_and_samples(tiny_model_dir, tmp_path):
    from lorarl.algos.loop import train
    from lorarl.runs import read_metrics

    recipe = recipe_from_dict(
        {
            "algo": "grpo",
            "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"train_size": 16, "eval_size": 4},
            "reward": {
                "functions": [
                    {"name": "numeric_match"},
                    {"name": "judge", "judge": {"mode": "group", "max_new_tokens": 6, "log_rows": 1}},
                ]
            },
            "generation": {"max_new_tokens": 4},
            "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "report_to": []},
            "grpo": {"group_size": 2},
            "eval": {"n": 2, "batch_size": 2},
        }
    )
    # every judge answer of a random model fails to parse: the run stops at the 2nd step without a judge value
    with pytest.raises(LorarlError, match=r"^reward judge failed on every call of 2 steps in a row .*did not parse"):
        train(recipe, tmp_path / "stopped")
    recipe.reward.max_failure_fraction = 1.0  # allowed to fail: the run goes on and logs what failed
    recipe.reward.max_failed_steps = 0
    train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["rewards/judge/failed_rows"] == 4.0 and r["rewards/judge/prompts"] == 2.0  # 2 groups of 2
        assert r["rewards/judge/mean"] is None  # no judge value: NaN, written as null -- never 0
        assert r["rewards/numeric_match/mean"] is not None
    logged = [json.loads(line) for line in (tmp_path / "run" / "judge.jsonl").read_text().splitlines()]
    assert [rec["call"] for rec in logged] == [1, 2] and all(rec["rows"] == [0, 1] for rec in logged)
    assert all('<response id="2">' in rec["prompt"] for rec in logged)
