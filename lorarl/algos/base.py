"""What the run loop needs of an algorithm, and the set-up pieces every algorithm shares.

An algorithm (GRPO, PPO, the reward model, SFT, ...) is a plain class with this shape (:class:`Algorithm`):

* ``__init__(recipe, shared)``: the set-up -- its roles on the one base, its data, its optimizers;
* ``batch(step) -> Batch``: the data of step ``step``, derived from ``(seed, step)`` so a resumed run sees the same;
* ``step(batch) -> metrics``: one step of the algorithm, written top to bottom in numbered steps;
* ``state_dict()`` / ``load_state_dict()``: what a checkpoint must hold beyond adapters, optimizers and RNGs;
* ``evaluate() -> metrics``: the held-out evaluation the loop runs every ``eval.every`` steps (``eval/...``);
* ``finish(run_dir, history) -> summary``: the final adapters and the algorithm's part of the run summary.

:func:`lorarl.algos.loop.train` does the rest (run directory, seeds, resume, checkpoints, metrics, evaluation,
progress, plot), and benchmarks and tests call ``step`` directly: there is one copy of each step.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from lorarl.config import Recipe, TrainConfig
from lorarl.core.schedules import make_scheduler

if TYPE_CHECKING:
    from lorarl.update import NonFiniteGuard


class Algorithm(Protocol):
    """The shape the run loop drives (see the module docstring)."""

    name: ClassVar[str]
    plot_panels: ClassVar[tuple]
    roles: list[str]  # the adapters a checkpoint holds (trained ones and a refreshed reference)
    outputs: list[str]  # the adapters the run produces: saved at the end and in DIR/best (the first is watched)
    final_eval: ClassVar[bool]  # evaluate at the last step even when eval.every is 0 (a class attribute: the
    #                            workbench reads it to say what eval.every 0 means)
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]
    total_steps: int  # steps of the run (train.steps, or fewer when an epoch limit comes first)
    last_step: int  # the step this run stops after (the loop sets it: --max-steps may stop it early)

    def batch(self, step: int) -> Any: ...

    def step(self, batch: Any) -> dict[str, Any]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def evaluate(self) -> dict: ...

    def finish(self, run_dir, history: list[dict]) -> dict: ...


class GuardState:
    """``state_dict`` / ``load_state_dict`` of an algorithm whose only state beyond adapters, optimizers and RNGs is
    its non-finite-update guard ``self.guard`` (:class:`lorarl.update.NonFiniteGuard`: the updates skipped in a
    row, so a resumed run stops where the uninterrupted one would). The checkpoint holds ``{"guard": ...}``."""

    guard: NonFiniteGuard

    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])


@dataclass
class TrainedRole:
    """One trained adapter (and head): exactly its parameters, its AdamW and its LR schedule, and the loss scaler
    when the base computes in fp16 (:func:`lorarl.update.loss_scaler`; None otherwise)."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None = None


def trained_role(shared, role: str, tcfg: TrainConfig, total_steps: int, lr: float | None = None) -> TrainedRole:
    """AdamW over ``role``'s adapter + head (``lr`` or ``train.learning_rate``) with ``train.lr_scheduler``, whose
    schedule spans ``total_steps`` RL steps (warm-up ``train.warmup_steps`` of them): the algorithm advances it
    once per step (:func:`lorarl.core.schedules.advance`), so every update of a step uses that step's LR whatever
    happened to the step's updates (PPO's early stop, skipped non-finite updates)."""
    from lorarl.model.precision import base_compute_dtype
    from lorarl.update import attach_loss_scaler, loss_scaler

    params = shared.trainable_parameters(role)
    opt = torch.optim.AdamW(params, lr=lr or tcfg.learning_rate, weight_decay=tcfg.weight_decay)
    sched = make_scheduler(opt, tcfg.lr_scheduler, tcfg.warmup_steps, total_steps)
    scaler = loss_scaler(base_compute_dtype(shared.base), shared.device.type)
    if scaler is not None:
        attach_loss_scaler(opt, scaler)
    return TrainedRole(params, opt, sched, scaler)


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of step ``step``: sampling is reproducible per step, so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def batch_indices(n_rows: int, per_step: int, seed: int, step: int) -> list[int]:
    """Rows of step ``step`` (1-based): consecutive slices of a per-epoch shuffle seeded by ``(seed, epoch)``.

    Example: 4 rows, 3 per step -> step 1 takes 3 rows of epoch 0's order, step 2 its last row and 2 of epoch 1's.
    """
    out: list[int] = []
    pos = (step - 1) * per_step
    while len(out) < per_step:
        epoch, offset = divmod(pos, n_rows)
        order = list(range(n_rows))
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
        take = min(per_step - len(out), n_rows - offset)
        out.extend(order[offset : offset + take])
        pos += take
    return out


def micro_batch_rows(value: int | str, n: int, planned: int | None = None) -> int:
    """Rows per forward/backward: an int as is; ``auto``: the memory planner's pick (``planned``) or else 16,
    never more than the ``n`` rows to split."""
    if value == "auto":
        return max(1, min(n, planned or 16))
    return int(value)


def planned_micro_batch(recipe: Recipe, device_type: str) -> int | None:
    """The planner's micro-batch for ``train.micro_batch_size: auto`` (None when a number is given)."""
    if recipe.train.micro_batch_size != "auto":
        return None
    from lorarl.plan import resolve_micro_batch

    return resolve_micro_batch(recipe, device_type=device_type)


def rollout_batch(recipe: Recipe, device_type: str) -> int | None:
    """Rows a training rollout decodes and scores at once (``generation.batch_size``; None: all of the step's rows),
    :func:`lorarl.plan.recipes.resolve_generation_batch`. When ``auto`` splits the step (CUDA, the rollout would
    not fit the card in one batch) one line on stderr says so."""
    from lorarl.plan.recipes import resolve_generation_batch

    batch = resolve_generation_batch(recipe, device_type)
    if batch is not None and recipe.generation.batch_size == "auto":
        print(
            f"generation.batch_size auto -> {batch}: each rollout decodes and scores {batch} rows at a time (all of "
            "the step's rows at once would not fit the card; `lorarl plan` shows the phases)",
            file=sys.stderr,
        )
    return batch


def load_train_prompts(recipe: Recipe, tokenizer):
    """The training prompts; skipped bad rows (``data.on_bad_row: skip``) are reported on stderr."""
    from lorarl.data import load_prompts

    prompts = load_prompts(recipe.data, tokenizer, "train", recipe_path=recipe.source_path)
    for i, why in prompts.skipped[:5]:
        print(f"data: skipped row {i}: {why}", file=sys.stderr)
    if prompts.skipped:
        print(
            f"data: skipped {len(prompts.skipped)} bad rows of {prompts.source} (data.on_bad_row: skip)",
            file=sys.stderr,
        )
    return prompts


def tail_mean(history: Sequence[dict], key: str, k: int = 10, head: bool = False) -> float | None:
    """Mean of the finite values of ``key`` over the last (``head``: first) ``k`` rows of ``history``."""
    rows = history[:k] if head else history[-k:]
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def evaluate_policy(algo, role: str = "policy") -> dict:
    """A policy algorithm's held-out evaluation during training: greedy, scored like training, ``eval/``-prefixed
    (:func:`lorarl.evaluate.evaluate_role`)."""
    from lorarl.evaluate import evaluate_role

    out = evaluate_role(algo.shared, algo.recipe, role, algo.recipe.eval.n, source=getattr(algo, "source", None))
    return {f"eval/{training_name(k)}": v for k, v in out.items() if isinstance(v, (int, float)) or v is None}


def training_name(key: str) -> str:
    """A ``lorarl eval`` key under the name the same quantity has in the training metrics: ``reward_mean`` ->
    ``reward``, ``reward/numeric_match`` -> ``rewards/numeric_match/mean`` (TRL's names; docs/metrics.md)."""
    if key.startswith("reward/"):
        return f"rewards/{key[len('reward/') :]}/mean"
    return TRAINING_NAMES.get(key, key)


# `lorarl eval`'s keys -> the names the same quantities have in the training metrics (TRL's; docs/metrics.md)
TRAINING_NAMES = {
    "reward_mean": "reward",
    "completion_len": "completions/mean_length",
    "truncated_frac": "completions/clipped_ratio",
}
