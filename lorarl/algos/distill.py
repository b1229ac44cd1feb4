"""On-policy distillation on the one shared base (TRL's ``DistillationTrainer``; GKD, Agarwal et al. 2024): the
student is the policy adapter, a frozen teacher scores every token the student samples, and the student learns to
match the teacher's next-token distribution on its own completions. No reward function, no reference, no critic.

Read :meth:`Distill.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does checkpoints, resume,
evaluation, health checks, logging and the plot):

1. ``train.prompts_per_step`` prompts, derived from ``(seed, step)`` (a resumed run sees the same);
2. one completion per prompt sampled by the student (the policy adapter, the rollout engine, plain
   ``softmax(logits / generation.temperature)``: the distribution the loss scores), masks from generation; on
   parity steps the sampler's log-probs are compared with the trainer's (:mod:`lorarl.health`);
3. the loss per micro-batch: the teacher's hidden states (no gradient), the student's (with), and the generalized
   JSD of the two next-token distributions at ``generation.temperature`` per completion token, a chunk of positions
   of both models' logits at a time (:func:`lorarl.model.chunked.chunked_divergence`,
   :func:`lorarl.core.distillation.generalized_jsd`), reduced as the token mean over the step's completion tokens
   (TRL: the sum over the generation batch's tokens divided by their count); one optimizer step;
4. metrics by TRL's names: ``loss`` (the divergence per token), ``entropy`` (the student's, nats per token),
   ``num_tokens`` (prompt + completion tokens trained on so far), ``completions/mean_length`` / ``min_length`` /
   ``max_length`` / ``clipped_ratio`` / ``mean_terminated_length`` / ``min_terminated_length`` /
   ``max_terminated_length``, ``grad_norm``, ``learning_rate``; and lorarl's ``accuracy`` (the task verifier on the
   student's samples, when the data has answers: no reward is computed).

The teacher (:mod:`lorarl.model.teacher`) is a frozen adapter on the same base, or a second model (its own folder or
a merged export, with the student's tokenizer). Differences from TRL, on purpose: TRL's teacher is loaded
unquantized by its script; lorarl loads a second-model teacher like the base (NF4 on CUDA when large). TRL's
``per_device_train_batch_size x gradient_accumulation_steps`` prompts per optimizer step are
``train.prompts_per_step`` here, one completion each.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

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
from lorarl.algos.samples import completion_samples
from lorarl.config import Recipe
from lorarl.core.losses import batch_totals, reduce_loss
from lorarl.core.schedules import advance
from lorarl.errors import LorarlError
from lorarl.health import parity_due, parity_metrics, parity_tolerance
from lorarl.model import SharedBase
from lorarl.model.chunked import chunked_divergence
from lorarl.model.logprobs import completion_hidden
from lorarl.model.teacher import Teacher, adapts_head, load_teacher
from lorarl.phases import phase
from lorarl.rollout import Rollout, generate_rollout
from lorarl.tasks import accuracy
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step_halving

POLICY = "policy"

PLOT_PANELS = (
    ("divergence to the teacher (loss, nats per token)", ("loss",), "not logged"),
    ("accuracy of the student's samples", ("accuracy",), "not logged (the data has no `answer` column)"),
    ("student entropy (nats per token)", ("entropy",), "not logged"),
    ("completion length (tokens)", ("completions/mean_length",), "not logged"),
)


@dataclass
class DistillBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the training prompts."""

    step: int
    prompt_index: list[int]


def length_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
    """TRL's completion-length metrics of a step: ``completions/mean_length`` / ``min_length`` / ``max_length`` over
    every completion, ``completions/clipped_ratio`` (the share cut at ``max_new_tokens`` without EOS) and
    ``completions/mean_terminated_length`` / ``min`` / ``max`` over those that ended (0 when none did, as TRL).

    Shapes: ``lengths`` ``[N]`` (tokens, EOS included), ``truncated`` ``[N]`` bool.
    Example: lengths ``[3, 5, 8]``, truncated ``[F, F, T]`` -> mean 5.33, min 3, max 8, clipped 1/3, terminated
    mean 4, min 3, max 5.
    """
    n = lengths.float()
    done = n[~truncated.bool()]
    out = {
        "completions/mean_length": float(n.mean()),
        "completions/min_length": float(n.min()),
        "completions/max_length": float(n.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
    }
    for name, fn in (("mean", torch.mean), ("min", torch.min), ("max", torch.max)):
        out[f"completions/{name}_terminated_length"] = float(fn(done)) if len(done) else 0.0
    return out


def distill_loss(
    rows: Tensor,
    *,
    shared: SharedBase,
    teacher: Teacher,
    rollout: Rollout,
    beta: float,
    temperature: float,
    totals: dict[str, int],
    row_divergence: Tensor,
) -> tuple[Tensor, dict[str, tuple[float, float]]]:
    """Step 3 on a micro-batch (``rows``: ``B`` row indices into ``rollout``): its share of the step's loss
    ``sum_{i,t} m_it D_it / total_tokens`` (``D``: :func:`~lorarl.core.distillation.generalized_jsd` of the student's
    and the teacher's next-token distributions at completion token ``t``; ``total_tokens``: the whole step's, so the
    micro-batch losses sum to the step's loss). Writes each row's mean divergence into ``row_divergence`` ``[N]``
    (the logged samples). Returns ``(loss, {"entropy": (sum, tokens), "divergence": (sum, tokens)})``."""
    mb = rollout.select(rows)
    dev = shared.device
    mask = mb.completion_mask.to(dev)  # [B, T]
    h_teacher = teacher.hidden(mb)  # [B, T, H_T] no gradient
    with shared.role(POLICY, train=True):
        h_student = completion_hidden(shared, mb)  # [B, T, H]
        div, ent = chunked_divergence(
            h_student,
            shared.output_head(),
            h_teacher.to(dev),
            teacher.head(),
            beta,
            temperature,
            shared.cfg.logprob_chunk_size,
            shared.cfg.logprob_chunk_tokens,
        )  # [B, T] each
    loss = reduce_loss(div, mask, "token_mean", **totals, max_len=mask.shape[1])
    m = mask.float()
    with torch.no_grad():
        per_row = (div.detach() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        row_divergence[torch.as_tensor(rows, dtype=torch.long)] = per_row.float().cpu()
    n_tok = float(m.sum())
    return loss, {
        "entropy": (float((ent * m).sum()), n_tok),
        "divergence": (float((div.detach() * m).sum()), n_tok),
    }


class Distill:
    """The policy adapter (the student) distilled from a frozen teacher on its own samples: set-up, then
    :meth:`step` per batch. Used by the run loop, the benchmarks and the tests alike."""

    name = "distill"
    plot_panels = PLOT_PANELS
    final_eval = False  # `lorarl eval` (or eval.every) evaluates, as for GRPO

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.distill, recipe.train
        if adapts_head(recipe.lora.target_modules):
            raise LorarlError(
                f"lora.target_modules {recipe.lora.target_modules!r}: distillation projects the student's hidden "
                "states through the base's own output head; leave lm_head out (all-linear does)"
            )
        if recipe.model.init_adapter:  # continue a trained adapter (an SFT run, say)
            shared.add_adapter(POLICY, init_from=recipe.model.init_adapter, trainable=True)
        else:
            shared.add_adapter(POLICY, recipe.lora)
        self.teacher = load_teacher(cfg.teacher, shared)
        self.roles = self.outputs = [POLICY]
        self.prompts = load_train_prompts(recipe, shared.tokenizer)
        self.rollout_rows = rollout_batch(recipe, shared.device.type)  # generation.batch_size
        self.total_steps = self.last_step = tcfg.steps
        self.policy = trained_role(shared, POLICY, tcfg, tcfg.steps)
        self.optimizers, self.schedulers = {POLICY: self.policy.optimizer}, {POLICY: self.policy.scheduler}
        self.mbs = micro_batch_rows(
            tcfg.micro_batch_size, tcfg.prompts_per_step, planned_micro_batch(recipe, shared.device.type)
        )
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)
        self.parity_tolerance = parity_tolerance(recipe, shared.device.type)
        self.num_tokens = 0  # TRL's num_tokens: prompt + completion tokens trained on so far
        self.samples: list[dict] = []  # the last step's logged completions (lorarl.algos.samples)

    def batch(self, step: int) -> DistillBatch:
        """1. Step ``step``'s prompts, derived from ``(seed, step)``."""
        tcfg = self.recipe.train
        return DistillBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def step(self, batch: DistillBatch) -> dict:
        """One distillation step on ``batch``'s prompts; returns its metrics."""
        from tqdm.auto import tqdm

        shared, cfg, gen, tcfg = self.shared, self.recipe.distill, self.recipe.generation, self.recipe.train

        # 2. One completion per prompt from the student; parity of sampler and trainer on parity steps -------------
        parity_step = parity_due(self.recipe.health.parity_every, batch.step)
        rollout = generate_rollout(
            shared,
            [self.prompts.token_ids[i] for i in batch.prompt_index],
            gen,
            role=POLICY,
            prompt_index=batch.prompt_index,
            batch_size=self.rollout_rows,
            record_sampler=parity_step,
        )
        health = {}
        if parity_step:
            health = parity_metrics(shared, rollout, POLICY, gen.temperature, self.recipe.health.parity_rows)
            health["health/parity_tolerance"] = self.parity_tolerance

        # 3. The divergence to the teacher per token, token mean over the step; one optimizer step ------------------
        row_divergence = torch.full((len(rollout),), float("nan"))
        loss_fn = functools.partial(
            distill_loss,
            shared=shared,
            teacher=self.teacher,
            rollout=rollout,
            beta=cfg.beta,
            temperature=gen.temperature,
            totals=batch_totals(rollout.completion_mask),
            row_divergence=row_divergence,
        )
        rows = torch.arange(len(rollout))
        # backward runs inside the policy role in train mode: activation checkpointing recomputes the student's
        # forward there and must see the same adapter and mode as the forward did (the teacher switches in and out)
        with phase("training"), shared.role(POLICY, train=True):
            result, self.mbs = optimizer_step_halving(
                self.policy.params,
                self.policy.optimizer,
                lambda size: (rows[s] for s in micro_batches(len(rows), size)),
                self.mbs,
                loss_fn,
                max_grad_norm=tcfg.max_grad_norm,
                scaler=self.policy.scaler,
                on_halve=lambda a, b: tqdm.write(
                    f"step {batch.step}: out of memory at micro-batch {a}, retrying with {b}"
                ),
            )
        self.guard.check(result, batch.step)
        advance(self.policy.scheduler)  # the LR schedule advances once per step

        # 4. Metrics (TRL's names); the first train.log_completions rows as text --------------------------------------
        lengths = rollout.lengths
        self.num_tokens += int(rollout.prompt_mask.sum() + lengths.sum())
        nan = torch.full((len(rollout),), float("nan"))
        self.samples = completion_samples(
            shared.tokenizer, rollout, nan, None, tcfg.log_completions, divergence=row_divergence
        )
        return {
            "loss": result.loss,
            "entropy": result.stats.get("entropy"),
            "num_tokens": float(self.num_tokens),
            **length_metrics(lengths, rollout.truncated),
            "accuracy": accuracy(self.recipe, rollout.completions, self.prompts.columns(rollout.prompt_index)),
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "beta": cfg.beta,
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": float(lengths.sum()),
            **health,
        }

    def evaluate(self) -> dict:
        return evaluate_policy(self)

    def progress(self, row: dict) -> dict:
        acc = row.get("accuracy")
        loss = row.get("loss")
        return {
            "loss": f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "-",
            "acc": f"{acc:.2f}" if acc is not None else "-",
            "len": f"{row['completions/mean_length']:.0f}",
        }

    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict(), "num_tokens": self.num_tokens, "micro_batch": self.mbs}

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["guard"])
        self.num_tokens = int(state["num_tokens"])
        self.mbs = int(state["micro_batch"])

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The student's adapter in PEFT format at ``run_dir/policy``; the summary's fields."""
        self.shared.save_adapter(POLICY, run_dir / POLICY)
        return {
            "policy": str(run_dir / POLICY),
            "teacher": self.teacher.source,
            "teacher_kind": self.teacher.kind,
            "beta": self.recipe.distill.beta,
            "loss_first10": tail_mean(history, "loss", head=True),
            "loss_last10": tail_mean(history, "loss"),
            "accuracy_first10": tail_mean(history, "accuracy", head=True),
            "accuracy_last10": tail_mean(history, "accuracy"),
            "skipped_updates": self.guard.skipped,
            "data_rows": len(self.prompts),
        }
