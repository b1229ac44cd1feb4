"""TRL's DPO quick start (TRL docs, docs/source/dpo_trainer.md, "Quick start"), with only the import changed
(``from trl import DPOTrainer`` -> ``from lorarl.trl import DPOTrainer``) and the model and dataset names read from
two variables, so it runs on the embedded model without the hub:

    MODEL  TRL's "Qwen/Qwen3-0.6B"; here the embedded SmolLM2-135M-Instruct (QUICKSTART_MODEL to change)
    DATA   TRL's "trl-lib/ultrafeedback_binarized" (a hub name, as TRL); QUICKSTART_DATA: a local dataset folder

    python examples/trl_quickstarts/dpo.py         # writes ./<model>-DPO; the reference is the base, adapters off

tests/test_trl_dropin.py runs this file unchanged on a tiny model and a local copy of the dataset's fields.
"""

import os

MODEL = os.environ.get("QUICKSTART_MODEL", "smollm2-135m")
DATA = os.environ.get("QUICKSTART_DATA", "trl-lib/ultrafeedback_binarized")

# train_dpo.py  (TRL's quick start from here on; names: MODEL, DATA)
from datasets import load_dataset  # noqa: E402

from lorarl.trl import DPOTrainer  # noqa: E402

trainer = DPOTrainer(
    model=MODEL,
    train_dataset=load_dataset(DATA, split="train"),
)
trainer.train()
