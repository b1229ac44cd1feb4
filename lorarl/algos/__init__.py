"""Algorithms on the one shared base, each a class with a set-up and a ``step`` (see :mod:`lorarl.algos.base`),
driven by one run loop (:mod:`lorarl.algos.loop`). ``ALGORITHMS`` maps a recipe's ``algo`` to its class; modules
are imported when first used."""

from __future__ import annotations

import importlib

ALGORITHMS = {
    "grpo": "lorarl.algos.grpo:GRPO",
    "ppo": "lorarl.algos.ppo:PPO",
    "reward_model": "lorarl.algos.reward_model:RewardModel",
    "sft": "lorarl.algos.sft:SFT",
    "rejection_sampling": "lorarl.algos.rejection_sampling:RejectionSampling",
    "dpo": "lorarl.algos.dpo:DPO",
    "online_dpo": "lorarl.algos.online_dpo:OnlineDPO",
    "rloo": "lorarl.algos.rloo:RLOO",
    "distill": "lorarl.algos.distill:Distill",
    "kto": "lorarl.algos.kto:KTO",
}


def algorithm_class(name: str):
    """The class registered for ``algo: name``."""
    module, _, cls = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_algorithm(recipe, shared):
    """Set up ``recipe.algo`` on ``shared`` (roles, data, optimizers): ready for ``batch`` / ``step``."""
    return algorithm_class(recipe.algo)(recipe, shared)
