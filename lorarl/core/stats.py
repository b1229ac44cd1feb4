"""Running statistics: means of (sum, count) pairs, the running moments of PPO's reward normalisation, the critic's
explained variance."""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import Tensor

from lorarl.core.ops import masked_var


class MeanAccumulator:
    """Named running sums and counts, divided once: ``add("kl", 3.0, 2)`` twice and ``means()["kl"]`` is
    ``6 / 4 = 1.5`` -- a mean over micro-batches of different sizes is the mean over all items, not a mean of means.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def means(self) -> dict[str, float]:
        return {k: (self.sums[k] / self.counts[k] if self.counts[k] else float("nan")) for k in self.sums}


def nan_std(x: Tensor) -> float:
    """The unbiased std of the non-NaN entries of ``x`` (TRL's ``reward_std``): ``sqrt(sum (x - mean)^2 / (n - 1))``;
    0 for fewer than two values.

    Example: ``[1, 3, nan]`` -> ``sqrt(2) = 1.4142``.
    """
    v = x[~x.isnan()].double()
    return float(v.std(unbiased=True)) if v.numel() > 1 else 0.0


def finite_mean(values: Iterable) -> float | None:
    """The mean of the finite floats among ``values`` (None when there is none): ``[1.0, nan, 3.0]`` -> 2.0."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


class RunningMoments:
    """Running mean and std of every score seen so far (Chan et al.'s parallel update), for reward normalisation.

    Example: ``m.update(tensor([1., 3.]))`` then ``m.update(tensor([5.]))`` -> ``mean 3``, ``std 2`` (unbiased).
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        b_mean, b_var = float(x.mean()), float(x.var(unbiased=False)) if n > 1 else 0.0
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * max(self.count - 1, 0) + b_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / max(total - 1, 1)
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def normalize(self, x: Tensor, eps: float = 1e-6) -> Tensor:
        return (x - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[returns - values] / Var[returns]`` over the valid tokens: 1 is a perfect critic, 0 no better than a
    constant, < 0 worse. NaN when the returns do not vary.

    Example: values ``[1, 2, 3]``, returns ``[1, 2, 4]`` -> ``1 - (1/3) / (7/3) = 0.857``.
    """
    var_ret = masked_var(returns, mask)
    if float(var_ret) == 0.0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_ret)
