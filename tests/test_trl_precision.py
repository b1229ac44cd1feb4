"""lorarl.trl on the machine at hand (issue 40): every TRL config lorarl.trl takes builds and translates with
``use_cpu=True`` and its other fields at their defaults (``bf16`` left unset: TRL's True), the device and precision
flags keep TRL's meaning (``precision`` by hand, CPU and GPUs with and without native bf16), ``model.device: cpu``
keeps a run on the CPU beside a GPU, and a short real training runs through lorarl.trl with ``use_cpu=True``."""

from __future__ import annotations

import math

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig

from lorarl.trl import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer
from lorarl.trl.fields import CONFIGS, Refused, precision, translate

USER = {"role": "user", "content": "What is 1+1?"}
PAIRS = [
    {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "2"}],
        "rejected": [{"role": "assistant", "content": "3"}],
    }
] * 4
TRAINERS = {  # config -> (trainer, its train_dataset, extra arguments)
    "GRPOConfig": (
        GRPOTrainer,
        [{"prompt": [USER]}] * 4,
        {"reward_funcs": lambda completions, **_: [0.0] * len(completions)},
    ),
    "DPOConfig": (DPOTrainer, PAIRS, {}),
    "SFTConfig": (SFTTrainer, [{"text": "A quiet, patient film."}] * 4, {}),
    "RewardConfig": (RewardTrainer, PAIRS, {}),
}
CTX = {"steps": 10, "steps_per_epoch": 5, "agent": False}


def test_precision_keeps_trls_meaning_on_each_device():
    t4, a100, why = (7, 5), (8, 0), 1  # compute capabilities
    assert precision(True, False, "cpu", None) == ("bfloat16", "")  # accelerate autocasts bf16 on the CPU
    assert precision(False, False, "cpu", None) == ("float32", "")
    dtype, notice = precision(False, True, "cpu", None)  # accelerate has no fp16 autocast on the CPU
    assert dtype == "float32" and notice.startswith("no fp16 on the CPU")
    assert precision(True, False, "cuda", a100) == ("bfloat16", "")
    assert precision(False, True, "cuda", a100) == ("float16", "")
    assert precision(False, False, "cuda", a100) == ("float32", "")
    dtype, notice = precision(True, False, "cuda", t4)  # bf16 only emulated there: lorarl's fp16 with loss scaling
    assert dtype == "float16" and "compute capability 7.5" in notice and "no native bfloat16" in notice
    assert precision(False, True, "cuda", t4)[why] == ""


@pytest.mark.parametrize("cls_name", list(CONFIGS))
def test_every_config_builds_and_translates_with_use_cpu(cls_name, tiny_model_dir, tmp_path):
    """``Config(use_cpu=True)``, bf16 left unset (TRL's True): TRL accepts it on any machine; so does lorarl.trl."""
    from lorarl.api import load_recipe

    args = getattr(trl, cls_name)(output_dir=str(tmp_path / "out"), use_cpu=True)
    assert args.bf16 is True and args.fp16 is False  # TRL's default: bf16 unless fp16
    keys, notices = translate(args, {**CTX, "algo": CONFIGS[cls_name]})
    assert keys["model.device"] == "cpu" and keys["model.dtype"] == "bfloat16" and notices == []
    if cls_name in TRAINERS:  # the trainer's whole recipe validates
        trainer, rows, extra = TRAINERS[cls_name]
        recipe = load_recipe(
            trainer(str(tiny_model_dir), args=args, train_dataset=rows, peft_config=LoraConfig(), **extra).recipe
        )
        assert recipe.model.device == "cpu" and recipe.model.dtype == "bfloat16"


def test_bf16_unset_on_a_cpu_machine(tiny_model_dir, tmp_path, caplog):
    """Without a bf16 GPU, transformers refuses TRL's default bf16 unless use_cpu; lorarl.trl's default config (no
    ``args``) turns bf16 off there, so the run computes in float32 on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        pytest.fail("this check is about a machine without a bf16 GPU (the CPU test machines)")
    with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
        trl.SFTConfig(output_dir=str(tmp_path / "x"))  # TRL itself, bf16 unset: refused by transformers
    trainer = SFTTrainer(str(tiny_model_dir), train_dataset=[{"text": "A quiet, patient film."}] * 4)
    assert trainer.args.bf16 is False and trainer.recipe["model"]["dtype"] == "float32"
    assert "device" not in trainer.recipe["model"]  # auto: the CPU here
    args = trl.SFTConfig(output_dir=str(tmp_path / "y"), use_cpu=True, fp16=True)  # accepted by TRL on the CPU
    keys, notices = translate(args, {**CTX, "algo": "sft"})
    assert keys["model.dtype"] == "float32" and notices == [
        "SFTConfig.fp16=True: no fp16 on the CPU (accelerate autocasts it on GPUs only; TRL runs without autocast): "
        "float32"
    ]
    keys, notices = translate(trl.SFTConfig(output_dir="z", use_cpu=True, tf32=False), {**CTX, "algo": "sft"})
    assert notices == [] and "model.tf32" not in keys  # TF32 off: what torch does on a CPU anyway


def test_model_device_cpu_keeps_a_run_on_the_cpu_beside_a_gpu(monkeypatch):
    from lorarl.config import recipe_from_dict
    from lorarl.model import pick_device
    from lorarl.plan import resolve_micro_batch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto").type == "cuda" and pick_device("cpu").type == "cpu"
    recipe = recipe_from_dict({"algo": "sft", "model": {"device": "cpu"}, "train": {"micro_batch_size": "auto"}})
    assert resolve_micro_batch(recipe) == 8  # the CPU's rule (min(8, rows)), not the GPU planner's


def test_text_dataset_refusals_follow_trl(tiny_model_dir, tmp_path):
    rows = [{"text": "A quiet, patient film."}] * 4
    args = trl.SFTConfig(output_dir=str(tmp_path / "a"), use_cpu=True, assistant_only_loss=True)
    with pytest.raises(Refused, match=r"^SFTConfig.assistant_only_loss=True: the dataset is not conversational"):
        SFTTrainer(str(tiny_model_dir), args=args, train_dataset=rows)
    args = trl.SFTConfig(output_dir=str(tmp_path / "b"), use_cpu=True, completion_only_loss=False)
    SFTTrainer(str(tiny_model_dir), args=args, train_dataset=rows)  # text rows train every token: what False asks
    with pytest.raises(Refused, match=r"^SFTConfig.completion_only_loss=False: lorarl's SFT loss is on completion"):
        SFTTrainer(str(tiny_model_dir), args=args, train_dataset=[{"prompt": "a", "completion": "b"}] * 4)
    args = trl.SFTConfig(output_dir=str(tmp_path / "d"), use_cpu=True, max_length=None, packing=True)
    with pytest.raises(Refused, match=r"^SFTConfig.max_length=None: lorarl needs a length"):
        SFTTrainer(str(tiny_model_dir), args=args, train_dataset=rows)
    with pytest.raises(Refused, match=r"^SFTConfig.packing_strategy='greedy': TRL's packing strategies are bfd"):
        args = trl.SFTConfig(output_dir=str(tmp_path / "c"), use_cpu=True, packing=True)
        args.packing_strategy = "greedy"
        SFTTrainer(str(tiny_model_dir), args=args, train_dataset=rows)


def test_packed_steps_are_counted_as_trl_counts_its_packed_rows(tiny_model_dir, tmp_path):
    from test_sft_packing import REVIEWS, _trl_prepared

    from lorarl.model import load_tokenizer

    rows = [{"review": t} for t in REVIEWS * 4]  # 32 reviews
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        packing=True,
        max_length=64,
        dataset_text_field="review",
        per_device_train_batch_size=2,
        num_train_epochs=2,
    )
    recipe = SFTTrainer(str(tiny_model_dir), args=args, train_dataset=Dataset.from_list(rows)).recipe
    trl_rows = _trl_prepared(load_tokenizer(str(tiny_model_dir)), [{"text": r["review"]} for r in rows], 64, True)
    assert len(trl_rows["input_ids"]) < len(rows)
    assert recipe["train"]["steps"] == math.ceil(2 * len(trl_rows["input_ids"]) / 2)  # TRL: epochs x packed rows
    assert recipe["data"]["columns"] == {"text": "review"} and recipe["sft"]["packing"] is True
    assert recipe["sft"]["packing_strategy"] == "bfd" and recipe["sft"]["max_length"] == 64


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's default
def test_text_sft_with_packing_trains_through_lorarl_trl_with_use_cpu(tiny_model_dir, tmp_path):
    """A TRL script with ``use_cpu=True`` and bf16 left unset: bf16 on the CPU, text rows packed, one step."""
    reviews = ["A quiet, patient film.", "Terrible. I walked out.", "Loud, dumb and fun.", "Beautiful, empty inside."]
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        packing=True,
        max_length=32,
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to="none",
    )
    trainer = SFTTrainer(
        str(tiny_model_dir), args=args, train_dataset=Dataset.from_list([{"text": t} for t in reviews])
    )
    out = trainer.train()
    assert out.global_step == 1 and math.isfinite(out.training_loss)
    recipe = trainer.run.recipe  # the run's resolved recipe: bf16 on the CPU, packed
    assert recipe.model.device == "cpu" and recipe.model.dtype == "bfloat16" and recipe.sft.packing
    assert (tmp_path / "run" / "policy" / "adapter_model.safetensors").is_file()
    summary = trainer.run.summary
    assert summary["examples"] == 4 and summary["packed_rows"] == 1  # four short reviews fit one 32-token row
    assert trainer.state.log_history[-1]["completion_tokens"] > 0
