"""Data sources the way the ecosystem names them: parquet / csv / json / jsonl files, folders laid out like a hub
dataset repository (configurations in a README), save_to_disk folders, hub names (offline error, and the call made);
column mapping, answer extraction and chat wrapping for prompts and preference pairs. Never the network."""

from __future__ import annotations

import json

import pytest
from gsm8k_data import GSM_TEST, GSM_TRAIN, make_gsm8k_repo, write_parquet

from lorarl.config import DataConfig
from lorarl.data import load_prompts, read_rows, read_source, shape_row, source_rows
from lorarl.data.preferences import load_preferences, preferences_for
from lorarl.data.sources import answer_regex, extract_answer_column, is_hub_name, map_columns, pick_split
from lorarl.errors import DataError


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))


GSM_MAPPING = {"columns": {"prompt": "question", "answer": "answer"}, "answer_pattern": "gsm8k"}


# ---- source types ---------------------------------------------------------------------------------------------


def test_each_file_type_reads_the_same_rows(tmp_path):
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    write_parquet(tmp_path / "p.parquet", rows)
    (tmp_path / "p.csv").write_text("prompt,answer\n2+2=,4\n3+3=,6\n")
    (tmp_path / "p.tsv").write_text("prompt\tanswer\n2+2=\t4\n3+3=\t6\n")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("p.parquet", "p.json", "p.jsonl"):
        got, where = read_source(str(tmp_path / name))
        assert got == rows and where == str(tmp_path / name), name
    for name in ("p.csv", "p.tsv"):  # csv infers types: the answers are read as numbers
        got, _ = read_source(str(tmp_path / name))
        assert got == [{"prompt": "2+2=", "answer": 4}, {"prompt": "3+3=", "answer": 6}], name
    # a single file is one split: evaluation needs data.eval_source (or reads it whole when it is the eval_source)
    assert read_source(str(tmp_path / "p.parquet"), "eval")[0] is None
    assert read_source(str(tmp_path / "p.parquet"), "eval", whole=True)[0] == rows


def test_hub_layout_folder_with_configurations_and_splits(tmp_path):
    repo = make_gsm8k_repo(tmp_path / "gsm8k")
    train, where = read_source(str(repo), "train", subset="main")
    assert train == GSM_TRAIN and where == str(repo)
    assert read_source(str(repo), "eval", subset="main")[0] == GSM_TEST  # the test split by default
    assert read_source(str(repo), "train", subset="socratic", split="test")[0] == GSM_TEST
    with pytest.raises(DataError, match=r"data\.subset for data\.source .*gsm8k.*main.*socratic"):
        read_source(str(repo), "train")  # two configurations and none chosen: datasets lists them
    with pytest.raises(DataError, match=r"data\.split 'dev': no such split \(has: train, test\)"):
        read_source(str(repo), "train", subset="main", split="dev")


def test_folder_of_data_files_without_readme_and_bad_folders(tmp_path):
    write_parquet(tmp_path / "ds" / "data" / "train-00000-of-00001.parquet", [{"prompt": "a", "answer": "1"}])
    write_parquet(tmp_path / "ds" / "data" / "validation-00000-of-00001.parquet", [{"prompt": "b", "answer": "2"}])
    assert read_source(str(tmp_path / "ds"))[0] == [{"prompt": "a", "answer": "1"}]
    assert read_source(str(tmp_path / "ds"), "eval")[0] == [{"prompt": "b", "answer": "2"}]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a folder saved with datasets' save_to_disk, nor a folder of data files"):
        read_source(str(tmp_path / "empty"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_bytes(b"\xff\xfe not text")
    with pytest.raises(DataError, match="data.source .*notes"):
        read_source(str(tmp_path / "notes"))


def test_save_to_disk_folder_and_relative_paths_beside_the_recipe(tmp_path, monkeypatch):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": "a"}]), "test": datasets.Dataset.from_list([{"prompt": "b"}])}
    ).save_to_disk(str(tmp_path / "recipes" / "saved"))
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipes" / "r.yaml"
    assert read_source("saved", "eval", recipe_path=recipe)[0] == [{"prompt": "b"}]  # beside the recipe
    with pytest.raises(DataError, match="data.subset applies to hub datasets"):
        read_source("saved", subset="main", recipe_path=recipe)
    with pytest.raises(DataError, match=r"data\.source nothing\.parquet: no such file or folder"):
        read_source("nothing.parquet", recipe_path=recipe)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="expected `arithmetic`, a hub dataset name"):
        read_source("x.txt")


def test_split_rules():
    assert pick_split(["train", "test"], "train", None, "w") == "train"
    assert pick_split(["only"], "train", None, "w") == "only"
    assert pick_split(["train", "validation", "test"], "eval", None, "w") == "test"
    assert pick_split(["train"], "eval", None, "w") is None
    assert pick_split(["train"], "eval", None, "w", whole=True) == "train"
    with pytest.raises(DataError, match=r"w: no train split \(has: a, b\); set data\.split"):
        pick_split(["a", "b"], "train", None, "w")


# ---- hub names ------------------------------------------------------------------------------------------------


def test_hub_names_are_recognised_only_when_not_a_path():
    assert is_hub_name("openai/gsm8k") and is_hub_name("gsm8k") and is_hub_name("HuggingFaceH4/MATH-500")
    for text in ("data.jsonl", "train.parquet", "./gsm8k", "/abs/path", "a/b/c", "~/x", "pkg:x.jsonl"):
        assert not is_hub_name(text), text


def test_hub_dataset_offline_and_not_cached_is_one_clear_line(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        read_source("openai/gsm8k", subset="main")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "data.source openai/gsm8k: not available offline (offline mode is set: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
        "and not in the datasets cache)"
    )
    assert msg.endswith("; nor is it a local file or folder")
    assert "datasets.load_dataset('openai/gsm8k', 'main')" in msg and "point data.source at a local copy" in msg


def test_hub_name_goes_to_load_dataset_with_the_subset(tmp_path, monkeypatch):
    """The call lorarl makes for a hub name (the library itself is replaced: no network here)."""
    import datasets

    from lorarl.data import sources

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(GSM_TRAIN), "test": datasets.Dataset.from_list(GSM_TEST)}
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(sources, "_hub_reachable", lambda timeout_s=3.0: True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(source="openai/gsm8k", subset="main", eval_split="test", **GSM_MAPPING)
    rows, where = read_rows(cfg, "train")
    assert calls == [("openai/gsm8k", "main", {})] and where == "openai/gsm8k (hub)"
    assert [r["answer"] for r in rows] == ["72", "10", "50"] and rows[0]["prompt"] == GSM_TRAIN[0]["question"]
    assert [r["answer"] for r in read_rows(cfg, "eval")[0]] == ["9", "3"]


# ---- mapping and extraction -----------------------------------------------------------------------------------


def test_gsm8k_folder_through_load_prompts_with_mapping_extraction_and_chat(tmp_path, tok):
    repo = make_gsm8k_repo(tmp_path / "gsm8k")
    cfg = DataConfig(source=str(repo), subset="main", as_chat=True, system_prompt="Think first.", **GSM_MAPPING)
    ps = load_prompts(cfg, tok, "train")
    assert [r["answer"] for r in ps.rows] == ["72", "10", "50"]
    assert ps.rows[0]["prompt"] == [{"role": "user", "content": GSM_TRAIN[0]["question"]}]
    assert "question" not in ps.rows[0]  # renamed, not copied
    assert ps.texts[0].startswith("<|im_start|>system\nThink first.<|im_end|>\n<|im_start|>user\nNatalia")
    assert ps.texts[0].endswith("<|im_start|>assistant\n") and ps.conversational
    assert ps.columns([0])["answer"] == ["72"]
    ev = load_prompts(cfg, tok, "eval")
    assert [r["answer"] for r in ev.rows] == ["9", "3"]
    # as_chat off: TRL's semantics, a string prompt is used as it is
    plain = load_prompts(DataConfig(source=str(repo), subset="main", **GSM_MAPPING), tok, "train")
    assert plain.texts[0] == GSM_TRAIN[0]["question"] and not plain.conversational


def test_a_mapping_to_a_missing_column_names_the_key_and_the_columns_there_are(tmp_path, tok):
    f = write_parquet(tmp_path / "t.parquet", GSM_TRAIN)
    cfg = DataConfig(source=str(f), columns={"prompt": "problem"}, on_bad_row="skip")
    with pytest.raises(DataError) as e:
        load_prompts(cfg, tok, "train")  # a wrong mapping is never a skippable bad row
    assert str(e.value) == f"{f}: data.columns.prompt: no column 'problem' (columns: question, answer)"
    # a column missing from one row only (JSON Lines rows can differ) is that row's problem
    j = tmp_path / "t.jsonl"
    j.write_text(json.dumps({"q": "1+1", "a": "2"}) + "\n" + json.dumps({"a": "3"}) + "\n")
    cfg = DataConfig(source=str(j), columns={"prompt": "q", "answer": "a"})
    with pytest.raises(DataError, match=r"row 1: data\.columns\.prompt: column 'q' is missing \(columns: a\)"):
        load_prompts(cfg, tok, "train")
    cfg.on_bad_row = "skip"
    ps = load_prompts(cfg, tok, "train")
    assert [r["prompt"] for r in ps.rows] == ["1+1"] and ps.skipped[0][0] == 1


def test_answer_pattern_rows_that_do_not_match_fail_or_are_skipped(tmp_path, tok):
    rows = [*GSM_TRAIN[:1], {"question": "no marker", "answer": "the answer is 5"}, GSM_TRAIN[2]]
    f = write_parquet(tmp_path / "t.parquet", rows)
    cfg = DataConfig(source=str(f), **GSM_MAPPING)
    with pytest.raises(DataError, match=r"row 1: column 'answer' does not match data\.answer_pattern"):
        load_prompts(cfg, tok, "train")
    cfg.on_bad_row = "skip"
    assert [r["answer"] for r in load_prompts(cfg, tok, "train").rows] == ["72", "50"]
    assert [r["answer"] for r in read_rows(cfg, "train")[0]] == ["72", "50"]  # export / reports see the same rows


def test_mapping_and_extraction_functions():
    row = {"question": "q", "answer": "work\n#### 1,234", "id": 3}
    mapped = map_columns(row, {"prompt": "question", "answer": "answer", "solution": "answer"}, 0)
    assert mapped == {"id": 3, "prompt": "q", "answer": row["answer"], "solution": row["answer"]}
    assert map_columns(row, {}, 0) is row
    assert extract_answer_column(mapped["answer"], answer_regex("gsm8k"), 0) == "1,234"
    assert extract_answer_column(None, answer_regex("gsm8k"), 0) is None
    assert extract_answer_column(42, answer_regex(r"(\d)$"), 0) == "2"  # numbers are read as text
    assert extract_answer_column("a=1; a=2", answer_regex(r"a=(\d)"), 0) == "2"  # the last match
    with pytest.raises(DataError, match="row 4: column 'answer' does not match"):
        extract_answer_column("#### ", answer_regex("gsm8k"), 4)


def test_defaults_leave_rows_untouched_so_the_quickstart_is_unchanged():
    rows, where = source_rows(DataConfig(train_size=5), "train")
    for i, row in enumerate(rows):
        assert shape_row(row, DataConfig(), i) is row
    assert where == "arithmetic (train, 5 rows, seed 1234)"


def test_recipe_keys_are_checked_when_the_recipe_loads(tmp_path):
    from lorarl.config import recipe_from_dict
    from lorarl.errors import RecipeError

    base = {"algo": "grpo", "data": {"source": "openai/gsm8k"}}
    with pytest.raises(RecipeError, match=r"data\.answer_pattern must be a preset \(gsm8k\) or a regex with one group"):
        recipe_from_dict({**base, "data": {"answer_pattern": "#### .+"}})
    with pytest.raises(RecipeError, match=r"data\.columns\.prompt must be a column name"):
        recipe_from_dict({**base, "data": {"columns": {"prompt": ""}}})
    with pytest.raises(RecipeError, match=r"data\.verifier must be one of 'numeric' \| 'math'"):
        recipe_from_dict({**base, "data": {"verifier": "sympy"}})


# ---- preference pairs -----------------------------------------------------------------------------------------


PAIRS = [
    {"question": "What is 2 + 2?", "good": "4", "bad": "5"},
    {"question": "What is 3 + 3?", "good": "6", "bad": "7"},
]


def test_preferences_from_a_hub_layout_folder_with_a_mapping_and_chat(tmp_path, tok):
    write_parquet(tmp_path / "prefs" / "data" / "train-00000-of-00001.parquet", PAIRS)
    write_parquet(tmp_path / "prefs" / "data" / "test-00000-of-00001.parquet", PAIRS[:1])
    cfg = DataConfig(
        source=str(tmp_path / "prefs"), columns={"prompt": "question", "chosen": "good", "rejected": "bad"}
    )
    train = preferences_for(cfg, tok, "train")
    assert [p["chosen"] for p in train.pairs] == ["4", "6"] and train.pairs[0]["prompt"] == "What is 2 + 2?"
    assert len(preferences_for(cfg, tok, "eval")) == 1  # the folder's test split
    cfg.as_chat = True
    chat = preferences_for(cfg, tok, "train")
    assert chat.pairs[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert chat.pairs[0]["chosen"] == [{"role": "assistant", "content": "4"}]
    prompt_ids = tok.apply_chat_template(chat.pairs[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert chat.chosen_ids[0][: len(tok(prompt_ids)["input_ids"])] == tok(prompt_ids)["input_ids"]


def test_preference_sources_errors_and_a_single_file(tmp_path, tok):
    f = write_parquet(tmp_path / "pairs.parquet", PAIRS)
    cfg = DataConfig(source=str(f), columns={"chosen": "good", "rejected": "worse"})
    with pytest.raises(DataError, match=r"data\.columns\.rejected: no column 'worse' \(columns: question, good, bad\)"):
        preferences_for(cfg, tok, "train")
    cfg.columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    assert preferences_for(cfg, tok, "eval") is None  # one file, no eval_source: no held-out set
    cfg.eval_source = str(f)
    assert len(preferences_for(cfg, tok, "eval")) == 2
    # without a mapping TRL's names are required, and the row says which is missing
    with pytest.raises(DataError, match="row 0: column 'chosen' is missing"):
        load_preferences(str(f), tok)
    with pytest.raises(DataError, match="reward_model needs preference pairs"):
        preferences_for(DataConfig(), tok)
