"""GRPO's dynamic sampling (DAPO, Yu et al. 2025, Sec. 3.2): the extra prompts of a step, and the rows of several
generation rounds joined into one batch. The bookkeeping (which groups are informative, what a round keeps) is the
pure :mod:`lorarl.core.dynamic_sampling`; :meth:`lorarl.algos.grpo.GRPO.fill_groups` drives the rounds.

Reproducible by construction: round 0 is the step's usual batch (``batch_indices(seed, step)``); round ``r >= 1``
draws its prompts from ``(seed, step, r)`` alone (:func:`round_prompts`), and the run loop seeds the sampler from
``(seed, step)`` before the step, so a resumed run draws and samples exactly what an uninterrupted one did.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from torch import Tensor

from lorarl.rollout import Rollout


def round_prompts(n_rows: int, per_step: int, seed: int, step: int, round_: int, exclude: set[int]) -> list[int]:
    """Prompt rows of dynamic-sampling round ``round_`` (>= 1) of step ``step``: ``per_step`` rows drawn without
    replacement by ``random.Random(f"{seed}:dynamic:{step}:{round_}")``, rows of ``exclude`` (already drawn this
    step) left out while enough others remain.

    Example: 10 rows, 3 per round -> the same 3 rows for the same ``(seed, step, round_)``, none of ``exclude``.
    """
    rng = random.Random(f"{seed}:dynamic:{step}:{round_}")
    order = list(range(n_rows))
    rng.shuffle(order)
    fresh = [i for i in order if i not in exclude]
    return (fresh + [i for i in order if i in exclude])[: min(per_step, n_rows)]


def _pad(x: Tensor, width: int, value, left: bool) -> Tensor:
    """``x`` ``[n, w]`` padded to ``[n, width]`` with ``value`` on the left or the right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    fill = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


def join_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rows of ``parts`` (each grouped, the same ``group_size``) as one Rollout, in order. Prompt columns
    (``prompt_*`` fields) are left padded to the widest prompt, every other ``[n, T]`` field right padded to the
    longest completion: ids with ``pad_id``, masks with False, log-probs with 0 (outside the masks, never read).

    Example: rows with prompts of 3 and 5 tokens and completions of 4 and 2 -> ``prompt_ids [n, 5]``,
    ``completion_ids [n, 4]``.
    """
    if len(parts) == 1:
        return parts[0]
    out = {}
    for f in dataclasses.fields(Rollout):
        values = [getattr(p, f.name) for p in parts]
        first = values[0]
        if isinstance(first, Tensor):
            if any(v is None for v in values):
                raise ValueError(f"rollout field {f.name} is recorded in some rounds only")
            if first.dim() == 2:
                width = max(v.shape[1] for v in values)
                value = pad_id if not first.dtype.is_floating_point and first.dtype != torch.bool else 0
                value = False if first.dtype == torch.bool else value
                left = f.name.startswith("prompt_")
                out[f.name] = torch.cat([_pad(v, width, value, left) for v in values])
            else:
                out[f.name] = torch.cat(values)
        elif isinstance(first, list):
            out[f.name] = [x for v in values for x in v]
        else:
            if any(v != first for v in values):
                raise ValueError(f"rollout field {f.name} differs between rounds")
            out[f.name] = first
    return Rollout(**out)


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """Row indices of ``groups`` (group ``g`` = rows ``[g*G, (g+1)*G)``). Example: groups ``[0, 2]``, ``G = 2`` ->
    ``[0, 1, 4, 5]``."""
    return [g * group_size + j for g in groups for j in range(group_size)]


def select_columns(columns: list[dict[str, list]], rows: list[list[int]]) -> dict[str, list]:
    """The rows ``rows[k]`` of round ``k``'s ``log_extra`` columns (``{column: values}``), joined in order; a column
    a round did not log is None on its rows. Example: ``[{"a": [1, 2]}, {}]``, rows ``[[1], [0]]`` ->
    ``{"a": [2, None]}``."""
    names = list(dict.fromkeys(name for c in columns for name in c))
    return {name: [c[name][i] if name in c else None for c, r in zip(columns, rows) for i in r] for name in names}


def select_scores(parts: list, rows: list[list[int]]):
    """The rows ``rows[k]`` of round ``k``'s :class:`~lorarl.rewards.source.SourceScores`, joined in order, with
    their ``log_extra`` columns. Failures of every round are kept (later rounds' messages win on the same function);
    other per-batch fields of the rule scores (``extra``, ``logged``) are the first round's."""
    idx = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    total = torch.cat([p.total[i] for p, i in zip(parts, idx)])
    rm = None if parts[0].reward_model is None else torch.cat([p.reward_model[i] for p, i in zip(parts, idx)])
    rules = parts[0].rules
    if rules is not None:
        failures = {}
        for p in parts:
            failures.update(p.rules.failures)
        rules = dataclasses.replace(
            rules,
            per_function=torch.cat([p.rules.per_function[i] for p, i in zip(parts, idx)]),
            total=torch.cat([p.rules.total[i] for p, i in zip(parts, idx)]),
            failures=failures,
            columns=select_columns([p.rules.columns for p in parts], rows),
        )
    return dataclasses.replace(parts[0], total=total, reward_model=rm, rules=rules)


def dynamic_sampling_metrics(tally, need: int, drawn_rewards: list[Tensor]) -> dict[str, float]:
    """The step's ``dynamic_sampling/*`` metrics (docs/metrics.md): groups drawn, dropped (no reward spread), kept,
    surplus, generation rounds, groups short of ``need`` (the step trained on fewer), and the mean reward of every
    completion drawn (``reward`` is the mean over the kept groups, the ones trained on)."""
    r = torch.cat(drawn_rewards) if drawn_rewards else torch.empty(0)
    valid = ~torch.isnan(r)
    return {
        "dynamic_sampling/groups_drawn": tally.drawn,
        "dynamic_sampling/groups_dropped": tally.dropped,
        "dynamic_sampling/groups_kept": tally.kept,
        "dynamic_sampling/groups_surplus": tally.surplus,
        "dynamic_sampling/rounds": tally.rounds,
        "dynamic_sampling/groups_short": tally.short(need),
        "dynamic_sampling/reward_drawn": float(r[valid].mean()) if valid.any() else float("nan"),
    }
