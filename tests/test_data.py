"""Prompt data: the arithmetic generator (disjoint, seeded splits), .jsonl and datasets folders, validation (more
source types and the column mapping: tests/test_sources.py)."""

from __future__ import annotations

import json

import pytest

from lorarl.config import DataConfig
from lorarl.data import load_prompts, read_rows
from lorarl.errors import DataError
from lorarl.tasks.arithmetic import HELD_OUT_FRACTION, all_problems, make_problems, split_of


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))


def _key(row):
    return (row["a"], row["op"], row["b"])


# ---- arithmetic -----------------------------------------------------------------------------------------------


def test_arithmetic_splits_are_disjoint_and_cover_every_problem():
    problems = all_problems(["+", "-"], 2)
    assert len(problems) == 90 * 90 + 90 * 91 // 2  # a >= b for subtraction
    held = [p for p in problems if split_of(*p, seed=1234) == "eval"]
    assert abs(len(held) / len(problems) - HELD_OUT_FRACTION) < 0.02
    train = {_key(r) for r in make_problems("train", 5000, seed=1234, operations=["+", "-"])}
    evals = {_key(r) for r in make_problems("eval", 1000, seed=1234, operations=["+", "-"])}
    assert len(evals) == 1000 and train.isdisjoint(evals)


def test_arithmetic_rows_are_seeded_prefix_stable_and_correct():
    a = make_problems("eval", 50, seed=7)
    assert a == make_problems("eval", 50, seed=7)
    assert make_problems("eval", 20, seed=7) == a[:20]  # --n 20 evaluates the first 20 of the 50
    assert a != make_problems("eval", 50, seed=8)
    for r in make_problems("train", 200, seed=7, operations=["+", "-", "*"]):
        a_, op, b = _key(r)
        assert 10 <= a_ <= 99 and 10 <= b <= 99
        assert int(r["answer"]) == {"+": a_ + b, "-": a_ - b, "*": a_ * b}[op] >= 0
        assert r["prompt"] == [{"role": "user", "content": f"What is {a_} {op} {b}?"}]


def test_arithmetic_template_and_more_digits():
    rows = make_problems("train", 5, seed=0, digits=4, template="{a}{op}{b}=")
    for r in rows:
        assert 1000 <= r["a"] <= 9999 and r["prompt"][0]["content"] == f"{r['a']}+{r['b']}="
        assert split_of(r["a"], "+", r["b"], 0) == "train"


def test_load_prompts_arithmetic_applies_chat_template_and_system_prompt(tok):
    cfg = DataConfig(train_size=4, system_prompt="Reply with only the number.")
    ps = load_prompts(cfg, tok, "train")
    assert len(ps) == 4 and not ps.skipped
    text = ps.texts[0]
    assert text.startswith("<|im_start|>system\nReply with only the number.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert ps.token_ids[0] == tok(text, add_special_tokens=False)["input_ids"]
    assert set(ps.columns([0, 1])) == {"answer", "a", "op", "b"}
    assert ps.columns([1])["answer"] == [ps.rows[1]["answer"]]


# ---- files ----------------------------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_string_and_conversational_prompts(tmp_path, tok):
    f = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "2+2=", "answer": "4"},
            {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], "answer": "x"},
        ],
    )
    ps = load_prompts(DataConfig(source=str(f), system_prompt="IGNORED FOR THESE"), tok, "train")
    assert ps.texts[0] == "2+2="  # plain strings are used as they are
    assert ps.texts[1].startswith("<|im_start|>system\nS<|im_end|>")  # the row's own system message is kept
    assert "IGNORED" not in ps.texts[1]
    with pytest.raises(DataError, match="eval_source"):
        load_prompts(DataConfig(source=str(f)), tok, "eval")
    ev = load_prompts(DataConfig(source=str(f), eval_source=str(f)), tok, "eval")
    assert len(ev) == 2


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "2+2"}, "row 1: column 'prompt' is missing"),
        ({"prompt": ""}, "row 1: column 'prompt' is empty"),
        ({"prompt": "   "}, "row 1: column 'prompt' is empty"),
        ({"prompt": []}, "row 1: column 'prompt' is an empty message list"),
        ({"prompt": [{"role": "user"}]}, "row 1: column 'prompt' message 0"),
        ({"prompt": [{"role": "user", "content": ""}]}, "row 1: column 'prompt' is empty"),
        ({"prompt": 5}, "row 1: column 'prompt' must be a string or a list"),
        ({"prompt": None}, "row 1: column 'prompt' is missing"),
        ({"prompt": "word " * 40}, "row 1: column 'prompt' has 4[01] tokens, more than data.max_prompt_tokens=16"),
    ],
)
def test_bad_rows_fail_naming_row_and_column_or_are_skipped(tmp_path, tok, row, message):
    f = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, row, {"prompt": "ok too"}])
    with pytest.raises(DataError, match=message):
        load_prompts(DataConfig(source=str(f), max_prompt_tokens=16), tok, "train")
    ps = load_prompts(DataConfig(source=str(f), max_prompt_tokens=16, on_bad_row="skip"), tok, "train")
    assert [r["prompt"] for r in ps.rows] == ["fine", "ok too"]
    assert len(ps.skipped) == 1 and ps.skipped[0][0] == 1
    # columns missing from some rows are passed as None for those rows
    assert ps.columns([0, 1])["answer"] == ["1", None]


def test_no_usable_rows_and_unreadable_files(tmp_path, tok):
    f = _jsonl(tmp_path / "all_bad.jsonl", [{"prompt": ""}, {"x": 1}])
    with pytest.raises(DataError, match="no usable rows"):
        load_prompts(DataConfig(source=str(f), on_bad_row="skip"), tok, "train")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 \\(row 1\\) is not valid JSON"):
        read_rows(DataConfig(source=str(broken)), "train")
    with pytest.raises(DataError, match="no such file"):
        read_rows(DataConfig(source=str(tmp_path / "missing.jsonl")), "train")
    (tmp_path / "x.csv").write_text("prompt\nhi\n")  # csv is read by datasets now (tests/test_sources.py)
    assert read_rows(DataConfig(source=str(tmp_path / "x.csv")), "train")[0] == [{"prompt": "hi"}]
    (tmp_path / "x.txt").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="expected `arithmetic`"):
        read_rows(DataConfig(source=str(tmp_path / "x.txt")), "train")


def test_datasets_folder_with_splits(tmp_path, tok):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]),
            "test": datasets.Dataset.from_list([{"prompt": "c", "answer": "3"}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    train = load_prompts(DataConfig(source=str(tmp_path / "ds")), tok, "train")
    assert [r["answer"] for r in train.rows] == ["1", "2"]
    ev = load_prompts(DataConfig(source=str(tmp_path / "ds")), tok, "eval")
    assert [r["prompt"] for r in ev.rows] == ["c"]
    single = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    single.save_to_disk(str(tmp_path / "one"))
    ps = load_prompts(DataConfig(source=str(tmp_path / "one")), tok, "train")
    assert ps.texts[0].endswith("<|im_start|>assistant\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a folder saved with datasets"):
        read_rows(DataConfig(source=str(tmp_path / "empty")), "train")
