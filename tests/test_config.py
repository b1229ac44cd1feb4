"""Recipes: validation names the key and the file; overrides; the CLI answers bad input with one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.config import Recipe, load_recipe, recipe_from_dict, recipe_to_dict
from lorarl.errors import RecipeError


def _write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, key, words",
    [
        ("grpo:\n  group_sise: 4\n", "grpo.group_sise", "did you mean grpo.group_size"),
        ("trian:\n  steps: 3\n", "trian", "did you mean train"),
        (
            "train:\n  gradient_checkpointing: false\n",
            "train.gradient_checkpointing",
            "did you mean model.gradient_checkpointing",
        ),
        ("grpo:\n  group_size: 1\n", "grpo.group_size", "must be >= 2"),
        ("grpo:\n  clip_eps_low: 0\n", "grpo.clip_eps_low", "must be > 0"),
        ("grpo:\n  clip_eps_high: -0.1\n", "grpo.clip_eps_high", "must be > 0"),
        ("train:\n  learning_rate: -1e-4\n", "train.learning_rate", "must be > 0"),
        ("train:\n  steps: ten\n", "train.steps", "must be int"),
        ("train:\n  steps: 2.5\n", "train.steps", "must be int"),
        ("grpo:\n  loss_reduction: mean\n", "grpo.loss_reduction", "must be one of"),
        ("model:\n  quantization: int8\n", "model.quantization", "must be one of"),
        ("lora:\n  r: 0\n", "lora.r", "must be >= 1"),
        ("generation:\n  temperature: 0\n", "generation.temperature", "must be > 0"),
        (
            "algo: ppo\nppo:\n  critic:\n    lora:\n      rr: 3\n",
            "ppo.critic.lora.rr",
            "did you mean ppo.critic.lora.r",
        ),
        ("reward:\n  functions:\n    - nam: x\n", "reward.functions[0].nam", "did you mean"),
        ("generation:\n  top_p: 0.9\n", "generation.top_p", "must be 1.0 for training"),
        ("generation:\n  top_k: 20\n", "generation.top_k", "must be 0 for training"),
        ("ppo:\n  epochs: 2\n", "section ppo", "does not apply to algo grpo"),
        ("algo: reward_model\ngeneration:\n  max_new_tokens: 4\n", "section generation", "does not apply"),
        ("grpo:\n  kl_coef: 0.1\n  kl:\n    coef: 0.2\n", "grpo.kl_coef and grpo.kl.coef", "keep only grpo.kl.coef"),
        ("algo: orpo\n", "algo", "must be one of"),  # (kto was refused here before issue 41)
    ],
)
def test_bad_values_name_the_key_and_the_file(tmp_path, text, key, words):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and words in msg, msg


def test_unreadable_yaml_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match=r"r.yaml: line \d+ unreadable YAML"):
        load_recipe(_write(tmp_path, "train:\n  steps: [1,\n"))
    with pytest.raises(RecipeError, match="nope.yaml: recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(_write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_overrides_apply_before_validation_and_types_convert(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 3\ngrpo:\n  kl:\n    coef: 0\n")
    r = load_recipe(
        path, ["train.steps=7", "grpo.kl.coef=0.04", "lora.target_modules=[q_proj, v_proj]", "model.init_adapter=null"]
    )
    assert r.train.steps == 7 and r.grpo.kl.coef == 0.04 and isinstance(r.grpo.kl.coef, float)
    assert r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.model.init_adapter is None
    with pytest.raises(RecipeError, match="grpo.group_size must be >= 2"):
        load_recipe(path, ["grpo.group_size=1"])
    with pytest.raises(RecipeError, match="must look like section.key=value"):
        load_recipe(path, ["grpo.group_size"])
    with pytest.raises(RecipeError, match="train.micro_batch_size"):
        load_recipe(path, ["train.micro_batch_size=many"])
    assert load_recipe(path, ["train.micro_batch_size=auto"]).train.micro_batch_size == "auto"


def test_roundtrip_of_resolved_recipe():
    r = recipe_from_dict({"grpo": {"group_size": 4}, "reward": {"functions": [{"name": "numeric_match", "weight": 2}]}})
    again = recipe_from_dict(recipe_to_dict(r))
    assert again == r
    assert recipe_to_dict(Recipe())["grpo"]["group_size"] == 8


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lorarl.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_bad_recipe_is_one_line_exit_2_and_debug_shows_traceback(tmp_path):
    path = _write(tmp_path, "grpo:\n  group_sise: 4\n")
    res = _cli("train", str(path), "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("lorarl: error: ") and "grpo.group_sise" in lines[0] and str(path) in lines[0]
    res = _cli("--debug", "train", str(path), "--out", str(tmp_path / "run"))
    assert res.returncode == 2 and "Traceback" in res.stderr
    res = _cli("eval", str(tmp_path / "missing.yaml"), "--checkpoint", "base")
    assert res.returncode == 2 and "missing.yaml: recipe file not found" in res.stderr


def test_cli_models_lists_the_embedded_default(default_model_dir):
    res = _cli("models")
    assert res.returncode == 0, res.stderr
    assert "smollm2-135m (default)  [converted]" in res.stdout
    res = _cli("models", "--json")
    import json

    rows = json.loads(res.stdout.strip().splitlines()[-1])["models"]
    assert rows[0]["name"] == "smollm2-135m" and rows[0]["converted"] and rows[0]["installed"]


def test_every_subcommand_has_help():
    for sub in ("models", "train", "eval", "export", "chat", "bench", "plan"):
        res = _cli(sub, "--help")
        assert res.returncode == 0 and "usage: lorarl " + sub in res.stdout, (sub, res.stderr)


def test_cli_overrides_may_follow_the_options(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 3\n")
    res = _cli("train", str(path), "--out", str(tmp_path / "run"), "grpo.group_size=1")
    assert res.returncode == 2 and "grpo.group_size must be >= 2" in res.stderr
    res = _cli("models", "x=1")
    assert res.returncode == 2 and "unrecognized arguments: x=1" in res.stderr


SHIPPED = sorted(
    p.name
    for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")
    if not p.name.startswith("pipeline")
)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load_and_validate(name, capsys):
    """Every recipe in recipes/ (pipelines: tests/test_pipeline.py) reads and validates (no unknown keys, no
    out-of-range values) and uses today's key names (no rename notice)."""
    from lorarl.config import ALGO_SECTIONS

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / name)
    assert recipe.algo in ALGO_SECTIONS
    assert capsys.readouterr().err == ""
    assert {"grpo_arithmetic.yaml", "ppo.yaml", "reward_model.yaml"} <= set(SHIPPED)


def test_old_recipes_keep_loading_under_the_new_names(tmp_path, capsys):
    from lorarl.config import load_recipe

    old = _write(
        tmp_path,
        "algo: ppo\nrewards:\n  - name: numeric_match\nppo:\n  reward_source: both\n  reward_adapter: rm\n"
        "  kl_coef: 0.2\n  critic_lora: {r: 4}\n  value_loss: huber\n  ptx_batch_size: 2\n"
        "data:\n  operations: ['-']\n  digits: 3\n",
    )
    r = load_recipe(old, ["ppo.vf_coef=0.3"])
    assert r.reward.source == "both" and r.reward.adapter == "rm" and r.reward.functions[0].name == "numeric_match"
    assert r.ppo.kl.coef == 0.2 and r.ppo.critic.lora.r == 4 and r.ppo.critic.loss == "huber"
    assert r.ppo.critic.vf_coef == 0.3 and r.ppo.ptx.batch_size == 2  # an old-style override too
    assert r.data.arithmetic.operations == ["-"] and r.data.arithmetic.digits == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ppo.kl_coef -> ppo.kl.coef" in err[0] and "ppo.vf_coef -> ppo.critic.vf_coef" in err[0]


def test_a_recipe_saves_only_its_algorithms_sections():
    from lorarl.config import recipe_to_dict

    d = recipe_to_dict(recipe_from_dict({"algo": "reward_model"}))
    assert "reward_model" in d and not {"grpo", "ppo", "generation", "reward"} & set(d)
    d = recipe_to_dict(recipe_from_dict({"algo": "grpo"}))
    assert "grpo" in d and "reward" in d and not {"ppo", "reward_model"} & set(d)
    # a run's saved recipe from an older version (every section) still loads, the foreign ones dropped
    from lorarl.config import load_run_recipe

    assert recipe_from_dict({"algo": "grpo", "ppo": {"epochs": 3}}, strict=False).ppo is None
    assert load_run_recipe is not None
