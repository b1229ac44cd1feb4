"""Scoring unpaired rows on the shared base for KTO: summed completion log-probs under a role (the matched rows and
the KL estimate's mismatched ones), the reference's log-probs, and TRL's KTO metrics.

A micro-batch of ``b`` rows is one :class:`~lorarl.algos.dpo_scoring.PairTokens` of ``b`` rows (DPO's token batch:
prompts left padded, completions right padded), scored by DPO's :func:`~lorarl.algos.dpo_scoring.response_logps`;
rows whose prompts tokenize identically (the two rows of an unpaired preference pair) share the prompt's forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorarl.algos.dpo_scoring import PairTokens, response_logps, token_rows
from lorarl.data.unpaired import UnpairedSet
from lorarl.model import SharedBase


def row_tokens(rows: UnpairedSet, idx: list[int], pad_id: int, completions: list[int] | None = None) -> PairTokens:
    """Rows ``idx`` of ``rows`` as a token batch: the prompt of ``idx[k]`` followed by the completion of
    ``completions[k]`` (default: its own; the KL estimate's mismatched pairs pass another row's). Rows whose prompts
    are the same tokens get the same ``prompt_index`` (the first such row's), so their prompt runs once.

    Example: idx ``[4, 7]``, completions ``[7, 4]`` -> prompt 4 + completion 7, prompt 7 + completion 4."""
    completions = idx if completions is None else completions
    prompts = [rows.prompt_ids[i] for i in idx]
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(p), i) for p, i in zip(prompts, idx)]
    return token_rows(prompts, [rows.completion_ids[j] for j in completions], index, pad_id)


def rows_logps(
    shared: SharedBase, rows: UnpairedSet, idx: list[int], max_tokens: int, completions: list[int] | None = None
) -> Tensor:
    """Under the ACTIVE role: ``log pi(y|x) [b]``, each row's summed completion log-probs (gradients when enabled),
    fp32, in ``idx``'s order (``completions``: see :func:`row_tokens`)."""
    return response_logps(shared, row_tokens(rows, idx, shared.pad_id, completions), max_tokens).logps


@torch.no_grad()
def role_rows_logps(
    shared: SharedBase,
    role: str,
    rows: UnpairedSet,
    idx: list[int],
    rows_per_forward: int,
    max_tokens: int = 0,
    completions: list[int] | None = None,
) -> Tensor:
    """Summed completion log-probs of ``idx`` (with ``completions``: the mismatched pairs) under ``role`` (dropout
    off, no gradients), ``rows_per_forward`` rows at a time, on the CPU -> ``[len(idx)]``."""
    completions = idx if completions is None else completions
    out = []
    with shared.role(role, train=False):
        for s in range(0, len(idx), rows_per_forward):
            part = slice(s, s + rows_per_forward)
            out.append(rows_logps(shared, rows, idx[part], max_tokens, completions[part]).cpu())
    return torch.cat(out)


def kto_stats(rewards: Tensor, logps: Tensor, desirable: Tensor) -> dict[str, tuple[float, float]]:
    """TRL's KTO metrics of ``b`` rows as ``{name: (sum, count)}`` (means once divided; summed over micro-batches
    they are means over the batch's rows of each kind): ``rewards/chosen`` / ``logps/chosen`` over the desirable
    rows, ``rewards/rejected`` / ``logps/rejected`` over the undesirable ones. A kind with no row in the batch has
    no entry (TRL logs none for it either).

    Example: rewards ``[1, -2, 3]``, desirable ``[T, F, T]`` -> ``rewards/chosen (4, 2)``, ``rewards/rejected (-2,
    1)``."""
    out: dict[str, tuple[float, float]] = {}
    for kind, mask in (("chosen", desirable), ("rejected", ~desirable)):
        n = int(mask.sum())
        if n:
            out[f"rewards/{kind}"] = (float(rewards[mask].sum()), float(n))
            out[f"logps/{kind}"] = (float(logps.detach()[mask].sum()), float(n))
    return out


def with_margin(metrics: dict) -> dict:
    """``metrics`` with ``rewards/margins`` = ``rewards/chosen - rewards/rejected`` when the batch had both kinds
    (TRL's)."""
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
