"""How many positions of log-probs are computed at once (layer 0: pure arithmetic, read by the model's chunked
log-prob pass and by the memory planner, so both size a chunk of logits the same way)."""

from __future__ import annotations

__all__ = ["logit_chunk_positions"]


def logit_chunk_positions(rows: int, positions: int, chunk_size: int, chunk_tokens: int) -> int:
    """Positions per chunk of logits: ``c = max(1, min(chunk_size, positions, chunk_tokens // rows))``.

    A chunk holds the logits of ``rows x c`` tokens (``[rows, c, V]`` fp32), so ``chunk_size``
    (``model.logprob_chunk_size``) bounds the positions and ``chunk_tokens`` (``model.logprob_chunk_tokens``) the
    tokens whatever the number of rows: 64 scoring rows of a 1.5B model (V = 151,936) at 256 positions would hold
    9.96 GB of fp32 logits at once; at 2048 tokens a chunk holds 1.24 GB. At least one position per chunk, so a
    batch of more rows than ``chunk_tokens`` still runs (one position at a time).

    >>> logit_chunk_positions(8, 1024, 256, 2048), logit_chunk_positions(64, 1024, 256, 2048)
    (256, 32)
    >>> logit_chunk_positions(64, 16, 256, 2048), logit_chunk_positions(5000, 100, 256, 2048)
    (16, 1)
    """
    if rows < 1 or positions < 0 or chunk_size < 1 or chunk_tokens < 1:
        raise ValueError(f"rows {rows}, positions {positions}, chunk_size {chunk_size}, chunk_tokens {chunk_tokens}")
    return max(1, min(chunk_size, positions, chunk_tokens // rows))
