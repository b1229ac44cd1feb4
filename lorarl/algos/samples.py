"""A few of a step's completions as text, for ``DIR/completions.jsonl`` (``train.log_completions``, as TRL's
``log_completions``): the run loop writes what :func:`completion_samples` returns (:class:`lorarl.runstate.
CompletionsLog`), so a user (or the workbench's Watch tab) reads what the policy writes while it trains."""

from __future__ import annotations

import math

import torch

from lorarl.rewards.call_args import LOG_EXTRA_PREFIX, add_logged
from lorarl.rollout import Rollout


def _number(x: float) -> float | None:
    """A JSON-safe float: NaN / inf (a failed reward) become None."""
    x = float(x)
    return x if math.isfinite(x) else None


def row_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row: ``advantages`` ``[N]`` as is (GRPO), or the mean over each row's loss tokens of
    per-token advantages ``[N, T]`` (PPO: ``sum_t A_t m_t / max(sum_t m_t, 1)``), ``mask`` ``[N, T]``. Returns ``[N]``."""
    if advantages.dim() == 1:
        return advantages
    m = mask.to(advantages.dtype)
    return (advantages * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


def completion_samples(
    tokenizer,
    rollout: Rollout,
    rewards: torch.Tensor,
    advantages: torch.Tensor | None,
    n: int,
    columns: dict[str, list] | None = None,
    **extra: torch.Tensor,
) -> list[dict]:
    """The first ``n`` rows of ``rollout`` as ``{"prompt", "completion", "reward", "advantage", **extra,
    **columns}``.

    ``prompt``: the prompt tokens decoded as the model saw them (chat template included); ``completion``: the text
    the rewards scored (``rollout.completions``), or for a multi-turn trajectory (``rollout.model_mask`` set) every
    turn and tool message decoded with its special tokens, so the turns show. ``rewards`` ``[N]`` (NaN -> null),
    ``advantages`` ``[N]`` or None, ``extra``: more ``[N]`` columns (PPO's ``score_used``); ``columns``: what the
    reward functions logged with ``log_extra`` (``{column: N JSON values}``; a name the row has already goes under
    ``log_extra/<column>``, :func:`lorarl.rewards.call_args.add_logged`)."""
    rows = []
    multi_turn = rollout.model_mask is not None
    for i in range(min(n, len(rollout))):
        prompt = tokenizer.decode(rollout.prompt_ids[i][rollout.prompt_mask[i]].tolist(), skip_special_tokens=False)
        if multi_turn:
            ids = rollout.completion_ids[i][rollout.completion_mask[i]].tolist()
            completion = tokenizer.decode(ids, skip_special_tokens=False)
        else:
            completion = rollout.completions[i]
        row = {"prompt": prompt, "completion": completion, "reward": _number(rewards[i])}
        if advantages is not None:
            row["advantage"] = _number(advantages[i])
        row.update({k: _number(v[i]) for k, v in extra.items()})
        add_logged(row, {k: v[i] for k, v in (columns or {}).items()}, LOG_EXTRA_PREFIX)
        rows.append(row)
    return rows
