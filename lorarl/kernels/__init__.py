"""Hand-written GPU kernels, one per file, each with its reference (the slow, obvious torch version it must equal)
and the shapes it is tuned for; chosen at load, with a fallback that is always there.

* :mod:`lorarl.kernels.nf4_matmul`: ``x @ W^T`` on bitsandbytes' NF4 weights for 1-256 rows (Triton).
* :mod:`lorarl.kernels.lora_decode`: the fast engine's LoRA layer on it (``generation.nf4_kernel``).
"""
