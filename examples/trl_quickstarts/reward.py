"""TRL's reward modelling quick start (TRL docs, docs/source/reward_trainer.md, "Quick start"), with only the
import changed (``from trl import RewardTrainer`` -> ``from lorarl.trl import RewardTrainer``) and the model and
dataset names read from two variables, so it runs on the embedded model without the hub:

    MODEL  TRL's "Qwen/Qwen3-0.6B"; here the embedded SmolLM2-135M-Instruct (QUICKSTART_MODEL to change)
    DATA   TRL's "trl-lib/ultrafeedback_binarized" (a hub name, as TRL); QUICKSTART_DATA: a local dataset folder

    python examples/trl_quickstarts/reward.py      # writes ./<model>-Reward: a reward adapter + score head

The trained folder is a reward adapter on the same base: GRPOTrainer(reward_funcs="<that folder>") scores with it.
tests/test_trl_dropin.py runs this file unchanged on a tiny model and a local copy of the dataset's fields.
"""

import os

MODEL = os.environ.get("QUICKSTART_MODEL", "smollm2-135m")
DATA = os.environ.get("QUICKSTART_DATA", "trl-lib/ultrafeedback_binarized")

# (TRL's quick start from here on; names: MODEL, DATA)
from datasets import load_dataset  # noqa: E402

from lorarl.trl import RewardTrainer  # noqa: E402

trainer = RewardTrainer(
    model=MODEL,
    train_dataset=load_dataset(DATA, split="train"),
)
trainer.train()
