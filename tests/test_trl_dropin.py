"""lorarl.trl: TRL 1.16's trainers as a drop-in.

* TRL's documented quick starts (examples/trl_quickstarts/*.py, TRL's code with only the import changed) run
  unchanged for one step on a tiny model and local copies of their datasets' fields; the trained adapter and TRL's
  metric names are checked.
* Every refused field of the five configs fails with its one line; every noted field gives its notice; mapped fields
  land in the recipe lorarl validates (hand-set values, conventions per docs/trl_dropin.md).
* docs/trl_dropin.md's field table equals the code table.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import runpy
from pathlib import Path

import pytest
import trl
from peft import LoraConfig

from lorarl.errors import LorarlError
from lorarl.trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, SFTTrainer
from lorarl.trl.fields import (
    DOC_END,
    DOC_START,
    DPO_LOSS_TYPES,
    KEEP_ALL,
    TABLE,
    Map,
    Note,
    Refuse,
    Refused,
    default_config,
    markdown_table,
    translate,
)

REPO = Path(__file__).resolve().parents[1]
QUICKSTARTS = REPO / "examples" / "trl_quickstarts"
USER = {"role": "user", "content": "What is $1+1$? Put the answer in \\boxed{}."}


def _write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return folder


# rows in the fields of the quick starts' datasets (trl-lib/DeepMath-103K, trl-lib/ultrafeedback_binarized,
# trl-lib/Capybara)
DATASETS = {
    "grpo": [{"prompt": [USER], "solution": "$2$"}] * 2,
    "dpo": [
        {
            "chosen": [USER, {"role": "assistant", "content": "\\boxed{2}"}],
            "rejected": [USER, {"role": "assistant", "content": "\\boxed{3}"}],
            "score_chosen": 9.0,
            "score_rejected": 2.0,
        }
    ]
    * 2,
    "sft": [{"source": "test", "messages": [USER, {"role": "assistant", "content": "\\boxed{2}"}]}] * 2,
    "kto": [  # trl-lib/kto-mix-14k: unpaired conversational rows
        {"prompt": [USER], "completion": [{"role": "assistant", "content": "\\boxed{2}"}], "label": True},
        {"prompt": [USER], "completion": [{"role": "assistant", "content": "\\boxed{3}"}], "label": False},
    ],
    "text": [{"text": "A quiet, patient film."}, {"text": "Loud, dumb and fun."}],  # stanfordnlp/imdb's column
}
# quick start -> (dataset, output_dir suffix, trained adapter folder, TRL metric names the run logs)
RUNS = {
    "grpo": (
        "grpo",
        "GRPO",
        "policy",
        [
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            "completions/mean_length",
            "rewards/accuracy_reward/mean",
            "learning_rate",
        ],
    ),
    "dpo": (
        "dpo",
        "DPO",
        "policy",
        [
            "loss",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
        ],
    ),
    "rloo": (
        "grpo",
        "RLOO",
        "policy",
        [
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            "completions/mean_length",
            "rewards/accuracy_reward/mean",
            "kl",
        ],
    ),
    "sft": ("sft", "SFT", "policy", ["loss", "learning_rate", "grad_norm"]),
    "kto": (
        "kto",
        "KTO",
        "policy",
        ["loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"],
    ),
    "sft_text": ("text", "SFT", "policy", ["loss", "learning_rate", "grad_norm"]),
    "reward": ("dpo", "Reward", "reward", ["loss", "accuracy", "margin", "learning_rate"]),
}


@pytest.fixture(scope="module")
def terse_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model made to end every reply at once, so a GRPO step with TRL's defaults (8 completions of up to 512
    tokens) samples 8 x 1 tokens on the CPU: every embedding gets +100 on dimension 0, which then dominates each
    hidden state (the final RMSNorm makes it ~sqrt(hidden) along that dimension), and the EOS ids' output rows get 300
    there, so their logits lead every other token's by ~1600."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorarl.model.tokens import eos_token_ids

    out = tmp_path_factory.mktemp("terse")
    for p in tiny_model_dir.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy2(p, out / p.name)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 100.0
        for i in eos_token_ids(model, AutoTokenizer.from_pretrained(tiny_model_dir)):
            model.get_output_embeddings().weight[i, 0] = 300.0
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trl_quickstart_runs_unchanged(name, tiny_model_dir, terse_model_dir, tmp_path, monkeypatch):
    data, suffix, adapter, metric_names = RUNS[name]
    model = terse_model_dir if name in ("grpo", "rloo") else tiny_model_dir  # GRPO / RLOO sample: replies end at once
    monkeypatch.setenv("QUICKSTART_MODEL", str(model))
    monkeypatch.setenv("QUICKSTART_DATA", str(_write(tmp_path / "data", DATASETS[data])))
    monkeypatch.setenv("LORARL_TRL_MAX_STEPS", "1")
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(QUICKSTARTS / f"{name}.py"), run_name="__main__")
    run = tmp_path / f"{model.name}-{suffix}"  # TRL's default output_dir: <model name>-<SUFFIX>
    assert (run / adapter / "adapter_model.safetensors").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    missing = [m for m in metric_names if m not in rows[0]]
    assert not missing, f"metrics.jsonl lacks TRL's {missing}: {sorted(rows[0])}"
    values = {m: rows[0][m] for m in metric_names}
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values()), values
    if name in ("grpo", "rloo"):  # the terse model's empty replies all score 0: no group has a spread, no update
        assert rows[0]["frac_reward_zero_std"] == 1.0 and "loss" in rows[0]
    trainer = scope["trainer"]
    assert trainer.state.log_history == rows and trainer.state.global_step == 1


# ---- the field table --------------------------------------------------------------------------------------------


def _other(value):
    """A value other than ``value`` of the same kind (the refused / noted check needs only 'not the default')."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 3
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return 7  # None and others


def _each_changed(cls_name, kind, tmp_path):
    """``(field, value, args)`` for each field of ``kind`` in the config: its default config with only that field
    set to another value."""
    base = default_config(getattr(trl, cls_name), str(tmp_path))
    assert translate(base, _ctx())[1] == []  # the defaults pass silently
    for f in dataclasses.fields(base):
        if isinstance(TABLE[cls_name][f.name], kind):
            args = copy.copy(base)
            value = _other(getattr(args, f.name))
            setattr(args, f.name, value)
            yield f.name, value, args


def _ctx():
    return {"steps": 10, "steps_per_epoch": 5, "algo": "grpo", "agent": False}


def test_table_covers_every_field_of_the_configs():
    for cls_name in TABLE:
        names = {f.name for f in dataclasses.fields(getattr(trl, cls_name))}
        assert names <= set(TABLE[cls_name]), sorted(names - set(TABLE[cls_name]))
        assert len(names) > 120  # TrainingArguments' fields are in it


@pytest.mark.parametrize("cls_name", list(TABLE))
def test_each_refused_field_fails_with_its_line(cls_name, tmp_path):
    """Every refused field of the config, one at a time at a non-default value: its one line (the default passes)."""
    wrong, fields = {}, []
    for field, value, args in _each_changed(cls_name, Refuse, tmp_path):
        fields.append(field)
        try:
            translate(args, _ctx())
            wrong[field] = "not refused"
        except Refused as e:
            if str(e) != f"{cls_name}.{field}={value!r}: {TABLE[cls_name][field].why}":
                wrong[field] = str(e)
    assert len(fields) >= 15 and not wrong, wrong


@pytest.mark.parametrize("cls_name", list(TABLE))
def test_each_noted_field_gives_one_notice(cls_name, tmp_path):
    """Every noted field of the config, one at a time at a non-default value: exactly its one notice."""
    wrong, fields = {}, []
    for field, value, args in _each_changed(cls_name, Note, tmp_path):
        fields.append(field)
        notices = translate(args, _ctx())[1]
        if notices != [f"{cls_name}.{field}={value!r} has no effect in lorarl: {TABLE[cls_name][field].why}"]:
            wrong[field] = notices
    assert len(fields) >= 50 and not wrong, wrong


def test_docs_field_table_is_the_code_table():
    doc = (REPO / "docs" / "trl_dropin.md").read_text()
    generated = doc[doc.index(DOC_START) + len(DOC_START) : doc.index(DOC_END)]
    assert generated == markdown_table(), "python -m lorarl.trl.fields docs/trl_dropin.md rewrites the table"


# ---- mapped fields land in the recipe ---------------------------------------------------------------------------


def _grpo(tiny_model_dir, tmp_path, **kw):
    from lorarl.api import load_recipe

    args = default_config(trl.GRPOConfig, str(tmp_path / "out"))
    for k, v in kw.items():
        setattr(args, k, v)
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": "hi"}] * 12,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05),
    )
    return trainer.recipe, load_recipe(trainer.recipe)


def test_grpo_fields_land_in_the_recipe(tiny_model_dir, tmp_path):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    raw, r = _grpo(
        tiny_model_dir,
        tmp_path,
        learning_rate=3e-4,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        generation_batch_size=16,
        beta=0.04,
        loss_type="dr_grpo",
        max_completion_length=32,
        epsilon=0.1,
        epsilon_high=0.28,
        scale_rewards=False,
        mask_truncated_completions=True,
        use_bias_correction_kl=False,
        temperature=0.7,
        num_iterations=2,
        max_steps=20,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        save_total_limit=None,
        save_steps=5,
        importance_sampling_level="token",
        entropy_coef=0.01,
        seed=7,
    )
    assert r.algo == "grpo" and r.model.name == str(tiny_model_dir)
    assert r.train.learning_rate == 3e-4 and r.train.steps == 20 and r.train.seed == 7
    assert r.train.prompts_per_step == 8 * 2 // 4 and r.train.micro_batch_size == 8  # 16 completions a step
    assert r.train.lr_scheduler == "cosine" and r.train.warmup_steps == 2  # ceil(0.1 x 20), as transformers
    assert r.train.save_every == 5 and r.train.keep_last == KEEP_ALL  # None: keep every checkpoint
    assert r.grpo.group_size == 4 and r.grpo.num_iterations == 2
    assert r.grpo.kl.coef == 0.04 and r.grpo.kl.estimator == "k3"  # TRL's beta is the k3 coefficient: same
    assert r.grpo.loss_reduction == "seq_sum_norm" and r.grpo.std_scaling == "none"
    assert (r.grpo.clip_eps_low, r.grpo.clip_eps_high) == (0.1, 0.28) and r.grpo.mask_truncated
    assert r.grpo.entropy_coef == 0.01
    assert r.generation.max_new_tokens == 32 and r.generation.temperature == 0.7
    assert (r.lora.r, r.lora.alpha, r.lora.dropout) == (8, 16.0, 0.05)
    assert r.lora.target_modules == sorted(PEFT_DEFAULTS["llama"])  # LoraConfig's None: PEFT's default for llama
    assert raw["model"]["dtype"] == "float32"  # bf16 off (CPU)


def test_grpo_defaults_follow_trl(tiny_model_dir, tmp_path):
    _, r = _grpo(tiny_model_dir, tmp_path)  # GRPOConfig() as TRL makes it
    assert r.train.learning_rate == 1e-6 and r.train.lr_scheduler == "linear"
    assert r.grpo.group_size == 8 and r.train.prompts_per_step == 1  # 8 completions per device step
    assert r.train.steps == 3 * 12  # 3 epochs of 12 prompts, one prompt a step
    assert r.grpo.loss_reduction == "token_mean" and r.grpo.kl.coef == 0.0 and r.grpo.kl.estimator == "k3_unbiased"
    assert r.generation.max_new_tokens == 512 and r.train.log_completions == 0


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        ("loss_type", "gspo", "GRPOConfig.loss_type='gspo': TRL 1.16's GRPO loss types are grpo, dapo, dr_grpo"),
        ("per_device_train_batch_size", 6, "GRPOConfig.per_device_train_batch_size=6: x gradient_accumulation_steps"),
        ("lr_scheduler_type", "polynomial", "GRPOConfig.lr_scheduler_type='polynomial': lorarl's schedules are"),
        ("report_to", ["mlflow"], "GRPOConfig.report_to=['mlflow']: lorarl logs to tensorboard, trackio, wandb"),
        ("steps_per_generation", 4, "GRPOConfig.steps_per_generation=4: lorarl samples once per optimizer step"),
        ("sync_ref_model", True, "GRPOConfig.sync_ref_model=True: lorarl's reference refresh copies the policy"),
    ],
)
def test_mapped_fields_refuse_what_lorarl_does_not_do(field, value, line, tiny_model_dir, tmp_path):
    with pytest.raises(Refused, match="^" + line.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        _grpo(tiny_model_dir, tmp_path, **{field: value})


@pytest.mark.parametrize(
    "loss_type, policy, reduction",
    [
        ("grpo", "clip", "seq_mean_token_mean"),
        ("dapo", "clip", "token_mean"),
        ("dr_grpo", "clip", "seq_sum_norm"),
        ("bnpo", "clip", "micro_batch_token_mean"),
        ("luspo", "clip", "seq_mean_token_sum"),
        ("cispo", "cispo", "token_mean"),
        ("sapo", "sapo", "seq_mean_token_mean"),
        ("vespo", "vespo", "token_mean"),
    ],
)
def test_every_trl_grpo_loss_type_maps(loss_type, policy, reduction, tiny_model_dir, tmp_path):
    """Each of TRL 1.16's GRPO loss types is two recipe keys; the loss parameters TRL reads travel with it."""
    extra = {
        "cispo": {"epsilon_high": 5.0},
        "sapo": {"sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2},
        "vespo": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.5},
    }.get(loss_type, {})
    _, r = _grpo(tiny_model_dir, tmp_path, loss_type=loss_type, **extra)
    assert (r.grpo.policy_loss, r.grpo.loss_reduction) == (policy, reduction)
    for field, value in extra.items():
        key = "cispo_eps_max" if field == "epsilon_high" else field
        assert getattr(r.grpo, key) == value, field


def test_cispo_reads_trls_epsilon_when_epsilon_high_is_none(tiny_model_dir, tmp_path):
    _, r = _grpo(tiny_model_dir, tmp_path, loss_type="cispo", epsilon=0.3)  # TRL caps the ratio at 0.3 then: so do we
    assert r.grpo.cispo_eps_max == 0.3


def test_grpo_reference_refresh_maps_with_alpha_one(tiny_model_dir, tmp_path):
    _, r = _grpo(
        tiny_model_dir, tmp_path, sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=16, beta=0.1
    )
    assert r.grpo.kl.ref_refresh_every == 16


def test_dpo_sft_reward_fields_land_in_the_recipe(tiny_model_dir, tmp_path):
    from lorarl.api import load_recipe

    pairs = DATASETS["dpo"] * 4
    args = default_config(trl.DPOConfig, str(tmp_path / "dpo"))
    args.beta, args.loss_type, args.loss_weights, args.max_length = 0.2, ["sigmoid", "sft"], [1.0, 0.5], 256
    args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_train_epochs = 2, 2, 2
    r = load_recipe(
        DPOTrainer(str(tiny_model_dir), ref_model=str(tiny_model_dir), args=args, train_dataset=pairs).recipe
    )
    assert r.dpo.beta == 0.2 and r.dpo.loss_type == ["sigmoid", "sft"] and r.dpo.loss_weights == [1.0, 0.5]
    assert r.dpo.batch_size == 4 and r.train.micro_batch_size == 2 and r.dpo.max_length == 256
    assert r.dpo.epochs == 2 and r.train.steps == 2 * 8 // 4

    args = default_config(trl.RewardConfig, str(tmp_path / "rm"))
    args.center_rewards_coefficient, args.max_length = 0.01, 128
    r = load_recipe(
        RewardTrainer(
            str(tiny_model_dir), args=args, train_dataset=pairs, peft_config=LoraConfig(modules_to_save=["score"])
        ).recipe
    )
    assert r.algo == "reward_model" and r.reward_model.center_coef == 0.01 and r.reward_model.max_length == 128
    assert r.reward_model.margin and r.train.learning_rate == 1e-4  # RewardConfig's default learning rate

    args = default_config(trl.SFTConfig, str(tmp_path / "sft"))
    args.max_length = 300
    r = load_recipe(SFTTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["sft"]).recipe)
    assert r.algo == "sft" and r.sft.max_length == 300 and r.train.learning_rate == 2e-5
    assert r.sft.loss_type == "nll"
    args.loss_type = "dft"  # Dynamic Fine-Tuning: sft.loss_type
    assert (
        load_recipe(SFTTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["sft"]).recipe).sft.loss_type
        == "dft"
    )
    args.loss_type = "chunked_nll"  # in SFTConfig's choices; TRL's SFTTrainer refuses it too
    with pytest.raises(
        LorarlError, match=r"SFTConfig.loss_type='chunked_nll': TRL 1.16's SFTTrainer trains loss types nll and dft"
    ):
        SFTTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["sft"])


def _dpo(tiny_model_dir, tmp_path, **kw):
    from lorarl.api import load_recipe

    args = default_config(trl.DPOConfig, str(tmp_path / "dpo"))
    for k, v in kw.items():
        setattr(args, k, v)
    return load_recipe(DPOTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["dpo"] * 4).recipe)


def test_every_trl_dpo_loss_type_and_option_maps(tiny_model_dir, tmp_path):
    from lorarl.core.preference_losses import PREFERENCE_LOSSES

    for name in DPO_LOSS_TYPES:  # every type TRL 1.16's DPOTrainer has, by its name (sft beside another)
        types = [name, "sigmoid"] if name == "sft" else [name]
        smoothing = 0.001 if name == "exo_pair" else 0.0
        r = _dpo(tiny_model_dir, tmp_path, loss_type=types, label_smoothing=smoothing)
        assert r.dpo.loss_types == tuple(types) and all(t in PREFERENCE_LOSSES or t == "sft" for t in types)
    r = _dpo(
        tiny_model_dir, tmp_path, loss_type=["robust", "sft"], loss_weights=[1.0, 0.2], label_smoothing=0.1,
        f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, ld_alpha=0.5, discopop_tau=0.1,
    )  # fmt: skip
    d = r.dpo
    assert (d.f_divergence_type, d.f_alpha_divergence_coef, d.ld_alpha, d.discopop_tau) == (
        "alpha_divergence",
        0.3,
        0.5,
        0.1,
    )
    assert d.losses == (("robust", 1.0), ("sft", 0.2)) and d.label_smoothing == 0.1
    assert _dpo(tiny_model_dir, tmp_path, loss_type="apo_zero", use_weighting=True).dpo.use_weighting
    with pytest.raises(LorarlError, match="dpo.use_weighting WPO's per-pair weights do not apply to loss_type aot"):
        _dpo(tiny_model_dir, tmp_path, loss_type="aot", use_weighting=True)  # TRL refuses it too
    with pytest.raises(Refused, match=r"^DPOConfig.loss_type=\['kto'\]: TRL 1.16's DPO loss types are sigmoid"):
        _dpo(tiny_model_dir, tmp_path, loss_type=["kto"])


def test_kto_fields_land_in_the_recipe(tiny_model_dir, tmp_path, caplog):
    from lorarl.api import load_recipe
    from lorarl.trl import KTOConfig

    args = KTOConfig(output_dir=str(tmp_path / "kto"))  # lorarl.trl's: TRL's, bf16 off without a bf16 GPU
    assert (
        isinstance(args, trl.KTOConfig) and args.learning_rate == 1e-6 and args.train_sampling_strategy == "sequential"
    )
    args.beta, args.loss_type, args.desirable_weight, args.undesirable_weight = 0.3, "apo_zero_unpaired", 1.33, 0.5
    args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_length = 2, 3, 200
    args.precompute_ref_log_probs, args.num_train_epochs = True, 2
    rows = DATASETS["kto"] * 6  # 12 rows
    r = load_recipe(
        KTOTrainer(str(tiny_model_dir), ref_model=str(tiny_model_dir), args=args, train_dataset=rows).recipe
    )
    assert r.algo == "kto" and r.kto.loss_type == "apo_zero_unpaired" and r.kto.beta == 0.3
    assert (r.kto.desirable_weight, r.kto.undesirable_weight) == (1.33, 0.5) and r.kto.precompute_ref_log_probs
    assert r.kto.batch_size == 6 and r.train.micro_batch_size == 2 and r.kto.max_length == 200
    assert r.kto.epochs == 2 and r.train.steps == 2 * 12 // 6 and r.train.learning_rate == 1e-6
    args.loss_type = "sigmoid"
    with pytest.raises(Refused, match=r"^KTOConfig.loss_type='sigmoid': TRL's KTO losses are kto and apo_zero"):
        KTOTrainer(str(tiny_model_dir), args=args, train_dataset=rows)
    args.loss_type, args.sync_ref_model = "kto", True
    with pytest.raises(Refused, match=r"^KTOConfig.sync_ref_model=True: lorarl's reference refresh copies the policy"):
        KTOTrainer(str(tiny_model_dir), args=args, train_dataset=rows)
    args.sync_ref_model, args.train_sampling_strategy = False, "random"  # lorarl shuffles anyway: a notice
    with caplog.at_level(logging.WARNING, logger="lorarl.trl"):
        KTOTrainer(str(tiny_model_dir), args=args, train_dataset=rows)
    assert any("KTOConfig.train_sampling_strategy='random' has no effect" in r.getMessage() for r in caplog.records)
    with pytest.raises(Refused, match=r"^ref_model='other/model': lorarl's KTO reference is the policy's own base"):
        KTOTrainer(str(tiny_model_dir), ref_model="other/model", args=args, train_dataset=rows)


def test_trainer_arguments_lorarl_cannot_honour_are_refused(tiny_model_dir, tmp_path, caplog):
    from datasets import Dataset

    args = default_config(trl.DPOConfig, str(tmp_path / "dpo"))
    with pytest.raises(Refused, match=r"^ref_model='other/model': lorarl's DPO reference is the policy's own base"):
        DPOTrainer(str(tiny_model_dir), ref_model="other/model", args=args, train_dataset=DATASETS["dpo"])
    with pytest.raises(Refused, match=r"^LoraConfig.use_dora=True: lorarl's LoRA reads r, lora_alpha"):
        DPOTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["dpo"], peft_config=LoraConfig(use_dora=True))
    with pytest.raises(Refused, match=r"^callbacks=\[1\]: lorarl's run loop takes no transformers callbacks"):
        DPOTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["dpo"], callbacks=[1])
    with pytest.raises(Refused, match=r"^reward_funcs\[0\]='org/reward-model': a hub reward model"):
        GRPOTrainer(str(tiny_model_dir), reward_funcs="org/reward-model", train_dataset=DATASETS["grpo"])
    sft = default_config(trl.SFTConfig, str(tmp_path / "sft"))
    with pytest.raises(Refused, match=r"^train_dataset=\"columns \['body'\]\": lorarl's SFT reads prompt"):
        SFTTrainer(str(tiny_model_dir), args=sft, train_dataset=Dataset.from_list([{"body": "hello"}]))
    with pytest.raises(LorarlError, match=r"^args: a SFTConfig; DPOTrainer takes TRL's DPOConfig"):
        DPOTrainer(str(tiny_model_dir), args=sft, train_dataset=DATASETS["dpo"])
    args.logging_first_step = True  # a noted field: accepted with one notice
    with caplog.at_level(logging.WARNING, logger="lorarl.trl"):
        DPOTrainer(str(tiny_model_dir), args=args, train_dataset=DATASETS["dpo"], peft_config=LoraConfig())
    assert [r.getMessage() for r in caplog.records] == [
        f"DPOConfig.logging_first_step=True has no effect in lorarl: {TABLE['DPOConfig']['logging_first_step'].why}"
    ]


def test_a_model_object_is_taken_by_its_folder(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    other_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    other_tokenizer.name_or_path = str(tmp_path / "elsewhere")
    args = default_config(trl.DPOConfig, str(tmp_path / "dpo"))
    trainer = DPOTrainer(model, args=args, train_dataset=DATASETS["dpo"])
    assert trainer.recipe["model"]["name"] == str(tiny_model_dir)
    same = DPOTrainer(model, ref_model=model, args=args, train_dataset=DATASETS["dpo"], processing_class=tokenizer)
    assert same.recipe == trainer.recipe  # the reference: the same base with adapters off
    with pytest.raises(Refused, match=r"^ref_model='other/model': lorarl's DPO reference is the policy's own base"):
        DPOTrainer(model, ref_model="other/model", args=args, train_dataset=DATASETS["dpo"])
    with pytest.raises(Refused, match=r"^processing_class=.*: lorarl uses the shared base's own tokenizer"):
        DPOTrainer(model, args=args, train_dataset=DATASETS["dpo"], processing_class=other_tokenizer)
    from peft import get_peft_model

    with pytest.raises(LorarlError, match=r"^model: a PeftModel; lorarl loads the base once"):
        DPOTrainer(get_peft_model(model, LoraConfig()), args=args, train_dataset=DATASETS["dpo"])


def test_map_entries_name_recipe_keys():
    for table in TABLE.values():
        for name, rule in table.items():
            assert isinstance(rule, (Map, Note, Refuse)), name
            assert not isinstance(rule, Map) or rule.key, name


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's default
def test_grpo_trains_scores_with_the_users_function_evaluates_and_saves(tiny_model_dir, tmp_path):
    """One GRPO step with a reward that has a spread: TRL's per-function metric is the user's function over the
    step's completions (all 4 logged), the update ran, evaluate() gives TRL's eval_ keys, save_model() writes the
    PEFT adapter of the LoraConfig given."""

    def reward_len(completions, **kwargs):
        return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "run"),
        bf16=False,
        max_steps=1,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        learning_rate=1e-2,
        report_to="none",
        log_completions=True,
        num_completions_to_print=4,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=[{"prompt": "Say hi", "answer": "2"}] * 4,
        eval_dataset=[{"prompt": "What is 1 + 1?", "answer": "2"}] * 2,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    out = trainer.train()
    row = trainer.state.log_history[0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    by_hand = reward_len([s["completion"] for s in samples])
    assert row["rewards/reward_len/mean"] == pytest.approx(sum(by_hand) / 4)
    assert [s["reward"] for s in samples] == pytest.approx(by_hand)
    if len(set(by_hand)) > 1:  # a spread: the update ran
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert out.global_step == 1
    metrics = trainer.evaluate()
    assert metrics and all(k.startswith("eval_") for k in metrics) and "eval_reward_mean" in metrics
    trainer.save_model(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8) and (
        tmp_path / "saved" / "adapter_model.safetensors"
    ).is_file()


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's default
def test_grpo_takes_tools_as_trl_does(terse_model_dir, tmp_path):
    """tools= as TRL's GRPOTrainer takes them: the run's agent section names the tool, max_tool_calling_iterations
    + 1 model turns; a step runs (the terse model answers at once: no call is made)."""
    import yaml

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "run"), bf16=False, max_steps=1, num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, max_tool_calling_iterations=2, report_to="none",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(terse_model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": [USER]}] * 2,
        tools=[multiply],
    )
    trainer.train()
    agent = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["agent"]
    assert agent["max_turns"] == 3 and len(agent["tools"]) == 1 and "multiply" in agent["tools"][0]
    assert trainer.state.global_step == 1
