"""TRL's trainers as a drop-in: ``from lorarl.trl import GRPOTrainer, RLOOTrainer, DPOTrainer, SFTTrainer,
RewardTrainer, KTOTrainer, DistillationTrainer`` (and their configs, TRL's own classes: ``from lorarl.trl import
RLOOConfig`` is ``trl.RLOOConfig``; TRL's quick starts import both from one place).

Each takes TRL 1.16's constructor arguments, its own ``GRPOConfig`` / ``RLOOConfig`` / ``DPOConfig`` / ``SFTConfig`` /
``RewardConfig`` / ``KTOConfig`` / ``DistillationConfig`` and ``peft.LoraConfig`` as they are; every config field is
mapped to a recipe key, noted (no effect here) or refused with one line (:mod:`lorarl.trl.fields`); training runs
:func:`lorarl.train` (docs/trl_dropin.md). ``lorarl.trl.KTOConfig`` is TRL's, with an unset ``bf16`` that follows
the machine (:mod:`lorarl.trl.configs`).
"""

from lorarl.trl.distillation import DistillationTrainer
from lorarl.trl.trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

# TRL's, imported when first named (importing TRL takes seconds)
CONFIGS = ("GRPOConfig", "RLOOConfig", "DPOConfig", "SFTConfig", "RewardConfig", "KTOConfig", "DistillationConfig")

__all__ = [
    "GRPOTrainer",
    "RLOOTrainer",
    "DPOTrainer",
    "SFTTrainer",
    "RewardTrainer",
    "KTOTrainer",
    "DistillationTrainer",
    *CONFIGS,
]


def __getattr__(name: str):
    """TRL's config classes, imported when first asked for (``KTOConfig``: :mod:`lorarl.trl.configs`'s)."""
    if name == "KTOConfig":
        from lorarl.trl.configs import KTOConfig

        return KTOConfig
    if name in CONFIGS:
        import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'lorarl.trl' has no attribute {name!r}")
