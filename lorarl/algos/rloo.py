"""RLOO on one shared base, as TRL 1.16's ``RLOOTrainer``: the policy is a LoRA adapter, the reference is the base
with adapters disabled (or a frozen ``reference`` adapter), the old policy is the log-probs recorded at rollout.

Read :meth:`RLOO.step` top to bottom; its steps are numbered (the run loop, :mod:`lorarl.algos.loop`, does the rest):

1. a batch of prompts (derived from ``(seed, step)``, so a resumed run sees the same data);
2. a rollout: ``group_size`` completions per prompt in one batched ``generate`` (GRPO's rollout function,
   :func:`lorarl.agents.step.make_step_rollout`), masks from generation; the policy's log-probs of its samples and the
   reference's when the KL penalty is on (``rloo.kl.coef > 0``), the policy's also when ``num_iterations > 1``;
3. rewards: the recipe's reward functions through GRPO's scorer (:func:`lorarl.rewards.source.reward_source`), each
   failure isolated and counted;
4. the reward RLOO's baseline reads: clipped to ``reward_clip_range``, minus ``kl.coef`` x the sequence's summed
   log-ratio of the sampling policy to the reference (TRL's convention: the KL is a reward penalty, never a loss term);
   then each completion's advantage over the mean of its group's other rewards (leave-one-out), normalised over the
   step when ``normalize_advantages`` (:mod:`lorarl.core.rloo`);
5. the loss: PPO's clipped surrogate on each whole sequence's probability ratio ``pi_theta(o) / pi_old(o)``, one
   loss per sequence, their mean over the step's rows;
6. ``num_iterations`` optimizer steps on the rollout, each over micro-batches with gradient accumulation;
7. the reference adapter is refreshed to the policy every ``kl.ref_refresh_every`` steps (TRL's ``sync_ref_model``
   with ``ref_model_mixup_alpha`` 1);
8. metrics under TRL's names; at the end (:meth:`RLOO.finish`) the policy adapter in PEFT format.

References: Ahmadian et al. 2024 ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs"); Kool et al. 2019 ("Buy 4 REINFORCE Samples, Get a Baseline for Free!"). docs/rloo.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lorarl.algos.base import batch_indices, evaluate_policy
from lorarl.algos.grpo import setup_roles
from lorarl.algos.sampled_policy import (
    POLICY,
    load_policy_state,
    policy_progress,
    policy_state,
    policy_summary,
    sampled_metrics,
    setup_sampled_policy,
    update_policy,
)
from lorarl.algos.samples import completion_samples
from lorarl.config import Recipe
from lorarl.config.algorithms import RLOOConfig
from lorarl.core.ops import masked_mean
from lorarl.core.rloo import leave_one_out_advantages, rloo_sequence_loss, sequence_kl, shaped_rewards
from lorarl.core.schedules import advance
from lorarl.health import parity_due, parity_metrics
from lorarl.metrics import PLOT_PANELS
from lorarl.model import REFERENCE, SharedBase, completion_logprobs
from lorarl.rewards.source import SourceScores
from lorarl.rollout import Rollout

# the loss's per-sequence stats (means over sequences, as TRL's clip_ratio/*) and their TRL metric names
SEQUENCE_STATS = {
    "clip_frac_low": "clip_ratio/low_mean",
    "clip_frac_high": "clip_ratio/high_mean",
    "clip_frac_region": "clip_ratio/region_mean",
}


@dataclass
class RLOOBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the training prompt set."""

    step: int
    prompt_index: list[int]


def rloo_advantages(
    rewards: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    cfg: RLOOConfig,
) -> tuple[torch.Tensor, float | None]:
    """Step 4: the advantages ``[N]`` of the step's rewards ``[N]`` (NaN: no value) and TRL's ``kl`` metric.

    The reward is clipped to ``cfg.reward_clip_range``, then ``cfg.kl.coef`` x the sequence's summed log-ratio of the
    sampling policy to the reference over ``loss_mask`` is subtracted (:func:`~lorarl.core.rloo.sequence_kl`,
    :func:`~lorarl.core.rloo.shaped_rewards`; ``ref_logprobs`` None: no penalty), and each completion's advantage is
    its reward minus the mean of its group's others, normalised when ``cfg.normalize_advantages``
    (:func:`~lorarl.core.rloo.leave_one_out_advantages`). ``kl`` is the per-token mean of ``old - ref`` over the loss
    tokens (None without a reference), as TRL logs it. ``old_logprobs``, ``ref_logprobs``, ``loss_mask`` ``[N, T]``.
    """
    kl = kl_mean = None
    if ref_logprobs is not None:
        kl = sequence_kl(old_logprobs, ref_logprobs, loss_mask)  # [N]
        kl_mean = float(masked_mean(old_logprobs - ref_logprobs, loss_mask))
    shaped = shaped_rewards(rewards, kl, cfg.kl.coef, cfg.reward_clip_range)  # [N]
    return leave_one_out_advantages(shaped, cfg.group_size, cfg.normalize_advantages).advantages, kl_mean


def rloo_loss(
    rows: torch.Tensor,
    *,
    shared: SharedBase,
    rollout: Rollout,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: RLOOConfig,
    temperature: float,
    total_rows: int,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Step 5: a micro-batch's share of the step's loss ``(1/N) sum_i loss_i`` over the step's ``N = total_rows``
    rows (:func:`~lorarl.core.rloo.rloo_sequence_loss`), so the micro-batch losses sum to the step's.

    ``rows``: the micro-batch, ``B`` row indices into ``rollout``; ``advantages`` ``[N]``; ``loss_mask`` ``[N, T]``.
    With ``num_iterations == 1`` the old policy IS the current one: its detached log-probs are used (ratio exactly
    1, the gradient is REINFORCE's; TRL divides by the log-probs of a separate no-grad pass, equal up to rounding
    without dropout). The entropy is logged (TRL's ``entropy``), never trained on. Returns ``(loss, {stat: (sum,
    count)})``: the clip stats over sequences, ``approx_kl`` and ``entropy`` over tokens.
    """
    mb = rollout.select(rows)
    mask = loss_mask[rows].to(shared.device)  # [B, T]
    with shared.role(POLICY, train=True):
        logprobs, ent = completion_logprobs(shared, mb, temperature, with_entropy=True, entropy_grad=False)  # [B, T]
    old = mb.old_logprobs.to(shared.device) if cfg.num_iterations > 1 else logprobs.detach()  # [B, T]
    loss, st = rloo_sequence_loss(
        logprobs, old, advantages[rows].to(shared.device), mask, cfg.clip_eps_low, cfg.clip_eps_high
    )  # [B]
    n_seq, n_tok = float(len(rows)), float(mask.sum())
    stats = {k: (float(st[k]) * n_seq, n_seq) for k in (*SEQUENCE_STATS, "ratio_mean")}
    stats["approx_kl"] = (float(st["approx_kl"]) * n_tok, n_tok)
    stats["entropy"] = (float(ent.detach()[mask.bool()].sum()), n_tok)
    return loss.sum() / total_rows, stats


class RLOO:
    """RLOO on the shared base: set up the roles, the prompts, the rewards and the policy's optimizer; then
    :meth:`step` per batch. Used by the run loop and the tests alike."""

    name = "rloo"
    final_eval = False  # held-out accuracy only every eval.every steps (lorarl eval after the run)
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg = recipe.rloo
        self.has_ref_adapter = setup_roles(shared, recipe, cfg.kl, "rloo")
        self.reference = REFERENCE if cfg.kl.coef > 0 else None  # None: the reference never runs
        self.roles = [POLICY] + ([REFERENCE] if self.has_ref_adapter else [])
        self.outputs = [POLICY]
        setup_sampled_policy(self, cfg.group_size)  # GRPO's: prompts, rollout, rewards, optimizer, guard

    def batch(self, step: int) -> RLOOBatch:
        """1. A batch of prompts, derived from ``(seed, step)``."""
        tcfg = self.recipe.train
        return RLOOBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def sample(self, batch: RLOOBatch, record_sampler: bool) -> tuple[Rollout, SourceScores]:
        """Steps 2-3: G completions per prompt with the log-probs the step needs, and their rewards."""
        cfg = self.recipe.rloo
        sampled = self.rollout_fn(
            batch.prompt_index,
            group_size=cfg.group_size,
            role=POLICY,
            record_old=cfg.num_iterations > 1 or cfg.kl.coef > 0,  # the ratio's pi_old; the KL's sampling policy
            reference=self.reference,
            record_sampler=record_sampler,
        )
        scored = sampled.score(self.source, self.prompts, batch.step)  # GRPO's scorer, TRL's reward arguments
        self.source.report_failures(scored, batch.step, self.recipe.reward.max_failure_fraction, "left out")
        self.source.end_step(batch.step)  # a reward function without a value in max_failed_steps steps stops the run
        return sampled.rollout, scored

    def step(self, batch: RLOOBatch) -> dict:
        """One RLOO step on ``batch``; returns its metrics."""
        shared, cfg, gen, tcfg = self.shared, self.recipe.rloo, self.recipe.generation, self.recipe.train
        step = batch.step

        # 2-3. Rollout and rewards; on parity steps the sampler's log-probs against the trainer's (lorarl.health) --
        parity_step = parity_due(self.recipe.health.parity_every, step)
        rollout, scored = self.sample(batch, record_sampler=parity_step)
        health = {}
        if parity_step:
            health = parity_metrics(shared, rollout, POLICY, gen.temperature, self.recipe.health.parity_rows)
            health["health/parity_tolerance"] = self.parity_tolerance
        loss_mask = rollout.loss_mask.clone()  # [N, T] the model's own tokens
        if cfg.mask_truncated:
            loss_mask &= ~rollout.truncated[:, None]  # TRL's mask_truncated_completions: no loss, no KL

        # 4. Shaped rewards (clip, then the KL penalty of the sampling policy to the reference), leave-one-out -----
        ref = rollout.ref_logprobs if self.reference is not None else None
        advantages, kl_mean = rloo_advantages(scored.total, rollout.old_logprobs, ref, loss_mask, cfg)  # [N]

        # 5. The loss on a micro-batch, as its share of the step's mean over sequences ---------------------------
        # Rows whose loss has a 0 gradient need no forward pass: no loss token, or a zero advantage (no KL or
        # entropy term is in RLOO's loss). They still count in the mean's N = every row, as TRL's.
        rows = (loss_mask.any(dim=1) & (advantages != 0)).nonzero().squeeze(1)  # [n_active]
        loss_fn = functools.partial(
            rloo_loss,
            shared=shared,
            rollout=rollout,
            advantages=advantages,
            loss_mask=loss_mask,
            cfg=cfg,
            temperature=gen.temperature,
            total_rows=len(rollout),
        )

        # 6. num_iterations optimizer steps, each over micro-batches with gradient accumulation ---------------
        update_stats = update_policy(self, rows, loss_fn, cfg.num_iterations, step)

        lr = self.policy.optimizer.param_groups[0]["lr"]  # what this step's updates used
        advance(self.policy.scheduler)  # the LR schedule advances once per RL step

        # 7. TRL's sync_ref_model (alpha 1): the reference adapter becomes the current policy --------------------
        if self.has_ref_adapter and cfg.kl.ref_refresh_every > 0 and step % cfg.kl.ref_refresh_every == 0:
            shared.copy_adapter(POLICY, REFERENCE)

        # 8. Metrics (TRL's names); the first train.log_completions rows as text ---------------------------------
        self.samples = completion_samples(
            shared.tokenizer, rollout, scored.total, advantages, tcfg.log_completions, columns=scored.columns
        )
        task = shaped_rewards(scored.total, clip_range=cfg.reward_clip_range)  # [N] before the KL penalty
        zero_std = leave_one_out_advantages(task, cfg.group_size).zero_std  # [N/G] (health's no-signal check)
        row = {
            **sampled_metrics(self, rollout, scored, len(rows), lr, update_stats),  # GRPO's: reward, loss, ...
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "kl": kl_mean,  # per token, over the loss tokens (TRL's); None without a reference
            **{name: update_stats.get(k) for k, name in SEQUENCE_STATS.items()},
            **health,
        }
        return self.source.with_logged(row)  # + what the reward functions logged with log_metric

    def evaluate(self) -> dict:
        return evaluate_policy(self)

    def progress(self, row: dict) -> dict:
        return policy_progress(row)

    def state_dict(self) -> dict:
        return policy_state(self)

    def load_state_dict(self, state: dict) -> None:
        load_policy_state(self, state)

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter in PEFT format at ``run_dir/policy``; the summary's RLOO fields."""
        return policy_summary(self, run_dir, history)
