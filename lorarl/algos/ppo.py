"""PPO (InstructGPT-style RLHF) on ONE shared base: every role is a way of running the same base weights.

| role       | how it runs                                                        | trained here          |
|------------|--------------------------------------------------------------------|-----------------------|
| policy     | LoRA adapter ``policy`` (from ``model.init_adapter`` if set)       | yes, its own AdamW    |
| old policy | the policy's log-probs recorded at rollout                         | no                    |
| reference  | adapters disabled, or the frozen ``reference`` adapter (= the      | no                    |
|            | ``model.init_adapter`` the policy started from)                    |                       |
| critic     | LoRA adapter ``critic`` + fp32 value head (optionally warm-started | yes, its own AdamW    |
|            | from the reward adapter)                                           |                       |
| reward     | LoRA adapter ``reward`` + fp32 score head, from                    | no (frozen, loaded    |
|            | ``recipes/reward_model.yaml``                                      | with trainable=False) |

Read :meth:`PPO.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does the rest). Each step has the four
phases of the seeds (and of CleanRL's ppo.py):

1. **Rollout** -- a batch of prompts; one batched ``generate`` with the policy (dropout off); masks from generation
   (through the first EOS); old log-probs with the policy and reference log-probs, at the sampling temperature.
2. **Reward** -- the reward adapter's score at the final token (the last non-pad token) and/or rule rewards; optional
   running normalisation and clipping; a fixed score for responses without EOS; a row whose reward failed (NaN:
   no reward function has a value for it) has no terminal reward and is left out of the update (its tokens leave
   the mask: no advantage, value target or loss; counted against ``reward.max_failure_fraction``); then per-token
   rewards
   ``r_t = -beta (log pi_old(a_t|s_t) - log pi_ref(a_t|s_t)) + score * 1[t = last]`` (Ziegler et al. 2019;
   InstructGPT Eq. 2; the k1 estimate, or k2 / k3 by ``ppo.kl.estimator``), with ``beta`` fixed or adaptive
   (Ziegler et al.'s proportional controller).
3. **Advantages** -- values ``V(s_t)`` from the critic adapter + value head; GAE (Schulman et al. 2016) with
   ``gamma``, ``lam`` and the masks; value targets ``returns = advantages + values``; advantage whitening.
4. **Optimisation** -- ``ppo.epochs`` x shuffled minibatches x micro-batches (gradient accumulation): the policy
   minimises PPO-clip ``- c_H * entropy`` (``+ ptx_coef *`` the InstructGPT pretraining loss on a text set), the
   critic ``c_V *`` the clipped value loss (or Huber); the epochs stop early once the minibatch approx KL passes
   ``ppo.target_approx_kl``.

The policy's and the critic's parameters are disjoint, so minimising the seeds' combined objective
``-L_clip + c_V L_V - c_H H`` is exactly one step of each optimizer on its own part (``c_V`` then only matters for
the critic's gradient clipping: Adam is invariant to the loss scale).
"""

from __future__ import annotations

import functools
import math
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
    step_seed,
    tail_mean,
    trained_role,
)
from lorarl.algos.ppo_losses import CRITIC, POLICY, PPOBatch, critic_loss, load_ptx_texts, policy_loss
from lorarl.algos.samples import completion_samples, row_advantage
from lorarl.algos.tis import tis_engages, tis_metrics
from lorarl.config import Recipe
from lorarl.core.advantages import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    gae,
    gae_skipping,
    kl_shaped_rewards,
)
from lorarl.core.losses import tis_weights
from lorarl.core.ops import masked_mean, masked_whiten
from lorarl.core.schedules import advance
from lorarl.core.stats import RunningMoments, explained_variance, finite_mean
from lorarl.errors import LorarlError
from lorarl.health import base_precision, parity_due, parity_metrics, parity_tolerance
from lorarl.model import REFERENCE, SharedBase
from lorarl.phases import phase
from lorarl.rewards.source import RewardSource, resolve_reward_adapter, reward_source
from lorarl.tasks import accuracy
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step_halving

PLOT_PANELS = (
    ("reward (score before shaping)", ("reward",)),
    ("KL to reference (per sequence)", ("objective/kl",)),
    ("critic explained variance", ("explained_variance",)),
    ("response length (tokens)", ("completions/mean_length",)),
)


@dataclass
class PromptBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the training prompt set."""

    step: int
    prompt_index: list[int]


@torch.no_grad()
def critic_values(shared: SharedBase, ids, att, start: int, batch_size: int):
    """The critic's ``V(s_t)`` for the states before each completion token (dropout off) -> ``[N, T]`` fp32 CPU."""
    out = []
    with shared.role(CRITIC, train=False):
        for s in range(0, ids.shape[0], batch_size):
            rows_ids, rows_att = ids[s : s + batch_size].to(shared.device), att[s : s + batch_size].to(shared.device)
            out.append(shared.values(rows_ids, rows_att, start).float().cpu())
    return torch.cat(out)


def setup_roles(shared: SharedBase, recipe: Recipe) -> RewardSource:
    """Add the PPO roles to the one base; return the reward source (which holds the frozen ``reward`` role).

    * ``policy``: fresh LoRA, or ``model.init_adapter`` (then ``reference`` is that adapter, frozen);
    * ``reward``: the trained reward adapter + score head, frozen, when the reward source uses it;
    * ``critic``: fresh LoRA (``ppo.critic_lora``) + value head, or a trainable copy of the reward adapter + head.
    """
    cfg = recipe.ppo
    init = recipe.model.init_adapter
    if init:
        shared.add_adapter(POLICY, init_from=init, trainable=True)
        shared.add_adapter(REFERENCE, init_from=init, trainable=False)
    else:
        shared.add_adapter(POLICY, recipe.lora)
    source = reward_source(recipe, shared, micro_batch_rows(recipe.eval.batch_size, recipe.train.prompts_per_step))
    if cfg.critic.init == "reward":
        if not recipe.reward.adapter:
            raise LorarlError("ppo.critic.init is 'reward' but reward.adapter is not set")
        folder = resolve_reward_adapter(recipe.reward.adapter, recipe.source_path)
        shared.add_adapter(CRITIC, init_from=folder, trainable=True, head=True)
    else:
        shared.add_adapter(CRITIC, cfg.critic.lora, head=True)
    return source


def rewarded_rows(total: torch.Tensor, truncated: torch.Tensor, no_eos_penalty: float | None) -> torch.Tensor:
    """``[N]`` bool: the rows PPO trains on -- those whose terminal reward is known. ``total`` ``[N]`` is NaN where
    no reward has a value (every reward function failed or returned None for the row): PPO's only learning signal
    is that terminal reward, so such a row is left out of the advantages and the losses, where GRPO leaves it out of
    its group's statistics (counted either way against ``reward.max_failure_fraction``). A truncated row under
    ``ppo.score.no_eos_penalty`` is kept: its score is the penalty, whatever the reward.

    Formula: ``kept_i = not isnan(total_i) or (truncated_i and no_eos_penalty is set)``.

    Example: ``total = [1, nan, nan]``, ``truncated = [F, F, T]``: ``[T, F, F]``; with a penalty: ``[T, F, T]``.
    """
    kept = ~torch.isnan(total)
    return kept | truncated.bool() if no_eos_penalty is not None else kept


class PPO:
    """PPO on the shared base: set up policy, reference, critic and reward roles, the prompts and both optimizers;
    then :meth:`step` per batch."""

    name = "ppo"
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.ppo, recipe.train
        self.source = setup_roles(shared, recipe)
        self.prompts = load_train_prompts(recipe, shared.tokenizer)
        rollout_rows = rollout_batch(recipe, shared.device.type)  # generation.batch_size (None: all rows at once)
        self.rollout_fn = make_step_rollout(recipe, shared, self.prompts, rollout_rows)
        self.gae = gae_skipping if recipe.agent is not None else gae  # multi-turn: GAE skips the tool tokens
        self.ptx = load_ptx_texts(cfg.ptx.source, shared.tokenizer, recipe.source_path) if cfg.ptx.coef > 0 else None
        self.need_ref = cfg.kl.coef > 0  # beta = 0 and fixed: the reference never runs
        self.roles = self.outputs = [POLICY, CRITIC]
        self.final_eval = False
        N = tcfg.prompts_per_step
        self.policy = trained_role(shared, POLICY, tcfg, tcfg.steps)  # the LR schedules span the RL steps
        self.critic = trained_role(shared, CRITIC, tcfg, tcfg.steps, lr=cfg.critic.learning_rate)
        self.optimizers = {POLICY: self.policy.optimizer, CRITIC: self.critic.optimizer}
        self.schedulers = {POLICY: self.policy.scheduler, CRITIC: self.critic.scheduler}
        self.kl_ctl = (
            AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
            if cfg.kl.adaptive
            else FixedKLController(cfg.kl.coef)
        )
        self.kl_penalty = KL_PENALTIES[cfg.kl.estimator]  # the per-token KL estimate in the reward (ppo.kl.estimator)
        self.reward_stats = RunningMoments()
        self.mbs = micro_batch_rows(
            tcfg.micro_batch_size, min(N, cfg.minibatch_size), planned_micro_batch(recipe, shared.device.type)
        )
        # rows per no-grad forward (scores, values): eval.batch_size, at most the rollout's scoring batch
        self.fwd_bs = min(micro_batch_rows(recipe.eval.batch_size, N), rollout_rows or N)
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.total_steps = self.last_step = tcfg.steps
        self.parity_tolerance = parity_tolerance(recipe, shared.device.type)
        self.precision = base_precision(recipe, shared.device.type)
        self.tis_active = cfg.tis.mode == "always"  # auto: switched on by the first parity check above tolerance
        self.samples: list[dict] = []  # the last step's logged completions (lorarl.algos.samples)

    def batch(self, step: int) -> PromptBatch:
        tcfg = self.recipe.train
        return PromptBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def step(self, batch: PromptBatch) -> dict:
        """One PPO step on ``batch``; returns its metrics."""
        shared, cfg, gen = self.shared, self.recipe.ppo, self.recipe.generation
        step = batch.step

        # ===== Phase 1. Rollout: sample with the policy; old and reference log-probs ===========================
        sampled = self.rollout_fn(  # single-turn, or multi-turn with tools (lorarl.agents.step), chosen at set-up
            batch.prompt_index,
            role=POLICY,
            record_old=True,
            reference=REFERENCE if self.need_ref else None,  # the frozen init adapter, else adapters disabled
            record_sampler=parity_due(self.recipe.health.parity_every, step) or self.tis_active,
        )
        rollout = sampled.rollout
        health = {}
        if parity_due(self.recipe.health.parity_every, step):  # generator / trainer parity (lorarl.health)
            health = parity_metrics(shared, rollout, POLICY, gen.temperature, self.recipe.health.parity_rows)
            health["health/parity_tolerance"] = self.parity_tolerance
            self.tis_active = self.tis_active or tis_engages(
                cfg.tis.mode, health, self.parity_tolerance, self.precision, step
            )
        N, P = len(rollout), rollout.prompt_ids.shape[1]
        old_logprobs = rollout.old_logprobs  # [N, T]
        ref_logprobs = rollout.ref_logprobs if self.need_ref else old_logprobs  # [N, T]

        # ===== Phase 2. Reward: score at the final token, then the per-token KL penalty =========================
        scored = sampled.score(self.source, self.prompts, step)  # (+ the environment's reward)
        self.source.report_failures(
            scored, step, self.recipe.reward.max_failure_fraction, "its rows are left out of the update"
        )
        self.source.end_step(step)  # a reward function without a value in max_failed_steps steps stops the run
        raw_score = scored.total  # [N]; NaN: no reward
        kept = rewarded_rows(raw_score, rollout.truncated, cfg.score.no_eos_penalty)  # [N]
        # [N, T] bool: the model's tokens through the first EOS (tool tokens: context), of the rows with a reward
        mask = rollout.loss_mask & kept[:, None]
        score = torch.nan_to_num(raw_score, nan=0.0)  # [N] a left-out row's 0 reaches no advantage (masked)
        if cfg.score.normalize:
            self.reward_stats.update(score[~torch.isnan(raw_score)])
            score = self.reward_stats.normalize(score)
        if cfg.score.clip is not None:
            score = score.clamp(-cfg.score.clip, cfg.score.clip)
        if cfg.score.no_eos_penalty is not None:
            score = torch.where(rollout.truncated, torch.full_like(score, cfg.score.no_eos_penalty), score)
        beta = self.kl_ctl.value
        rewards, kl = kl_shaped_rewards(score, old_logprobs, ref_logprobs, mask, beta, self.kl_penalty)  # [N, T]

        # ===== Phase 3. Values from the critic; GAE; value targets; whitening ==================================
        with phase("scoring"):
            values = critic_values(shared, rollout.input_ids, rollout.attention_mask, P, self.fwd_bs)  # [N, T]
        advantages, returns = self.gae(rewards, values, mask, cfg.gamma, cfg.lam)  # [N, T] each
        ev = explained_variance(values, returns, mask)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)

        # ===== Phase 4. K epochs x shuffled minibatches x micro-batches ========================================
        sampler = rollout.sampler_logprobs if self.tis_active else None  # [N, T] TIS (ppo.tis)
        data = PPOBatch(rollout, mask, old_logprobs, advantages, values, returns, sampler)
        tis_w = tis_weights(old_logprobs, sampler, mask, cfg.tis.cap)[mask] if sampler is not None else None
        lr = self.policy.optimizer.param_groups[0]["lr"]  # what this step's updates use
        acc, updates, early_stop = self.optimise(data, step)
        advance(self.policy.scheduler)  # once per RL step, whatever the early stop did
        advance(self.critic.scheduler)
        seq_kl = float((kl * mask).sum(dim=1)[kept].mean()) if kept.any() else 0.0  # mean_i sum_t kl_t, kept rows
        self.kl_ctl.update(seq_kl, n_steps=N)

        # ===== Metrics; the first train.log_completions rows as text (the loop writes them to completions.jsonl) ==
        adv_row = row_advantage(advantages, mask)  # [N] mean advantage over each row's model tokens
        self.samples = completion_samples(
            shared.tokenizer,
            rollout,
            raw_score,
            adv_row,
            self.recipe.train.log_completions,
            columns=scored.columns,
            score_used=score,
        )
        lengths, m_f = rollout.lengths.float(), mask.float()
        rewarded = raw_score[~torch.isnan(raw_score)]  # the rows with a reward
        row = {
            "reward": float(rewarded.mean()) if len(rewarded) else float("nan"),
            "reward_std": float(rewarded.std()) if len(rewarded) > 1 else 0.0,
            "rm_score": float(scored.reward_model.mean()) if scored.reward_model is not None else None,
            **{f"rewards/{k}/mean": v for k, v in (scored.rules.means() if scored.rules else {}).items()},
            **(scored.rules.extra if scored.rules else {}),  # rewards/judge/*, rewards/remote/* (docs/metrics.md)
            "score_used": float(score[kept].mean()) if kept.any() else float("nan"),
            "accuracy": accuracy(self.recipe, rollout.completions, self.prompts.columns(rollout.prompt_index)),
            "objective/kl": seq_kl if self.need_ref else None,
            "kl_per_token": float((kl * m_f).sum() / m_f.sum().clamp(min=1)) if self.need_ref else None,
            "kl_coef": beta,
            **{TRL_NAMES.get(k, k): finite_mean(acc.get(k, [])) for k in STAT_KEYS},
            "explained_variance": ev,
            "values_mean": float(masked_mean(values, mask)),
            "returns_mean": float(masked_mean(returns, mask)),
            "returns_final": float(returns[kept, 0].mean()) if kept.any() else float("nan"),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
            "epochs_done": updates / max(math.ceil(N / cfg.minibatch_size), 1),
            "updates": updates,
            "early_stop": early_stop,
            "policy_grad_norm": finite_mean(acc.get("policy_grad_norm", [])),
            "critic_grad_norm": finite_mean(acc.get("critic_grad_norm", [])),
            "lr": lr,
            "reward_failures": self.source.failures,
            "reward_failed_values": self.source.failed_values,
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": float(lengths.sum()),
            **health,
            **sampled.metrics,
            **tis_metrics(
                self.tis_active,
                [tis_w] if tis_w is not None else [],
                {"tis_truncated": float((tis_w >= cfg.tis.cap).float().mean()) if tis_w is not None else None},
            ),
        }
        return self.source.with_logged(row)

    def evaluate(self) -> dict:
        return evaluate_policy(self)

    def optimise(self, data: PPOBatch, step: int) -> tuple[dict[str, list[float]], int, bool]:
        """Phase 4: ``ppo.epochs`` passes of shuffled minibatches; each minibatch one policy and one critic optimizer
        step over micro-batches. Early stop (``ppo.target_approx_kl``): the approx KL of a minibatch about to be
        applied is measured in its own forward; past the target that update is held back -- policy and critic --
        and the epochs end (no update beyond the target is ever applied). Returns (per-minibatch stats, updates
        applied, whether the approx KL stopped it)."""
        cfg, tcfg = self.recipe.ppo, self.recipe.train
        N, mask = len(data.rollout), data.mask
        shuffle = torch.Generator().manual_seed(step_seed(tcfg.seed, step) + 1)
        acc: dict[str, list[float]] = {}
        applied = 0
        for _epoch in range(cfg.epochs):
            order = torch.randperm(N, generator=shuffle)
            for s in range(0, N, cfg.minibatch_size):
                mb_rows = order[s : s + cfg.minibatch_size]
                if not mask[mb_rows].any():  # every row left out (its reward failed): nothing to fit, no step
                    continue
                denom = (len(mb_rows), max(float(mask[mb_rows].sum()), 1.0))  # the minibatch's sequences, tokens

                def rl_items(size, mb_rows=mb_rows, denom=denom):
                    return [("rl", mb_rows[sl], denom) for sl in micro_batches(len(mb_rows), size)]

                pres = self._policy_update(data, rl_items, self._ptx_item(applied), step)
                if pres.held:  # past the approx-KL target: neither this policy nor this critic update is applied
                    acc.setdefault("approx_kl", []).append(pres.stats.get("approx_kl"))
                    return acc, applied, True
                cres = self._critic_update(data, rl_items, step)
                applied += 1
                stats = {
                    **pres.stats,
                    **cres.stats,
                    "policy_grad_norm": pres.grad_norm,
                    "critic_grad_norm": cres.grad_norm,
                }
                for k, v in stats.items():
                    acc.setdefault(k, []).append(v)
        return acc, applied, False

    def _ptx_item(self, updates_done: int):
        """The pretraining-text rows of the next policy update (InstructGPT's ptx term), or None."""
        if self.ptx is None:
            return None
        k = self.recipe.ppo.ptx.batch_size
        first = (updates_done * k) % len(self.ptx)
        return ("ptx", [(first + j) % len(self.ptx) for j in range(k)], None)

    def _policy_update(self, data: PPOBatch, rl_items, ptx_item, step: int):
        """One policy optimizer step on a minibatch (held back past ``ppo.target_approx_kl``). The whole step
        (forward AND backward) runs with the policy active: gradient checkpointing recomputes the forward during
        backward with whatever adapter is active then. A CUDA out-of-memory halves the micro-batch and redoes it."""
        target = self.recipe.ppo.target_approx_kl
        policy_fn = functools.partial(
            policy_loss, self.shared, self.recipe.ppo, self.recipe.generation.temperature, data, self.ptx
        )
        with phase("training"), self.shared.role(POLICY, train=True):
            res, self.mbs = optimizer_step_halving(
                self.policy.params,
                self.policy.optimizer,
                lambda size: rl_items(size) + ([ptx_item] if ptx_item else []),
                self.mbs,
                policy_fn,
                max_grad_norm=self.recipe.train.max_grad_norm,
                hold=(lambda st: st.get("approx_kl", 0.0) > target) if target is not None else None,
                scaler=self.policy.scaler,
            )
        self.guard.check(res, step, "policy")
        return res

    def _critic_update(self, data: PPOBatch, rl_items, step: int):
        """One critic optimizer step on a minibatch (value loss), with the critic adapter active throughout."""
        critic_fn = functools.partial(critic_loss, self.shared, self.recipe.ppo, data)
        with phase("critic_training"), self.shared.role(CRITIC, train=True):
            res, self.mbs = optimizer_step_halving(
                self.critic.params,
                self.critic.optimizer,
                rl_items,
                self.mbs,
                critic_fn,
                max_grad_norm=self.recipe.train.max_grad_norm,
                scaler=self.critic.scaler,
            )
        self.guard.check(res, step, "critic")
        return res

    def progress(self, row: dict) -> dict:
        ev = row["explained_variance"]
        return {
            "reward": f"{row['reward']:.3f}",
            "ev": f"{ev:.2f}" if ev is not None else "-",
            "kl": f"{row['objective/kl'] or 0.0:.2f}",
            "len": f"{row['completions/mean_length']:.0f}",
        }

    def state_dict(self) -> dict:
        return {
            "guard": self.guard.state_dict(),
            "rewards": self.source.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_stats": self.reward_stats.state_dict(),
            "micro_batch": self.mbs,
            "tis_active": self.tis_active,
        }

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        self.source.load_state_dict(state["rewards"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        self.mbs = int(state["micro_batch"])
        self.tis_active = bool(state.get("tis_active", self.tis_active))  # checkpoints before TIS lack the key

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy and critic adapters at ``run_dir/policy`` and ``run_dir/critic``; the summary's PPO fields."""
        self.shared.save_adapter(POLICY, run_dir / POLICY)
        self.shared.save_adapter(CRITIC, run_dir / CRITIC)
        return {
            "policy": str(run_dir / POLICY),
            "critic": str(run_dir / CRITIC),
            "reward_first10": tail_mean(history, "reward", head=True),
            "reward_last10": tail_mean(history, "reward"),
            "explained_variance_last10": tail_mean(history, "explained_variance"),
            "kl_last10": tail_mean(history, "objective/kl"),
            "kl_coef": self.kl_ctl.value,
            "skipped_updates": self.guard.skipped,
        }


STAT_KEYS = ("approx_kl", "clip_frac", "entropy", "policy_loss", "ptx_loss", "value_loss", "value_clip_frac")
# the update's statistics under TRL's PPO names (docs/metrics.md)
TRL_NAMES = {
    "approx_kl": "policy/approxkl_avg",
    "clip_frac": "policy/clipfrac_avg",
    "entropy": "policy/entropy_avg",
    "policy_loss": "loss/policy_avg",
    "value_loss": "loss/value_avg",
    "value_clip_frac": "val/clipfrac_avg",
}
