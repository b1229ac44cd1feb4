"""Supervised fine-tuning (SFT) of the policy adapter on the shared base: the cold start of DeepSeek-R1, and the
second SFT of its rejection-sampling stage.

The loss is the mean negative log-likelihood of the completion tokens (prompt tokens carry none), over every
completion token of the batch (TRL's ``SFTTrainer`` with ``completion_only_loss``):

    loss = -(1 / N_tok) * sum_i sum_t m_it * log p(y_it | x_i, y_i,<t)

or, with ``sft.loss_type: dft`` (TRL's ``loss_type="dft"``), each token's NLL weighted by its own probability,
held constant (:func:`completion_dft`).

Examples are rendered exactly as RL prompts are (:mod:`lorarl.data.sft`): the chat template with the generation
prompt, then the completion and the end-of-turn EOS a rollout ends with. A language-modeling row (``text``, TRL's
standard format) is its first token as the "prompt" and every later token as the completion: all trained, as TRL.
Log-probs come from the model's chunked path (:func:`lorarl.model.completion_logprobs`, temperature 1): the
``[B, T, V]`` logits never exist at once.

With ``sft.packing`` the examples are packed once into rows of ``sft.max_length`` tokens (TRL's packs,
:mod:`lorarl.data.packing`) and a step takes ``sft.batch_size`` of those rows; each example attends only to itself
and trains the same tokens as unpacked (:func:`packed_sft_loss`), so the loss is the same token mean over fewer,
fuller forwards (no padding).

Why not TRL's ``SFTTrainer``: it owns its model and training loop (a second copy of the base, or its own PEFT
wrapping), writes ``Trainer`` checkpoints (not atomic; resume not bit-identical across lorarl's per-step seeds) and
renders examples with its own templating. lorarl's step machinery gives SFT the one shared base, the run loop's
atomic checkpoints, bit-identical resume, metrics, plots and export for free; the loss is the same.

Read :meth:`SFT.step` top to bottom (the run loop, :mod:`lorarl.algos.loop`, does the rest):

1. a batch of examples, or of packed rows (a per-epoch shuffle derived from ``(seed, epoch)``, so a resumed run
   sees the same data);
2. one optimizer step over micro-batches, each contributing its share of the batch's token-mean NLL;
3. metrics; at the end (:meth:`SFT.finish`) the policy adapter in PEFT format at ``RUN/policy``.

The run stops after ``sft.epochs`` passes over the examples (packed rows) or ``train.steps`` steps, whichever
comes first.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.algos.base import GuardState, batch_indices, evaluate_policy, micro_batch_rows, tail_mean, trained_role
from lorarl.config import Recipe
from lorarl.core.schedules import advance
from lorarl.data.packing import Packs, pack_batch, pack_sft
from lorarl.data.sft import SFTSet, load_sft
from lorarl.model import SharedBase, completion_logprobs
from lorarl.model.logprobs import packed_logprobs
from lorarl.model.tokens import end_of_turn_id, pad_left, pad_right
from lorarl.phases import phase
from lorarl.update import NonFiniteGuard, micro_batches, optimizer_step

POLICY = "policy"

PLOT_PANELS = (
    ("SFT loss (NLL per completion token)", ("loss",)),
    ("gradient norm", ("grad_norm",)),
    ("learning rate", ("learning_rate",)),
    ("completion tokens per step", ("completion_tokens",)),
)


@dataclass
class SFTBatch:
    """Step ``step``'s examples: rows ``rows`` of the supervised set."""

    step: int
    rows: list[int]


@dataclass
class ExampleBatch:
    """Supervised examples as a :class:`lorarl.model.logprobs.TokenBatch`: prompts left padded, completions right
    padded, every row its own prompt (``prompt_index``: the example's index)."""

    prompt_ids: Tensor  # [B, P] long
    prompt_mask: Tensor  # [B, P] bool
    completion_ids: Tensor  # [B, T] long
    completion_mask: Tensor  # [B, T] bool
    prompt_index: list[int]

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


def example_batch(data: SFTSet, rows: list[int], pad_id: int) -> ExampleBatch:
    """Rows ``rows`` of ``data`` as an :class:`ExampleBatch`."""
    p_ids, p_mask = pad_left([data.prompt_ids[i] for i in rows], pad_id)
    c_ids, c_mask = pad_right([data.completion_ids[i] for i in rows], pad_id)
    return ExampleBatch(p_ids, p_mask, c_ids, c_mask.bool(), list(rows))


def loss_mask(data: SFTSet, rows: list[int], batch: ExampleBatch) -> Tensor:
    """``[B, T]`` bool: the completion tokens the loss counts -- all of them, or a trace's assistant turns."""
    if data.loss_masks is None:
        return batch.completion_mask
    return pad_right([[int(x) for x in data.loss_masks[i]] for i in rows], 0)[0].bool()


def loss_tokens(data: SFTSet, rows: list[int]) -> int:
    """The number of completion tokens of ``rows`` the loss counts."""
    if data.loss_masks is None:
        return sum(len(data.completion_ids[i]) for i in rows)
    return sum(sum(data.loss_masks[i]) for i in rows)


def completion_nll(logprobs: Tensor, mask: Tensor, total_tokens: int) -> Tensor:
    """A micro-batch's share of the batch's token-mean NLL: ``-sum_{b,t} m_bt * logp_bt / total_tokens``.

    ``logprobs``, ``mask`` ``[B, T]``; ``total_tokens``: completion tokens of the WHOLE batch, so the micro-batch
    shares sum to the batch loss. Example: logp ``[[-1, -2], [-3, 0]]``, mask ``[[1, 1], [1, 0]]``, 3 tokens -> 2.0.
    """
    return -(logprobs * mask).sum() / total_tokens


def completion_dft(logprobs: Tensor, mask: Tensor, total_tokens: int) -> Tensor:
    """A micro-batch's share of the batch's token-mean DFT loss (Dynamic Fine-Tuning, Wu et al. 2025,
    arXiv:2508.05629; TRL's SFT ``loss_type="dft"``): ``-sum_{b,t} m_bt * sg(p_bt) * logp_bt / total_tokens`` with
    ``p = exp(logp)`` and ``sg`` stop-gradient, so a token's gradient is its NLL's scaled by its probability (the
    paper's fix of SFT's implicit ``1 / p`` reward weighting).

    Shapes as :func:`completion_nll`. Example: logp ``[[-1, -2], [-3, 0]]``, mask ``[[1, 1], [1, 0]]``, 3 tokens ->
    ``(e^-1 + 2 e^-2 + 3 e^-3) / 3 = 0.262637``.
    """
    return -(logprobs * logprobs.detach().exp() * mask).sum() / total_tokens


SFT_LOSSES = {"nll": completion_nll, "dft": completion_dft}  # sft.loss_type -> the token loss


def common_prefix(prompts: list[list[int]]) -> int:
    """The length of the longest token prefix every prompt of ``prompts`` starts with (at most the shortest prompt).

    Example: ``[[1, 2, 3], [1, 2, 4], [1, 2]]`` -> 2.
    """
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for q in prompts[1:]:
        k = 0
        while k < n and q[k] == first[k]:
            k += 1
        n = k
    return n


def prefix_split(
    prompts: list[list[int]], completions: list[list[int]], masks: list[list[bool]]
) -> tuple[list[int], list[list[int]], list[list[bool]]]:
    """``(prefix, rests, rest masks)``: the prefix every prompt shares, and each row's rest -- its prompt's tail,
    then its completion. ``prefix + rest_i == prompt_i + completion_i`` token for token; a rest's loss mask is False
    on the prompt's tail and the completion's own mask after it.

    Example: prompts ``[[1, 2, 3], [1, 2, 4]]``, completions ``[[7], [8, 9]]``, masks ``[[T], [T, F]]`` ->
    ``([1, 2], [[3, 7], [4, 8, 9]], [[F, T], [F, T, F]])``.
    """
    n = common_prefix(prompts)
    rests = [p[n:] + c for p, c in zip(prompts, completions)]
    rest_masks = [[False] * (len(p) - n) + list(m) for p, m in zip(prompts, masks)]
    return prompts[0][:n], rests, rest_masks


def shared_prefix_batch(data: SFTSet, rows: list[int], pad_id: int) -> tuple[ExampleBatch, Tensor]:
    """Rows ``rows`` as ONE shared prompt (the prefix all their prompts share: the chat template's system prompt,
    with a tool-use trace's tool schemas ~170 tokens) and per-row completions (each prompt's tail, then its
    completion), with the loss mask ``[B, T]`` bool on the completions' loss tokens only.

    The same prompt on every row lets :func:`lorarl.model.completion_logprobs` run the prefix once (its keys /
    values shared, or packed under activation checkpointing): the same log-probs as the per-row forward of
    :func:`example_batch` (an exact rewrite: same tokens, positions and attention), for ``L + sum(rest)`` tokens
    instead of ``sum(prompt + completion)``. A prefix shorter than 2 tokens gives back :func:`example_batch`.
    """
    prompts = [data.prompt_ids[i] for i in rows]
    completions = [data.completion_ids[i] for i in rows]
    masks = (
        [data.loss_masks[i] for i in rows] if data.loss_masks is not None else [[True] * len(c) for c in completions]
    )
    prefix, rests, rest_masks = prefix_split(prompts, completions, masks)
    if len(prefix) < 2 or len(rows) < 2:
        mb = example_batch(data, rows, pad_id)
        return mb, loss_mask(data, rows, mb)
    p_ids = torch.as_tensor([prefix] * len(rows), dtype=torch.long)
    c_ids, c_mask = pad_right(rests, pad_id)
    mask = pad_right([[int(x) for x in m] for m in rest_masks], 0)[0].bool()
    return ExampleBatch(p_ids, torch.ones_like(p_ids, dtype=torch.bool), c_ids, c_mask.bool(), [0] * len(rows)), mask


def packed_sft_loss(shared: SharedBase, packs: Packs, total_tokens: int, rows: list[int], loss_type: str = "nll"):
    """Step 2 with ``sft.packing``: the loss share (``SFT_LOSSES[loss_type]``) of packed rows ``rows`` ->
    ``(loss, {})``. Each example attends only to itself (:func:`lorarl.model.logprobs.packed_logprobs`); the targets
    are the tokens its unpacked row trains (:func:`lorarl.data.packing.pack_targets`), so the batch's loss is the same
    token mean."""
    ids, pos, targets = pack_batch(packs, rows, shared.pad_id)  # [R, L], [R, L], [R, L - 1]
    with shared.role(POLICY, train=True, dropout=True):
        logprobs = packed_logprobs(shared, ids, pos)  # [R, L - 1]
    return SFT_LOSSES[loss_type](logprobs, targets.to(shared.device), total_tokens), {}


def sft_loss(shared: SharedBase, data: SFTSet, total_tokens: int, rows: list[int], loss_type: str = "nll"):
    """Step 2: the loss share (``SFT_LOSSES[loss_type]``) of micro-batch ``rows`` under the policy -> ``(loss, {})``
    (the loss is the metric). The rows' common prompt prefix runs once (:func:`shared_prefix_batch`)."""
    mb, mask = shared_prefix_batch(data, rows, shared.pad_id)
    mask = mask.to(shared.device)  # [B, T]
    with shared.role(POLICY, train=True, dropout=True):
        logprobs, _ = completion_logprobs(shared, mb, temperature=1.0)  # [B, T]
    return SFT_LOSSES[loss_type](logprobs, mask, total_tokens), {}


class SFT(GuardState):
    """The policy adapter trained on supervised examples: set-up, then :meth:`step` per batch."""

    name = "sft"
    final_eval = False  # held-out accuracy every eval.every steps; the pipeline evaluates every stage
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.sft, recipe.train
        if recipe.model.init_adapter:
            shared.add_adapter(POLICY, init_from=recipe.model.init_adapter, trainable=True)
        else:
            shared.add_adapter(POLICY, recipe.lora)
        self.roles = self.outputs = [POLICY]
        if recipe.agent is not None:  # tool-use traces: loss on the assistant's turns only (lorarl.agents.traces)
            from lorarl.agents.traces import load_tool_sft

            self.data = load_tool_sft(recipe, shared.tokenizer, shared.eos_ids, self.eos_id(), cfg.max_length)
        else:
            self.data = load_sft(
                recipe.data,
                shared.tokenizer,
                self.eos_id(),
                cfg.max_length,
                recipe_path=recipe.source_path,
                long_rows=cfg.packing and cfg.packing_strategy != "bfd",  # the other strategies split them
            )
        for i, why in self.data.skipped[:5]:
            print(f"data: skipped row {i}: {why}", file=sys.stderr)
        if self.data.skipped:
            print(
                f"data: skipped {len(self.data.skipped)} bad rows of {self.data.source} (data.on_bad_row: skip)",
                file=sys.stderr,
            )
        # with packing a step's units are packed rows of examples (TRL's batch), else examples
        self.packs = pack_sft(self.data, cfg.max_length, cfg.packing_strategy) if cfg.packing else None
        self.step_loss = self.packed_rows_loss if cfg.packing else self.examples_loss
        self.loss_type = cfg.loss_type
        n, B = self.units(), cfg.batch_size
        self.total_steps = min(tcfg.steps, math.ceil(cfg.epochs * n / B))  # batches run on across epochs
        self.last_step = self.total_steps  # the loop lowers it for --max-steps
        self.policy = trained_role(shared, POLICY, tcfg, self.total_steps)
        self.optimizers, self.schedulers = {POLICY: self.policy.optimizer}, {POLICY: self.policy.scheduler}
        self.mbs = micro_batch_rows(tcfg.micro_batch_size, B)
        self.guard = NonFiniteGuard(tcfg.max_nonfinite_in_row)

    def examples_loss(self, rows: list[int]):
        """``(loss tokens, tokens run, micro-batch loss)`` of a batch of examples ``rows``."""
        total = loss_tokens(self.data, rows)
        tokens = total + sum(len(self.data.prompt_ids[i]) for i in rows)
        return total, tokens, functools.partial(sft_loss, self.shared, self.data, total, loss_type=self.loss_type)

    def packed_rows_loss(self, rows: list[int]):
        """``(loss tokens, tokens run, micro-batch loss)`` of a batch of packed rows ``rows`` (``sft.packing``)."""
        total = self.packs.targets(rows)
        loss = functools.partial(packed_sft_loss, self.shared, self.packs, total, loss_type=self.loss_type)
        return total, self.packs.tokens(rows), loss

    def units(self) -> int:
        """What a step's batch counts: packed rows with ``sft.packing``, else examples."""
        return len(self.packs) if self.packs is not None else len(self.data)

    def eos_id(self) -> int:
        """The EOS a rollout's response ends with: every completion is trained to end with it."""
        return end_of_turn_id(self.shared.base, self.shared.tokenizer)

    def batch(self, step: int) -> SFTBatch:
        """1. Step ``step``'s examples: consecutive slices of a per-epoch shuffle."""
        cfg, tcfg = self.recipe.sft, self.recipe.train
        return SFTBatch(step, batch_indices(self.units(), cfg.batch_size, tcfg.seed, step))

    def step(self, batch: SFTBatch) -> dict:
        """One optimizer step on ``batch``; returns its metrics."""
        shared, tcfg, rows, step = self.shared, self.recipe.train, batch.rows, batch.step
        total_tokens, tokens, loss_fn = self.step_loss(rows)

        # 2. One optimizer step over micro-batches: each returns its share of the batch's token-mean NLL --------
        # (active through backward: activation checkpointing recomputes under the same adapter and dropout)
        with phase("training"), shared.role(POLICY, train=True, dropout=True):
            result = optimizer_step(
                self.policy.params,
                self.policy.optimizer,
                (rows[s] for s in micro_batches(len(rows), self.mbs)),
                loss_fn,
                max_grad_norm=tcfg.max_grad_norm,
                scaler=self.policy.scaler,
            )
        advance(self.policy.scheduler)
        self.guard.check(result, step)

        # 3. Metrics ------------------------------------------------------------------------------------------------
        return {
            "loss": result.loss,
            # exp(token-mean NLL); DFT's loss is no NLL, so no perplexity
            "perplexity": math.exp(min(result.loss, 50.0))
            if math.isfinite(result.loss) and self.loss_type == "nll"
            else None,
            "grad_norm": result.grad_norm,
            "learning_rate": result.lr,
            "epoch": (step - 1) * self.recipe.sft.batch_size / self.units(),
            "completion_tokens": total_tokens,
            "skipped_updates": self.guard.skipped,
            **self.guard.loss_scale_metrics(),  # fp16 bases only
            "tokens": float(tokens),
        }

    def evaluate(self) -> dict:
        """Greedy held-out evaluation of the policy, as RL evaluates it (``eval/...``)."""
        return evaluate_policy(self)

    def progress(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}"}

    def finish(self, run_dir, history: list[dict]) -> dict:
        """The policy adapter at ``run_dir/policy``; the summary's SFT fields."""
        self.shared.save_adapter(POLICY, run_dir / POLICY)
        return {
            "policy": str(run_dir / POLICY),
            "loss_first10": tail_mean(history, "loss", head=True),
            "loss_last10": tail_mean(history, "loss"),
            "examples": len(self.data),
            **({"packed_rows": len(self.packs)} if self.packs is not None else {}),
            "skipped_rows": len(self.data.skipped),
            "epochs": self.total_steps * self.recipe.sft.batch_size / self.units(),
            "skipped_updates": self.guard.skipped,
        }
