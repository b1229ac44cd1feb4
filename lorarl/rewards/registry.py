"""Reward functions by name: a built-in, ``package.module:function`` or ``path/to/file.py:function``; and the
entries built from their own recipe section, chosen once from :data:`SPECIAL_REWARDS` (``remote``: an HTTP reward
server, :mod:`lorarl.rewards.remote`; ``judge``: an LLM judge on the shared base, :mod:`lorarl.rewards.judge`)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorarl.config import RewardSpec
from lorarl.errors import LorarlError
from lorarl.rewards.builtins import BUILTIN_REWARDS, RewardFn
from lorarl.user_code import load_object


def load_reward_fn(name: str, recipe_path: str | None = None) -> RewardFn:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function`` -> the function (a relative
    file is found beside the recipe ``recipe_path`` that names it, then in the working folder)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise LorarlError(
            f"unknown reward {name!r}{hint}: use a built-in ({', '.join(BUILTIN_REWARDS)}), module:function, "
            "or remote / judge with their section"
        )
    fn = load_object(name, "reward", recipe_path, noun="function")
    if not callable(fn):
        raise LorarlError(f"reward {name!r}: {name.rpartition(':')[0]} has no function {name.rpartition(':')[2]!r}")
    return fn


@dataclass
class RewardContext:
    """What reward entries beyond a function need: the shared base (``shared``, a SharedBase) a judge runs on,
    and the recipe's path (relative judge folders are resolved against it)."""

    shared: Any = None
    recipe_path: str | None = None


def _build_remote(spec: RewardSpec, context: RewardContext | None) -> RewardFn:
    from lorarl.rewards.remote import RemoteReward

    return RemoteReward(spec.remote)


def _build_judge(spec: RewardSpec, context: RewardContext | None) -> RewardFn:
    from lorarl.rewards.judge import make_judge

    if context is None or context.shared is None:
        raise LorarlError("judge: an LLM judge runs on the shared base; it is available in training and `lorarl eval`")
    return make_judge(spec.judge, context.shared, context.recipe_path)


SPECIAL_REWARDS: dict[str, Callable[[RewardSpec, RewardContext | None], RewardFn]] = {
    "remote": _build_remote,
    "judge": _build_judge,
}


def build_reward_fn(spec: RewardSpec, context: RewardContext | None = None) -> RewardFn:
    """The callable behind a ``reward.functions`` entry: a special entry built from its section, else
    :func:`load_reward_fn` of its name."""
    if spec.name in SPECIAL_REWARDS:
        section = getattr(spec, spec.name, None)
        if section is None:
            raise LorarlError(f"{spec.name!r} needs its section ({spec.name}: ...) in the entry")
        return SPECIAL_REWARDS[spec.name](spec, context)
    return load_reward_fn(spec.name, context.recipe_path if context is not None else None)


def _metric_names(specs: list[RewardSpec]) -> list[str]:
    names = []
    for spec in specs:
        base = spec.name.rpartition(":")[2] or spec.name
        name, i = base, 1
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------------------------------
