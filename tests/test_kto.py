"""KTO on the tiny model (lorarl.algos.kto): a step's loss starts at 0.5 (policy = reference, z0 = 0) and falls on a
separable set of unpaired rows and pairs mixed, the desirable rows' implicit reward rising above the undesirable ones';
TRL's metric names; `lorarl eval` on a run and on the base; resume bit-identical with the reference log-probs
precomputed and kept in the checkpoint; lorarl.train from an in-memory list; unpaired rows read as TRL writes them
(plain and conversational, pairs unpaired into two rows), bad rows one line naming the row and column or skipped and
counted; a single 👍 / 👎 under one pane's answer is a row, and the workbench's KTO retrain trains on them from two
rows on; the recipe checks."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_dpo import BAD, GOOD, separable_pairs, write_jsonl

from lorarl.algos.loop import train
from lorarl.cli import main
from lorarl.config import DataConfig, load_recipe, recipe_from_dict
from lorarl.data.unpaired import load_unpaired, unpaired_summary
from lorarl.errors import DataError, RecipeError
from lorarl.runs import read_metrics

REPO = Path(__file__).resolve().parents[1]
TRL_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def unpaired_rows(n: int, seed: int, start: int) -> list[dict]:
    """Conversational unpaired rows: a desirable answer of positive words, an undesirable one of negative words."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": f"Review {start + i}:"}],
            "completion": [{"role": "assistant", "content": " ".join(rng.choices(GOOD if good else BAD, k=3))}],
            "label": good,
        }
        for i, good in zip(range(n), [True, False] * n)
    ]


def kto_recipe(tiny_model_dir, folder, **sections) -> dict:
    # 32 unpaired rows and 16 pairs (32 rows more) in one file; 8 held-out pairs (16 rows)
    write_jsonl(folder / "train.jsonl", unpaired_rows(32, 0, 0) + separable_pairs(16, 2, 500))
    write_jsonl(folder / "eval.jsonl", separable_pairs(8, 1, 1000))
    d = {
        "algo": "kto",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0},
        "data": {"source": "train.jsonl", "eval_source": "eval.jsonl", "eval_size": 4},
        "kto": {"beta": 0.5, "batch_size": 8, "epochs": 3, "task_source": "arithmetic"},
        "generation": {"max_new_tokens": 4},
        "train": {"steps": 10, "learning_rate": 2e-2, "micro_batch_size": 4, "seed": 0, "report_to": []},
        "eval": {"n": 16, "batch_size": 8, "every": 5},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    path = folder / "kto.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.fixture(scope="module")
def kto_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kto")
    path = kto_recipe(tiny_model_dir, tmp)
    assert main(["train", str(path), "--out", str(tmp / "run")]) == 0  # the YAML door
    return path, tmp / "run", json.loads((tmp / "run" / "summary.json").read_text()), read_metrics(tmp / "run")


def test_loss_starts_at_one_half_and_falls_on_a_separable_set(kto_run):
    _, run, summary, rows = kto_run
    first = rows[0]
    # step 1: the policy is the reference (LoRA B = 0): every log-ratio and z0 are 0 up to fp32 rounding, so each
    # row's loss is 1 - sigmoid(0) = 0.5 (tolerances as tests/test_dpo.py's: a few fp32 ulps per token)
    assert first["loss"] == pytest.approx(0.5, abs=1e-6) and first["kl"] == pytest.approx(0.0, abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected"):
        assert first[key] == pytest.approx(0.0, abs=1e-5), key
    assert all(all(k in r for k in TRL_METRICS) for r in rows if r.get("loss") is not None and "kl" in r)
    last4 = rows[-4:]
    assert rows[-1]["step"] == 10 and summary["loss_first10"] == pytest.approx(sum(r["loss"] for r in rows) / 10)
    assert sum(r["loss"] for r in last4) / 4 < 0.45  # from 0.5 (0.41 measured)
    assert sum(r["rewards/margins"] for r in last4) / 4 > 0.5  # desirable above undesirable (0.82 measured)
    assert all(r["kl"] >= 0 for r in rows)  # z0 is clamped at 0
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [5, 10] and evals[-1]["eval/loss"] < 0.45  # base: 0.5
    assert evals[-1]["eval/rewards/margins"] > 0.5 and "eval/kl" in evals[-1]  # 0.81 measured
    assert "eval/accuracy" in evals[-1] and evals[-1]["eval/n"] == 16  # the task evaluation (kto.task_source)
    assert summary["train_rows"] == 64 and summary["desirable_rows"] == 32 and summary["rows_from_pairs"] == 32
    assert summary["n_rows"] == 16 and summary["eval_loss"] == evals[-1]["eval/loss"]
    assert (run / "policy" / "adapter_model.safetensors").is_file() and (run / "plot.png").is_file()


def test_eval_cli_on_a_kto_run_and_the_base(kto_run, capsys):
    path, run, _, _ = kto_run
    assert main(["eval", str(path), "--checkpoint", str(run), "--n", "8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kto/n_rows"] == 8 and out["kto/rewards/margins"] > 0.5 and out["kto/loss"] < 0.45  # base: 0, 0.5
    assert out["n"] == 8 and "accuracy" in out  # the greedy task evaluation
    assert main(["eval", str(path), "--checkpoint", "base", "--n", "8"]) == 0
    base = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert base["kto/rewards/chosen"] == 0.0 and base["kto/kl"] == 0.0 and base["kto/loss"] == pytest.approx(0.5)


def _adapter(run):
    return load_file(str(run / "policy" / "adapter_model.safetensors"))


def test_resume_is_bit_identical_with_precomputed_reference(tiny_model_dir, tmp_path):
    path = kto_recipe(
        tiny_model_dir,
        tmp_path,
        kto={"precompute_ref_log_probs": True, "task_source": None},
        lora={"dropout": 0.1},  # dropout draws from the RNG: the resume must restore it too
        train={"steps": 4, "save_every": 2, "lr_scheduler": "cosine", "warmup_steps": 1},
        eval={"every": 0},
    )
    recipe = load_recipe(path)
    train(recipe, tmp_path / "full")
    want = _adapter(tmp_path / "full")
    train(recipe, tmp_path / "cut", max_steps=2)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-000002" / "state.json").read_text())
    assert len(state["algo"]["ref_log_probs"]) == 64  # every training row, precomputed once
    train(recipe, tmp_path / "cut", resume=True)
    got = _adapter(tmp_path / "cut")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [(r["loss"], r["kl"]) for r in full] == [(r["loss"], r["kl"]) for r in cut]


def test_apo_zero_unpaired_and_the_python_door(tiny_model_dir, tmp_path):
    """lorarl.train with an in-memory list of TRL unpaired rows; apo_zero_unpaired has no KL term (kl 0), so a batch
    of one row is allowed; the loss at step 1 is 0.5 as well (sigmoid(0))."""
    from lorarl.api import train as api_train

    rows = [{"prompt": f"{a} + {a} =", "completion": f" {2 * a + (a % 2)}", "label": a % 2 == 0} for a in range(6)]
    recipe = {
        "algo": "kto",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "kto": {"loss_type": "apo_zero_unpaired", "beta": 0.5, "batch_size": 1},
        "train": {"steps": 2, "learning_rate": 1e-2, "micro_batch_size": 1, "seed": 0},
        "eval": {"n": 4, "batch_size": 4},
    }
    run = api_train(recipe, tmp_path / "kto", train_dataset=rows, progress=False)
    got = run.metrics
    assert [r["step"] for r in got] == [1, 2] and all(r["kl"] == 0.0 for r in got)
    assert got[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    # a batch of one row logs only its own kind, as TRL: no margin
    assert all(("rewards/chosen" in r) != ("rewards/rejected" in r) and "rewards/margins" not in r for r in got)


def test_balance_warning_when_the_counts_differ(tiny_model_dir, tmp_path, capsys):
    path = kto_recipe(tiny_model_dir, tmp_path, train={"steps": 1}, eval={"every": 0}, kto={"task_source": None})
    write_jsonl(tmp_path / "train.jsonl", [r for r in unpaired_rows(12, 0, 0) if r["label"]] + unpaired_rows(2, 3, 50))
    summary = train(load_recipe(path), tmp_path / "run", progress=False)
    line = "7 desirable and 1 undesirable rows, and the weights do not balance them (KTO paper, Eq. 8): set EITHER "
    assert summary["balance_warning"].startswith(line) and line in capsys.readouterr().err
    assert "kto.undesirable_weight in [5.26, 7.0]" in summary["balance_warning"]  # (7 x 1 / 1) / 1.33 .. 7


# ---- data ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    return SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))


def _load(tok, tmp_path, rows, **data):
    write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = DataConfig(source=str(tmp_path / "rows.jsonl"), **data)
    return load_unpaired(cfg, tok.tokenizer, "train", eos_ids=tok.eos_ids, end_id=tok.end_of_turn_id, max_length=64)


def test_trl_unpaired_rows_and_pairs_unpaired_like_trl(tok, tmp_path):
    rows = [
        {"prompt": "The sky is", "completion": " blue.", "label": True},  # TRL's plain example
        {
            "prompt": [{"role": "user", "content": "What color is the sky?"}],
            "completion": [{"role": "assistant", "content": "It is blue."}],
            "label": False,
        },  # fmt: skip
        {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5", "source": "x"},  # a pair: two rows, as TRL unpairs
    ]
    got = _load(tok, tmp_path, rows)
    t, end = tok.tokenizer, tok.end_of_turn_id
    assert got.labels == [True, False, True, False] and got.from_pairs == 2 and got.desirable == 2
    assert got.prompt_ids[0] == t("The sky is")["input_ids"] and got.prompt_ids[2] == got.prompt_ids[3]
    assert got.completion_ids[0] == t(" blue.", add_special_tokens=False)["input_ids"] + [end]
    assert got.completion_ids[3] == t(" 5", add_special_tokens=False)["input_ids"] + [end]
    templated = t.apply_chat_template(rows[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert got.prompt_ids[1] == t(templated, add_special_tokens=False)["input_ids"]
    assert got.rows[2]["columns"] == {"source": "x"} and got.rows[2]["completion"] == " 4"
    # TRL's own unpairing gives the same rows (prompt, completion, label) for the pair
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    trl_rows = unpair_preference_dataset(Dataset.from_list([rows[2]])).to_list()
    assert [(r["prompt"], r["completion"], r["label"]) for r in trl_rows] == [
        (g["prompt"], g["completion"], g["label"]) for g in got.rows[2:]
    ]
    assert unpaired_summary(got).endswith("rows.jsonl: 4 rows (2 desirable, 2 undesirable; 2 from 1 pairs)")


def test_bad_rows_one_line_or_skipped_and_counted(tok, tmp_path):
    good = {"prompt": "Q:", "completion": " yes", "label": True}
    rows = [
        good,
        {"prompt": "Q:", "completion": " no"},  # 1: no label -> data.on_bad_row
        {"prompt": "Q:", "completion": "", "label": False},  # 2: empty completion
        {"prompt": "word " * 80, "completion": " yes", "label": True},  # 3: no room under 64 tokens
        {"prompt": "Q:", "completion": " no", "label": 1},  # 4: not a bool -> data.on_bad_row
        {"prompt": "Q:", "completion": " no", "label": False, "tie": True},  # 5: a tie
        {"prompt": "Q:", "chosen": " same", "rejected": " same"},  # 6: a pair with the same response twice
        {"prompt": "Q:", "completion": [{"role": "assistant", "content": "x"}], "label": False},  # 7: mixed types
        {"completion": " no", "label": False},  # 8: no prompt
        good,
    ]
    with pytest.raises(DataError) as e:
        _load(tok, tmp_path, rows)
    line = str(e.value)
    assert (
        line.endswith(
            "rows.jsonl: row 1: column 'label' is missing (true: a desirable completion, false: an undesirable one) "
            "(set data.on_bad_row: skip to drop bad rows)"
        )
        and "\n" not in line
    )
    got = _load(tok, tmp_path, rows, on_bad_row="skip")
    assert len(got) == 2 and got.counts == {"missing": 2, "identical": 1, "too_long": 1, "tie": 1, "bad": 3}
    why = dict(got.skipped)
    assert why[4] == "row 4: column 'label' must be true or false (a bool), got 1"
    assert (
        why[2] == "row 2: column 'completion' is missing or empty"
        and why[8] == "row 8: column 'prompt' is missing or empty"
    )
    assert "no room for a completion under kto.max_length=64" in why[3]
    assert why[7] == "row 7: column 'prompt' must be a list of messages when 'completion' is"


def test_nothing_usable_and_bad_label_are_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys):
    path = kto_recipe(tiny_model_dir, tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q:", "completion": " a", "label": "yes"}] * 3)
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "train.jsonl: row 0: column 'label' must be true or false (a bool), got 'yes' (set data.on_bad_row: skip to "
        "drop bad rows)"
    )
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q:", "completion": " a", "label": True}])
    assert main(["train", str(path), "--out", str(tmp_path / "run2")]) == 2
    assert "1 usable row; kto.loss_type kto needs at least 2" in capsys.readouterr().err.strip().splitlines()[-1]


def test_recipe_checks(tiny_model_dir, tmp_path):
    base = yaml.safe_load(kto_recipe(tiny_model_dir, tmp_path).read_text())
    with pytest.raises(RecipeError, match="kto.batch_size must be >= 2 with loss_type kto"):
        recipe_from_dict({**base, "kto": {"batch_size": 1}})
    assert recipe_from_dict({**base, "kto": {"batch_size": 1, "loss_type": "apo_zero_unpaired"}}).kto.batch_size == 1
    with pytest.raises(RecipeError, match="kto.loss_type"):
        recipe_from_dict({**base, "kto": {"loss_type": "sigmoid"}})
    with pytest.raises(RecipeError, match="kto.desirable_weight and kto.undesirable_weight are both 0"):
        recipe_from_dict({**base, "kto": {"desirable_weight": 0.0, "undesirable_weight": 0.0}})
    with pytest.raises(RecipeError, match="kto.beta must be > 0"):
        recipe_from_dict({**base, "kto": {"beta": 0}})
    recipe = recipe_from_dict({**base, "data": {"source": "arithmetic"}})
    from lorarl.algos.kto import KTO
    from lorarl.model import SharedBase

    with pytest.raises(DataError, match="kto needs labelled completions"):
        KTO(recipe, SharedBase.load(recipe.model))


# ---- chat votes -> KTO rows -> the workbench's retrain ---------------------------------------------------------


def _answered(session, sid, answers=("4", "5")):
    from lorarl.chat.session import ChatSession

    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    session = session or ChatSession(SimpleNamespace(catalog=None), sid, sid.with_name("preferences_ties.jsonl"))
    session.record_turn("s", "", ["base", "run/policy"], [conv, conv], [SimpleNamespace(text=a) for a in answers])
    return session


def test_one_thumb_under_one_pane_is_a_kto_row(tok, tmp_path):
    from lorarl.errors import LorarlError

    votes = tmp_path / "preferences.jsonl"
    session = _answered(None, votes)
    path, what = session.rate_turn("s", 1, True)
    assert path == str(tmp_path / "preferences_unpaired.jsonl") and what == "pane 2 👍"
    with pytest.raises(LorarlError, match="pane 2's answer is rated already"):
        session.rate_turn("s", 1, False)
    with pytest.raises(LorarlError, match="pane 3 has not answered yet"):
        session.rate_turn("s", 2, False)
    session.rate_turn("s", 0, False)  # the other pane, 👎
    rows = [json.loads(line) for line in (tmp_path / "preferences_unpaired.jsonl").read_text().splitlines()]
    assert [(r["completion"], r["label"], r["model"]) for r in rows] == [
        ([{"role": "assistant", "content": "5"}], True, "run/policy"),
        ([{"role": "assistant", "content": "4"}], False, "base"),
    ]
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    got = load_unpaired(
        DataConfig(source=str(tmp_path / "preferences_unpaired.jsonl")), tok.tokenizer, "train",
        eos_ids=tok.eos_ids, end_id=tok.end_of_turn_id, max_length=64,
    )  # fmt: skip
    assert got.labels == [True, False] and len(got) == 2  # TRL's unpaired rows, read as they are


def test_kto_retrain_from_one_vote_of_each_kind(tmp_path):
    from lorarl.app.retrain import retrain_overrides, snapshot_votes, votes_summary
    from lorarl.errors import LorarlError

    runs = tmp_path / "runs"
    votes = runs / "preferences.jsonl"
    recipes = [REPO / "recipes"]
    runs.mkdir()  # a single-answer row that cannot be used is counted, not "no votes yet"
    (runs / "preferences_unpaired.jsonl").write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    text = votes_summary(runs).text
    assert "no votes yet" not in text and "1 unusable row(s) left out" in text, text
    (runs / "preferences_unpaired.jsonl").unlink()
    session = _answered(None, votes)
    session.rate_turn("s", 0, True)
    with pytest.raises(LorarlError, match="KTO needs 2 rows or more"):
        retrain_overrides("kto", votes, None, runs_dir=runs, recipe_dirs=recipes)
    with pytest.raises(LorarlError, match="nothing to train on"):  # DPO needs a pair
        retrain_overrides("dpo", votes, None, runs_dir=runs, recipe_dirs=recipes)
    session.rate_turn("s", 1, False)
    summary = votes_summary(runs)
    assert (summary.up, summary.down, summary.usable, summary.kto_rows) == (1, 1, 0, 2)
    assert "2 single-answer vote(s) (1 👍, 1 👎: KTO only)" in summary.text
    recipe, overrides = retrain_overrides("kto", votes, None, runs_dir=runs, recipe_dirs=recipes)
    assert recipe.name == "kto_arithmetic.yaml" and "kto.batch_size=2" in overrides and "train.steps=1" in overrides
    # a pairwise vote on a fresh turn adds two rows; the snapshot holds both kinds in one file
    session = _answered(session, votes, ("4", "22"))
    session.vote_turn("s", "left", 0, 1)
    snap = snapshot_votes(votes, runs / "kto-votes", unpaired=True)
    lines = snap.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["chosen"] and json.loads(lines[-1])["label"] is False
    _, overrides = retrain_overrides("kto", snap, "base", runs_dir=runs, recipe_dirs=recipes)
    assert "kto.batch_size=4" in overrides and "data.eval_source=null" in overrides


def test_health_warns_when_the_preferred_answers_lose_likelihood():
    """health.chosen_falling_steps: rewards/chosen < 0 three steps in a row warns once; a step at or above 0 resets the
    count; the count survives a resume (state_dict)."""
    from lorarl.health import HealthMonitor

    monitor = HealthMonitor(learning_after=0, chosen_falling_steps=3)
    said = []
    for step, chosen in enumerate([-0.1, -0.2, 0.1, -0.1, -0.1], start=1):
        said.append(monitor.check(step, {"rewards/chosen": chosen, "kl": 0.0}, []))
    assert said == [[], [], [], [], []] and monitor.falling_run == 2
    resumed = HealthMonitor(learning_after=0, chosen_falling_steps=3)
    resumed.load_state_dict(monitor.state_dict())
    row = {"rewards/chosen": -0.3}
    (line,) = resumed.check(6, row, [])
    assert line.startswith("chosen falling: rewards/chosen") and "for 3 steps in a row (-0.300 now)" in line
    assert row["health/warning"] == line and resumed.check(7, {"rewards/chosen": -0.3}, []) == []  # said once
    off = HealthMonitor(learning_after=0, chosen_falling_steps=0)
    assert all(off.check(s, {"rewards/chosen": -1.0}, []) == [] for s in range(1, 9))


def test_the_train_tab_offers_the_kto_recipe_with_its_fields_and_plan():
    """The workbench's Train tab (lorarl.app.recipes): the shipped KTO recipe listed, its header, its common fields
    (no group size: not GRPO), a refused value named at its field, and the planner's line for a KTO step."""
    from lorarl.app.recipes import fields_for, list_recipes, plan_line, recipe_header, validate

    path = REPO / "recipes" / "kto_arithmetic.yaml"
    assert any(c.path == str(path) for c in list_recipes([REPO / "recipes"], REPO / "no-runs-here"))
    assert recipe_header(path).startswith("KTO: trains the `policy` LoRA adapter")
    keys = [f.key for f in fields_for(path)]
    assert keys[:3] == ["model.name", "train.steps", "train.learning_rate"] and "grpo.group_size" not in keys
    _, errors = validate(path, {"train.steps": "two"})
    assert "train.steps must be int" in errors["train.steps"]
    line = plan_line(path)
    assert line.startswith("plan:") and "no estimate" not in line
