"""Temporary alias of :mod:`lorarl.model.registry` while the package split lands (removed before release)."""

from lorarl.model.registry import *  # noqa: F403
from lorarl.model.registry import DEFAULT_MODEL, EMBEDDED, cache_dir, convert_embedded, list_models, resolve_model  # noqa: F401
