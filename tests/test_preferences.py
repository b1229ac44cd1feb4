"""Preference pairs: TRL's four formats, sources (pkg:, relative, datasets folder), errors with row and column,
tokenization that matches what PPO scores, and the shipped arithmetic set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.data.preferences import encode_pair, load_preferences, normalize_pair, resolve_source
from lorarl.errors import DataError
from lorarl.model.tokens import pad_right

REPO = Path(__file__).resolve().parents[1]
U = {"role": "user", "content": "What is 2 + 2?"}
A4 = {"role": "assistant", "content": "4"}
A5 = {"role": "assistant", "content": "5"}


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------ formats


def test_normalize_the_four_trl_formats():
    p = normalize_pair({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, 0)
    assert (p["prompt"], p["chosen"], p["rejected"], p["margin"]) == ("2 + 2 =", " 4", " 5", None)
    p = normalize_pair({"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}, 0)
    assert p["prompt"] is None and p["chosen"] == "2 + 2 = 4"
    p = normalize_pair({"prompt": [U], "chosen": [A4], "rejected": [A5], "margin": 2}, 0)
    assert p["prompt"] == [U] and p["chosen"] == [A4] and p["margin"] == 2.0
    # implicit conversational prompt: the shared leading messages
    p = normalize_pair({"chosen": [U, A4], "rejected": [U, A5], "kind": "x"}, 0)
    assert p["prompt"] == [U] and p["chosen"] == [A4] and p["rejected"] == [A5]
    assert p["columns"] == {"kind": "x"}


@pytest.mark.parametrize(
    "row, column",
    [
        ({"chosen": "a"}, "rejected"),
        ({"rejected": "a"}, "chosen"),
        ({"chosen": "a", "rejected": [A5]}, "rejected"),
        ({"chosen": "", "rejected": "b"}, "chosen"),
        ({"chosen": 3, "rejected": "b"}, "chosen"),
        ({"prompt": [U], "chosen": "a", "rejected": "b"}, "prompt"),
        ({"prompt": "q", "chosen": [A4], "rejected": [A5]}, "prompt"),
        ({"chosen": [U, {"role": "assistant"}], "rejected": [U, A5]}, "chosen"),
        ({"chosen": [A4], "rejected": [A5]}, "prompt"),  # implicit prompt with nothing shared
        ({"prompt": [U], "chosen": [U], "rejected": [A5]}, "chosen"),  # must end with an assistant message
        ({"chosen": "a", "rejected": "b", "margin": "big"}, "margin"),
    ],
)
def test_bad_rows_name_row_and_column(row, column):
    with pytest.raises(DataError, match=rf"row 7: column '{column}'"):
        normalize_pair(row, 7)


def test_load_errors_name_source_row_and_column_or_skip(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"chosen": "a", "rejected": "b"}, {"chosen": "a", "rejected": "b"}, {"chosen": "a"}]
    )
    with pytest.raises(DataError, match=r"p\.jsonl: row 2: column 'rejected' is missing"):
        load_preferences(str(path))
    ps = load_preferences(str(path), on_bad_row="skip")
    assert len(ps) == 2 and ps.skipped[0][0] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "a", "rejected": "b"}\n{not json\n')
    with pytest.raises(DataError, match=r"line 2 \(row 1\)"):
        load_preferences(str(bad))
    empty = write_jsonl(tmp_path / "e.jsonl", [{"chosen": "a"}])
    with pytest.raises(DataError, match="no usable preference pairs"):
        load_preferences(str(empty), on_bad_row="skip")


# ------------------------------------------------------------------ sources


def test_pkg_prefix_and_relative_paths(tmp_path, monkeypatch):
    assert resolve_source("pkg:prefs_arith_train.jsonl").is_file()
    with pytest.raises(DataError, match="shipped"):
        resolve_source("pkg:nope.jsonl")
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    write_jsonl(recipe_dir / "pairs.jsonl", [{"chosen": "a", "rejected": "b"}])
    assert resolve_source("pairs.jsonl", recipe_dir / "r.yaml") == recipe_dir / "pairs.jsonl"
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "here.jsonl", [{"chosen": "a", "rejected": "b"}])
    assert resolve_source("here.jsonl", recipe_dir / "r.yaml") == Path("here.jsonl")
    with pytest.raises(DataError, match="no such file"):
        resolve_source("missing.jsonl", recipe_dir / "r.yaml")
    # one documented order (lorarl.runs.resolve_path): the current directory first, then beside the recipe
    write_jsonl(tmp_path / "pairs.jsonl", [{"chosen": "a", "rejected": "b"}])
    assert resolve_source("pairs.jsonl", recipe_dir / "r.yaml") == Path("pairs.jsonl")


def test_datasets_folder_train_and_test_splits(tmp_path):
    import datasets

    rows = [{"prompt": [U], "chosen": [A4], "rejected": [A5]}] * 3
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])})
    dd.save_to_disk(str(tmp_path / "ds"))
    assert len(load_preferences(str(tmp_path / "ds"), split="train")) == 3
    assert len(load_preferences(str(tmp_path / "ds"), split="eval")) == 2


# ------------------------------------------------------------------ tokenization


def test_conversational_pair_tokens_match_the_rollout_prompt_and_end_with_eos(tok):
    from lorarl.config import DataConfig
    from lorarl.data import load_prompts

    prompt = [{"role": "user", "content": "What is 23 + 45?"}]
    pair = normalize_pair({"prompt": prompt, "chosen": [{"role": "assistant", "content": "68"}], "rejected": [A5]}, 0)
    chosen, rejected = encode_pair(pair, tok)
    # the prompt part is exactly what PPO's rollout feeds the policy (data.load_prompts)
    rows = load_prompts(DataConfig(train_size=1), tok).token_ids
    from lorarl.data import encode_prompt, prompt_text

    want = encode_prompt(prompt_text(prompt, tok, None), tok, templated=True)
    assert chosen[: len(want)] == want == rejected[: len(want)]
    assert chosen[len(want) : -1] == tok("68", add_special_tokens=False)["input_ids"]
    assert chosen[-1] == tok.eos_token_id and rejected[-1] == tok.eos_token_id
    assert sum(t == tok.eos_token_id for t in chosen[len(want) :]) == 1  # one EOS ends the response
    assert rows and isinstance(rows[0], list)


def test_plain_pairs_and_padding_read_score_at_eos(tok):
    from lorarl.model import last_token_index

    c, r = encode_pair(normalize_pair({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " five or so"}, 0), tok)
    assert c[-1] == tok.eos_token_id and r[-1] == tok.eos_token_id
    ids, att = pad_right([c, r], tok.pad_token_id)
    assert ids.shape == (2, max(len(c), len(r)))
    # pad == eos for SmolLM2: the score position comes from the mask, and it is the EOS that ends each response
    idx = last_token_index(att)
    assert idx.tolist() == [len(c) - 1, len(r) - 1]
    c2, _ = encode_pair(normalize_pair({"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}, 0), tok)
    assert c2[-1] == tok.eos_token_id


def test_max_length_drops_long_pairs_and_margins(tmp_path, tok):
    rows = [{"chosen": "short", "rejected": "no", "margin": 1.5}, {"chosen": "word " * 100, "rejected": "x"}]
    ps = load_preferences(str(write_jsonl(tmp_path / "m.jsonl", rows)), tok, max_length=20)
    assert len(ps) == 1 and "max_length" in ps.skipped[0][1]
    assert ps.margins([0]).tolist() == [1.5]
    assert len(ps.chosen_ids) == len(ps.rejected_ids) == 1


def test_identical_pairs_are_left_out_and_counted(tmp_path, tok):
    rows = [{"prompt": [U], "chosen": [A4], "rejected": [A4]}, {"prompt": [U], "chosen": [A4], "rejected": [A5]}]
    ps = load_preferences(str(write_jsonl(tmp_path / "same.jsonl", rows)), tok)
    assert len(ps) == 1 and ps.pairs[0]["rejected"][0]["content"] == "5"
    assert ps.skipped == [(0, "row 0: columns 'chosen' and 'rejected' are the same response")]
    with pytest.raises(DataError, match="no usable preference pairs.*same response"):
        load_preferences(str(write_jsonl(tmp_path / "only.jsonl", rows[:1])), tok)


# ------------------------------------------------------------------ the shipped set


def test_shipped_arithmetic_preferences(tok):
    from lorarl.rewards import is_correct
    from lorarl.tasks.arithmetic import split_of

    train = load_preferences("pkg:prefs_arith_train.jsonl", tok, max_length=256)
    held = load_preferences("pkg:prefs_arith_eval.jsonl", tok, max_length=256)
    assert 1000 <= len(train) <= 5000 and 200 <= len(held) <= 1000
    assert not train.skipped and not held.skipped
    for path in ("prefs_arith_train.jsonl", "prefs_arith_eval.jsonl"):
        assert (REPO / "lorarl" / "data" / path).stat().st_size < 2_000_000

    def problems(ps):
        out = set()
        for p in ps.pairs:
            a, _, b = p["prompt"][0]["content"][len("What is ") : -1].split(" ")
            out.add((int(a), int(b)))
            assert is_correct(p["chosen"], str(int(a) + int(b)))  # chosen is always right
        return out

    tr, ev = problems(train), problems(held)
    assert not tr & ev  # held-out pairs use held-out problems
    assert all(split_of(a, "+", b, 1234) == "eval" for a, b in ev)
    kinds = {p["columns"]["kind"] for p in held.pairs}
    assert kinds == {"wrong_number", "ramble", "unfinished"}


def test_make_preferences_script_reproduces_the_shipped_files():
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_preferences.py"), "--check"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
