"""TRL's RLOO quick start (TRL docs, docs/source/rloo_trainer.md, "Quick start"), with only the import changed
(``from trl import RLOOTrainer`` -> ``from lorarl.trl import RLOOTrainer``) and the model and dataset names read from
two variables, so it runs on the embedded model without the hub:

    MODEL  TRL's "Qwen/Qwen2-0.5B-Instruct"; here the embedded SmolLM2-135M-Instruct (QUICKSTART_MODEL to change)
    DATA   TRL's "trl-lib/DeepMath-103K" (a hub name, as TRL); QUICKSTART_DATA: a local dataset folder instead

    python examples/trl_quickstarts/rloo.py        # writes ./<model>-RLOO, as TRL's RLOOTrainer does

tests/test_trl_dropin.py runs this file unchanged on a tiny model and a local copy of the dataset's fields.
"""

import os

MODEL = os.environ.get("QUICKSTART_MODEL", "smollm2-135m")
DATA = os.environ.get("QUICKSTART_DATA", "trl-lib/DeepMath-103K")

# train_rloo.py  (TRL's quick start from here on; names: MODEL, DATA)
from datasets import load_dataset  # noqa: E402
from trl.rewards import accuracy_reward  # noqa: E402

from lorarl.trl import RLOOTrainer  # noqa: E402

dataset = load_dataset(DATA, split="train")

trainer = RLOOTrainer(
    model=MODEL,
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
