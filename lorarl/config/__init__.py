"""Recipes: YAML files validated into dataclasses (:mod:`lorarl.config.schema`), read by
:mod:`lorarl.config.loader` with command-line overrides; keys that moved are read under their new names
(:mod:`lorarl.config.migrate`)."""

from lorarl.config.algorithms import (
    ALGO_SECTIONS,
    CriticConfig,
    GRPOConfig,
    GRPOKLConfig,
    PPOConfig,
    PPOKLConfig,
    PtxConfig,
    RewardModelConfig,
    ScoreConfig,
)
from lorarl.config.common import LoraSettings
from lorarl.config.loader import (
    apply_overrides,
    load_recipe,
    load_run_recipe,
    parse_override,
    recipe_from_dict,
    recipe_to_dict,
    yaml_load,
)
from lorarl.config.schema import (
    ArithmeticConfig,
    DataConfig,
    EvalConfig,
    GenerationConfig,
    HealthConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RewardSpec,
    TrainConfig,
)

__all__ = [
    "ALGO_SECTIONS",
    "ArithmeticConfig",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GRPOKLConfig",
    "HealthConfig",
    "GenerationConfig",
    "LoraSettings",
    "ModelConfig",
    "PPOConfig",
    "PPOKLConfig",
    "PtxConfig",
    "Recipe",
    "RewardConfig",
    "RewardModelConfig",
    "RewardSpec",
    "ScoreConfig",
    "TrainConfig",
    "apply_overrides",
    "load_recipe",
    "load_run_recipe",
    "parse_override",
    "recipe_from_dict",
    "recipe_to_dict",
    "yaml_load",
]
