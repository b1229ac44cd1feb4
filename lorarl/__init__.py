"""lorarl: parameter-efficient RL fine-tuning (GRPO, PPO, reward models) on one GPU.

One base model is loaded once (NF4 on CUDA); policy, reference, critic and reward model are LoRA adapters on it.
"""

import logging as _logging
import warnings as _warnings

__version__ = "0.1.0"

# Library noise a user would otherwise have to learn to ignore, silenced at its source and nothing else:
# - bitsandbytes (imported by peft) tries to fetch an optional CPU kernel from the hub at import and logs a warning
#   when it cannot (offline, or no `kernels` package); its own CPU path is used then, which is what lorarl wants.
# - peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model (a FutureWarning on
#   every command); the replacement `is_activation_checkpointing` is what lorarl itself calls.
# Each is (message regex, category); tests/test_quiet.py keeps these ignored while turning every other warning into
# an error, so a new deprecation on lorarl's path fails a test instead of reaching users.
LIBRARY_WARNINGS_IGNORED = ((r"`is_gradient_checkpointing` is deprecated", FutureWarning),)


def ignore_library_warnings() -> None:
    """Install the filters for :data:`LIBRARY_WARNINGS_IGNORED` (at import; again inside a ``catch_warnings``)."""
    for message, category in LIBRARY_WARNINGS_IGNORED:
        _warnings.filterwarnings("ignore", message=message, category=category)


_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
ignore_library_warnings()

# The Python door (lorarl.api), imported on first use so `import lorarl` stays light (the CLI sets thread settings
# before torch loads).
_API = ("train", "evaluate", "export", "load_recipe", "Run")


def forward_calls_to_api(module_name: str, name: str) -> None:
    """Make the submodule ``module_name`` callable as :func:`lorarl.api.<name>`.

    ``lorarl.evaluate`` and ``lorarl.export`` are both submodules and functions of the Python door: once a submodule
    is imported, Python binds the package attribute to it, so ``from lorarl import evaluate`` then gives the module.
    Called at the end of those two modules, this makes that module object call the API function, so the import
    works the same before and after (attribute paths such as ``lorarl.export.gguf`` still reach the submodules)."""
    import sys
    import types

    class _CallsApi(types.ModuleType):
        def __call__(self, *args, **kwargs):
            from lorarl import api

            return getattr(api, name)(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallsApi


def __getattr__(name: str):
    if name in _API:
        from lorarl import api

        return getattr(api, name)
    if name == "LorarlError":
        from lorarl.errors import LorarlError

        return LorarlError
    raise AttributeError(f"module 'lorarl' has no attribute {name!r}")


__all__ = ["LorarlError", "Run", "evaluate", "export", "load_recipe", "train", "__version__"]
