"""Rejection sampling: the selection rule by hand; a tiny run whose kept set is exactly what the verifier accepted
(written atomically as a TRL dataset that SFT reads, with statistics that add up); resume; an empty kept set."""

from __future__ import annotations

import json
import math

import pytest

from lorarl.algos.loop import train
from lorarl.algos.rejection_sampling import select_kept, value_histogram
from lorarl.config import DataConfig, recipe_from_dict
from lorarl.data.sft import load_sft
from lorarl.errors import DataError
from lorarl.runs import read_metrics

# a verifier the tiny random model passes about half the time, with three reward levels
GRADED = '''
def graded(prompts, completions, **kwargs):
    """0, 0.5 or 1 from the completion's length in characters (mod 3)."""
    return [(len(c[0]["content"] if isinstance(c, list) else c) % 3) / 2 for c in completions]
'''


def test_select_kept_by_hand():
    sel = select_kept([1, 0, 1, 1], ["a", "b", " a", "c"], [False, False, False, True], min_reward=1)
    assert sel.kept == [0] and (sel.below_threshold, sel.truncated, sel.duplicate, sel.over_limit) == (1, 1, 1, 0)
    # best-of-G: highest reward first, ties in sampling order; NaN never passes
    sel = select_kept([0.5, 1.0, math.nan, 1.0, 0.7], list("vwxyz"), [False] * 5, min_reward=0.5, max_per_prompt=2)
    assert sel.kept == [1, 3] and sel.over_limit == 2 and sel.below_threshold == 1
    # truncated completions may be kept when asked
    assert select_kept([1.0], ["a"], [True], 1.0, drop_truncated=False).kept == [0]


def test_value_histogram_by_hand():
    assert value_histogram([1.0, 0.5, 1.0, math.nan]) == {"0.5": 1, "1.0": 2, "nan": 1}
    assert value_histogram([-0.0001, 0.004, 0.006]) == {"0.0": 2, "0.01": 1}


def rs_recipe(model_dir, reward_file, **sections):
    data = {
        "algo": "rejection_sampling",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "data": {"train_size": 64, "eval_size": 8, "arithmetic": {"operations": ["-"]}},
        "reward": {"functions": [{"name": f"{reward_file}:graded"}]},
        "generation": {"max_new_tokens": 6, "temperature": 1.0},
        "rejection_sampling": {"group_size": 4, "min_reward": 0.5, "max_per_prompt": 3, "drop_truncated": False},
        "train": {"steps": 3, "prompts_per_step": 4, "seed": 0},
        "eval": {"n": 4, "batch_size": 4},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


@pytest.fixture()
def reward_file(tmp_path):
    f = tmp_path / "graded.py"
    f.write_text(GRADED)
    return f


def test_kept_set_is_what_the_verifier_accepted_and_stats_add_up(tiny_model_dir, reward_file, tmp_path, tok):
    recipe = rs_recipe(tiny_model_dir, reward_file)
    result = train(recipe, tmp_path / "run")
    folder = tmp_path / "run" / "dataset"
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    stats = json.loads((folder / "stats.json").read_text())
    assert result["dataset"] == str(folder / "train.jsonl") and result["kept"] == len(rows) == stats["kept"] > 0
    # every kept row passes the verifier as written, carries its prompt row's columns, in TRL's format
    for r in rows:
        (msg,) = r["completion"]
        assert msg["role"] == "assistant" and r["reward"] >= 0.5
        assert (len(msg["content"]) % 3) / 2 == r["reward"]
        assert r["prompt"][0]["content"] == f"What is {r['a']} - {r['b']}?" and int(r["answer"]) == r["a"] - r["b"]
    by_prompt: dict[str, list[dict]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"][0]["content"], []).append(r)
    for group in by_prompt.values():  # best-of-G: at most 3, distinct, best first
        texts = [r["completion"][0]["content"].strip() for r in group]
        assert len(group) <= 3 and len(set(texts)) == len(texts)
        assert [r["reward"] for r in group] == sorted((r["reward"] for r in group), reverse=True)
    # the statistics add up
    assert stats["prompts"] == 12 and stats["sampled"] == 48
    assert stats["kept"] + sum(stats["dropped"].values()) == 48
    assert sum(stats["prompts_by_kept_count"].values()) == 12
    assert sum(stats["reward_histogram"]["sampled"].values()) == 48
    assert sum(stats["reward_histogram"]["kept"].values()) == stats["kept"]
    assert set(stats["reward_histogram"]["kept"]) <= {"0.5", "1.0"}
    assert sum(p["kept"] for p in stats["per_prompt"]) == stats["kept"]
    assert all(p["kept_frac"] == p["kept"] / 4 for p in stats["per_prompt"])
    assert stats["prompts_with_kept"] == len(by_prompt) == sum(p["kept"] > 0 for p in stats["per_prompt"])
    metrics = read_metrics(tmp_path / "run")
    assert [m["kept_total"] for m in metrics][-1] == stats["kept"]
    assert sum(m["kept"] for m in metrics) == stats["kept"]
    # SFT reads it as it is
    sft = load_sft(DataConfig(source=str(folder / "train.jsonl")), tok, 2, 256)
    assert len(sft) == len(rows) and not sft.skipped


def test_resumed_sampling_writes_the_same_dataset(tiny_model_dir, reward_file, tmp_path):
    recipe = rs_recipe(tiny_model_dir, reward_file, train={"save_every": 1})
    train(recipe, tmp_path / "straight")
    train(recipe, tmp_path / "split", max_steps=1)  # stops after step 1 (and writes what it kept so far)
    partial = (tmp_path / "split" / "dataset" / "train.jsonl").read_text()
    train(recipe, tmp_path / "split", resume=True)
    assert len(partial) < len((tmp_path / "split" / "dataset" / "train.jsonl").read_text())
    for name in ("train.jsonl", "stats.json"):
        a = (tmp_path / "straight" / "dataset" / name).read_text()
        assert a == (tmp_path / "split" / "dataset" / name).read_text()


def test_nothing_kept_is_one_clear_error_and_nothing_written(tiny_model_dir, reward_file, tmp_path):
    recipe = rs_recipe(
        tiny_model_dir, reward_file, rejection_sampling={"min_reward": 2.0, "drop_truncated": True}, train={"steps": 2}
    )
    with pytest.raises(DataError) as err:
        train(recipe, tmp_path / "run")
    msg = str(err.value)
    assert "nothing passed the verifier (reward >= rejection_sampling.min_reward=2, finished with EOS)" in msg
    assert "32 completions sampled for 8 prompts, best reward seen 1;" in msg and "\n" not in msg
    assert not list((tmp_path / "run").glob("*dataset*"))


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))
