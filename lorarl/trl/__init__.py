"""TRL's trainers as a drop-in: ``from lorarl.trl import GRPOTrainer, RLOOTrainer, DPOTrainer, SFTTrainer,
RewardTrainer`` (and their configs, TRL's own classes: ``from lorarl.trl import RLOOConfig`` is ``trl.RLOOConfig``).

Each takes TRL 1.16's constructor arguments, its own ``GRPOConfig`` / ``RLOOConfig`` / ``DPOConfig`` / ``SFTConfig`` /
``RewardConfig`` and ``peft.LoraConfig`` as they are; every config field is mapped to a recipe key, noted (no effect
here) or refused with one line (:mod:`lorarl.trl.fields`); training runs :func:`lorarl.train` (docs/trl_dropin.md).
"""

from lorarl.trl.trainers import DPOTrainer, GRPOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

CONFIGS = ("GRPOConfig", "RLOOConfig", "DPOConfig", "SFTConfig", "RewardConfig")  # TRL's, imported when first named

__all__ = ["GRPOTrainer", "RLOOTrainer", "DPOTrainer", "SFTTrainer", "RewardTrainer", *CONFIGS]


def __getattr__(name: str):
    """TRL's config classes, imported from ``trl`` when first asked for (importing TRL takes seconds)."""
    if name in CONFIGS:
        import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'lorarl.trl' has no attribute {name!r}")
