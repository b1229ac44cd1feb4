"""TRL's trainers as a drop-in: ``from lorarl.trl import GRPOTrainer, DPOTrainer, SFTTrainer, RewardTrainer``, and
``DistillationTrainer`` with ``DistillationConfig`` (TRL's own config class, re-exported: its quick start imports both
from one place).

Each takes TRL 1.16's constructor arguments, its own ``GRPOConfig`` / ``DPOConfig`` / ``SFTConfig`` /
``RewardConfig`` / ``DistillationConfig`` and ``peft.LoraConfig`` as they are; every config field is mapped to a
recipe key, noted (no effect here) or refused with one line (:mod:`lorarl.trl.fields`); training runs
:func:`lorarl.train` (docs/trl_dropin.md).
"""

from lorarl.trl.distillation import DistillationTrainer
from lorarl.trl.trainers import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer

__all__ = ["GRPOTrainer", "DPOTrainer", "SFTTrainer", "RewardTrainer", "DistillationTrainer", "DistillationConfig"]


def __getattr__(name: str):
    """TRL's config classes on demand (``from lorarl.trl import DistillationConfig``), so importing lorarl.trl does not
    import trl."""
    if name == "DistillationConfig":
        from trl import DistillationConfig

        return DistillationConfig
    raise AttributeError(f"module 'lorarl.trl' has no attribute {name!r}")
