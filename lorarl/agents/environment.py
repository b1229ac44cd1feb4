"""Environments in TRL's ``environment_factory`` convention, so a class written for TRL runs here unchanged.

TRL's convention (``GRPOTrainer(environment_factory=...)``, trl 1.x): the factory takes no argument and returns an
instance; the instance has ``reset(**row)`` -- called with the dataset row's fields as keyword arguments -- that
returns None or a string appended to the last user message; its public methods other than ``reset`` and
``get_reward`` are the tools (schemas from their type hints and docstrings; ``async def`` methods are awaited); an
optional ``get_reward()`` (no argument, plain or ``async``) returns the rollout's reward from the environment's
state, added to the reward functions with weight 1 and logged as ``rewards/<class name>/mean``. An environment with
``get_reward`` may be the only reward source (``reward.functions: []``), as in TRL.

Here the class named in ``agent.environment`` is the factory. :class:`EnvironmentSession` is one rollout's
instance: built when the rollout starts, reset with the row, asked for the reward at the end, then released
(``close()`` when it has one; the reference dropped). An environment whose constructor or ``reset`` raises does not
stop the step: the trajectory goes on without the environment's observation, the model is told the environment
failed, and the event is counted (``reset_error``).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

from lorarl.agents.tools import Tool, resolve_awaitable, tool_schema
from lorarl.errors import LorarlError
from lorarl.user_code import load_object

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
RESERVED = ("reset", "get_reward", "close")  # TRL reserves the first two; close is lorarl's release hook


def tool_method_names(cls: type) -> list[str]:
    """The methods of ``cls`` that are tools, as TRL lists them: public functions defined on the class, except
    ``reset`` and ``get_reward`` (and ``close``, which lorarl calls to release the instance; read from the class, so
    properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


def load_environment(spec: str, recipe_path: str | Path | None = None) -> type:
    """``agent.environment`` -> the class, checked: callable with no argument, has ``reset``, and every tool method
    has a schema. One :class:`LorarlError` line naming what is missing."""
    cls = load_object(spec, "agent.environment:", recipe_path)
    if not isinstance(cls, type):
        raise LorarlError(f"agent.environment: {spec!r} is not a class")
    if not callable(getattr(cls, "reset", None)):
        raise LorarlError(f"agent.environment: {spec!r} has no reset method (TRL's environment_factory needs one)")
    try:
        probe = cls()  # TRL probes one instance at set-up too
    except Exception as e:
        raise LorarlError(f"agent.environment: {spec}() raised {type(e).__name__}: {e}") from None
    for name in tool_method_names(cls):
        tool_schema(getattr(probe, name), f"agent.environment: {spec}.{name}")
    return cls


class EnvironmentSession:
    """One rollout's environment instance (see the module docstring). ``tools`` are the instance's bound tool
    methods; ``observation`` what ``reset`` returned (or None); ``reset_error`` why building or resetting failed."""

    def __init__(self, cls: type, row: dict[str, Any]):
        self.instance: Any = None
        self.tools: list[Tool] = []
        self.observation: str | None = None
        self.reset_error: str | None = None
        self.reward_error: str | None = None  # why reward() has no value (set by reward())
        self.cls = cls
        try:
            self.instance = cls()
            obs = resolve_awaitable(self.instance.reset(**row))
            if obs is not None and not isinstance(obs, str):
                raise TypeError(f"reset returned {type(obs).__name__}, not a string or None")
            self.observation = obs
        except Exception as e:  # an environment's failure is the trajectory's, never the step's
            self.reset_error = f"{type(e).__name__}: {e}"
        if self.instance is not None:
            for name in tool_method_names(cls):
                method = getattr(self.instance, name)
                self.tools.append(Tool(name, method, tool_schema(method, f"agent.environment: {cls.__name__}.{name}")))

    def reward(self) -> float:
        """``get_reward()`` of the instance: NaN when it has none or returned None (does not apply), and NaN with
        ``reward_error`` set when the instance failed to build or reset, ``get_reward`` raised, or its value is not
        a finite float32 (left out of the group statistics, and counted, like a failed reward function's value)."""
        fn = getattr(self.instance, "get_reward", None)
        if self.reset_error is not None and callable(getattr(self.cls, "get_reward", None)):
            self.reward_error = f"reset failed: {self.reset_error}"
        if fn is None or self.reset_error is not None:
            return math.nan
        try:
            value = resolve_awaitable(fn())  # (an ``async def get_reward``, as TRL allows, is awaited)
            value = math.nan if value is None else float(value)
        except Exception as e:  # counted by the caller as a failed value
            self.reward_error = f"get_reward raised {type(e).__name__}: {e}"
            return math.nan
        if not math.isnan(value) and not abs(value) <= FLOAT32_MAX:
            self.reward_error = f"get_reward returned {value:g}, not a finite float32"
            return math.nan
        return value

    def release(self) -> None:
        """End of the rollout: ``close()`` when the environment has one (errors ignored); drop the instance."""
        close = getattr(self.instance, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - releasing must not stop the step
                pass
        self.instance = None
        self.tools = []
