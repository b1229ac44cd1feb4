"""``lorarl.trl.KTOConfig``: TRL 1.16's ``KTOConfig`` itself (every field, default and check), except where ``bf16``
is left unset: TRL then turns it on, which transformers refuses on a machine without a bf16 GPU ("Your setup doesn't
support bf16/gpu"), so TRL's own KTO quick start (``KTOConfig(output_dir=...)``) fails on a CPU. Here an unset
``bf16`` follows the machine: on where a CUDA device supports bf16, off elsewhere (lorarl trains in fp32 there). A
value set by hand is TRL's to check, as it is."""

from __future__ import annotations

import trl


def bf16_gpu() -> bool:
    """Whether this machine has a CUDA device that supports bf16."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


class KTOConfig(trl.KTOConfig):
    """TRL's ``KTOConfig``; an unset ``bf16`` is on only where a bf16 GPU is (module docstring)."""

    def __post_init__(self):
        if self.bf16 is None and not self.fp16 and not bf16_gpu():
            self.bf16 = False
        super().__post_init__()
