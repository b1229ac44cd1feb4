"""Reward model: the ``reward`` LoRA adapter plus a fp32 score head on the shared base, trained with the
Bradley-Terry loss on preference pairs (InstructGPT, Ouyang et al. 2022, Eq. 1):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin) + center_coef * (r_chosen + r_rejected)^2

with the optional margin of Llama 2 (Touvron et al. 2023, Eq. 2; ``reward_model.margin`` reads a ``margin``
column) and the reward-centering term of Eisenstein et al. 2023 (``reward_model.center_coef``). The score of a
sequence is the head applied to the hidden state of its last non-pad token (the EOS that ends the response), found
from the attention mask.

Read :meth:`RewardModel.step` top to bottom; its steps are numbered (the run loop does the rest):

1. a batch of pairs (a per-epoch shuffle derived from ``(seed, epoch)``, so a resumed run sees the same data);
2. one optimizer step over micro-batches: chosen and rejected sequences of a micro-batch go through the base in one
   forward pass, the Bradley-Terry loss is averaged over the batch's pairs (gradient accumulation is exact);
3. held-out pairwise accuracy every ``eval.every`` steps and at the end (:meth:`RewardModel.evaluate`, run by the
   loop);
4. metrics; at the end (:meth:`RewardModel.finish`) the ``reward/`` adapter (PEFT folder + ``head.safetensors``).

The run stops after ``reward_model.epochs`` passes over the pairs or ``train.steps`` optimizer steps, whichever
comes first. :func:`evaluate` prints the held-out pairwise accuracy (``lorarl eval recipes/reward_model.yaml
--checkpoint DIR``).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass

import torch

from lorarl.algos.base import GuardState, batch_indices, micro_batch_rows, tail_mean, trained_role
from lorarl.config import Recipe
from lorarl.core.losses import bradley_terry_loss
from lorarl.core.schedules import advance
from lorarl.data.preferences import PreferenceSet, preferences_for
from lorarl.errors import DataError, LorarlError
from lorarl.model import SharedBase
from lorarl.model.tokens import pad_right, with_end_of_turn
from lorarl.phases import phase
from lorarl.rewards.source import REWARD, resolve_reward_adapter
from lorarl.runfiles import write_atomic
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step

PLOT_PANELS = (
    ("Bradley-Terry loss", ("loss",)),
    ("pairwise accuracy", ("accuracy", "eval/accuracy")),
    ("score margin r_chosen - r_rejected", ("margin",)),
    ("mean score (centering)", ("mean_reward",)),
)


@dataclass
class PairBatch:
    """Step ``step``'s pairs: rows ``pairs`` of the training preference set."""

    step: int
    pairs: list[int]


def load_pairs(recipe: Recipe, shared: SharedBase, split: str, limit: int | None = None) -> PreferenceSet | None:
    """The recipe's preference pairs of ``split``, tokenized. For ``eval``: ``data.eval_source``, else the test split
    of a datasets folder given as ``data.source``; None when there is no held-out set."""
    pairs = preferences_for(
        recipe.data,
        shared.tokenizer,
        split,
        recipe_path=recipe.source_path,
        max_length=recipe.reward_model.max_length,
        limit=limit,
    )
    if pairs is None:
        return None
    # one EOS rule: each response ends with the end-of-turn id a rollout's finished response is scored at
    eos, end = shared.eos_ids, shared.end_of_turn_id
    pairs.chosen_ids = [with_end_of_turn(x, eos, end) for x in pairs.chosen_ids]
    pairs.rejected_ids = [with_end_of_turn(x, eos, end) for x in pairs.rejected_ids]
    return pairs


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into groups whose padded size ``len(group) * longest`` stays within
    ``max_tokens`` (a group holds at least one sequence; ``max_tokens`` 0: one group, original order)."""
    if max_tokens <= 0:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def score_sequences(shared: SharedBase, seqs: list[list[int]], max_tokens: int) -> torch.Tensor:
    """Scores of ``seqs`` with the active ``reward`` role -> [len(seqs)] fp32, in the order given. Sequences are
    scored in length-sorted groups (:func:`length_groups`), so short ones are not padded to long ones; the scores
    do not depend on the grouping (each is read at its own last token under a causal mask)."""
    pad = shared.pad_id
    out = [None] * len(seqs)
    for group in length_groups([len(s) for s in seqs], max_tokens):
        ids, att = pad_right([seqs[i] for i in group], pad)
        scores = shared.scores(ids.to(shared.device), att.to(shared.device), head=REWARD)
        for k, i in enumerate(group):
            out[i] = scores[k]
    return torch.stack(out)


@torch.no_grad()
def score_pairs(
    shared: SharedBase, pairs: PreferenceSet, batch_size: int = 32, max_tokens: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every pair with the ``reward`` role, dropout off -> ``(r_chosen [n], r_rejected [n])`` fp32 CPU."""
    rc, rr = [], []
    with shared.role(REWARD, train=False):
        for s in range(0, len(pairs), batch_size):
            seqs = pairs.chosen_ids[s : s + batch_size] + pairs.rejected_ids[s : s + batch_size]
            scores = score_sequences(shared, seqs, max_tokens).float().cpu()
            b = len(seqs) // 2
            rc.append(scores[:b])
            rr.append(scores[b:])
    return torch.cat(rc), torch.cat(rr)


def pairwise_metrics(rc: torch.Tensor, rr: torch.Tensor, pairs: PreferenceSet | None = None) -> dict:
    """Pairwise accuracy (``r_chosen > r_rejected``, ties count as wrong), mean BT loss, mean margin; per ``kind``
    column too when the pairs have one."""
    correct = (rc > rr).float()
    out = {
        "pairwise_accuracy": float(correct.mean()),
        "n": int(rc.numel()),
        "loss": float(bradley_terry_loss(rc, rr).mean()),
        "margin_mean": float((rc - rr).mean()),
        "score_mean": float(torch.cat([rc, rr]).mean()),
    }
    if pairs is not None:
        kinds = [p["columns"].get("kind") for p in pairs.pairs[: rc.numel()]]
        if any(k is not None for k in kinds):
            by: dict[str, list[float]] = {}
            for k, c in zip(kinds, correct.tolist()):
                by.setdefault(str(k), []).append(c)
            out["accuracy_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(by.items())}
    return out


def bt_loss(
    shared: SharedBase,
    pairs: PreferenceSet,
    batch_pairs: int,
    use_margin: bool,
    center_coef: float,
    max_tokens: int,
    mb: list[int],
):
    """One micro-batch's share of the batch's mean Bradley-Terry loss: chosen and rejected sequences are scored in
    length-sorted forwards of at most ``max_tokens`` padded tokens; ``sum_i loss_i / batch_pairs``. Returns
    ``(loss, {stat: (sum, count)})``."""
    seqs = [pairs.chosen_ids[i] for i in mb] + [pairs.rejected_ids[i] for i in mb]
    with shared.role(REWARD, train=True, dropout=True):
        scores = score_sequences(shared, seqs, max_tokens)  # [2b]
    rc, rr = scores[: len(mb)], scores[len(mb) :]  # [b], [b]
    margin = pairs.margins(mb).to(shared.device) if use_margin else None
    per_pair = bradley_terry_loss(rc, rr, margin, center_coef)  # [b]
    b = float(len(mb))
    with torch.no_grad():
        stats = {
            "accuracy": (float((rc > rr).float().sum()), b),
            "margin": (float((rc - rr).sum()), b),
            "mean_reward": (float((rc + rr).sum()) / 2, b),
            "bt_loss": (float(per_pair.sum()), b),
        }
    return per_pair.sum() / batch_pairs, stats


class RewardModel(GuardState):
    """The reward adapter + score head on the shared base, trained on preference pairs: set-up, then :meth:`step`."""

    name = "reward_model"
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.reward_model, recipe.train
        if recipe.model.init_adapter:
            shared.add_adapter(REWARD, init_from=recipe.model.init_adapter, trainable=True, head=True)
        else:
            shared.add_adapter(REWARD, recipe.lora, head=True)
        self.roles = self.outputs = [REWARD]
        self.final_eval = True  # the run's summary reports the held-out pairwise accuracy
        self.train_pairs = load_pairs(recipe, shared, "train")
        self.eval_pairs = load_pairs(recipe, shared, "eval", limit=recipe.eval.n)
        n, B = len(self.train_pairs), cfg.batch_size
        self.total_steps = min(tcfg.steps, cfg.epochs * math.ceil(n / B))  # train.steps or the epochs, first
        self.last_step = self.total_steps  # the loop lowers it for --max-steps
        self.role = trained_role(shared, REWARD, tcfg, self.total_steps)
        self.optimizers, self.schedulers = {REWARD: self.role.optimizer}, {REWARD: self.role.scheduler}
        self.use_margin = cfg.margin and self.train_pairs.margins([0]) is not None
        self.mbs = micro_batch_rows(tcfg.micro_batch_size, B)
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.eval_result: dict | None = None

    def batch(self, step: int) -> PairBatch:
        """1. A batch of pairs: step ``step`` of a per-epoch shuffle."""
        return PairBatch(
            step,
            batch_indices(len(self.train_pairs), self.recipe.reward_model.batch_size, self.recipe.train.seed, step),
        )

    def step(self, batch: PairBatch) -> dict:
        """One optimizer step on ``batch`` (the loop runs the held-out evaluation, :meth:`evaluate`)."""
        shared, cfg, tcfg = self.shared, self.recipe.reward_model, self.recipe.train
        idx, step = batch.pairs, batch.step

        # 2. One optimizer step: chosen + rejected in length-sorted forwards, BT loss / batch pairs -------------
        loss_fn = functools.partial(
            bt_loss, shared, self.train_pairs, len(idx), self.use_margin, cfg.center_coef, cfg.max_tokens_per_forward
        )
        with phase("training"), shared.role(REWARD, train=True, dropout=True):  # active through backward (recompute)
            result = optimizer_step(
                self.role.params,
                self.role.optimizer,
                (idx[s] for s in micro_batches(len(idx), self.mbs)),
                loss_fn,
                max_grad_norm=tcfg.max_grad_norm,
                scaler=self.role.scaler,
            )
        advance(self.role.scheduler)
        self.guard.check(result, step)
        row = {
            "loss": result.loss,
            **result.stats,
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "epoch": (step - 1) * cfg.batch_size / len(self.train_pairs),
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
        }
        return row

    def evaluate(self) -> dict:
        """3. Held-out pairwise accuracy (every ``eval.every`` steps and at the end, run by the loop)."""
        if self.eval_pairs is None:
            return {}
        cfg = self.recipe.reward_model
        scores = score_pairs(self.shared, self.eval_pairs, self.recipe.eval.batch_size, cfg.max_tokens_per_forward)
        self.eval_result = pairwise_metrics(*scores, self.eval_pairs)
        return {"eval/accuracy": self.eval_result["pairwise_accuracy"], "eval/loss": self.eval_result["loss"]}

    def progress(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}", "acc": f"{row.get('accuracy', float('nan')):.2f}"}

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The reward adapter + head at ``run_dir/reward``, the held-out result in ``eval.json``; summary fields."""
        self.shared.save_adapter(REWARD, run_dir / REWARD)
        ev = self.eval_result
        if ev is not None:
            write_atomic(run_dir / "eval.json", json.dumps(ev, indent=2))
        return {
            "reward": str(run_dir / REWARD),
            "train_pairs": len(self.train_pairs),
            "skipped_pairs": len(self.train_pairs.skipped),
            "train_accuracy_last20": tail_mean(history, "accuracy", k=20),
            "pairwise_accuracy": ev["pairwise_accuracy"] if ev else None,
            "n": ev["n"] if ev else 0,
        }

    @staticmethod
    def evaluate_checkpoint(
        recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None
    ) -> dict:
        """``lorarl eval`` of a reward model: held-out pairwise accuracy (:func:`evaluate`)."""
        return evaluate(recipe, checkpoint, n, shared=shared)


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Held-out pairwise accuracy of a trained reward adapter: ``checkpoint`` is a run directory, a step checkpoint
    or an adapter folder. Returns ``{pairwise_accuracy, n, loss, margin_mean, score_mean, [accuracy_by_kind],
    checkpoint, seconds}``."""
    t0 = time.perf_counter()
    if checkpoint == "base":
        raise LorarlError("a reward model has no `base` to evaluate: give its run directory or adapter folder")
    folder = resolve_reward_adapter(checkpoint)
    if shared is None:
        shared = SharedBase.load(recipe.model)
    shared.remove_adapter(REWARD)
    shared.add_adapter(REWARD, init_from=folder, trainable=False, head=True)
    pairs = load_pairs(recipe, shared, "eval", limit=n or recipe.eval.n)
    if pairs is None:
        raise DataError(
            "no held-out preference pairs: set data.eval_source (or use a datasets folder with a test split)"
        )
    out = pairwise_metrics(
        *score_pairs(shared, pairs, recipe.eval.batch_size, recipe.reward_model.max_tokens_per_forward), pairs
    )
    out.update({"checkpoint": str(folder), "seconds": round(time.perf_counter() - t0, 1)})
    return out
