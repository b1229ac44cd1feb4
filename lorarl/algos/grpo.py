"""GRPO on one shared base: the policy is a LoRA adapter, the reference is the base with adapters disabled (or a
frozen ``reference`` adapter), the old policy is the log-probs recorded at rollout.

Read :meth:`GRPO.step` top to bottom; its steps are numbered (the run loop, :mod:`lorarl.algos.loop`, does the rest):

1. a batch of prompts (derived from ``(seed, step)``, so a resumed run sees the same data);
2. a rollout: ``group_size`` completions per prompt in one batched ``generate``, masks from generation, old
   log-probs (only when ``num_iterations > 1``) and reference log-probs (only when ``kl_coef > 0``);
3. rewards: the recipe's reward functions, each failure isolated and counted; with DAPO's dynamic sampling
   (``grpo.dynamic_sampling``) groups without a reward spread are dropped and steps 2-3 repeat on more prompts;
4. group-relative advantages (DeepSeekMath; std scaling group | batch | none = Dr. GRPO);
5. the loss (:mod:`lorarl.algos.grpo_losses`): PPO-clip per token with ``eps_low`` / ``eps_high`` (DAPO
   clip-higher), or per sequence on GSPO's geometric-mean ratio (``importance_sampling_level: sequence``), or
   ``grpo.policy_loss`` CISPO / SAPO / VESPO, weighted by truncated importance sampling when the sampler's log-probs
   differ from the trainer's (``grpo.tis``), plus ``kl_coef`` * k3 to the reference (or DeepSeek-V3.2's
   importance-weighted k3), reduced once (GRPO / DAPO / Dr. GRPO / LUSPO / BNPO), minus ``entropy_coef`` * the
   token mean of the entropy (TRL's convention);
6. ``num_iterations`` optimizer steps on the rollout, each over micro-batches with gradient accumulation;
7. iterative GRPO: the reference adapter is refreshed to the policy every ``ref_refresh_every`` steps;
8. metrics; at the end (:meth:`GRPO.finish`) the policy adapter in PEFT format.

References: Shao et al. 2024 (DeepSeekMath, GRPO, Eqs. 3-4 and iterative GRPO, Alg. 1); Yu et al. 2025 (DAPO);
Liu et al. 2025 (Dr. GRPO); DeepSeek-AI 2025 (DeepSeek-V3.2, unbiased KL estimate); Zheng et al. 2025 (GSPO);
Yao et al. 2025 (truncated importance sampling for a mismatched sampler). docs/grpo_options.md.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from lorarl.agents.step import make_step_rollout
from lorarl.algos.base import (
    batch_indices,
    evaluate_policy,
    load_train_prompts,
    micro_batch_rows,
    planned_micro_batch,
    rollout_batch,
    tail_mean,
    trained_role,
)
from lorarl.algos.grpo_losses import POLICY_LOSSES, POLICY_METRICS, grpo_token_loss, policy_term  # noqa: F401
from lorarl.algos.grpo_sampling import (
    dynamic_sampling_metrics,
    group_rows,
    join_rollouts,
    round_prompts,
    select_scores,
)
from lorarl.algos.samples import completion_samples
from lorarl.algos.tis import tis_engages, tis_metrics
from lorarl.config import GRPOConfig, Recipe
from lorarl.core.advantages import group_advantages
from lorarl.core.dynamic_sampling import GroupTally, informative_groups, take_groups
from lorarl.core.losses import batch_totals, reduce_loss, tis_weights
from lorarl.core.schedules import advance
from lorarl.core.stats import nan_std
from lorarl.health import base_precision, parity_due, parity_metrics, parity_tolerance
from lorarl.metrics import PLOT_PANELS
from lorarl.model import REFERENCE, SharedBase, completion_logprobs
from lorarl.phases import phase
from lorarl.rewards.source import SourceScores, reward_source
from lorarl.rollout import Rollout
from lorarl.tasks import accuracy
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step_halving

POLICY = "policy"


@dataclass
class GRPOBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the training prompt set."""

    step: int
    prompt_index: list[int]


def setup_roles(shared: SharedBase, recipe: Recipe) -> bool:
    """Add the policy adapter, and a frozen ``reference`` adapter when the reference is not the bare base.

    The reference is the bare base (adapters disabled) unless RL starts from a trained adapter
    (``model.init_adapter``: the reference is that adapter, frozen) or iterative GRPO refreshes it
    (``grpo.ref_refresh_every``: the reference starts as a copy of the policy). It is only built when
    ``kl_coef > 0`` (otherwise nothing reads it). Returns whether a reference adapter was added.
    """
    cfg = recipe.grpo
    init = recipe.model.init_adapter
    if init:
        shared.add_adapter(POLICY, init_from=init, trainable=True)
    else:
        shared.add_adapter(POLICY, recipe.lora)
    if cfg.kl.coef <= 0:
        if cfg.kl.ref_refresh_every > 0:
            print(
                "grpo.kl.ref_refresh_every has no effect with grpo.kl.coef = 0 (no reference is used)", file=sys.stderr
            )
        return False
    if init:
        shared.add_adapter(REFERENCE, init_from=init, trainable=False)
        return True
    if cfg.kl.ref_refresh_every > 0:
        shared.add_adapter(REFERENCE, recipe.lora, trainable=False)
        shared.copy_adapter(POLICY, REFERENCE)
        return True
    return False


def grpo_loss(
    rows: torch.Tensor,
    *,
    shared: SharedBase,
    rollout: Rollout,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: GRPOConfig,
    temperature: float,
    total_rows: int,
    total_sequences: int,
    total_tokens: int,
    max_len: int,
    use_reference: bool,
    use_tis: bool = False,
    tis_seen: list | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Step 5: a micro-batch's share of the GRPO loss (Shao et al. 2024, Eq. 3, as a loss to minimise): the
    per-token loss of :func:`grpo_token_loss`, reduced by ``cfg.loss_reduction`` with the WHOLE batch's
    ``total_*`` so the micro-batch losses sum to the batch loss, minus the entropy bonus
    ``entropy_coef * sum_{i,t} m_it H_it / total_tokens`` -- the token mean whatever ``loss_reduction`` is, as TRL's
    ``GRPOTrainer`` (verl reduces it like the loss: the two differ for ``seq_mean_token_mean`` / ``seq_sum_norm``).

    ``rows``: the micro-batch, ``B`` row indices into ``rollout`` (``N`` rows); ``advantages`` ``[N]``;
    ``loss_mask`` ``[N, T]``. Without recorded
    ``old_logprobs`` (``num_iterations == 1``) the old policy IS the current one: its detached log-probs are used
    (ratio 1, the gradient is the policy gradient). ``use_tis``: weight the policy-gradient term by the truncated
    ratio of the trainer's old log-probs to the sampler's recorded ones (``rollout.sampler_logprobs``,
    ``cfg.tis.cap``); the weights of the mask tokens are appended to ``tis_seen`` when given (for min / max).
    Returns ``(loss, {stat: (sum, count)})``.
    """
    mb = rollout.select(rows)
    mask = loss_mask[rows].to(shared.device)  # [B, T]
    with shared.role(POLICY, train=True):
        # the entropy is logged; it carries a gradient only for the bonus (entropy_coef > 0)
        logprobs, ent = completion_logprobs(
            shared, mb, temperature, with_entropy=True, entropy_grad=cfg.entropy_coef > 0
        )  # [B, T] each
    old = mb.old_logprobs.to(shared.device) if mb.old_logprobs is not None else logprobs.detach()  # [B, T]
    sampler = mb.sampler_logprobs.to(shared.device) if use_tis else None  # [B, T]
    per_token, stats = grpo_token_loss(
        logprobs,
        old,
        advantages[rows].to(shared.device),
        mask,
        cfg,
        entropy=ent,
        ref_logprobs=mb.ref_logprobs.to(shared.device) if use_reference else None,
        sampler_logprobs=sampler,
        tis_cap=cfg.tis.cap,
    )
    if tis_seen is not None and sampler is not None:
        tis_seen.append(tis_weights(old, sampler, mask, cfg.tis.cap)[mask.bool()].cpu())
    totals = dict(total_rows=total_rows, total_sequences=total_sequences, total_tokens=total_tokens, max_len=max_len)
    return reduce_grpo_loss(per_token, ent, mask, cfg, **totals), stats


def reduce_grpo_loss(per_token: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig, **totals):
    """Step 5's reduction of a micro-batch: ``reduce_loss(l, m, cfg.loss_reduction) - entropy_coef * sum_{i,t}
    m_it H_it / total_tokens`` (``totals``: the whole batch's, :func:`~lorarl.core.losses.batch_totals`, and
    ``max_len``). The entropy bonus is the token mean of the entropy whatever ``loss_reduction`` is -- TRL's
    ``GRPOTrainer`` convention, so an ``entropy_coef`` taken from a TRL config means the same here; verl reduces the
    entropy like the loss (its ``loss_agg_mode``), which differs for ``seq_mean_token_mean`` / ``seq_sum_norm``.

    Shapes: ``per_token``, ``entropy``, ``mask`` ``[B, T]`` -> ``[]``.

    Example: ``l = [[1, 3], [5, 0]]``, ``H = [[2, 2], [4, 0]]``, ``m = [[1, 1], [1, 0]]``, seq_mean_token_mean,
    ``entropy_coef = 0.5``, totals of this batch: ``(2 + 5)/2 - 0.5 * 8/3 = 2.1667``.
    """
    loss = reduce_loss(per_token, mask, cfg.loss_reduction, **totals)
    if cfg.entropy_coef > 0:  # TRL's bonus: the token mean of the entropy, not reduced like the loss
        loss = loss - cfg.entropy_coef * reduce_loss(entropy, mask, "token_mean", **totals)
    return loss


class GRPO:
    """GRPO on the shared base: set up the roles, the prompts, the rewards and the policy's optimizer; then
    :meth:`step` per batch. Used by the run loop, the benchmarks and the tests alike."""

    name = "grpo"
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.grpo, recipe.train
        has_ref_adapter = setup_roles(shared, recipe)
        self.has_ref_adapter = has_ref_adapter
        self.reference = REFERENCE if cfg.kl.coef > 0 else None  # None: the reference never runs
        self.roles = [POLICY] + ([REFERENCE] if has_ref_adapter else [])
        self.outputs, self.final_eval = [POLICY], False
        self.planned_mbs = planned_micro_batch(recipe, shared.device.type)
        self.prompts = load_train_prompts(recipe, shared.tokenizer)
        self.rollout_fn = make_step_rollout(recipe, shared, self.prompts, rollout_batch(recipe, shared.device.type))
        self.agent_metrics: dict = {}  # turns, tool calls, ... of the last rollout (multi-turn only)
        self.source = reward_source(
            recipe, shared, micro_batch_rows(recipe.eval.batch_size, tcfg.prompts_per_step * cfg.group_size)
        )
        self.total_steps = self.last_step = tcfg.steps
        self.policy = trained_role(shared, POLICY, tcfg, tcfg.steps)
        self.optimizers = {POLICY: self.policy.optimizer}
        self.schedulers = {POLICY: self.policy.scheduler}
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.micro_batch_cap: int | None = None  # lowered for good after an out-of-memory halving
        self.parity_tolerance = parity_tolerance(recipe, shared.device.type)
        self.precision = base_precision(recipe, shared.device.type)
        self.tis_active = cfg.tis.mode == "always"  # auto: switched on by the first parity check above tolerance
        self.drawn_rewards: list[torch.Tensor] = []  # dynamic sampling: the rewards of every round of the step
        self.samples: list[dict] = []  # the last step's logged completions (lorarl.algos.samples)

    def batch(self, step: int) -> GRPOBatch:
        """1. A batch of prompts, derived from ``(seed, step)``."""
        tcfg = self.recipe.train
        return GRPOBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def sample_round(self, prompt_index: list[int], step: int, record_sampler: bool) -> tuple[Rollout, SourceScores]:
        """Steps 2-3 on the prompts ``prompt_index``: the rollout and its rewards.

        2. G completions per prompt, one generate call; old / reference log-probs when needed.
        3. Rewards: rule functions (each once on the batch; failures isolated as NaN and counted) and/or the frozen
           reward adapter's score at each response's last token.
        """
        cfg = self.recipe.grpo
        sampled = self.rollout_fn(  # single-turn, or multi-turn with tools (lorarl.agents.step), chosen at set-up
            prompt_index,
            group_size=cfg.group_size,
            role=POLICY,
            record_old=cfg.num_iterations > 1,
            reference=self.reference,
            record_sampler=record_sampler,
        )
        rollout, self.agent_metrics = sampled.rollout, sampled.metrics
        scored = sampled.score(self.source, self.prompts, step)  # + the environment's get_reward(), when it has one
        self.source.report_failures(scored, step, self.recipe.reward.max_failure_fraction, "its values are left out")
        return rollout, scored

    def fill_groups(
        self, batch: GRPOBatch, rollout: Rollout, scored: SourceScores, record_sampler: bool
    ) -> tuple[Rollout, SourceScores, GroupTally]:
        """DAPO's dynamic sampling (``grpo.dynamic_sampling``): keep the groups of the first round whose valid rewards
        differ; while fewer than ``train.prompts_per_step`` are kept and ``max_rounds`` allows, sample another round
        of prompts derived from ``(seed, step, round)`` and keep its informative groups, first come first kept.
        Returns the kept rows as one rollout with their scores (the first round's when none was kept: the step then
        trains on nothing) and the counts."""
        tcfg, ds, G = self.recipe.train, self.recipe.grpo.dynamic_sampling, self.recipe.grpo.group_size
        need, tally = tcfg.prompts_per_step, GroupTally()
        parts: list[tuple[Rollout, SourceScores, list[int]]] = []
        drawn, first = set(batch.prompt_index), (rollout, scored)
        self.drawn_rewards = [scored.total]
        for round_ in range(ds.max_rounds):
            if round_ > 0:
                index = round_prompts(len(self.prompts), need, tcfg.seed, batch.step, round_, drawn)
                drawn |= set(index)
                rollout, scored = self.sample_round(index, batch.step, record_sampler)
                self.drawn_rewards.append(scored.total)
            taken = take_groups(informative_groups(scored.total, G), need, tally)
            if taken:
                parts.append((rollout, scored, group_rows(taken, G)))
            if tally.kept >= need:
                break
        if not parts:
            return *first, tally
        joined = join_rollouts([r.select(rows) for r, _, rows in parts], self.shared.pad_id)
        return joined, select_scores([sc for _, sc, _ in parts], [rows for _, _, rows in parts]), tally

    def step(self, batch: GRPOBatch) -> dict:
        """One GRPO step on ``batch``; returns its metrics."""
        from tqdm.auto import tqdm

        shared, cfg, gen, tcfg = self.shared, self.recipe.grpo, self.recipe.generation, self.recipe.train
        G, step = cfg.group_size, batch.step

        # 2-3. Rollout and rewards (dynamic sampling: more rounds until enough groups have a reward spread) ----
        parity_step = parity_due(self.recipe.health.parity_every, step)
        record_sampler = parity_step or self.tis_active  # TIS needs the sampler's log-probs of every row
        rollout, scored = self.sample_round(batch.prompt_index, step, record_sampler)
        health = {}
        if parity_step:  # generator / trainer parity (lorarl.health); auto TIS engages above the tolerance
            health = parity_metrics(shared, rollout, POLICY, gen.temperature, self.recipe.health.parity_rows)
            health["health/parity_tolerance"] = self.parity_tolerance
            self.tis_active = self.tis_active or tis_engages(
                cfg.tis.mode, health, self.parity_tolerance, self.precision, step
            )
        tally = None
        if cfg.dynamic_sampling.enabled:
            rollout, scored, tally = self.fill_groups(batch, rollout, scored, record_sampler)
        self.source.end_step(step)  # a reward function without a value in max_failed_steps steps stops the run

        # 4. Group-relative advantages [N] (NaN rewards left out of their group's statistics) ------------------
        adv = group_advantages(scored.total, G, cfg.std_scaling, unbiased_std=cfg.unbiased_std)
        advantages = adv.advantages  # [N]

        # 5. The loss on a micro-batch, as its share of the full-batch loss -----------------------------------
        loss_mask = rollout.loss_mask.clone()  # [N, T] the model's own tokens (tool tokens are context)
        if cfg.mask_truncated:
            loss_mask &= ~rollout.truncated[:, None]  # DAPO overlong filtering: no loss on truncated rows
        if tally is not None and tally.kept == 0:
            loss_mask[:] = False  # dynamic sampling kept no group: nothing to train on this step
        totals = batch_totals(loss_mask)  # rows without a loss token count in total_rows only (Dr. GRPO's constant)
        # Rows whose loss is 0 with a 0 gradient need no forward pass: zero advantage and no KL / entropy
        # term. They still count in the normaliser (the batch's totals), so the update is exact.
        needs_all_rows = cfg.kl.coef > 0 or cfg.entropy_coef > 0
        active = loss_mask.any(dim=1) & (needs_all_rows | (advantages != 0))
        if cfg.loss_reduction == "micro_batch_token_mean":  # BNPO normalises per micro-batch: TRL's, every row in order
            active = torch.ones_like(active)
        rows = active.nonzero().squeeze(1)  # [n_active]
        tis_seen: list[torch.Tensor] = []  # the TIS weights of the loss tokens (sampling/importance_sampling_ratio/*)
        loss_fn = functools.partial(
            grpo_loss,
            shared=shared,
            rollout=rollout,
            advantages=advantages,
            loss_mask=loss_mask,
            cfg=cfg,
            temperature=gen.temperature,
            **totals,
            max_len=gen.max_new_tokens,
            use_reference=self.reference is not None,
            use_tis=self.tis_active,
            tis_seen=tis_seen,
        )

        # 6. num_iterations optimizer steps, each over micro-batches with gradient accumulation ---------------
        mbs = micro_batch_rows(tcfg.micro_batch_size, max(len(rows), 1), self.planned_mbs)
        update_stats: dict[str, float] = {}
        # backward runs inside the policy role in train mode: activation checkpointing recomputes the forward
        # there, and must see the same adapter and mode (dropout) as the forward did
        with phase("training"), shared.role(POLICY, train=True):
            for _ in range(cfg.num_iterations if len(rows) else 0):  # no rows: nothing to learn (all zero-std)
                tis_seen.clear()  # one iteration's weights (the old and sampler log-probs are fixed across them)
                # a CUDA out-of-memory in a micro-batch halves the micro-batch and redoes the step
                result, mbs = optimizer_step_halving(
                    self.policy.params,
                    self.policy.optimizer,
                    lambda size, rows=rows: (rows[s] for s in micro_batches(len(rows), size)),
                    min(mbs, self.micro_batch_cap or mbs),
                    loss_fn,
                    max_grad_norm=tcfg.max_grad_norm,
                    scaler=self.policy.scaler,
                    on_halve=lambda a, b: tqdm.write(
                        f"step {step}: out of memory at micro-batch {a}, retrying with {b}"
                    ),
                )
                self.micro_batch_cap = mbs
                self.guard.check(result, step)
                update_stats = dict(result.stats, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr)

        lr = self.policy.optimizer.param_groups[0]["lr"]  # what this step's updates used
        advance(self.policy.scheduler)  # the LR schedule advances once per RL step

        # 7. Iterative GRPO: refresh the reference adapter to the current policy ---------------------------------
        if self.has_ref_adapter and cfg.kl.ref_refresh_every > 0 and step % cfg.kl.ref_refresh_every == 0:
            shared.copy_adapter(POLICY, REFERENCE)

        # 8. Metrics; the first train.log_completions rows as text (the loop writes them to completions.jsonl) ----
        self.samples = completion_samples(
            shared.tokenizer, rollout, scored.total, advantages, tcfg.log_completions, columns=scored.columns
        )
        lengths = rollout.lengths.float()
        valid = ~torch.isnan(scored.total)
        row = {
            "reward": float(torch.nanmean(scored.total)) if valid.any() else float("nan"),
            "reward_std": nan_std(scored.total),
            "reward_std_group": float(adv.group_std.mean()),
            **scored.means(),
            "accuracy": accuracy(self.recipe, rollout.completions, self.prompts.columns(rollout.prompt_index)),
            "frac_reward_zero_std": float(adv.zero_std.float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
            "kl": update_stats.get("kl"),
            "clip_ratio/low_mean": update_stats.get("clip_frac_low"),
            "clip_ratio/high_mean": update_stats.get("clip_frac_high"),
            **{name: update_stats[k] for k, name in POLICY_METRICS.items() if k in update_stats},  # cispo, vespo
            "approx_kl": update_stats.get("approx_kl"),
            "entropy": update_stats.get("entropy"),
            "loss": update_stats.get("loss"),
            "grad_norm": update_stats.get("grad_norm"),
            "learning_rate": lr,
            "trained_rows": int(len(rows)),
            "reward_failures": self.source.failures,
            "reward_failed_values": self.source.failed_values,
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": float(lengths.sum()),
            **health,
            **self.agent_metrics,
            **tis_metrics(self.tis_active, tis_seen, update_stats),
            **(dynamic_sampling_metrics(tally, tcfg.prompts_per_step, self.drawn_rewards) if tally else {}),
        }
        return self.source.with_logged(row)  # + what the reward functions logged with log_metric

    def evaluate(self) -> dict:
        return evaluate_policy(self)

    def progress(self, row: dict) -> dict:
        acc = row.get("accuracy")
        return {
            "reward": f"{row['reward']:.3f}",
            "acc": f"{acc:.2f}" if acc is not None else "-",
            "len": f"{row['completions/mean_length']:.0f}",
        }

    def state_dict(self) -> dict:
        return {
            "guard": self.guard.state_dict(),
            "rewards": self.source.state_dict(),
            "micro_batch_cap": self.micro_batch_cap,
            "tis_active": self.tis_active,
        }

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        self.source.load_state_dict(state["rewards"])
        self.micro_batch_cap = state["micro_batch_cap"]
        self.tis_active = bool(state.get("tis_active", self.tis_active))  # checkpoints before TIS lack the key

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter in PEFT format at ``run_dir/policy``; the summary's GRPO fields."""
        self.shared.save_adapter(POLICY, run_dir / POLICY)
        return {
            "policy": str(run_dir / POLICY),
            "reward_last10": tail_mean(history, "reward"),
            "accuracy_last10": tail_mean(history, "accuracy"),
            "skipped_updates": self.guard.skipped,
            "reward_failures": self.source.failures,
            "data_rows": len(self.prompts),
            "data_skipped_rows": len(self.prompts.skipped),
        }
