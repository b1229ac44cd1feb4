"""TRL's trainers as a drop-in: ``from lorarl.trl import GRPOTrainer, DPOTrainer, SFTTrainer, RewardTrainer,
KTOTrainer, KTOConfig``.

Each takes TRL 1.16's constructor arguments, its own ``GRPOConfig`` / ``DPOConfig`` / ``SFTConfig`` /
``RewardConfig`` / ``KTOConfig`` and ``peft.LoraConfig`` as they are; every config field is mapped to a recipe key,
noted (no effect here) or refused with one line (:mod:`lorarl.trl.fields`); training runs :func:`lorarl.train`
(docs/trl_dropin.md). ``lorarl.trl.KTOConfig`` is TRL's, with an unset ``bf16`` that follows the machine
(:mod:`lorarl.trl.configs`; imported when first asked for, as TRL itself).
"""

from lorarl.trl.trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, SFTTrainer

__all__ = ["GRPOTrainer", "DPOTrainer", "SFTTrainer", "RewardTrainer", "KTOTrainer", "KTOConfig"]


def __getattr__(name: str):
    if name == "KTOConfig":
        from lorarl.trl.configs import KTOConfig

        return KTOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
