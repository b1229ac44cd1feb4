"""A recipe whose sizes multiply past the machine, refused before the model loads (issue 34 item 6).

The loader bounds each number on its own (``generation.max_new_tokens <= 131072``, completions and tokens per step:
docs/bad_input.md); their product can still need terabytes. :func:`check_planned_memory` asks the planner
(:func:`lorarl.plan.estimate.estimate_memory`, from the recipe and the model's ``config.json``: no weights, under
a millisecond once imported) for one step's peak, at ``train.micro_batch_size`` 1 (the smallest a training
out-of-memory halving reaches), and refuses a step that needs more than :data:`CPU_FACTOR` times the machine's
physical RAM on CPU (a CPU run can swap; the planner is measured on GPUs), or :data:`CUDA_FACTOR` times the card's
memory on CUDA. The line names the term that dominates and the recipe keys that multiply into it.
"""

from __future__ import annotations

import os
from typing import Any

from lorarl.errors import LorarlError
from lorarl.plan.terms import GB

CPU_FACTOR = 4  # a step's estimate above 4 x physical RAM is refused on CPU
CUDA_FACTOR = 2  # ... above 2 x the card's memory on CUDA (generation is never split on out-of-memory)

# the planner's terms that grow with the step's rollout (completions x tokens) and with one training forward
ROLLOUT_TERMS = {
    "kv_cache": "the KV cache",
    "kv_cache_growth": "the KV cache growth",
    "static_kv_cache": "the static KV cache",
    "cache_copy": "the prompt cache copies",
    "prompt_cache": "the prompt cache",
    "sampling_logits": "the sampling logits",
    "graph_pool": "the CUDA graph pool",
    "hidden_states": "the hidden states",
    "last_position_logits": "the last-position logits",
}
TRAINING_TERMS = {
    "checkpoints": "the activation checkpoints",
    "layer_recompute": "a layer's recomputed activations",
    "attention_mask": "the attention mask",
    "logits_chunk": "a chunk of logits",
    "logits": "the logits",
    "final_hidden": "the final hidden states",
    "layer": "one layer's activations",
    "layer_forward": "one layer's forward",
}


def machine_memory(device_type: str) -> int:
    """Bytes of memory a run on ``device_type`` has: the card's total on CUDA, physical RAM on CPU
    (``SC_PHYS_PAGES x SC_PAGE_SIZE``)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def driving_keys(recipe, settings: dict[str, Any], term: str) -> str:
    """The recipe keys (with their values) that multiply into the planner's ``term``."""
    tokens = (
        f"data.max_prompt_tokens ({settings['prompt_len']}) + generation.max_new_tokens ({settings['max_new_tokens']})"
    )
    if term in ROLLOUT_TERMS:
        rows = f"train.prompts_per_step ({recipe.train.prompts_per_step})"
        if recipe.algo in ("grpo", "online_dpo"):
            rows += f" x {recipe.algo}.group_size ({settings['group_size']})"
        return f"{settings['rows']} completions [{rows}] x [{tokens}] tokens"
    if term in TRAINING_TERMS:
        return f"train.micro_batch_size (1 planned) x [{tokens}] tokens"
    if term.startswith("base_"):
        return f"model.name ({recipe.model.name})"
    return "this recipe (`lorarl plan` shows every term)"


def planned_step_bytes(recipe, device_type: str) -> dict[str, Any] | None:
    """The planner's estimate of one step of ``recipe`` on ``device_type`` at micro-batch 1 (None: an algorithm
    the planner does not model, or a model whose shape cannot be read offline: the load says why)."""
    from lorarl.plan.estimate import estimate_memory
    from lorarl.plan.recipes import PLANNED_RECIPES, recipe_model_shape, recipe_settings

    if recipe.algo not in PLANNED_RECIPES:
        return None
    try:
        shape = recipe_model_shape(recipe)
    except (LorarlError, OSError, ValueError, KeyError):
        return None
    return estimate_memory(shape, recipe_settings(recipe, device_type=device_type), micro_batch_size=1)


def memory_refusal(recipe, device_type: str, memory_bytes: int) -> str | None:
    """The one line refusing ``recipe`` on a ``device_type`` machine with ``memory_bytes`` of memory, or None.

    Refused when the planner's step peak (with the CUDA context and allocator slack on CUDA: ``peak_total_bytes``;
    allocated bytes on CPU) exceeds ``factor x memory_bytes`` (:data:`CPU_FACTOR`, :data:`CUDA_FACTOR`)."""
    est = planned_step_bytes(recipe, device_type)
    if est is None:
        return None
    cuda = device_type == "cuda"
    need = est["peak_total_bytes"] if cuda else est["peak_bytes"]
    factor = CUDA_FACTOR if cuda else CPU_FACTOR
    if need <= factor * memory_bytes:
        return None
    phase = est["peak_phase"]
    terms = {**est["breakdown"]["persistent"], **est["breakdown"][phase]}  # the fast engine's cache is persistent
    term = max(terms, key=terms.get)
    size = terms[term]
    label = (
        ROLLOUT_TERMS.get(term)
        or TRAINING_TERMS.get(term)
        or ("the base weights" if term.startswith("base_") else f"{term!r}")
    )
    where = f"the card's {memory_bytes / GB:.1f} GB" if cuda else f"this machine's {memory_bytes / GB:.1f} GB of RAM"
    return (
        f"recipe: one step needs about {need / GB:,.1f} GB by the planner's estimate (`lorarl plan`), over {factor} x "
        f"{where}; its {phase} peak is mostly {label} ({size / GB:,.1f} GB) of "
        f"{driving_keys(recipe, est['settings'], term)}: lower these keys"
    )


def check_planned_memory(recipe, device_type: str | None = None, memory_bytes: int | None = None) -> None:
    """Raise :class:`LorarlError` with :func:`memory_refusal`'s line when the recipe's step cannot fit this
    machine (``device_type``: cuda when a GPU is visible; ``memory_bytes``: :func:`machine_memory`)."""
    if device_type is None:
        from lorarl.model.loading import pick_device

        device_type = pick_device(recipe.model.device).type
    line = memory_refusal(recipe, device_type, memory_bytes or machine_memory(device_type))
    if line is not None:
        raise LorarlError(line)
