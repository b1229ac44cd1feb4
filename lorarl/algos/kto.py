"""KTO on the shared base (Ethayarajh et al. 2024; TRL's KTOTrainer): the policy is a LoRA adapter trained on
unpaired rows -- a prompt, one completion, a label (desirable or not) -- against the reference, the base with adapters
disabled (or ``model.init_adapter`` loaded a second time frozen), so no second model is ever loaded. Losses by TRL's
names (``kto.loss_type``: ``kto``, ``apo_zero_unpaired``), pure functions in :mod:`lorarl.core.kto_losses`.

Read :meth:`KTO.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does checkpoints, resume, evaluation,
logging and the plot):

1. a batch of rows: a per-epoch shuffle derived from ``(seed, epoch)``, so a resumed run sees the same data;
2. the KL estimate's mismatched pairs: each prompt of the batch with the completion of the row before it (TRL's
   rotation by one), scored without gradients under the policy and the reference: ``kl`` = ``z0``, the clamped mean
   log-ratio (none for ``apo_zero_unpaired``);
3. the reference's summed completion log-probs of the batch, without gradients -- or, with
   ``kto.precompute_ref_log_probs`` (TRL's name), of every training row once before the first step, kept in the
   checkpoint so a resumed run uses the very same numbers;
4. one optimizer step over micro-batches of rows: each row's weighted loss summed and divided by the batch's rows
   (TRL's mean; gradient accumulation is exact: ``z0`` is one number for the whole batch);
5. metrics by TRL's names: ``loss``, ``kl``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
   ``logps/chosen``, ``logps/rejected`` (a batch with rows of one kind only logs that kind, as TRL), ``grad_norm``,
   ``learning_rate``.

Where lorarl differs from TRL: TRL builds the mismatched pairs when it prepares the dataset, against each
``per_device_train_batch_size`` slice in dataset order, and so needs ``train_sampling_strategy="sequential"`` (on a
paired dataset it unpairs, its first thousand rows are all desirable, then all undesirable); lorarl draws each batch
in a seeded shuffle first and rotates within it, so a batch mixes both kinds and the KL is estimated over the whole
step's batch (TRL: per micro-batch).

:meth:`KTO.evaluate` (every ``eval.every`` steps and at the end): the held-out loss and TRL's metrics on
``data.eval_source`` (``eval/loss``, ``eval/kl``, ``eval/rewards/...``; the reference's log-probs computed once), and
with ``kto.task_source`` the greedy held-out task evaluation RL uses (``eval/accuracy``, ``eval/reward``).
``lorarl eval recipes/kto_arithmetic.yaml --checkpoint RUN|base`` prints both (:meth:`KTO.evaluate_checkpoint`).

Data (:mod:`lorarl.data.unpaired`): TRL's unpaired rows (``prompt``, ``completion``, ``label``), or preference pairs
unpaired into two rows each, as TRL does; unusable rows are left out and counted.
"""

from __future__ import annotations

import functools
import math
import sys
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
from lorarl.algos.dpo import setup_roles
from lorarl.algos.kto_scoring import kto_stats, role_rows_logps, rows_logps, with_margin
from lorarl.algos.preference_eval import POLICY, evaluate_against_reference, report_split, save_policy
from lorarl.config import Recipe
from lorarl.core.kto_losses import NEEDS_KL, kl_estimate, mismatched_rows, unpaired_loss, weight_ranges
from lorarl.core.schedules import advance
from lorarl.data.unpaired import UnpairedSet, load_unpaired, unpaired_summary
from lorarl.errors import DataError
from lorarl.model import SharedBase
from lorarl.phases import phase
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step

PLOT_PANELS = (
    ("KTO loss", ("loss", "eval/loss")),
    ("implicit rewards (beta x log-ratio)", ("rewards/chosen", "rewards/rejected")),
    ("KL estimate z0 (mismatched pairs)", ("kl", "eval/kl")),
    ("completion log-probs (policy)", ("logps/chosen", "logps/rejected")),
)


@dataclass
class RowBatch:
    """Step ``step``'s rows: rows ``rows`` of the training set."""

    step: int
    rows: list[int]


def load_split(recipe: Recipe, shared: SharedBase, split: str, limit: int | None = None) -> UnpairedSet | None:
    """The recipe's tokenized rows of ``split`` (None for ``eval`` without held-out rows); what they are and what was
    left out is reported on stderr."""
    rows = load_unpaired(
        recipe.data,
        shared.tokenizer,
        split,
        eos_ids=shared.eos_ids,
        end_id=shared.end_of_turn_id,
        max_length=recipe.kto.max_length,
        recipe_path=recipe.source_path,
        limit=limit,
    )
    if rows is not None:
        report_split(unpaired_summary(rows), rows.skipped)
    return rows


def balance_line(rows: UnpairedSet, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's warning when the desirable and undesirable counts differ and neither weight balances them
    (:func:`lorarl.core.kto_losses.weight_ranges`), as one line; None when balanced."""
    d = rows.desirable
    ranges = weight_ranges(d, len(rows) - d, desirable_weight, undesirable_weight)
    if ranges is None:
        return None
    (dl, dh), (ul, uh) = ranges
    return (
        f"{d} desirable and {len(rows) - d} undesirable rows, and the weights do not balance them (KTO paper, Eq. 8): "
        f"set EITHER kto.desirable_weight in [{dl}, {dh}] OR kto.undesirable_weight in [{ul}, {uh}]"
    )


def kto_loss_part(
    shared: SharedBase,
    rows: UnpairedSet,
    idx: list[int],
    ref: torch.Tensor,
    kl: torch.Tensor,
    loss_fn,
    max_tokens: int,
    part: slice,
):
    """Step 4: micro-batch ``idx[part]``'s share of the batch's mean loss under the active policy -> ``(sum of its
    rows' losses / len(idx), {stat: (sum, count)})``; ``ref``: the reference's log-probs of ``idx`` in order."""
    mb = idx[part]
    logps = rows_logps(shared, rows, mb, max_tokens)  # [b]
    dev = logps.device
    desirable = torch.tensor([rows.labels[i] for i in mb], dtype=torch.bool, device=dev)
    losses, rewards = loss_fn(logps=logps, ref_logps=ref[part].to(dev), desirable=desirable, kl=kl.to(dev))
    return losses.sum() / len(idx), kto_stats(rewards, logps, desirable)


class KTO:
    """The policy adapter trained on labelled completions against the reference: set-up, then :meth:`step`."""

    name = "kto"
    plot_panels = PLOT_PANELS
    final_eval = True  # the summary reports the held-out loss (and task accuracy)

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.kto, recipe.train
        self.reference = setup_roles(shared, recipe)
        self.roles = self.outputs = [POLICY]
        self.train_rows = load_split(recipe, shared, "train")
        self.eval_rows = load_split(recipe, shared, "eval", limit=recipe.eval.n)
        n, B = len(self.train_rows), cfg.batch_size
        self.needs_kl = cfg.loss_type in NEEDS_KL
        if self.needs_kl and n < 2:
            raise DataError(
                f"{self.train_rows.source}: 1 usable row; kto.loss_type kto needs at least 2 (its KL estimate pairs a "
                "prompt with another row's completion): add a vote, or use loss_type apo_zero_unpaired"
            )
        self.balance = balance_line(self.train_rows, cfg.desirable_weight, cfg.undesirable_weight)
        if self.balance:
            print(f"data: {self.balance}", file=sys.stderr)
        self.total_steps = min(tcfg.steps, math.ceil(cfg.epochs * n / B))  # batches run on across epochs
        self.last_step = self.total_steps  # the loop lowers it for --max-steps
        self.policy = trained_role(shared, POLICY, tcfg, self.total_steps)
        self.optimizers, self.schedulers = {POLICY: self.policy.optimizer}, {POLICY: self.policy.scheduler}
        self.mbs = micro_batch_rows(tcfg.micro_batch_size, B, planned_micro_batch(recipe, shared.device.type))
        self.max_tokens = cfg.max_tokens_per_forward
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.loss_fn = loss_of(recipe)
        self.ref_cache: torch.Tensor | None = None  # kto.precompute_ref_log_probs: every training row's, once
        self.eval_ref: tuple | None = None  # the held-out rows' reference log-probs (matched, mismatched), once
        self.eval_result: dict | None = None

    def batch(self, step: int) -> RowBatch:
        """1. Step ``step``'s rows: consecutive slices of a per-epoch shuffle."""
        cfg = self.recipe.kto
        return RowBatch(step, batch_indices(len(self.train_rows), cfg.batch_size, self.recipe.train.seed, step))

    def kl_point(self, idx: list[int]) -> torch.Tensor:
        """2. ``z0`` of the batch ``idx``: the policy's and the reference's log-probs of its mismatched pairs (each
        prompt with the previous row's completion), no gradients (0 for a loss without a KL term)."""
        if not self.needs_kl:
            return torch.zeros(())
        completions = [idx[j] for j in mismatched_rows(len(idx))]
        kw = dict(rows_per_forward=self.mbs, max_tokens=self.max_tokens, completions=completions)
        with phase("reference"):
            policy = role_rows_logps(self.shared, POLICY, self.train_rows, idx, **kw)
            reference = role_rows_logps(self.shared, self.reference, self.train_rows, idx, **kw)
        return kl_estimate(policy, reference)

    def reference_logps(self, idx: list[int]) -> torch.Tensor:
        """3. The reference's log-probs of ``idx``: from the precomputed set, or computed now without gradients."""
        with phase("reference"):
            if self.recipe.kto.precompute_ref_log_probs:
                if self.ref_cache is None:
                    every = list(range(len(self.train_rows)))
                    self.ref_cache = role_rows_logps(
                        self.shared, self.reference, self.train_rows, every, self.mbs, self.max_tokens
                    )
                return self.ref_cache[torch.as_tensor(idx, dtype=torch.long)]
            return role_rows_logps(self.shared, self.reference, self.train_rows, idx, self.mbs, self.max_tokens)

    def step(self, batch: RowBatch) -> dict:
        """One optimizer step on ``batch``; returns its metrics."""
        shared, tcfg, idx, step = self.shared, self.recipe.train, batch.rows, batch.step

        # 2-3. The KL reference point and the reference's log-probs (no gradients) ---------------------------------
        kl = self.kl_point(idx)
        ref = self.reference_logps(idx)

        # 4. One optimizer step: each micro-batch's weighted row losses / the batch's rows ---------------------------
        tr = self.train_rows
        loss = functools.partial(kto_loss_part, shared, tr, idx, ref, kl, self.loss_fn, self.max_tokens)
        with phase("training"), shared.role(POLICY, train=True, dropout=True):
            result = optimizer_step(
                self.policy.params,
                self.policy.optimizer,
                micro_batches(len(idx), self.mbs),
                loss,
                max_grad_norm=tcfg.max_grad_norm,
                scaler=self.policy.scaler,
            )
        advance(self.policy.scheduler)
        self.guard.check(result, step)

        # 5. Metrics (TRL's names) --------------------------------------------------------------------------------
        return {
            "loss": result.loss,
            "kl": float(kl),
            **with_margin(dict(result.stats)),
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "epoch": (step - 1) * self.recipe.kto.batch_size / len(tr),
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": row_token_count(tr, idx, self.needs_kl),
        }

    def evaluate(self) -> dict:
        """Held-out loss and TRL's metrics (``eval/loss``, ``eval/kl``, ``eval/rewards/...``) and, with
        ``kto.task_source``, the greedy held-out task evaluation (``eval/accuracy``, ``eval/reward``, ...)."""
        out: dict = {}
        if self.eval_rows is not None:
            bs = self.recipe.eval.batch_size
            if self.eval_ref is None:  # computed once: the reference never changes
                self.eval_ref = held_out_reference(self.shared, self.reference, self.eval_rows, bs, self.max_tokens)
            self.eval_result = held_out_metrics(
                self.shared, self.eval_rows, POLICY, self.eval_ref, self.loss_fn, self.needs_kl, bs, self.max_tokens
            )
            out.update({f"eval/{k}": v for k, v in self.eval_result.items() if isinstance(v, float)})
        if self.recipe.kto.task_source:
            task = evaluate_policy(self)
            out.update(task)
            self.eval_result = {**(self.eval_result or {}), "task": task}
        return out

    def progress(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}", "kl": f"{row.get('kl', float('nan')):.2f}"}

    def state_dict(self) -> dict:
        state: dict = {"guard": self.guard.state_dict()}
        if self.ref_cache is not None:  # exact: float32 values survive JSON (as float64 reprs) bit for bit
            state["ref_log_probs"] = self.ref_cache.tolist()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        saved = state.get("ref_log_probs")
        if saved is not None:
            self.ref_cache = torch.tensor(saved, dtype=torch.float32)

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter at ``run_dir/policy``, the held-out results in ``eval.json``; the summary's fields."""
        save_policy(self.shared, run_dir, self.eval_result)
        ev = self.eval_result or {}
        tr = self.train_rows
        return {
            "policy": str(run_dir / POLICY),
            "loss_type": self.recipe.kto.loss_type,
            "train_rows": len(tr),
            "desirable_rows": tr.desirable,
            "rows_from_pairs": tr.from_pairs,
            "skipped_rows": dict(tr.counts),
            "ties_beside": tr.ties_beside,
            "balance_warning": self.balance,
            "epochs": self.total_steps * self.recipe.kto.batch_size / len(tr),
            "loss_first10": tail_mean(history, "loss", head=True),
            "loss_last10": tail_mean(history, "loss"),
            "kl_last10": tail_mean(history, "kl"),
            "eval_loss": ev.get("loss"),
            "n_rows": ev.get("n_rows", 0),
            "task_accuracy": (ev.get("task") or {}).get("eval/accuracy"),
            "skipped_updates": self.guard.skipped,
        }

    @staticmethod
    def evaluate_checkpoint(
        recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None
    ) -> dict:
        """``lorarl eval`` of a KTO recipe (:func:`evaluate`)."""
        return evaluate(recipe, checkpoint, n, shared=shared)


def loss_of(recipe: Recipe):
    """The recipe's KTO loss with its settings bound: ``fn(logps, ref_logps, desirable, kl) -> (losses [B],
    rewards [B])`` (:func:`lorarl.core.kto_losses.unpaired_loss`)."""
    cfg = recipe.kto
    return functools.partial(
        unpaired_loss,
        cfg.loss_type,
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
    )


def row_token_count(rows: UnpairedSet, idx: list[int], needs_kl: bool) -> float:
    """Tokens the step's forwards read for rows ``idx``: each row once with gradients and once under the reference,
    and with a KL term the mismatched pairs (as many tokens) under both roles again."""
    n = sum(len(rows.prompt_ids[i]) + len(rows.completion_ids[i]) for i in idx)
    return float(n * (4 if needs_kl else 2))


def held_out_reference(
    shared: SharedBase, role: str, rows: UnpairedSet, rows_per_forward: int, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs of every held-out row and of the held-out set's mismatched pairs (each row's prompt
    with the previous row's completion, over the whole set): ``([n], [n])``."""
    every = list(range(len(rows)))
    matched = role_rows_logps(shared, role, rows, every, rows_per_forward, max_tokens)
    if len(rows) < 2:
        return matched, matched
    shifted = [every[j] for j in mismatched_rows(len(rows))]
    return matched, role_rows_logps(shared, role, rows, every, rows_per_forward, max_tokens, completions=shifted)


def held_out_metrics(
    shared: SharedBase,
    rows: UnpairedSet,
    role: str,
    ref: tuple[torch.Tensor, torch.Tensor],
    loss_fn,
    needs_kl: bool,
    rows_per_forward: int,
    max_tokens: int,
) -> dict:
    """Held-out figures of ``role`` as the policy on every row of ``rows`` (``ref``: :func:`held_out_reference`):
    the mean loss, ``kl`` (over the whole set's mismatched pairs), TRL's reward and log-prob metrics by kind, the
    row count."""
    every = list(range(len(rows)))
    pol = role_rows_logps(shared, role, rows, every, rows_per_forward, max_tokens)
    kl = torch.zeros(())
    if needs_kl and len(rows) >= 2:
        shifted = [every[j] for j in mismatched_rows(len(rows))]
        pol_kl = role_rows_logps(shared, role, rows, every, rows_per_forward, max_tokens, completions=shifted)
        kl = kl_estimate(pol_kl, ref[1])
    desirable = torch.tensor(rows.labels, dtype=torch.bool)
    losses, rewards = loss_fn(logps=pol, ref_logps=ref[0], desirable=desirable, kl=kl)
    stats = {k: s / c for k, (s, c) in kto_stats(rewards, pol, desirable).items()}
    return {"loss": float(losses.mean()), "kl": float(kl), **with_margin(stats), "n_rows": len(rows)}


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Held-out results of ``checkpoint`` (``base``, a run directory, a checkpoint or an adapter folder) as the
    policy against the recipe's reference: the loss and TRL's metrics on the held-out rows (``kto/...``) and, with
    ``kto.task_source``, the greedy task evaluation (:func:`lorarl.evaluate.evaluate`: ``accuracy``,
    ``reward_mean``, ...). For ``base`` (the starting point) every implicit reward is 0."""

    def held_out(shared: SharedBase, reference: str | None, policy_role) -> dict | None:
        rows = load_split(recipe, shared, "eval", limit=n or recipe.eval.n)
        if rows is None:
            return None
        role = policy_role()
        bs, max_tokens = recipe.eval.batch_size, recipe.kto.max_tokens_per_forward
        ref = held_out_reference(shared, reference, rows, bs, max_tokens)
        needs_kl = recipe.kto.loss_type in NEEDS_KL
        metrics = held_out_metrics(shared, rows, role, ref, loss_of(recipe), needs_kl, bs, max_tokens)
        return {f"kto/{k}": v for k, v in metrics.items()}

    return evaluate_against_reference(
        recipe, checkpoint, n, shared, needs_reference=True, held_out=held_out, what="rows"
    )
