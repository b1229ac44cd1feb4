"""Every recipe key the README and docs/*.md name is one the loader accepts (issue 22: the README documented
``ppo.kl.estimator`` while the loader refused it).

Three forms are read from the Markdown: dotted keys (``grpo.kl.coef``, ``train.keep_best``), command-line overrides
``section.key=value`` (the value is loaded too), and YAML code blocks shaped like a recipe (loaded whole). Keys that
moved are accepted under their old names, as the loader reads them (with a notice). A dotted name that is lorarl code
(``health.parity_metrics``: ``lorarl.health.parity_metrics``) is not a key. Keys of other tools that the docs name
beside lorarl's (verl's in the hand-off tables) are listed in :data:`FOREIGN`, and the test checks that they are
indeed not lorarl keys."""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from pathlib import Path
from typing import Union

import pytest
import yaml

from lorarl.config import recipe_from_dict
from lorarl.config.migrate import migrate_path
from lorarl.config.schema import Recipe

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = [f.name for f in dataclasses.fields(Recipe) if f.name != "source_path"]
ALGOS = ("grpo", "ppo", "reward_model", "sft", "rejection_sampling", "dpo", "online_dpo", "kto")
FILE_SUFFIXES = {"py", "json", "jsonl", "md", "yaml", "yml", "png", "txt", "csv", "parquet"}

# dotted names in the docs that are other tools' configuration keys, not lorarl's
FOREIGN = {
    "data.train_batch_size": "verl (docs/handoff.md: what train.prompts_per_step maps to)",
    "data.filter_overlong_prompts": "verl (docs/handoff.md: what data.on_bad_row maps to)",
    "reward.custom_reward_function": "verl (docs/export.md: the hand-off's compute_score)",
}

KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_]\w*)+)(?![\w/-])(?:=([^\s`)]+))?")


def _dataclass_in(tp) -> type | None:
    """The dataclass an annotation holds (``X | None``, ``list[X]``) or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType, list, tuple):
        for arg in typing.get_args(tp):
            if (found := _dataclass_in(arg)) is not None:
                return found
    return None


def _is_mapping(tp) -> bool:
    if tp is dict or typing.get_origin(tp) is dict:
        return True
    return typing.get_origin(tp) in (Union, types.UnionType) and any(_is_mapping(a) for a in typing.get_args(tp))


def schema_has(path: list[str]) -> bool:
    """Whether ``section.key...`` names a field (or a section) of the recipe schema; past a free mapping
    (``data.columns``) any name is a key of that mapping."""
    cls = Recipe
    for i, part in enumerate(path):
        names = {f.name for f in dataclasses.fields(cls)} - {"source_path"}
        if part not in names:
            return False
        tp = typing.get_type_hints(cls)[part]
        if i == len(path) - 1:
            return True
        sub = _dataclass_in(tp)
        if sub is None:
            return _is_mapping(tp)
        cls = sub
    return True


def code_reference(key: str) -> bool:
    """Whether ``key`` names Python code rather than a recipe key: ``health.parity_metrics`` is
    ``lorarl.health.parity_metrics``."""
    module, *attrs = key.split(".")
    try:
        obj = importlib.import_module(f"lorarl.{module}")
    except ImportError:
        return False
    for attr in attrs:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def documented() -> tuple[dict[str, set[str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """``(keys -> files, overrides (file, "k=v"), recipe-shaped YAML blocks (file, text))`` from the docs."""
    keys: dict[str, set[str]] = {}
    overrides, blocks = [], []
    for doc in DOCS:
        text = doc.read_text()
        for m in KEY.finditer(text):
            key = m.group(1) + m.group(2)
            if key.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # a file name: grpo.py, eval.json
                continue
            keys.setdefault(key, set()).add(doc.name)
            if m.group(3):
                value = m.group(3).rstrip(",.;:")
                while value.endswith("]") and value.count("]") > value.count("["):  # inside a YAML list: [k=v]
                    value = value[:-1]
                overrides.append((doc.name, f"{key}={value}"))
        for block in re.findall(r"```ya?ml\n(.*?)```", text, flags=re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data and set(data) <= set(SECTIONS):
                blocks.append((doc.name, block))
    return keys, overrides, blocks


def test_the_extractor_reads_each_form():
    """The patterns find what the docs use: keys in prose, overrides in commands, keys with values."""
    keys, overrides, blocks = documented()
    assert {"grpo.kl.coef", "train.keep_best", "ppo.kl.estimator", "data.columns", "eval.every"} <= set(keys)
    assert ("cli.md", "grpo.kl.coef=0.04") in overrides
    assert any(name == "recipes_24gb.md" for name, _ in blocks)
    assert not {k for k in keys if k.endswith((".py", ".json"))}
    # the schema walk itself: real keys, moved keys, a free mapping's keys pass; made-up ones do not
    assert schema_has(["grpo", "kl", "coef"]) and schema_has(["data", "columns", "prompt"])
    assert schema_has(migrate_path(["grpo", "kl_coef"]))
    assert not schema_has(["grpo", "kl", "coeff"]) and not schema_has(["train", "steps", "x"])
    assert code_reference("health.parity_metrics") and not code_reference("health.parity_metricz")
    assert not code_reference("grpo.kl.coef")


def test_every_documented_key_is_a_recipe_key():
    keys, _, _ = documented()
    unknown = {
        k: sorted(files)
        for k, files in keys.items()
        if k not in FOREIGN and not schema_has(migrate_path(k.split("."))) and not code_reference(k)
    }
    assert not unknown, f"documented keys the loader refuses: {unknown}"


def test_foreign_keys_are_not_lorarl_keys_and_still_documented():
    keys, _, _ = documented()
    for key, owner in FOREIGN.items():
        assert key in keys, f"{key} ({owner}) is no longer in the docs: drop it from FOREIGN"
        assert not schema_has(migrate_path(key.split("."))), f"{key} is a lorarl key now: drop it from FOREIGN"


@pytest.mark.parametrize("where, override", documented()[1], ids=[f"{w}:{o}" for w, o in documented()[1]])
def test_documented_overrides_load(where, override):
    """``section.key=value`` from a command in the docs loads, value included (a recipe of the key's algorithm)."""
    section = override.split(".", 1)[0]
    algo = section if section in ALGOS else "grpo"
    recipe_from_dict({"algo": algo}, where=where, overrides=[override])


@pytest.mark.parametrize("where, block", documented()[2], ids=[w for w, _ in documented()[2]])
def test_documented_recipe_blocks_load(where, block):
    data = yaml.safe_load(block)
    algo = next((s for s in data if s in ALGOS), "grpo")
    recipe_from_dict({"algo": algo, **data}, where=where)
