"""DPO and its common variants on the shared base: the policy is a LoRA adapter, the reference is the base with
adapters disabled (or ``model.init_adapter``, loaded a second time as a frozen ``reference`` adapter), so no second
model is ever loaded. Losses by TRL's names (``dpo.loss_type``: ``sigmoid`` = DPO, the 14 other types of TRL 1.16's
DPOTrainer and SimPO, and TRL 1.x's weighted lists such as ``[sigmoid, sft]``), pure functions in
:mod:`lorarl.core.preference_losses`, chosen once at set-up, with TRL's options: f-DPO's divergences
(``dpo.f_divergence_type``), WPO's pair weights (``dpo.use_weighting``) and LD-DPO's length desensitisation
(``dpo.ld_alpha``), the last two computed in the policy's own forward (:mod:`lorarl.algos.dpo_scoring`).

Read :meth:`DPO.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does checkpoints, resume, evaluation,
logging and the plot):

1. a batch of pairs: a per-epoch shuffle derived from ``(seed, epoch)``, so a resumed run sees the same data;
2. the reference's summed response log-probs of the batch, without gradients -- or, with
   ``dpo.precompute_ref_log_probs`` (TRL's name), of every training pair once before the first step, kept in the
   checkpoint so a resumed run uses the very same numbers; none at all for the reference-free ``simpo``;
3. one optimizer step over micro-batches of pairs: chosen and rejected responses of a micro-batch go through the
   policy in one forward (their prompt once), the per-pair loss summed and divided by the batch's pairs (TRL's
   mean; gradient accumulation is exact);
4. metrics by TRL's names: ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
   ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``grad_norm``, ``learning_rate``.

:meth:`DPO.evaluate` (every ``eval.every`` steps and at the end): the held-out implicit-reward accuracy on
``data.eval_source`` (``eval/rewards/accuracies``; the reference's log-probs of the held-out pairs are computed once),
and with ``dpo.task_source`` the greedy held-out task evaluation RL uses (``eval/accuracy``, ``eval/reward``).
``lorarl eval recipes/dpo.yaml --checkpoint RUN|base`` prints both (:meth:`DPO.evaluate_checkpoint`).

Data (:mod:`lorarl.data.pairs`): TRL's preference format, prompts rendered as rollouts render them, responses ending
with the end-of-turn EOS; unusable rows are left out and counted. The run stops after ``dpo.epochs`` passes or
``train.steps`` steps, whichever comes first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from lorarl.algos.base import (
    batch_indices,
    evaluate_policy,
    micro_batch_rows,
    planned_micro_batch,
    tail_mean,
    trained_role,
)
from lorarl.algos.dpo_scoring import (
    PLAIN,
    Scoring,
    implicit_reward_metrics,
    pair_logps,
    pair_metrics,
    pair_tokens,
    response_logps,
    role_logps,
)
from lorarl.algos.preference_eval import POLICY, evaluate_against_reference, report_split, save_policy
from lorarl.config import Recipe
from lorarl.core.preference_losses import LossSettings, PairLogps, combined_loss
from lorarl.core.schedules import advance
from lorarl.data.pairs import PairSet, load_pairs, skipped_summary
from lorarl.model import REFERENCE, SharedBase
from lorarl.phases import phase
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step

PLOT_PANELS = (
    ("DPO loss", ("loss", "eval/loss")),
    ("implicit-reward accuracy", ("rewards/accuracies", "eval/rewards/accuracies")),
    ("reward margin (chosen - rejected)", ("rewards/margins", "eval/rewards/margins")),
    ("response log-probs (policy)", ("logps/chosen", "logps/rejected")),
)


@dataclass
class PairBatch:
    """Step ``step``'s pairs: rows ``rows`` of the training pairs."""

    step: int
    rows: list[int]


def load_split(recipe: Recipe, shared: SharedBase, split: str, limit: int | None = None) -> PairSet | None:
    """The recipe's tokenized pairs of ``split`` (None for ``eval`` without held-out pairs); what was left out is
    reported on stderr in one line."""
    pairs = load_pairs(
        recipe.data,
        shared.tokenizer,
        split,
        eos_ids=shared.eos_ids,
        end_id=shared.end_of_turn_id,
        max_length=recipe.dpo.max_length,
        recipe_path=recipe.source_path,
        limit=limit,
    )
    if pairs is not None:
        report_split(skipped_summary(pairs), pairs.skipped)
    return pairs


def setup_roles(shared: SharedBase, recipe: Recipe, needs_reference: bool = True) -> str | None:
    """The policy adapter (fresh, or a trainable copy of ``model.init_adapter``) and the reference role: the bare
    base (``reference`` with no such adapter disables adapters), the init adapter loaded again frozen, or None for a
    reference-free loss (``needs_reference`` False: nothing runs it). Offline and online DPO alike."""
    init = recipe.model.init_adapter
    if init:
        shared.add_adapter(POLICY, init_from=init, trainable=True)
    else:
        shared.add_adapter(POLICY, recipe.lora)
    if not needs_reference:
        return None
    if init:
        shared.add_adapter(REFERENCE, init_from=init, trainable=False)
    return REFERENCE


def dpo_loss(
    shared: SharedBase,
    pairs: PairSet,
    rows: list[int],
    ref: PairLogps | None,
    loss_fn,
    batch_pairs: int,
    batch_chosen_tokens: float,
    max_tokens: int,
    scoring: Scoring,
    part: slice,
):
    """Step 3: micro-batch ``rows[part]``'s share of the batch's mean preference loss under the active policy ->
    ``(sum of its per-pair losses / batch_pairs, {stat: (sum, count)})``. ``ref`` holds the reference's log-probs of
    ``rows`` in order (None: reference-free); ``batch_chosen_tokens``: the chosen responses' tokens of all ``rows``;
    ``scoring``: LD-DPO's weighting and WPO's weights, from this forward."""
    mb = rows[part]
    b = len(mb)
    scored = response_logps(shared, pair_tokens(pairs, mb, shared.pad_id), max_tokens, scoring)  # [2b] each
    pair = pair_logps(scored, b, scoring)
    if ref is not None:
        dev = scored.logps.device
        pair.ref_chosen, pair.ref_rejected = ref.chosen[part].to(dev), ref.rejected[part].to(dev)
    # [b] each; an `sft` term is a token mean over the whole batch (its chosen tokens), not over this micro-batch
    per_pair, chosen_rewards, rejected_rewards = loss_fn(
        pair, batch_pairs=batch_pairs, batch_chosen_tokens=batch_chosen_tokens
    )
    with torch.no_grad():
        stats = {
            key: (value * b, float(b))
            for key, value in implicit_reward_metrics(chosen_rewards, rejected_rewards).items()
        }
        stats["logps/chosen"] = (float(pair.chosen.sum()), float(b))
        stats["logps/rejected"] = (float(pair.rejected.sum()), float(b))
        if pair.weights is not None:
            stats["wpo/weight"] = (float(pair.weights.sum()), float(b))
    return per_pair.sum() / batch_pairs, stats


def pair_update(
    shared: SharedBase,
    policy,
    pairs: PairSet,
    rows: list[int],
    ref: PairLogps | None,
    loss_fn,
    mbs: int,
    max_tokens: int,
    max_grad_norm: float,
    scoring: Scoring = PLAIN,
):
    """Step 3 of DPO and online DPO: one optimizer step of the ``policy`` role (a :class:`TrainedRole`) on pairs
    ``rows`` of ``pairs``, micro-batches of ``mbs`` pairs, each micro-batch's per-pair losses / the batch's pairs
    (:func:`dpo_loss`; ``ref``: the reference's log-probs of ``rows`` in order, None when reference-free); the LR
    schedule advanced. Returns the optimizer step's result."""
    chosen_tokens = float(sum(len(pairs.chosen_ids[i]) for i in rows))
    loss = functools.partial(dpo_loss, shared, pairs, rows, ref, loss_fn, len(rows), chosen_tokens, max_tokens, scoring)
    # (active through backward: activation checkpointing recomputes under the same adapter and dropout)
    with phase("training"), shared.role(POLICY, train=True, dropout=True):
        result = optimizer_step(
            policy.params,
            policy.optimizer,
            micro_batches(len(rows), mbs),
            loss,
            max_grad_norm=max_grad_norm,
            scaler=policy.scaler,
        )
    advance(policy.scheduler)
    return result


def pair_token_count(pairs: PairSet, rows: list[int]) -> float:
    """Tokens the step's forwards read for pairs ``rows``: each prompt twice, both responses."""
    return float(
        sum(2 * len(pairs.prompt_ids[i]) + len(pairs.chosen_ids[i]) + len(pairs.rejected_ids[i]) for i in rows)
    )


class DPO:
    """The policy adapter trained on preference pairs against the reference: set-up, then :meth:`step` per batch."""

    name = "dpo"
    final_eval = True  # the summary reports the held-out implicit-reward (and task) accuracy
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.dpo, recipe.train
        self.reference = setup_roles(shared, recipe, recipe.dpo.needs_reference)
        self.roles = self.outputs = [POLICY]
        self.train_pairs = load_split(recipe, shared, "train")
        self.eval_pairs = load_split(recipe, shared, "eval", limit=recipe.eval.n)
        n, B = len(self.train_pairs), cfg.batch_size
        self.total_steps = min(tcfg.steps, math.ceil(cfg.epochs * n / B))  # batches run on across epochs
        self.last_step = self.total_steps  # the loop lowers it for --max-steps
        self.policy = trained_role(shared, POLICY, tcfg, self.total_steps)
        self.optimizers, self.schedulers = {POLICY: self.policy.optimizer}, {POLICY: self.policy.scheduler}
        self.mbs = micro_batch_rows(tcfg.micro_batch_size, B, planned_micro_batch(recipe, shared.device.type))
        self.max_tokens = cfg.max_tokens_per_forward
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.loss_fn = loss_of(recipe)
        self.scoring = scoring_of(recipe)  # the policy's: LD-DPO's weighting, WPO's weights
        self.ref_scoring = Scoring(ld_alpha=self.scoring.ld_alpha)  # the reference's: LD-DPO's weighting only
        self.ref_cache: PairLogps | None = None  # dpo.precompute_ref_log_probs: every training pair's, once
        self.eval_ref: PairLogps | None = None  # the held-out pairs' reference log-probs, once
        self.eval_result: dict | None = None

    def batch(self, step: int) -> PairBatch:
        """1. Step ``step``'s pairs: consecutive slices of a per-epoch shuffle."""
        return PairBatch(
            step, batch_indices(len(self.train_pairs), self.recipe.dpo.batch_size, self.recipe.train.seed, step)
        )

    def reference_logps(self, rows: list[int]) -> PairLogps | None:
        """2. The reference's log-probs of ``rows``: from the precomputed set, or computed now without gradients."""
        if self.reference is None:
            return None
        with phase("reference"):
            if self.recipe.dpo.precompute_ref_log_probs:
                if self.ref_cache is None:
                    every = list(range(len(self.train_pairs)))
                    self.ref_cache = role_logps(
                        self.shared,
                        self.reference,
                        self.train_pairs,
                        every,
                        self.mbs,
                        self.max_tokens,
                        self.ref_scoring,
                    )
                idx = torch.as_tensor(rows, dtype=torch.long)
                c = self.ref_cache
                return PairLogps(c.chosen[idx], c.rejected[idx], c.chosen_tokens[idx], c.rejected_tokens[idx])
            return role_logps(
                self.shared, self.reference, self.train_pairs, rows, self.mbs, self.max_tokens, self.ref_scoring
            )

    def step(self, batch: PairBatch) -> dict:
        """One optimizer step on ``batch``; returns its metrics."""
        shared, tcfg, rows, step = self.shared, self.recipe.train, batch.rows, batch.step

        # 2. Reference log-probs (none for a reference-free loss) -----------------------------------------------------
        ref = self.reference_logps(rows)

        # 3. One optimizer step: each micro-batch's per-pair losses / the batch's pairs -----------------------------
        tp = self.train_pairs
        result = pair_update(
            shared,
            self.policy,
            tp,
            rows,
            ref,
            self.loss_fn,
            self.mbs,
            self.max_tokens,
            tcfg.max_grad_norm,
            self.scoring,
        )
        self.guard.check(result, step)

        # 4. Metrics (TRL's names) --------------------------------------------------------------------------------
        return {
            "loss": result.loss,
            **result.stats,
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "epoch": (step - 1) * self.recipe.dpo.batch_size / len(tp),
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": pair_token_count(tp, rows),
        }

    def evaluate(self) -> dict:
        """Held-out implicit-reward accuracy (``eval/rewards/accuracies``, ...) and, with ``dpo.task_source``, the
        greedy held-out task evaluation (``eval/accuracy``, ``eval/reward``, ...)."""
        out: dict = {}
        if self.eval_pairs is not None:
            bs = self.recipe.eval.batch_size
            if self.eval_ref is None:  # computed once: the reference never changes
                self.eval_ref = held_out_reference(
                    self.shared, self.reference, self.eval_pairs, bs, self.max_tokens, self.ref_scoring
                )
            self.eval_result = pair_metrics(
                self.shared, self.eval_pairs, POLICY, self.eval_ref, self.loss_fn, bs, self.max_tokens, self.scoring
            )
            out.update({f"eval/{k}": v for k, v in self.eval_result.items() if isinstance(v, float)})
        if self.recipe.dpo.task_source:
            task = evaluate_policy(self)
            out.update(task)
            self.eval_result = {**(self.eval_result or {}), "task": task}
        return out

    def progress(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}", "acc": f"{row.get('rewards/accuracies', float('nan')):.2f}"}

    def state_dict(self) -> dict:
        state: dict = {"guard": self.guard.state_dict()}
        if self.ref_cache is not None:  # exact: float32 values survive JSON (as float64 reprs) bit for bit
            c = self.ref_cache
            state["ref_log_probs"] = {k: getattr(c, k).tolist() for k in REF_FIELDS}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        saved = state.get("ref_log_probs")
        if saved is not None:
            self.ref_cache = PairLogps(*(torch.tensor(saved[k], dtype=torch.float32) for k in REF_FIELDS))

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter at ``run_dir/policy``, the held-out results in ``eval.json``; the summary's fields."""
        save_policy(self.shared, run_dir, self.eval_result)
        ev = self.eval_result or {}
        tp = self.train_pairs
        return {
            "policy": str(run_dir / POLICY),
            "loss_type": self.recipe.dpo.loss_type,
            "train_pairs": len(tp),
            "skipped_pairs": dict(tp.counts),
            "ties_beside": tp.ties_beside,
            "epochs": self.total_steps * self.recipe.dpo.batch_size / len(tp),
            "loss_first10": tail_mean(history, "loss", head=True),
            "loss_last10": tail_mean(history, "loss"),
            "train_accuracy_last10": tail_mean(history, "rewards/accuracies"),
            "preference_accuracy": ev.get("rewards/accuracies"),
            "n_pairs": ev.get("n_pairs", 0),
            "task_accuracy": (ev.get("task") or {}).get("eval/accuracy"),
            "skipped_updates": self.guard.skipped,
        }

    @staticmethod
    def evaluate_checkpoint(
        recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None
    ) -> dict:
        """``lorarl eval`` of a DPO recipe (:func:`evaluate`)."""
        return evaluate(recipe, checkpoint, n, shared=shared)


REF_FIELDS = ("chosen", "rejected", "chosen_tokens", "rejected_tokens")


def loss_of(recipe: Recipe):
    """The recipe's preference loss with its settings bound: ``fn(pair) -> (loss [B], chosen_rewards [B],
    rejected_rewards [B])`` (:mod:`lorarl.core.preference_losses`)."""
    cfg = recipe.dpo
    settings = LossSettings(
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        simpo_gamma=cfg.simpo_gamma,
        discopop_tau=cfg.discopop_tau,
        f_divergence=cfg.f_divergence_type,
        f_alpha_divergence_coef=cfg.f_alpha_divergence_coef,
    )
    return functools.partial(combined_loss, losses=cfg.losses, settings=settings)


def scoring_of(recipe: Recipe) -> Scoring:
    """How the policy scores the pairs: ``dpo.ld_alpha`` (LD-DPO) and ``dpo.use_weighting`` (WPO)."""
    return Scoring(ld_alpha=recipe.dpo.ld_alpha, wpo=recipe.dpo.use_weighting)


def held_out_reference(
    shared: SharedBase,
    role: str | None,
    pairs: PairSet,
    rows_per_forward: int,
    max_tokens: int,
    scoring: Scoring = PLAIN,
) -> PairLogps | None:
    """The reference's log-probs of every held-out pair (None for a reference-free loss)."""
    if role is None:
        return None
    return role_logps(shared, role, pairs, list(range(len(pairs))), rows_per_forward, max_tokens, scoring)


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Held-out results of ``checkpoint`` (``base``, a run directory, a checkpoint or an adapter folder) as the
    policy against the recipe's reference: the implicit-reward metrics on the held-out pairs (``preference/...``)
    and, with ``dpo.task_source``, the greedy task evaluation (:func:`lorarl.evaluate.evaluate`: ``accuracy``,
    ``reward_mean``, ...). For ``base`` (the starting point) every implicit reward of a reference-based loss is 0
    (accuracy 0: a tie counts as wrong)."""

    def held_out(shared: SharedBase, reference: str | None, policy_role) -> dict | None:
        pairs = load_split(recipe, shared, "eval", limit=n or recipe.eval.n)
        if pairs is None:
            return None
        role = policy_role()
        bs, max_tokens = recipe.eval.batch_size, recipe.dpo.max_tokens_per_forward
        scoring = scoring_of(recipe)
        ref = held_out_reference(shared, reference, pairs, bs, max_tokens, Scoring(ld_alpha=scoring.ld_alpha))
        metrics = pair_metrics(shared, pairs, role, ref, loss_of(recipe), bs, max_tokens, scoring)
        return {f"preference/{k}": v for k, v in metrics.items()}

    needs = recipe.dpo.needs_reference
    return evaluate_against_reference(
        recipe, checkpoint, n, shared, needs_reference=needs, held_out=held_out, what="pairs"
    )
