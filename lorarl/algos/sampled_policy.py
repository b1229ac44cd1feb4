"""What the algorithms that sample groups of completions and train one policy adapter on them share (GRPO, RLOO):
the set-up on the shared base, the update loop of a step, the step's common metrics, its progress line, the
checkpointed state and the run summary. Plain functions over the algorithm object (no base class): each algorithm
keeps its own numbered ``step`` and calls these where its steps are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lorarl.agents.step import make_step_rollout
from lorarl.algos.base import (
    load_train_prompts,
    micro_batch_rows,
    planned_micro_batch,
    rollout_batch,
    tail_mean,
    trained_role,
)
from lorarl.core.stats import nan_std
from lorarl.health import parity_tolerance
from lorarl.phases import phase
from lorarl.rewards.source import reward_source
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step_halving

POLICY = "policy"


def setup_sampled_policy(algo, group_size: int) -> None:
    """The set-up after the roles (``algo.recipe``, ``algo.shared`` set): the training prompts, the rollout function
    (single- or multi-turn, :func:`lorarl.agents.step.make_step_rollout`), the reward scorer
    (:func:`lorarl.rewards.source.reward_source`, ``group_size`` completions per prompt), the policy's AdamW and LR
    schedule over ``train.steps``, the non-finite-update guard and the parity tolerance, as attributes of ``algo``."""
    recipe, shared, tcfg = algo.recipe, algo.shared, algo.recipe.train
    algo.planned_mbs = planned_micro_batch(recipe, shared.device.type)
    algo.prompts = load_train_prompts(recipe, shared.tokenizer)
    algo.rollout_fn = make_step_rollout(recipe, shared, algo.prompts, rollout_batch(recipe, shared.device.type))
    algo.source = reward_source(
        recipe, shared, micro_batch_rows(recipe.eval.batch_size, tcfg.prompts_per_step * group_size)
    )
    algo.total_steps = algo.last_step = tcfg.steps
    algo.policy = trained_role(shared, POLICY, tcfg, tcfg.steps)
    algo.optimizers = {POLICY: algo.policy.optimizer}
    algo.schedulers = {POLICY: algo.policy.scheduler}
    algo.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
    algo.micro_batch_cap = None  # lowered for good after an out-of-memory halving
    algo.parity_tolerance = parity_tolerance(recipe, shared.device.type)
    algo.samples = []  # the last step's logged completions (lorarl.algos.samples)


def update_policy(
    algo, rows: torch.Tensor, loss_fn: Callable, iterations: int, step: int, before_each: Callable | None = None
) -> dict[str, float]:
    """``iterations`` optimizer steps of ``algo``'s policy on the rollout rows ``rows`` (none: no update), each over
    micro-batches of ``train.micro_batch_size`` rows (``auto``: the planner's) with gradient accumulation;
    ``loss_fn(micro-batch rows) -> (loss, {stat: (sum, count)})`` returns each micro-batch's share of the step's
    loss. A CUDA out-of-memory in a micro-batch halves the micro-batch for the rest of the run and redoes the
    update; a non-finite loss or gradient skips it (``algo.guard``). ``before_each`` runs before each iteration.
    Returns the last update's stats with ``loss``, ``grad_norm`` and ``lr`` ({} without an update)."""
    from tqdm.auto import tqdm

    tcfg = algo.recipe.train
    mbs = micro_batch_rows(tcfg.micro_batch_size, max(len(rows), 1), algo.planned_mbs)
    stats: dict[str, float] = {}
    # backward runs inside the policy role in train mode: activation checkpointing recomputes the forward
    # there, and must see the same adapter and mode (dropout) as the forward did
    with phase("training"), algo.shared.role(POLICY, train=True):
        for _ in range(iterations if len(rows) else 0):  # no rows: nothing to learn
            if before_each is not None:
                before_each()
            result, mbs = optimizer_step_halving(
                algo.policy.params,
                algo.policy.optimizer,
                lambda size: (rows[s] for s in micro_batches(len(rows), size)),
                min(mbs, algo.micro_batch_cap or mbs),
                loss_fn,
                max_grad_norm=tcfg.max_grad_norm,
                scaler=algo.policy.scaler,
                on_halve=lambda a, b: tqdm.write(f"step {step}: out of memory at micro-batch {a}, retrying with {b}"),
            )
            algo.micro_batch_cap = mbs
            algo.guard.check(result, step)
            stats = dict(result.stats, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr)
    return stats


def sampled_metrics(algo, rollout, scored, trained_rows: int, lr: float, update_stats: dict) -> dict:
    """The metrics every sampled step logs (TRL's names where TRL has them, docs/metrics.md): the rewards
    (``scored``, NaN where no function had a value), the task's accuracy, the completions' lengths, the update's
    loss, gradient norm, entropy and approximate KL (``update_stats`` of :func:`update_policy`; None without an
    update), the step's learning rate ``lr``, the rows trained, the reward failures (calls, values) and skipped
    updates so far, the fp16 loss scale."""
    from lorarl.tasks import accuracy

    lengths = rollout.lengths.float()
    valid = ~torch.isnan(scored.total)
    return {
        "reward": float(torch.nanmean(scored.total)) if valid.any() else float("nan"),
        "reward_std": nan_std(scored.total),
        **scored.means(),
        "accuracy": accuracy(algo.recipe, rollout.completions, algo.prompts.columns(rollout.prompt_index)),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(rollout.truncated.float().mean()),
        "approx_kl": update_stats.get("approx_kl"),
        "entropy": update_stats.get("entropy"),
        "loss": update_stats.get("loss"),
        "grad_norm": update_stats.get("grad_norm"),
        "learning_rate": lr,
        "trained_rows": int(trained_rows),
        "reward_failures": algo.source.failures,
        "reward_failed_values": algo.source.failed_values,
        "skipped_updates": algo.guard.skipped,
        **algo.guard.loss_scale_metrics(),  # fp16 bases only
        "tokens": float(lengths.sum()),
    }


def policy_progress(row: dict) -> dict:
    """The progress bar's fields of a step's metrics row: reward, accuracy, mean completion length."""
    acc = row.get("accuracy")
    return {
        "reward": f"{row['reward']:.3f}",
        "acc": f"{acc:.2f}" if acc is not None else "-",
        "len": f"{row['completions/mean_length']:.0f}",
    }


def policy_state(algo) -> dict:
    """What a checkpoint holds beyond adapters, optimizers and RNGs: the guard's counters, the reward scorer's
    failure counts and the micro-batch cap (a resumed run stops and halves where an uninterrupted one would)."""
    return {
        "guard": algo.guard.state_dict(),
        "rewards": algo.source.state_dict(),
        "micro_batch_cap": algo.micro_batch_cap,
    }


def load_policy_state(algo, state: dict) -> None:
    algo.guard.load_state_dict(state["guard"])
    algo.source.load_state_dict(state["rewards"])
    algo.micro_batch_cap = state["micro_batch_cap"]


def policy_summary(algo, run_dir, history: list[dict]) -> dict:
    """The policy adapter in PEFT format at ``run_dir/policy``; the run summary's fields."""
    algo.shared.save_adapter(POLICY, run_dir / POLICY)
    return {
        "policy": str(run_dir / POLICY),
        "reward_last10": tail_mean(history, "reward"),
        "accuracy_last10": tail_mean(history, "accuracy"),
        "skipped_updates": algo.guard.skipped,
        "reward_failures": algo.source.failures,
        "data_rows": len(algo.prompts),
        "data_skipped_rows": len(algo.prompts.skipped),
    }
