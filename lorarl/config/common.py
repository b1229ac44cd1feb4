"""What every recipe section uses: the range check and the LoRA settings (the policy's, the critic's, the reward
model's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from lorarl.errors import RecipeError


def check(ok: bool, where: str, key: str, message: str) -> None:
    """Raise RecipeError ``"<file>: <key> <message>"`` unless ``ok``."""
    if not ok:
        raise RecipeError(f"{where}: {key} {message}")


@dataclass
class LoraSettings:
    """LoRA settings of one adapter (PEFT LoraConfig)."""

    r: int = 16  # rank
    alpha: float = 32.0  # scaling alpha / r
    dropout: float = 0.0  # LoRA dropout (off while sampling and scoring: docs/how_it_works.md)
    target_modules: Union[str, list[str]] = "all-linear"  # noqa: UP007  PEFT's target_modules

    def validate(self, where: str, prefix: str = "lora") -> None:
        check(self.r >= 1, where, f"{prefix}.r", "must be >= 1")
        check(self.alpha > 0, where, f"{prefix}.alpha", "must be > 0")
        check(0.0 <= self.dropout < 1.0, where, f"{prefix}.dropout", "must be in [0, 1)")
