"""TRL's trainers as a drop-in: ``from lorarl.trl import GRPOTrainer, DPOTrainer, SFTTrainer, RewardTrainer``.

Each takes TRL 1.16's constructor arguments, its own ``GRPOConfig`` / ``DPOConfig`` / ``SFTConfig`` /
``RewardConfig`` and ``peft.LoraConfig`` as they are; every config field is mapped to a recipe key, noted (no effect
here) or refused with one line (:mod:`lorarl.trl.fields`); training runs :func:`lorarl.train` (docs/trl_dropin.md).
"""

from lorarl.trl.trainers import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer

__all__ = ["GRPOTrainer", "DPOTrainer", "SFTTrainer", "RewardTrainer"]
