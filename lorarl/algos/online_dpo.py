"""Online DPO on the shared base (TRL's ``OnlineDPOTrainer``): the pairs come from the policy itself, ranked by the
recipe's reward, instead of from a fixed preference dataset.

Read :meth:`OnlineDPO.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does checkpoints, resume,
evaluation, logging and the plot):

1. ``train.prompts_per_step`` prompts from ``data.source`` (RL's prompts and rendering), derived from
   ``(seed, step)``;
2. ``online_dpo.group_size`` completions per prompt (2: TRL's) sampled with the policy (``generation``: temperature,
   length; one engine call, the prompt prefilled once for all), the token ids kept as sampled;
3. all scored by the ``reward`` section (rule functions / verifiers, the reward adapter, or both: what GRPO and PPO
   use) minus ``online_dpo.missing_eos_penalty`` for a completion cut without EOS; per prompt the highest is
   ``chosen``, the lowest ``rejected`` (:func:`rank_pairs`: best-of-n against worst-of-n; a tie is no pair);
4. the reference's summed log-probs of the pairs, without gradients (adapters off, or ``model.init_adapter``
   frozen), then one optimizer step of the DPO loss (:mod:`lorarl.core.preference_losses`, TRL's names) over
   micro-batches of pairs, each pair's prompt run once for both responses;
5. metrics by TRL's names: ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
   ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``objective/scores``, ``objective/scores_margin``,
   ``objective/kl``, ``objective/entropy``, ``objective/non_score_reward``, ``objective/rlhf_reward``
   (:func:`objective_metrics`), ``val/contain_eos_token``, ``beta``; and lorarl's ``pairs``, ``pairs/ties``,
   ``reward``.

Differences from TRL, on purpose: a prompt whose best and worst completions score the same gives no pair (TRL keeps
it with the first completion as chosen, an arbitrary label: with a 0/1 verifier most groups tie early on); the pairs
are scored on the token ids the sampler drew (TRL decodes and scores text for reward functions too: so does lorarl,
but trains on the sampled ids, never on re-tokenized text); more than 2 samples per prompt (``group_size``: TRL
samples exactly 2) give best-against-worst pairs, as OpenRLHF's and RLHFlow's iterative DPO, and fewer ties.

:meth:`OnlineDPO.evaluate`: the greedy held-out task evaluation RL uses (``eval/accuracy``, ``eval/reward``, the
reward adapter's ``eval/rm_score`` when the reward section has one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.algos.base import (
    GuardState,
    batch_indices,
    evaluate_policy,
    load_train_prompts,
    micro_batch_rows,
    planned_micro_batch,
    rollout_batch,
    tail_mean,
    trained_role,
)
from lorarl.algos.dpo import POLICY, pair_token_count, pair_update, setup_roles
from lorarl.algos.dpo_scoring import role_logps
from lorarl.config import Recipe
from lorarl.core.preference_losses import LossSettings, combined_loss
from lorarl.core.schedules import advance
from lorarl.data.pairs import PairSet
from lorarl.model import REFERENCE, SharedBase
from lorarl.phases import phase
from lorarl.rewards.source import reward_source
from lorarl.rollout import Rollout, generate_rollout
from lorarl.update import NonFiniteGuard

PLOT_PANELS = (
    ("DPO loss", ("loss",)),
    ("reward of the samples (mean, chosen - rejected)", ("objective/scores", "objective/scores_margin")),
    ("implicit-reward accuracy", ("rewards/accuracies",)),
    ("held-out accuracy", ("eval/accuracy",)),
)


def rank_pairs(
    rewards: Tensor, truncated: Tensor, missing_eos_penalty: float | None = None, group_size: int = 2
) -> tuple[list[int], list[int], int]:
    """``group_size`` completions per prompt (rows ``gi .. gi + g - 1``) -> ``(chosen rows, rejected rows, ties)``.

    ``score_j = reward_j - missing_eos_penalty * [row j was cut without EOS]`` (TRL's penalty); per prompt the row
    with the highest score is chosen and the row with the lowest rejected (with 2 rows: TRL's OnlineDPOTrainer; with
    more: best-of-n against worst-of-n, the pairs of OpenRLHF's and RLHFlow's iterative DPO), the first sampled among
    equal scores. Rows without a score (NaN: no reward value) are left out; a prompt with fewer than 2 scored rows,
    or whose best and worst score are equal, gives no pair and counts in ``ties`` (TRL's OnlineDPOTrainer keeps a
    tie with the first row as chosen: a preference the reward never expressed).

    Example: rewards ``[1, 0, 0.5, 0.5, 0, 2]``, row 5 cut, penalty 3, 2 per prompt -> scores
    ``[1, 0, 0.5, 0.5, 0, -1]``: chosen ``[0, 4]``, rejected ``[1, 5]``, 1 tie. The same rewards, 3 per prompt,
    no penalty: ``[1, 0, 0.5]`` -> (0, 1); ``[0.5, 0, 2]`` -> (5, 4).
    """
    if group_size < 2:
        raise ValueError(f"rank_pairs: group_size must be >= 2, got {group_size}")
    scores = rewards.double().clone()
    if missing_eos_penalty:
        scores = scores - missing_eos_penalty * truncated.double()
    chosen, rejected, ties = [], [], 0
    for start in range(0, len(scores) - group_size + 1, group_size):
        rows = [j for j in range(start, start + group_size) if not math.isnan(float(scores[j]))]
        if len(rows) < 2:
            ties += 1
            continue
        best = max(rows, key=lambda j: (float(scores[j]), -j))  # the first sampled among equal scores
        worst = min(rows, key=lambda j: (float(scores[j]), j))
        if float(scores[best]) == float(scores[worst]):
            ties += 1
        else:
            chosen.append(best)
            rejected.append(worst)
    return chosen, rejected, ties


def objective_metrics(stats: dict, beta: float, pair_score: float) -> dict[str, float]:
    """TRL's OnlineDPOTrainer ``objective/*`` figures from a step's pair metrics, over the trained rows (each pair's
    chosen and rejected completion; TRL trains on every sampled row, lorarl leaves ties and, past 2 samples, the
    middle rows out). With ``kl_y = log pi(y|x) - log ref(y|x)`` summed over a completion's tokens and the implicit
    reward ``r_y = beta * kl_y`` (``rewards/chosen`` and ``rewards/rejected`` are the means of ``r`` over the chosen
    and the rejected rows, as many of each):

    * ``objective/kl = mean_y kl_y = (rewards/chosen + rewards/rejected) / (2 beta)``;
    * ``objective/entropy = -mean_y log pi(y|x) = -(logps/chosen + logps/rejected) / 2`` (TRL's sequence estimate);
    * ``objective/non_score_reward = -beta * objective/kl``;
    * ``objective/rlhf_reward = pair_score + objective/non_score_reward`` (``pair_score``: the mean reward of the
      same rows).

    Example: rewards/chosen 0.2, rewards/rejected -0.1, beta 0.1, logps -3 and -5, pair_score 1.5 -> kl 0.5,
    entropy 4, non_score_reward -0.05, rlhf_reward 1.45.
    """
    kl = (stats["rewards/chosen"] + stats["rewards/rejected"]) / (2 * beta)
    return {
        "objective/kl": kl,
        "objective/entropy": -(stats["logps/chosen"] + stats["logps/rejected"]) / 2,
        "objective/non_score_reward": -beta * kl,
        "objective/rlhf_reward": pair_score - beta * kl,
    }


def sampled_pairs(rollout: Rollout, chosen: list[int], rejected: list[int]) -> PairSet:
    """The ranked rows of ``rollout`` as an in-memory :class:`PairSet`: each pair's prompt ids (padding dropped) and
    the two completions' ids exactly as sampled, through their EOS (the rollout's completion mask)."""

    def ids(row: int) -> list[int]:
        return rollout.completion_ids[row][rollout.completion_mask[row]].tolist()

    prompts = [rollout.prompt_ids[c][rollout.prompt_mask[c]].tolist() for c in chosen]
    rows = [
        {"prompt_index": rollout.prompt_index[c], "chosen_row": c, "rejected_row": r} for c, r in zip(chosen, rejected)
    ]
    return PairSet(
        pairs=rows,
        prompt_ids=prompts,
        chosen_ids=[ids(c) for c in chosen],
        rejected_ids=[ids(r) for r in rejected],
        source="online",
    )


@dataclass
class OnlineBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the training prompts."""

    step: int
    prompt_index: list[int]


class OnlineDPO(GuardState):
    """The policy adapter trained on its own ranked samples against the reference: set-up, then :meth:`step`."""

    name = "online_dpo"
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.online_dpo, recipe.train
        # continue model.init_adapter (an SFT or offline-DPO run), also loaded frozen as the reference; else a fresh
        # adapter against the bare base
        setup_roles(shared, recipe)
        self.roles = self.outputs = [POLICY]
        self.final_eval = True  # the summary reports the held-out task evaluation
        self.prompts = load_train_prompts(recipe, shared.tokenizer)
        rows = tcfg.prompts_per_step * cfg.group_size
        self.source = reward_source(recipe, shared, micro_batch_rows(recipe.eval.batch_size, rows))
        self.total_steps = self.last_step = tcfg.steps
        self.policy = trained_role(shared, POLICY, tcfg, tcfg.steps)
        self.optimizers, self.schedulers = {POLICY: self.policy.optimizer}, {POLICY: self.policy.scheduler}
        # micro-batches of pairs (2 responses each), as offline DPO counts them; the planner's `auto` pick counts
        # rows (it plans the step as GRPO with group_size samples per prompt)
        planned = planned_micro_batch(recipe, shared.device.type)
        self.mbs = micro_batch_rows(
            tcfg.micro_batch_size, tcfg.prompts_per_step, None if planned is None else max(1, planned // 2)
        )
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.loss_fn = functools.partial(combined_loss, losses=cfg.losses, settings=LossSettings(beta=cfg.beta))
        self.eval_result: dict | None = None
        self.rollout_rows = rollout_batch(recipe, shared.device.type)  # generation.batch_size

    def batch(self, step: int) -> OnlineBatch:
        """1. Step ``step``'s prompts, derived from ``(seed, step)``."""
        tcfg = self.recipe.train
        return OnlineBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def step(self, batch: OnlineBatch) -> dict:
        """One online DPO step on ``batch``'s prompts; returns its metrics."""
        shared, cfg, tcfg = self.shared, self.recipe.online_dpo, self.recipe.train
        prompt_index = batch.prompt_index

        # 2. group_size completions per prompt from the policy ------------------------------------------------------
        rollout = generate_rollout(
            shared,
            [self.prompts.token_ids[i] for i in prompt_index],
            self.recipe.generation,
            group_size=cfg.group_size,
            role=POLICY,
            prompt_index=prompt_index,
            batch_size=self.rollout_rows,
        )

        # 3. Rewards, then the ranking --------------------------------------------------------------------------------
        with phase("rewards"):
            scored = self.source.score_rollout(self.prompts, rollout, step=batch.step)
        # failures isolated as NaN (no pair), reported, and bounded as in GRPO
        self.source.report_failures(
            scored, batch.step, self.recipe.reward.max_failure_fraction, "its values are left out"
        )
        self.source.end_step(batch.step)
        chosen, rejected, ties = rank_pairs(scored.total, rollout.truncated, cfg.missing_eos_penalty, cfg.group_size)
        metrics = self.sample_metrics(rollout, scored.total, chosen, rejected, ties)
        metrics.update(scored.means(), reward_failures=self.source.failures)
        self.source.with_logged(metrics)
        if not chosen:  # every prompt tied: nothing to prefer (the schedule still advances, as an empty GRPO step)
            advance(self.policy.scheduler)
            return {**metrics, "loss": float("nan"), "skipped_updates": self.guard.skipped}
        pairs = sampled_pairs(rollout, chosen, rejected)
        rows = list(range(len(pairs)))

        # 4. Reference log-probs, then one optimizer step over micro-batches of pairs -------------------------------
        with phase("reference"):
            ref = role_logps(shared, REFERENCE, pairs, rows, self.mbs, cfg.max_tokens_per_forward)
        result = pair_update(
            shared,
            self.policy,
            pairs,
            rows,
            ref,
            self.loss_fn,
            self.mbs,
            cfg.max_tokens_per_forward,
            tcfg.max_grad_norm,
        )
        self.guard.check(result, batch.step)
        objective = objective_metrics(result.stats, cfg.beta, float(scored.total[chosen + rejected].mean()))

        # 5. Metrics (TRL's names) ----------------------------------------------------------------------------------
        return {
            **metrics,
            "loss": result.loss,
            **result.stats,
            **objective,
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": pair_token_count(pairs, rows),
        }

    def sample_metrics(self, rollout: Rollout, total: Tensor, chosen: list[int], rejected: list[int], ties: int):
        """What the step sampled: TRL's ``objective/scores`` (mean reward), ``objective/scores_margin`` (chosen -
        rejected over the pairs), ``val/contain_eos_token``; the pair / tie counts, completion lengths, ``beta``."""
        valid = total[~torch.isnan(total)]
        margin = (total[chosen] - total[rejected]).mean() if chosen else torch.tensor(float("nan"))
        lengths = rollout.completion_mask.sum(dim=1).float()
        return {
            "reward": float(valid.mean()) if len(valid) else float("nan"),
            "objective/scores": float(valid.mean()) if len(valid) else float("nan"),
            "objective/scores_margin": float(margin),
            "val/contain_eos_token": float((~rollout.truncated).float().mean()),
            "pairs": float(len(chosen)),
            "pairs/ties": float(ties),
            "completions/mean_length": float(lengths.mean()),
            "beta": self.recipe.online_dpo.beta,
        }

    def evaluate(self) -> dict:
        """The greedy held-out task evaluation (``eval/accuracy``, ``eval/reward``, ``eval/rm_score``, ...)."""
        out = evaluate_policy(self)
        self.eval_result = out
        return out

    def progress(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}", "reward": f"{row.get('reward', float('nan')):.2f}"}

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter at ``run_dir/policy``; the summary's fields."""
        self.shared.save_adapter(POLICY, run_dir / POLICY)
        ev = self.eval_result or {}
        return {
            "policy": str(run_dir / POLICY),
            "loss_type": self.recipe.online_dpo.loss_type,
            "loss_first10": tail_mean(history, "loss", head=True),
            "loss_last10": tail_mean(history, "loss"),
            "reward_first10": tail_mean(history, "reward", head=True),
            "reward_last10": tail_mean(history, "reward"),
            "pairs_last10": tail_mean(history, "pairs"),
            "task_accuracy": ev.get("eval/accuracy"),
            "skipped_updates": self.guard.skipped,
            "reward_failures": self.source.failures,
            "data_rows": len(self.prompts),
        }
