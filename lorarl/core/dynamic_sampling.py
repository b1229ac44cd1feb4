"""DAPO's dynamic sampling, as bookkeeping (layer 0: torch + stdlib only, no I/O).

Yu et al. 2025 (DAPO, Sec. 3.2, "Dynamic Sampling"): a group whose rewards are all equal has zero advantage for
every completion, so it adds nothing to the policy gradient but still dilutes the batch. Such groups are dropped
and more prompts are sampled until the batch holds the requested number of informative groups, or a maximum number
of generation rounds has run (then the step trains on what it kept).

* :func:`informative_groups` -- which groups of a reward table carry a learning signal;
* :class:`GroupTally` and :func:`take_groups` -- what each round keeps, and the step's counts.

NaN marks a failed reward (left out of its group's statistics, as :func:`lorarl.core.advantages.group_advantages`
does). "All equal" is read over the valid rewards: a group is informative when at least two of its valid rewards
differ, so ``[1, NaN, 1, 1]`` (one failure, the rest equal) and ``[NaN, NaN, NaN, NaN]`` (all failed) are dropped,
``[1, NaN, 0, NaN]`` is kept -- exactly the groups ``group_advantages`` gives a non-zero advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["informative_groups", "GroupTally", "take_groups"]


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[M]`` bool, True where group ``g`` (rows ``[g*G, (g+1)*G)`` of ``rewards`` ``[N]``, ``M = N / G``) has two
    valid (non-NaN) rewards that differ: ``max_valid(r_g) > min_valid(r_g)``.

    Example: rewards ``[1, 0, 1, 1,  1, 1, 1, 1,  NaN, 2, NaN, 2,  NaN, 0, NaN, 1]``, ``G = 4`` ->
    ``[True, False, False, True]``.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be [N] with N a multiple of group_size {group_size}, got {tuple(rewards.shape)}"
        )
    r = rewards.detach().to(torch.float64).reshape(-1, group_size)  # [M, G]
    valid = ~torch.isnan(r)
    hi = torch.where(valid, r, torch.tensor(float("-inf"), dtype=r.dtype)).amax(dim=1)  # [M]
    lo = torch.where(valid, r, torch.tensor(float("inf"), dtype=r.dtype)).amin(dim=1)  # [M]
    return hi > lo  # False for groups with 0 or 1 valid reward (inf > -inf is False only when both are absent)


@dataclass
class GroupTally:
    """One step's dynamic-sampling counts: groups ``drawn`` (sampled, all rounds), ``dropped`` (no reward spread),
    ``kept`` (trained on), ``surplus`` (informative but beyond the requested number, left out), ``rounds`` (generation
    rounds run). ``drawn = dropped + kept + surplus``."""

    drawn: int = 0
    dropped: int = 0
    kept: int = 0
    surplus: int = 0
    rounds: int = 0

    def short(self, need: int) -> int:
        """How many groups the step lacks of ``need`` (0 when the batch is full)."""
        return max(need - self.kept, 0)


def take_groups(informative: Tensor, need: int, tally: GroupTally) -> list[int]:
    """One generation round: the indices of the informative groups of this round (``informative`` ``[M]`` bool,
    in draw order) that the batch still needs (``need`` minus ``tally.kept``), first come first kept; updates
    ``tally`` (``rounds`` +1, ``drawn`` +M, ``dropped`` + uninformative, ``kept`` + taken, ``surplus`` + the rest).

    Example: need 3, round 1 ``[T, F, T, F]`` -> ``[0, 2]`` (kept 2, dropped 2); round 2 ``[F, T, T, T]`` -> ``[1]``
    (kept 3, dropped 3, surplus 2, drawn 8, rounds 2).
    """
    flags = [bool(x) for x in informative.tolist()]
    room = max(need - tally.kept, 0)
    good = [g for g, ok in enumerate(flags) if ok]
    taken = good[:room]
    tally.rounds += 1
    tally.drawn += len(flags)
    tally.dropped += len(flags) - len(good)
    tally.kept += len(taken)
    tally.surplus += len(good) - len(taken)
    return taken
