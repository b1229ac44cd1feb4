"""Keys that moved, and reading older recipes under the new names.

Recipes written before the sections were grouped keep loading: each moved key is read under its new name, and the
loader prints one line listing what to rename. A recipe that sets both the old and the new name is refused.
"""

from __future__ import annotations

from typing import Any

from lorarl.errors import RecipeError

# old dotted key -> new dotted key
MOVED: dict[str, str] = {
    "rewards": "reward.functions",
    "train.reward_timeout_s": "reward.timeout_s",
    "train.max_reward_failure_fraction": "reward.max_failure_fraction",
    "ppo.reward_source": "reward.source",
    "ppo.reward_adapter": "reward.adapter",
    "ppo.reward_model_weight": "reward.model_weight",
    "ppo.reward_normalize": "ppo.score.normalize",
    "ppo.reward_clip": "ppo.score.clip",
    "ppo.no_eos_penalty": "ppo.score.no_eos_penalty",
    "ppo.kl_coef": "ppo.kl.coef",
    "ppo.adaptive_kl": "ppo.kl.adaptive",
    "ppo.kl_target": "ppo.kl.target",
    "ppo.kl_horizon": "ppo.kl.horizon",
    "ppo.critic_init": "ppo.critic.init",
    "ppo.critic_lora": "ppo.critic.lora",
    "ppo.critic_learning_rate": "ppo.critic.learning_rate",
    "ppo.vf_coef": "ppo.critic.vf_coef",
    "ppo.value_clip": "ppo.critic.value_clip",
    "ppo.value_loss": "ppo.critic.loss",
    "ppo.huber_delta": "ppo.critic.huber_delta",
    "ppo.ptx_coef": "ppo.ptx.coef",
    "ppo.ptx_source": "ppo.ptx.source",
    "ppo.ptx_batch_size": "ppo.ptx.batch_size",
    "grpo.kl_coef": "grpo.kl.coef",
    "grpo.kl_estimator": "grpo.kl.estimator",
    "grpo.ref_refresh_every": "grpo.kl.ref_refresh_every",
    "data.operations": "data.arithmetic.operations",
    "data.digits": "data.arithmetic.digits",
    "data.prompt_template": "data.arithmetic.prompt_template",
    "reward_model.eval_every": "eval.every",
}


def migrate_path(path: list[str]) -> list[str]:
    """The new key path for an old one (a prefix match: ``ppo.critic_lora.r`` -> ``ppo.critic.lora.r``)."""
    for i in range(len(path), 0, -1):
        new = MOVED.get(".".join(path[:i]))
        if new is not None:
            return new.split(".") + path[i:]
    return list(path)


def _pop(data: dict, path: list[str]) -> tuple[bool, Any]:
    node = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False, None
    if path[-1] not in node:
        return False, None
    return True, node.pop(path[-1])


def _has(data: dict, path: list[str]) -> bool:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _put(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"{'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def migrate(data: dict, where: str = "<recipe>") -> tuple[dict, list[tuple[str, str]]]:
    """A copy of a raw recipe mapping with every moved key under its new name; and the ``(old, new)`` pairs moved.
    Raises RecipeError when a recipe sets a key under both names."""
    import copy

    out = copy.deepcopy(data)
    moved = []
    for old, new in MOVED.items():
        found, value = _pop(out, old.split("."))
        if not found:
            continue
        if _has(out, new.split(".")):
            raise RecipeError(f"{where}: {old} and {new} are the same setting: keep only {new}")
        _put(out, new.split("."), value)
        moved.append((old, new))
    for section in ("ppo", "grpo", "train", "data", "reward_model"):  # sections emptied by the moves
        if out.get(section) == {} and section not in data:
            out.pop(section)
    return out, moved
