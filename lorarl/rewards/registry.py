"""Reward functions by name: a built-in, ``package.module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from pathlib import Path

from lorarl.config import RewardSpec
from lorarl.errors import LorarlError
from lorarl.rewards.builtins import BUILTIN_REWARDS, RewardFn


def load_reward_fn(name: str) -> RewardFn:
    """A built-in name, ``package.module:function`` or ``path/to/file.py:function`` -> the function."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise LorarlError(
            f"unknown reward {name!r}{hint}: use a built-in ({', '.join(BUILTIN_REWARDS)}) or module:function"
        )
    module_name, _, attr = name.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise LorarlError(f"reward {name!r}: file {path} not found")
            spec = importlib.util.spec_from_file_location(f"lorarl_user_rewards_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except LorarlError:
        raise
    except Exception as e:  # a user's module failing to import is the user's problem to fix: say which
        raise LorarlError(f"reward {name!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise LorarlError(f"reward {name!r}: {module_name} has no function {attr!r}")
    return fn


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
