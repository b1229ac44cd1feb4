"""The decode engines by name (``generation.engine``), above both: :class:`~lorarl.rollout.engines.HFEngine` and
:class:`~lorarl.rollout.fast.FastEngine` (which falls back to ``hf`` for models it cannot drive, so it sits above
:mod:`lorarl.rollout.engines`)."""

from __future__ import annotations

from lorarl.rollout.engines import Engine, HFEngine
from lorarl.rollout.fast import FastEngine

ENGINES: dict[str, type] = {"hf": HFEngine, "fast": FastEngine}


def make_engine(name: str) -> Engine:
    """The engine registered as ``name`` (``generation.engine_for(device)``: ``auto`` resolved)."""
    return ENGINES[name]()
