"""The KV cache's name in transformers' API, in one place.

transformers 5.x renamed the cache argument of every model ``forward`` and of ``generate`` from ``past_key_values``
to ``cache``, and the output field with it (``out.past_key_values`` -> ``out.cache``); the old names still work in
the releases that renamed them but print a ``FutureWarning`` at every call (and ``logger.warning_once``), and are
to be removed (forward: 5.40, ``generate``: 6.0). Releases before the rename know only ``past_key_values``.

lorarl passes and reads the cache only through :func:`cache_arg` / :func:`output_cache`, which use the name the
installed transformers declares (read once from its ``BaseModelOutputWithPast`` fields), so every release that
pyproject.toml admits runs without deprecation warnings.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any


@functools.cache
def cache_name() -> str:
    """``"cache"`` where the installed transformers names the KV cache so (5.x after the rename), else
    ``"past_key_values"``."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    names = {f.name for f in fields(BaseModelOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to a model's ``forward`` or to ``generate``:
    ``model(..., **cache_arg(DynamicCache()), use_cache=True)``."""
    return {cache_name(): cache}


def output_cache(out: Any) -> Any:
    """The KV cache a forward returned (``out.cache``, or ``out.past_key_values`` before the rename)."""
    return getattr(out, cache_name())
