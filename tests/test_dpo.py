"""DPO on the tiny model: a step's loss starts at log 2 (policy = reference) and falls on a separable toy set, the
held-out implicit-reward accuracy rises; every loss type trains (simpo without ever running the reference);
resume is bit-identical (with the reference log-probs precomputed and kept in the checkpoint); a pipeline SFT then
DPO; TRL's preference formats, the chat's votes file and its ties; bad rows skipped and counted, or one line and
exit code 2; `lorarl eval` / `lorarl doctor` on a DPO run."""

from __future__ import annotations

import json
import math
import random
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lorarl.algos.loop import train
from lorarl.cli import main
from lorarl.config import DataConfig, LoraSettings, load_recipe, recipe_from_dict
from lorarl.data.pairs import implicit_text_prompt, load_pairs, skipped_summary
from lorarl.errors import DataError, RecipeError
from lorarl.runs import read_metrics

GOOD = ["good", "great", "fine", "nice", "lovely", "superb"]
BAD = ["bad", "awful", "poor", "ugly", "nasty", "dreadful"]


def separable_pairs(n: int, seed: int, start: int) -> list[dict]:
    """Conversational pairs: the chosen answer uses only positive words, the rejected one only negative words."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": f"Review {start + i}:"}],
            "chosen": [{"role": "assistant", "content": " ".join(rng.choices(GOOD, k=3))}],
            "rejected": [{"role": "assistant", "content": " ".join(rng.choices(BAD, k=3))}],
            "kind": "words",
        }
        for i in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_recipe(tiny_model_dir, folder, **sections) -> dict:
    write_jsonl(folder / "train.jsonl", separable_pairs(48, 0, 0))
    write_jsonl(folder / "eval.jsonl", separable_pairs(16, 1, 1000))
    d = {
        "algo": "dpo",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0},
        "data": {"source": "train.jsonl", "eval_source": "eval.jsonl", "eval_size": 4},
        "dpo": {"beta": 0.5, "batch_size": 8, "epochs": 3, "task_source": "arithmetic"},
        "generation": {"max_new_tokens": 4},
        "train": {"steps": 12, "learning_rate": 2e-2, "micro_batch_size": 4, "seed": 0, "report_to": []},
        "eval": {"n": 16, "batch_size": 8, "every": 6},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    path = folder / "dpo.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    path = dpo_recipe(tiny_model_dir, tmp)
    summary = train(load_recipe(path), tmp / "run")
    return path, tmp / "run", summary, read_metrics(tmp / "run")


def test_loss_starts_at_log2_and_falls_on_a_separable_set(dpo_run):
    _, run, summary, rows = dpo_run
    first = rows[0]
    # step 1: the policy is the reference (LoRA B = 0), so every implicit reward is 0 and the loss is log 2 -- up to
    # fp32 rounding: the policy (adapters on, B = 0) and the reference (adapters off) may take different float paths
    # on another CPU (2.4e-7 measured on an AMD EPYC without AVX-512, issue 34). A reward is beta (0.5) x a sum of
    # <= 64 per-token log-prob differences of a few fp32 ulps each (|log p| <= log V ~ 11, ulp ~ 1e-6): ~ 4e-6 as a
    # random walk, so 1e-5. Whether a tie counts as wrong (TRL) is checked by hand in tests/test_dpo_losses.py: here
    # the margins are rounding noise, and so is which pairs they call right.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[key] == pytest.approx(0.0, abs=1e-5), key
    last = rows[-1]
    assert last["step"] == 12 and summary["loss_last10"] < summary["loss_first10"]
    assert sum(r["loss"] for r in rows[-4:]) / 4 < 0.4 and last["rewards/margins"] > 0.5
    # held-out: implicit-reward accuracy from chance-or-below to (nearly) all pairs; evaluated at steps 6 and 12
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [6, 12]
    assert evals[-1]["eval/rewards/accuracies"] >= 0.9 and evals[-1]["eval/loss"] < math.log(2)
    assert "eval/accuracy" in evals[-1] and evals[-1]["eval/n"] == 16  # the task evaluation (dpo.task_source)
    assert summary["preference_accuracy"] == evals[-1]["eval/rewards/accuracies"] and summary["n_pairs"] == 16
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "learning_rate"):
        assert all(key in r for r in rows), key
    assert (run / "policy" / "adapter_model.safetensors").is_file() and (run / "plot.png").is_file()


def test_eval_and_doctor_cli_on_a_dpo_run(dpo_run, capsys):
    path, run, summary, _ = dpo_run
    assert main(["eval", str(path), "--checkpoint", str(run), "--n", "8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["preference/n_pairs"] == 8 and out["preference/rewards/accuracies"] >= 0.875
    assert out["preference/accuracy_by_kind"] == {"words": out["preference/rewards/accuracies"]}
    assert out["n"] == 8 and "accuracy" in out  # the greedy task evaluation
    assert main(["eval", str(path), "--checkpoint", "base", "--n", "8"]) == 0
    base = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert base["preference/rewards/accuracies"] == 0.0 and base["preference/loss"] == pytest.approx(math.log(2))
    assert main(["doctor", str(run)]) == 0
    report = capsys.readouterr().out
    assert "preference_accuracy" in report and "eval_preference_accuracy" in report


def test_export_of_a_dpo_run_is_gated_on_the_task_prompts(dpo_run, tmp_path):
    from lorarl.export import export

    _, run, _, _ = dpo_run
    result = export(run, tmp_path / "merged", fmt="merged", dtype="fp32", gate_n=4, gate=1.0)
    gate = json.loads((tmp_path / "merged" / "gate.json").read_text())
    assert result["gate"]["passed"] is True and gate["greedy_agreement"] == 1.0 and gate["prompts"] == 4
    # the held-out arithmetic prompts of dpo.task_source (they carry answers), not the preference pairs' prompts
    assert gate["prompt_source"] == "held-out split" and gate["accuracy_trained"] is not None
    assert "# lorarl dpo export (merged)" in (tmp_path / "merged" / "README.md").read_text()


@pytest.mark.parametrize(
    "loss_type,beta", [("hinge", 0.5), ("ipo", 0.5), ("simpo", 2.0), (["sigmoid", "sft"], 0.5), (["simpo", "sft"], 2.0)]
)
def test_every_loss_type_trains(tiny_model_dir, tmp_path, monkeypatch, loss_type, beta):
    weights = {"loss_weights": [1.0, 0.5]} if isinstance(loss_type, list) else {}
    path = dpo_recipe(
        tiny_model_dir,
        tmp_path,
        dpo={"loss_type": loss_type, "beta": beta, "task_source": None, **weights},
        train={"steps": 6},
        eval={"every": 0},
    )
    recipe = load_recipe(path)
    from lorarl.algos import dpo as dpo_module

    calls = []
    real = dpo_module.role_logps
    monkeypatch.setattr(dpo_module, "role_logps", lambda shared, role, *a: calls.append(role) or real(shared, role, *a))
    summary = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    assert summary["preference_accuracy"] >= 0.8
    if "simpo" in loss_type:
        assert "reference" not in calls  # reference-free (sft reads none either): the reference never runs
    else:
        assert calls.count("reference") == 6 + 1  # once per step, once for the held-out pairs


def _adapter(run):
    return load_file(str(run / "policy" / "adapter_model.safetensors"))


def test_resume_is_bit_identical_with_precomputed_reference(tiny_model_dir, tmp_path):
    path = dpo_recipe(
        tiny_model_dir,
        tmp_path,
        dpo={"precompute_ref_log_probs": True, "task_source": None},
        lora={"dropout": 0.1},  # dropout draws from the RNG: the resume must restore it too
        train={"steps": 6, "save_every": 2, "lr_scheduler": "cosine", "warmup_steps": 1},
        eval={"every": 0},
    )
    recipe = load_recipe(path)
    train(recipe, tmp_path / "full")
    want = _adapter(tmp_path / "full")
    train(recipe, tmp_path / "cut", max_steps=4)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-000004" / "state.json").read_text())
    assert len(state["algo"]["ref_log_probs"]["chosen"]) == 48  # the whole training set, precomputed once
    train(recipe, tmp_path / "cut", resume=True)
    got = _adapter(tmp_path / "cut")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [r["loss"] for r in full] == [r["loss"] for r in cut]  # the same figures, step for step


def test_pipeline_sft_then_dpo(tiny_model_dir, tmp_path):
    from lorarl.pipeline import load_pipeline, run_pipeline

    write_jsonl(tmp_path / "train.jsonl", separable_pairs(32, 0, 0))
    write_jsonl(tmp_path / "eval.jsonl", separable_pairs(8, 1, 1000))
    text = textwrap.dedent(
        f"""
        defaults:
          model: {{name: {tiny_model_dir}, quantization: none, dtype: float32, gradient_checkpointing: false}}
          lora: {{r: 8, alpha: 16, dropout: 0.0}}
          data: {{train_size: 32, eval_size: 8, arithmetic: {{operations: ["-"]}}}}
          generation: {{max_new_tokens: 6}}
          reward: {{functions: [{{name: numeric_match}}]}}
          train: {{learning_rate: 1.0e-2, micro_batch_size: 8, report_to: []}}
          eval: {{n: 4, batch_size: 4}}
        stages:
          - name: cold_start
            algo: sft
            sft: {{batch_size: 8}}
            train: {{steps: 2}}
          - name: prefs
            algo: dpo
            data: {{source: train.jsonl, eval_source: eval.jsonl}}
            dpo: {{beta: 0.5, batch_size: 8, task_source: arithmetic}}
            train: {{steps: 3}}
        """
    )
    (tmp_path / "pipe.yaml").write_text(text)
    out = tmp_path / "out"
    result = run_pipeline(load_pipeline(tmp_path / "pipe.yaml", out), out)
    rows = result["rows"]
    assert [(r["stage"], r["algo"]) for r in rows] == [("base", "-"), ("cold_start", "sft"), ("prefs", "dpo")]
    assert all(r["accuracy"] is not None for r in rows)  # every row: the same held-out subtraction prompts
    assert rows[2]["notes"].startswith("3 steps on 32 pairs, held-out implicit-reward accuracy ")
    wired = yaml.safe_load((out / "02-prefs" / "recipe.yaml").read_text())
    assert wired["model"]["init_adapter"] == str(out / "01-cold_start" / "policy")
    # the DPO stage starts from the SFT adapter, which is also its frozen reference: implicit rewards 0 at step 1
    first = read_metrics(out / "02-prefs")[0]
    # (zero up to fp32 rounding on another CPU: see test_loss_starts_at_log2_and_falls_on_a_separable_set)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    # a DPO stage that would be the evaluation recipe needs task prompts
    bad = text.replace(", task_source: arithmetic", "")
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(RecipeError, match="dpo.task_source"):
        load_pipeline(tmp_path / "bad.yaml", tmp_path / "bad_out")


# ---------------------------------------------------------------------------------------------------------------
# Data: formats, the chat's votes, bad rows
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def tok(tiny_shared):
    return tiny_shared


def _load(shared, folder, rows, **data):
    write_jsonl(folder / "p.jsonl", rows)
    cfg = DataConfig(source=str(folder / "p.jsonl"), **data)
    return load_pairs(
        cfg, shared.tokenizer, "train", eos_ids=shared.eos_ids, end_id=shared.end_of_turn_id, max_length=64
    )


def test_implicit_plain_prompt_is_trls():
    from trl.data_utils import extract_prompt

    for c, r in [
        ("2 + 2 = 4", "2 + 2 = 5"),
        ("The sky is blue.", "The sky is green."),
        ("Q: x? A: yes", "Q: x? A: no"),
    ]:
        want = extract_prompt({"chosen": c, "rejected": r})
        assert implicit_text_prompt(c, r) == (want["prompt"], want["chosen"], want["rejected"])


def test_trl_formats_render_like_rl_and_end_with_the_end_of_turn_id(tok, tmp_path):
    from lorarl.data import encode_prompt, prompt_text

    rows = [
        {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "Hello."}],
         "rejected": [{"role": "assistant", "content": "Go away."}]},  # conversational, explicit
        {"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
         "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go away."}]},  # implicit
        {"prompt": "Hi?", "chosen": " Hello.", "rejected": " Go away."},  # plain, explicit
        {"chosen": "Hi? Hello.", "rejected": "Hi? Go away."},  # plain, implicit
    ]  # fmt: skip
    pairs = _load(tok, tmp_path, rows)
    t = tok.tokenizer
    chat = encode_prompt(prompt_text([{"role": "user", "content": "Hi?"}], t, None), t, templated=True)
    assert pairs.prompt_ids[0] == pairs.prompt_ids[1] == chat  # the rollout's rendering, generation prompt included
    assert (
        pairs.chosen_ids[0]
        == pairs.chosen_ids[1]
        == t("Hello.", add_special_tokens=False)["input_ids"] + [tok.end_of_turn_id]
    )
    assert pairs.prompt_ids[2] == pairs.prompt_ids[3] == t("Hi?")["input_ids"]
    assert all(ids[-1] == tok.end_of_turn_id for ids in pairs.chosen_ids + pairs.rejected_ids)
    assert skipped_summary(pairs) is None


def test_column_mapping_and_a_datasets_folder_with_a_test_split(tok, tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"question": f"Q{i}:", "pos": " yes", "neg": " no", "id": i} for i in range(6)]
    DatasetDict({"train": Dataset.from_list(rows[:4]), "test": Dataset.from_list(rows[4:])}).save_to_disk(
        str(tmp_path / "ds")
    )
    cfg = DataConfig(source=str(tmp_path / "ds"), columns={"prompt": "question", "chosen": "pos", "rejected": "neg"})
    kw = dict(eos_ids=tok.eos_ids, end_id=tok.end_of_turn_id, max_length=64)
    train_pairs = load_pairs(cfg, tok.tokenizer, "train", **kw)
    held_out = load_pairs(cfg, tok.tokenizer, "eval", **kw)  # no eval_source: the folder's test split
    assert len(train_pairs) == 4 and len(held_out) == 2
    assert held_out.pairs[0]["prompt"] == "Q4:" and held_out.pairs[0]["columns"]["id"] == 4
    bad = DataConfig(source=str(tmp_path / "ds"), columns={"chosen": "good_answer"})
    with pytest.raises(DataError, match="good_answer"):
        load_pairs(bad, tok.tokenizer, "train", **kw)


def test_chat_votes_file_ties_left_out_and_counted(tok, tmp_path):
    from lorarl.chat.votes import preference_record, ties_path

    def history(answer):
        return [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": answer}]

    votes = tmp_path / "preferences.jsonl"
    records = [preference_record("", history("5"), history("6"), "run-a", "base", v)[0] for v in ("left", "right")]
    tie, is_tie = preference_record("", history("5"), history("five"), "run-a", "base", "tie")
    assert is_tie
    write_jsonl(votes, records + [tie])  # a tie pasted into the votes file is left out too
    write_jsonl(ties_path(votes), [tie, tie])
    pairs = load_pairs(
        DataConfig(source=str(votes)), tok.tokenizer, "train", eos_ids=tok.eos_ids, end_id=tok.end_of_turn_id,
        max_length=64,
    )  # fmt: skip
    assert len(pairs) == 2 and pairs.counts["tie"] == 1 and pairs.ties_beside == 2
    t = tok.tokenizer
    assert pairs.chosen_ids[1] == t("6", add_special_tokens=False)["input_ids"] + [tok.end_of_turn_id]  # right won
    line = skipped_summary(pairs)
    assert "left out 1 of 3 rows: 1 tie" in line and "2 ties in the chat's ties file" in line


def test_bad_rows_skipped_and_counted(tok, tmp_path):
    good = {"prompt": "Q:", "chosen": " yes", "rejected": " no"}
    rows = [
        good,
        {"prompt": "Q:", "rejected": " no"},  # 1: no chosen
        {"prompt": "Q:", "chosen": " yes", "rejected": None},  # 2: null rejected
        {"prompt": "Q:", "chosen": " same", "rejected": " same"},  # 3: identical
        {"prompt": "word " * 80, "chosen": " yes", "rejected": " no"},  # 4: no room for a response under 64
        {"prompt": "Q:", "chosen": " yes " * 70, "rejected": " no"},  # 5: the pair is too long
        {"prompt": "Q:", "chosen": 5, "rejected": " no"},  # 6: malformed -> data.on_bad_row
        good,
    ]
    with pytest.raises(DataError, match=r"row 6: column 'chosen' must be a string.*on_bad_row: skip"):
        _load(tok, tmp_path, rows)
    pairs = _load(tok, tmp_path, rows, on_bad_row="skip")
    assert len(pairs) == 2
    assert pairs.counts == {"missing": 2, "identical": 1, "too_long": 2, "tie": 0, "bad": 1}
    reasons = dict(pairs.skipped)
    assert reasons[1] == "row 1: column 'chosen' is missing or empty"
    assert reasons[2] == "row 2: column 'rejected' is missing or empty"
    assert reasons[3] == "row 3: columns 'chosen' and 'rejected' are the same response"
    assert "no room for a response under dpo.max_length=64" in reasons[4]
    assert "more than dpo.max_length=64" in reasons[5]


def test_nothing_usable_is_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys):
    path = dpo_recipe(tiny_model_dir, tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q:", "chosen": " a", "rejected": " a"}] * 3)
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "train.jsonl: no usable preference pairs; first problem: row 0: columns 'chosen' and 'rejected' are the same "
        "response"
    )


def test_recipe_checks(tiny_model_dir, tmp_path):
    base = yaml.safe_load(dpo_recipe(tiny_model_dir, tmp_path).read_text())
    with pytest.raises(
        RecipeError, match="dpo.label_smoothing applies to loss_type sigmoid, simpo, robust, .* not hinge"
    ):
        recipe_from_dict({**base, "dpo": {"loss_type": "hinge", "label_smoothing": 0.1}})
    with pytest.raises(RecipeError, match="dpo.label_smoothing"):
        recipe_from_dict({**base, "dpo": {"label_smoothing": 0.5}})
    with pytest.raises(RecipeError, match="dpo.loss_type"):
        recipe_from_dict({**base, "dpo": {"loss_type": "kto"}})
    with pytest.raises(RecipeError, match="dpo.loss_type sft needs a preference loss beside it"):
        recipe_from_dict({**base, "dpo": {"loss_type": ["sft"]}})
    with pytest.raises(RecipeError, match="dpo.loss_type names a loss twice"):
        recipe_from_dict({**base, "dpo": {"loss_type": ["sigmoid", "sigmoid"]}})
    with pytest.raises(RecipeError, match=r"dpo.loss_weights has 1 weight\(s\) for 2 loss type\(s\)"):
        recipe_from_dict({**base, "dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}})
    with pytest.raises(RecipeError, match="not ipo: set it to 0"):
        recipe_from_dict({**base, "dpo": {"loss_type": ["sigmoid", "ipo"], "label_smoothing": 0.1}})
    rpo = recipe_from_dict({**base, "dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.2]}}).dpo
    assert rpo.losses == (("sigmoid", 1.0), ("sft", 0.2)) and rpo.needs_reference
    assert not recipe_from_dict({**base, "dpo": {"loss_type": ["simpo", "sft"]}}).dpo.needs_reference
    recipe = recipe_from_dict({**base, "data": {"source": "arithmetic"}})
    from lorarl.model import SharedBase

    with pytest.raises(DataError, match="dpo needs preference pairs"):
        from lorarl.algos.dpo import DPO

        DPO(recipe, SharedBase.load(recipe.model))


def test_auto_micro_batch_is_the_planners_pick(tiny_model_dir, tmp_path):
    """``train.micro_batch_size: auto`` takes the planner's pick (on CPU: at most 8 pairs), not 16 pairs."""
    from lorarl.algos import make_algorithm
    from lorarl.model import SharedBase
    from lorarl.plan import resolve_micro_batch

    path = dpo_recipe(tiny_model_dir, tmp_path, dpo={"batch_size": 16}, train={"micro_batch_size": "auto"})
    recipe = load_recipe(path)
    algo = make_algorithm(recipe, SharedBase.load(recipe.model))
    assert algo.mbs == resolve_micro_batch(recipe, device_type="cpu") == 8


# ---- TRL 1.16's other loss types and options (WPO, LD-DPO, f-DPO) through the model ----------------------------------


def test_wpo_and_ld_scoring_from_the_policys_forward_equal_the_models_own_logits(tiny_shared):
    """response_logps with WPO and LD-DPO (one forward, the prompt shared by a pair's rows, a chunk of logits at a
    time) against the model's own forward, one row at a time: sum_t w_t log p(y_t) with LD's weights (1 up to the
    pair's shorter response, alpha after) and WPO's exp(mean_t (log p(y_t) - log sum_v p_v^2)). Without gradients
    (the reference's path) and with them (the policy's: the chunk's custom autograd function)."""
    from lorarl.algos.dpo_scoring import Scoring, response_logps, token_rows

    prompts = [[1, 17, 42, 9], [1, 23, 5]]
    chosen, rejected = [[30, 31, 32, 2], [40, 2]], [[50, 2], [60, 61, 62, 63, 2]]
    tokens = token_rows(prompts * 2, chosen + rejected, [0, 1, 0, 1], tiny_shared.pad_id)
    alpha = 0.3
    want_ld, want_plain, want_w = [], [], []
    with tiny_shared.role("base"):
        for p, y, partner in zip(prompts * 2, chosen + rejected, rejected + chosen):
            ids = torch.tensor([p + y])
            logp = torch.log_softmax(tiny_shared.module(input_ids=ids).logits.float()[0, len(p) - 1 : -1], -1)
            lp = logp.gather(-1, torch.tensor(y)[:, None])[:, 0]  # [|y|]
            w = torch.tensor([1.0 if t < min(len(y), len(partner)) else alpha for t in range(len(y))])
            want_ld.append(float((lp * w).sum()))
            want_plain.append(float(lp.sum()))
            want_w.append(math.exp(float((lp - torch.logsumexp(2 * logp, -1)).mean())))
    scoring = Scoring(ld_alpha=alpha, wpo=True)
    with torch.no_grad(), tiny_shared.role("base"):
        got = response_logps(tiny_shared, tokens, 0, scoring)
    for name, want in (("logps", want_ld), ("full", want_plain), ("wpo", want_w)):
        assert getattr(got, name).tolist() == pytest.approx(want, rel=1e-5, abs=1e-6), name
    assert got.counts.tolist() == [4, 2, 2, 5]
    assert want_ld != pytest.approx(want_plain)  # the LD weighting changed the longer responses' sums
    tiny_shared.add_adapter("policy", LoraSettings(r=4, alpha=8.0, dropout=0.0))  # B = 0: the base's values
    with tiny_shared.role("policy", train=True):
        got = response_logps(tiny_shared, tokens, 0, scoring)
        assert got.logps.requires_grad and not got.wpo.requires_grad  # WPO's weights are detached, as TRL's
        got.logps.sum().backward()
    assert got.wpo.tolist() == pytest.approx(want_w, rel=1e-5) and got.logps.tolist() == pytest.approx(
        want_ld, rel=1e-5
    )


def test_a_new_loss_type_with_wpo_and_ld_trains_one_step(tiny_model_dir, tmp_path):
    """apo_zero with WPO's weights and LD-DPO, one step, through the recipe: at step 1 the policy is the reference
    (LoRA B = 0), so every log-ratio is 0 and apo_zero's loss per pair is (1 - sigmoid(0)) + sigmoid(0) = 1: the
    step's loss is the mean WPO weight, logged as wpo/weight; the update moved the adapter."""
    path = dpo_recipe(
        tiny_model_dir,
        tmp_path,
        dpo={"loss_type": "apo_zero", "use_weighting": True, "ld_alpha": 0.5, "task_source": None},
        train={"steps": 1},
        eval={"every": 0},
    )
    summary = train(load_recipe(path), tmp_path / "run")
    row = read_metrics(tmp_path / "run")[0]
    # a near-uniform random model: each weight exp(mean_t log(p(y_t) / sum_v p_v^2)) is near 1, not 1
    assert abs(row["wpo/weight"] - 1) > 1e-3 and row["loss"] == pytest.approx(row["wpo/weight"], rel=1e-5)
    assert row["grad_norm"] > 0 and summary["loss_type"] == "apo_zero"
    assert summary["preference_accuracy"] is not None  # the held-out evaluation ran with the same options


@pytest.mark.parametrize(
    "dpo, line",
    [
        ({"loss_type": "exo_pair"}, "dpo.label_smoothing must be > 0 with loss_type exo_pair"),
        (
            {"loss_type": "apo_zero", "f_divergence_type": "js_divergence"},
            "dpo.f_divergence_type js_divergence applies",
        ),
        ({"loss_type": "aot", "use_weighting": True}, "dpo.use_weighting WPO's per-pair weights do not apply"),
        ({"loss_type": ["sigmoid", "sft"], "use_weighting": True}, "do not apply to loss_type sft"),
        ({"ld_alpha": 1.5}, "dpo.ld_alpha must be in"),
        ({"discopop_tau": 0}, "dpo.discopop_tau must be > 0"),
        ({"f_divergence_type": "chi2"}, "dpo.f_divergence_type must be one of"),
    ],
)
def test_new_option_checks(tiny_model_dir, tmp_path, dpo, line):
    base = yaml.safe_load(dpo_recipe(tiny_model_dir, tmp_path).read_text())
    with pytest.raises(RecipeError, match=line):
        recipe_from_dict({**base, "dpo": dpo})


def test_sorted_losses_need_a_fixed_micro_batch(tiny_model_dir, tmp_path):
    base = yaml.safe_load(dpo_recipe(tiny_model_dir, tmp_path).read_text())
    with pytest.raises(RecipeError, match="train.micro_batch_size must be a number with dpo.loss_type aot"):
        recipe_from_dict({**base, "dpo": {"loss_type": "aot"}, "train": {"micro_batch_size": "auto"}})
    assert recipe_from_dict({**base, "dpo": {"loss_type": "aot_unpaired"}}).dpo.needs_reference
