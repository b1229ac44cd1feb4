"""TRL's KTO quick start (TRL docs, docs/source/kto_trainer.md, "Quick start"), with only the import changed
(``from trl import KTOConfig, KTOTrainer`` -> ``from lorarl.trl import KTOConfig, KTOTrainer``) and the model and
dataset names read from two variables, so it runs on the embedded model without the hub:

    MODEL  TRL's "Qwen/Qwen2-0.5B-Instruct"; here the embedded SmolLM2-135M-Instruct's folder (QUICKSTART_MODEL)
    DATA   TRL's "trl-lib/kto-mix-14k" (a hub name, as TRL); QUICKSTART_DATA: a local dataset folder instead

    python examples/trl_quickstarts/kto.py         # writes ./<output_dir>; the reference is the base, adapters off

TRL's script loads the model and tokenizer itself; lorarl takes the model by its folder and loads that folder once
as the shared base (a notice says so). ``lorarl.trl.KTOConfig`` is TRL's, except that an unset ``bf16`` follows
the machine: TRL's own ``KTOConfig(output_dir=...)`` is refused by transformers on a machine without a bf16 GPU.
TRL's ``learning_rate`` default (1e-6) is kept: a LoRA adapter barely moves at it (pass ``learning_rate=`` to train).
tests/test_trl_dropin.py runs this file unchanged on a tiny model and a local copy of the dataset's fields.
"""

import os

from lorarl.model.registry import resolve_model

MODEL = os.environ.get("QUICKSTART_MODEL") or resolve_model("smollm2-135m")
DATA = os.environ.get("QUICKSTART_DATA", "trl-lib/kto-mix-14k")
OUTPUT = f"{os.path.basename(str(MODEL).rstrip('/'))}-KTO"  # TRL's "Qwen2-0.5B-KTO"

# train_kto.py  (TRL's quick start from here on; names: MODEL, DATA, OUTPUT)
from datasets import load_dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lorarl.trl import KTOConfig, KTOTrainer  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(MODEL)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
train_dataset = load_dataset(DATA, split="train")

training_args = KTOConfig(output_dir=OUTPUT)
trainer = KTOTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset)
trainer.train()
