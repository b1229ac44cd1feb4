"""Role placement for the ``ppo-memory`` benchmark's baseline: every role on its own copy of the model, behind the
part of :class:`~lorarl.model.SharedBase`'s interface that the algorithms use, so that the real PPO step
(:class:`lorarl.algos.ppo.PPO`) runs unchanged on four models as it does on one.

A step only ever reaches the model through ``shared``: it switches roles (``shared.role(name)``), runs the active
role's forward functions (``generate``, ``token_logprobs``, ``values``, ``scores``, ``decoder()``, ...), reads
``device`` / ``tokenizer`` / ``pad_id`` and asks for a role's parameters. :class:`SeparateModels` keeps one
SharedBase per role; ``role(name)`` activates the copy that holds ``name`` (and that copy's own role switch), and
every other attribute is the active copy's. So what differs between the two variants is only where the roles
live: the step, its losses, its optimizers and its phases are the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lorarl.config import ModelConfig
from lorarl.errors import LorarlError
from lorarl.model import REFERENCE, SharedBase

# the copy a role runs on, where it is not the role's own name
HOLDER = {"base": REFERENCE}


class SeparateModels:
    """One model copy per role, used like a SharedBase: policy, reference (the bare copy: no adapter, so its role
    runs the base), critic, reward, ...; adapters are added to the copy of the role they are named after."""

    def __init__(self, copies: dict[str, SharedBase]):
        if not copies:
            raise LorarlError("SeparateModels needs at least one role")
        self.copies = copies
        self._active = [next(iter(copies.values()))]  # outside any role: the first copy (tokenizer, device, ...)

    @classmethod
    def load(cls, model_cfg: ModelConfig, roles: list[str], device: torch.device | None = None) -> SeparateModels:
        """Load ``model_cfg``'s base once per role (each a full copy of the weights)."""
        return cls({role: SharedBase.load(model_cfg, device) for role in roles})

    @property
    def bases(self) -> list[SharedBase]:
        """The copies (what holds memory)."""
        return list(self.copies.values())

    def _holder(self, role: str) -> SharedBase:
        name = HOLDER.get(role, role)
        if name not in self.copies:
            raise LorarlError(f"no model copy for role {role!r} (have: {', '.join(self.copies)})")
        return self.copies[name]

    # ---- adapters: on the copy of the role they are named after --------------------------------------------------
    def add_adapter(self, name: str, settings=None, **kwargs) -> None:
        self._holder(name).add_adapter(name, settings, **kwargs)

    def remove_adapter(self, name: str) -> None:
        self._holder(name).remove_adapter(name)

    def has_adapter(self, name: str) -> bool:
        return HOLDER.get(name, name) in self.copies and self._holder(name).has_adapter(name)

    @property
    def adapters(self) -> list[str]:
        return [a for base in self.bases for a in base.adapters]

    def adapter_parameters(self, name: str) -> list[torch.nn.Parameter]:
        return self._holder(name).adapter_parameters(name)

    def trainable_parameters(self, name: str) -> list[torch.nn.Parameter]:
        return self._holder(name).trainable_parameters(name)

    def save_adapter(self, name: str, folder):
        return self._holder(name).save_adapter(name, folder)

    def copy_adapter(self, src: str, dst: str) -> None:
        raise LorarlError("copy_adapter across separate model copies is not supported (iterative GRPO)")

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of every copy's base weights (summed under ``base``) and of each adapter (+ head)."""
        out: dict[str, int] = {"base": 0}
        for base in self.bases:
            for k, v in base.parameter_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    # ---- roles: the copy that holds the role becomes the active one --------------------------------------------
    @contextlib.contextmanager
    def role(self, name: str, train: bool = False, **options: Any) -> Iterator[SeparateModels]:
        """Run the body with role ``name`` active on its copy (``train`` and any other option as SharedBase.role
        takes them); every forward function reaches that copy."""
        holder = self._holder(name)
        with holder.role(name, train=train, **options):
            self._active.append(holder)
            try:
                yield self
            finally:
                self._active.pop()

    def __getattr__(self, attr: str) -> Any:
        # only reached for what is not defined above: the active copy's forward functions and properties
        if attr.startswith("_") or attr == "copies":
            raise AttributeError(attr)
        return getattr(self._active[-1], attr)
