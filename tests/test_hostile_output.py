"""Hostile data and model output (issue 42, item 8): a message role that is not a string, a 10 MB prompt, a judge's
answer of 5,000 brackets or a 5,000-digit score, 128K-256K characters of tags for the answer and format rewards. Each
is one bad row (or one failed judge row), in bounded time; the rewards' results on ordinary text are unchanged (they
are checked against the regexes they replaced, on thousands of generated texts)."""

from __future__ import annotations

import json
import math
import random
import re
import time

import pytest

from lorarl.config import DataConfig
from lorarl.core.messages import decode_json, tag_blocks
from lorarl.data.preferences import normalize_pair
from lorarl.data.prompts import load_prompts, max_token_chars
from lorarl.data.sft import load_sft
from lorarl.errors import DataError
from lorarl.rewards.answers import answer_region, extract_answer, has_r1_format
from lorarl.rewards.builtins import format_reward, numeric_match, partial_credit
from lorarl.rewards.judge_prompts import JudgeParseError, parse_group, parse_pointwise

BOUND_S = 0.5  # every hostile text below is read in well under this (the old regexes took 8-85 s)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


# ---- data: roles, long prompts ---------------------------------------------------------------------------------------

GOOD = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
BAD_ROLES = [1, ["user"], None, ""]


def test_a_role_that_is_not_a_string_is_a_bad_row(tmp_path, tok):
    """The chat template raised outside the data checks (on_bad_row: skip exited 1 with a traceback)."""
    rows = [GOOD] + [{"prompt": [{"role": r, "content": "hi"}], "answer": "1"} for r in BAD_ROLES]
    source = _jsonl(tmp_path, rows)
    with pytest.raises(DataError, match=r"row 1: column 'prompt' message 0 role must be a string .* got 1 "):
        load_prompts(DataConfig(source=source), tok)
    kept = load_prompts(DataConfig(source=source, on_bad_row="skip"), tok)
    assert len(kept) == 1 and [i for i, _ in kept.skipped] == [1, 2, 3, 4]
    assert "got ['user']" in kept.skipped[1][1] and "got None" in kept.skipped[2][1]
    with pytest.raises(DataError, match=r"row 0: column 'chosen' message 0 role must be a string"):
        normalize_pair({"chosen": [{"role": 7, "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}, 0)


def test_a_row_the_chat_template_refuses_is_a_bad_row(tmp_path, tok):
    """A template's raise_exception (here: roles must alternate) is the row's DataError, skipped with skip."""
    import copy

    strict = copy.copy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endfor %}"
    )
    twice = {"prompt": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "answer": "1"}
    source = _jsonl(tmp_path, [GOOD, twice])
    with pytest.raises(DataError, match=r"row 1: column 'prompt': the chat template cannot render it .*alternate"):
        load_prompts(DataConfig(source=source), strict)
    assert [i for i, _ in load_prompts(DataConfig(source=source, on_bad_row="skip"), strict).skipped] == [1]


def test_a_10_mb_prompt_is_refused_by_its_length_before_tokenizing(tmp_path, tok):
    """It was tokenized whole before the length check (10.8 s, 2.7 GB)."""
    huge = {"prompt": [{"role": "user", "content": "word " * 2_000_000}], "answer": "1"}
    source = _jsonl(tmp_path, [GOOD, huge])
    per = max_token_chars(tok)
    assert per == max(map(len, tok.get_vocab()))
    cfg = DataConfig(source=source, max_prompt_tokens=512)
    with pytest.raises(
        DataError, match=r"row 1: column 'prompt' has 10,000,\d{3} characters, more than 512 tokens hold"
    ):
        load_prompts(cfg, tok)
    kept, took = _timed(load_prompts, DataConfig(source=source, max_prompt_tokens=512, on_bad_row="skip"), tok)
    assert len(kept) == 1 and took < 2.0  # the file is read and parsed; nothing of the row is tokenized
    # the bound only refuses what cannot fit: a prompt of 2 x 81 x 8 characters would, one token longer would not
    near = {"prompt": "#" * (2 * per * 8), "answer": "1"}
    with pytest.raises(DataError, match=r"has \d+ tokens, more than data.max_prompt_tokens=8"):  # tokenized: 17 > 8
        load_prompts(DataConfig(source=_jsonl(tmp_path, [near]), max_prompt_tokens=8), tok)


def test_a_10_mb_sft_completion_is_refused_before_tokenizing(tmp_path, tok):
    rows = [{"prompt": "2 + 3 =", "completion": "5"}, {"prompt": "1 + 1 =", "completion": "2 " * 5_000_000}]
    cfg = DataConfig(source=_jsonl(tmp_path, rows), on_bad_row="skip")
    sft, took = _timed(load_sft, cfg, tok, tok.eos_token_id, 256)
    assert len(sft.prompt_ids) == 1 and "row 1: the completion has 10,000,000 characters" in sft.skipped[0][1]
    assert "(sft.max_length=256)" in sft.skipped[0][1] and took < 2.0


def test_a_10_mb_response_leaves_its_pair_out_before_tokenizing(tmp_path, tok):
    from lorarl.data.pairs import load_pairs
    from lorarl.data.preferences import load_preferences

    ok = {"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"}
    rows = [ok, {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 3" * 5_000_000}]
    cfg = DataConfig(source=_jsonl(tmp_path, rows))
    eos = tok.eos_token_id
    pairs, took = _timed(load_pairs, cfg, tok, "train", eos_ids=[eos], end_id=eos, max_length=128)
    assert len(pairs) == 1 and pairs.counts["too_long"] == 1 and took < 2.0
    assert "more than dpo.max_length=128 tokens: it has 10,000,007 characters" in pairs.skipped[0][1]
    prefs, took = _timed(load_preferences, cfg.source, tok, max_length=128)
    assert len(prefs.pairs) == 1 and "longer than reward_model.max_length=128" in prefs.skipped[0][1] and took < 2.0


# ---- the judge's answers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('{"scores": ' + "[" * 5000, "JSON nested deeper than 64 brackets"),  # RecursionError before
        ('{"scores": [{"id": 1, "score": ' + "9" * 5000 + "}]}", "Exceeds the limit"),  # AttributeError before
        ('{"scores": [{"id": 1, "score": "' + "\\" * 100_000, "Unterminated string"),
    ],
)
def test_a_hostile_judge_answer_fails_its_row_only(answer, why):
    with pytest.raises(JudgeParseError, match=re.escape(why)):
        _timed(parse_group, answer, 1, 0, 10)
    _, took = _timed(pytest.raises, JudgeParseError, parse_group, answer, 1, 0, 10)
    assert took < BOUND_S


def test_the_judge_reward_fails_the_bad_rows_and_scores_the_others():
    from types import SimpleNamespace

    from lorarl.config.rewards import JudgeConfig
    from lorarl.rewards.judge import JudgeReward

    answers = ['{"scores": ' + "[" * 5000, '{"scores": [{"id": 1, "score": 7}]}', "Score: " + "9" * 5000]
    model = SimpleNamespace(generate=lambda texts, *a: [answers[int(t[-1])] for t in texts])
    judge = JudgeReward(JudgeConfig(mode="group", rubric="{completions}#", min_score=0, max_score=10), model)
    judge.prompts_for = lambda prompts, texts, columns, g: ([f"p{i}" for i in range(3)], [[0], [1], [2]])
    values = judge(["p"] * 3, ["a", "b", "c"], group_size=1)
    assert math.isnan(values[0]) and values[1] == 0.7 and math.isnan(values[2])
    assert judge.step_metrics()["failed_rows"] == 2 and "nested deeper than 64" in judge.last_value_error


def test_a_pointwise_answer_is_read_in_linear_time():
    for text in ("Score: 1" + " " * 256_000 + "x", "Score: " + "1" * 256_000 + "x", "*" * 256_000):
        _, took = _timed(pytest.raises, JudgeParseError, parse_pointwise, text, 0, 10)
        assert took < BOUND_S, (text[:20], took)  # 20,000 spaces took 6.5 s before
    assert parse_pointwise("**Score:** 7 / 10 .", 0, 10) == 7.0 and parse_pointwise("score = 3\n", 0, 10) == 3.0


# ---- the answer and format rewards ------------------------------------------------------------------------------------

HOSTILE = {
    "unclosed <answer>": "<answer>" * 16_000,  # 128K characters: numeric_match took 8 s (43 s on a busy machine)
    "unclosed answers after think": "<think>" + "</think><answer>" * 16_000,  # 256K: format took 17 s
    "closing tags": "</think>" * 32_000,
    "digits": "<answer>" + "1," * 128_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_rewards_read_hostile_completions_in_linear_time(name):
    text = HOSTILE[name]
    for reward in (numeric_match, format_reward, partial_credit):
        _, took = _timed(reward, ["p"], [text], answer=["1"])
        assert took < BOUND_S, (reward.__name__, took)
    _, took = _timed(pytest.raises, ValueError, decode_json, "[" * 256_000 + "]" * 256_000)
    assert took < BOUND_S


# The regexes the answer and format readers replaced: their results are the reference on ordinary text.
OLD_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
OLD_FORMAT = re.compile(r"\s*<think>(.+?)</think>\s*<answer>(.+?)</answer>\s*", re.S)
PIECES = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "\t", "7", "42", "x", ",", "-3.5", "1,234", "<"]


def _near_r1(rng: random.Random) -> str:
    """A text built like the R1 format, with pieces dropped, doubled or inserted at random."""
    parts = [" ", "<think>", "x", "</think>", "\n", "<answer>", "42", "</answer>", "\t"]
    out = []
    for p in parts:
        roll = rng.random()
        out += [] if roll < 0.15 else [p, p] if roll < 0.3 else [p, rng.choice(PIECES)] if roll < 0.45 else [p]
    return "".join(out)


def test_the_readers_give_the_old_regexes_results():
    rng = random.Random(0)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))) for _ in range(10_000)]
    texts += [_near_r1(rng) for _ in range(10_000)]
    formatted = 0
    for text in texts:
        assert tag_blocks(text, "<answer>", "</answer>") == OLD_ANSWER_TAG.findall(text), text
        assert has_r1_format(text) == bool(OLD_FORMAT.fullmatch(text)), text
        formatted += has_r1_format(text)
    assert 1_000 < formatted < 19_000  # the generated texts hold both kinds
    assert extract_answer("<answer>12</answer> or 13") == "12" and answer_region("x <answer>y</answer>") == "y"
    assert numeric_match(
        ["p"] * 3, ["<think>a</think><answer>1,234</answer>", "it is 7.", "no"], answer=["1234", "7", "1"]
    ) == [
        1.0,
        1.0,
        0.0,
    ]
