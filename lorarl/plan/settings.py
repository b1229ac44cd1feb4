"""The planner's shared types, below every module that estimates a phase (:mod:`.estimate`, :mod:`.engine`,
:mod:`.dpo`, :mod:`.supervised`): what a plan is asked about (:class:`PlanSettings`), the sizes of one step derived
from it (:class:`StepSizes`), and a phase's moments (terms alive at the same time, by name)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lorarl.core.chunking import logit_chunk_positions
from lorarl.plan.terms import (
    dequantized_weight_bytes,
    head_params,
    kv_bytes_per_token,
    layer_train_bytes_per_token,
    lora_params,
    resolve_targets,
)
from lorarl.shapes import ModelShape

PLANNED_ALGOS = ("grpo", "ppo", "dpo", "reward_model", "sft", "distill", "kto")  # the steps the planner models
PREFERENCE_STEPS = ("dpo", "kto")  # a no-grad reference pass, then the policy's forward + backward (lorarl.plan.dpo)
Moment = dict[str, float]  # the terms alive at the same time, by name
Moments = dict[str, Moment]  # a phase's moments, by name


@dataclass
class PlanSettings:
    """What one step looks like (the recipe numbers the planner reads)."""

    # grpo | ppo | dpo | reward_model | sft | kto (lorarl.plan.dpo, lorarl.plan.supervised: for dpo and
    # reward_model prompts_per_step / micro_batch_size count pairs, for sft examples, for kto rows)
    algo: str = "grpo"
    quantization: str = "nf4"  # nf4 | none
    double_quant: bool = True
    dtype_bytes: int = 2  # compute dtype: 2 (bf16 / fp16) or 4 (fp32)
    lora_r: int = 16
    lora_targets: Any = "all-linear"
    critic_lora_r: int = 16  # ppo
    critic_lora_targets: Any = "all-linear"  # ppo
    group_size: int = 8  # grpo; ppo samples one completion per prompt
    prompts_per_step: int = 8
    prompt_len: int = 256
    max_new_tokens: int = 256
    micro_batch_size: int = 8
    generation_batch_size: int | None = None  # rows per generate call; None: all rows of the step at once
    scoring_batch_size: int | None = None  # rows per no-grad log-prob / value / score pass; None: generation's
    logprob_chunk_size: int = 256
    logprob_chunk_tokens: int = 2048
    gradient_checkpointing: bool = True
    kl_coef: float = 0.0  # > 0 runs the reference
    num_iterations: int = 1  # grpo: > 1 records old log-probs
    reference_adapter: bool = False  # the reference is a frozen adapter (init_adapter / iterative GRPO), not the base
    minibatch_size: int | None = None  # ppo: rows per optimizer step (micro-batches split a minibatch)
    reward_model: bool = True  # ppo: a frozen reward adapter + score head is scored
    sampling_filters: bool = False  # top_p < 1 or top_k > 0
    training_entropy: bool = False  # an entropy bonus (entropy_coef > 0): the entropy carries a gradient
    device: str = "cuda"  # cuda | cpu (the cuBLAS workspace is a CUDA term)
    share_prompts: bool = True  # GRPO rollouts prefill / score each distinct prompt once (lorarl.rollout)
    # GRPO training under checkpointing packs each micro-batch's completions behind their shared prompt
    # (lorarl.rollout.pack_completions); False: one full row per completion (what docs/plan_validation measured)
    packed_training: bool = True
    engine: str = "hf"  # generation.engine: hf (transformers' generate) | fast (static cache, lorarl.plan.engine)
    cuda_graphs: bool = True  # generation.cuda_graphs: the fast engine keeps its cache and graph pool (CUDA only)
    keep_cache: bool = True  # generation.keep_cache resolved: with graphs, cache + pool held between rollouts
    # held-out evaluation during training (eval.every > 0): rows per greedy generate call (eval.batch_size, at most
    # eval.n; 0: no evaluation between steps) and its new tokens (eval.max_new_tokens; None: max_new_tokens). With
    # CUDA graphs its decode state is kept beside the training one (lorarl.plan.engine)
    eval_batch_size: int = 0
    eval_max_new_tokens: int | None = None
    # dpo / reward_model / kto: padded tokens per length-sorted forward (<algo>.max_tokens_per_forward; 0: one
    # forward per micro-batch), and whether a reference pass runs (dpo: when a loss reads it, not simpo / sft; kto:
    # always)
    max_tokens_per_forward: int = 0
    dpo_reference: bool = True
    judge: str = "none"  # an LLM-judge reward (lorarl.plan.judge): none | base | adapter | folder
    judge_model: str | None = None  # judge folder: its folder / config.json / known name (its weights count)
    judge_rows: int = 16  # judge prompts per generate call (judge.batch_size)
    judge_tokens: int = 0  # tokens of one judge prompt with its answer
    # distill (lorarl.plan.distill): the teacher (none | adapter: frozen on the base | model: a second base), a model
    # teacher's folder / config.json / known name (its weights count) and quantization, and distill.beta (0 / 1: a
    # KL, else the JSD)
    teacher: str = "none"
    teacher_model: str | None = None
    teacher_quantization: str | None = None  # nf4 | none; None: the base's
    distill_beta: float = 1.0

    @property
    def rows(self) -> int:
        """Completions per step (DPO, reward model: a chosen and a rejected response per pair; SFT: examples)."""
        per = self.group_size if self.algo == "grpo" else 2 if self.algo in ("dpo", "reward_model") else 1
        return self.prompts_per_step * per

    @property
    def split_rows(self) -> int:
        """The rows micro-batches split: the whole step for GRPO, a minibatch for PPO, the step's pairs for DPO and
        the reward model, its examples for SFT."""
        if self.algo in ("dpo", "reward_model", "sft", "kto"):
            return self.prompts_per_step
        return self.rows if self.algo == "grpo" else min(self.rows, self.minibatch_size or self.rows)


def plan_settings(settings: PlanSettings | None = None, **overrides: Any) -> PlanSettings:
    """``settings`` (default :class:`PlanSettings`) with keyword overrides of its fields."""
    return PlanSettings(**{**(asdict(settings) if settings else {}), **overrides})


@dataclass(frozen=True)
class StepSizes:
    """The sizes of one step that several phases read, derived once by :func:`step_sizes`."""

    dt: int  # bytes of the compute dtype
    prompt_len: int  # P
    new_tokens: int  # C
    seq_len: int  # T = P + C
    chunk_size: int  # model.logprob_chunk_size
    chunk_tokens: int  # model.logprob_chunk_tokens
    rows: int  # completions per step
    generation_rows: int  # rows per generate call
    scoring_rows: int  # rows per no-grad scoring pass
    micro_batch: int  # rows per training forward / backward
    n_policy: int  # policy LoRA parameters
    n_critic: int  # PPO: critic LoRA + value head parameters; GRPO: 0
    dequantized: int  # bytes of the largest dequantized projection (NF4), else 0
    kv_per_token: int  # KV cache bytes per token
    per_layer: float  # bytes per token of one layer recomputed with its backward

    def chunk(self, rows: int) -> int:
        """Positions per chunk of logits for a forward of ``rows`` rows over the ``C`` completion positions:
        ``c = max(1, min(logprob_chunk_size, C, logprob_chunk_tokens // rows))``
        (:func:`~lorarl.core.chunking.logit_chunk_positions`, what the model's chunked pass runs)."""
        return logit_chunk_positions(rows, self.new_tokens, self.chunk_size, self.chunk_tokens)


def step_sizes(shape: ModelShape, s: PlanSettings) -> StepSizes:
    """The rows, lengths and parameter counts of one step of ``s`` on ``shape``."""
    C = s.max_new_tokens
    targets = resolve_targets(shape, s.lora_targets)
    n_critic = 0
    if s.algo == "ppo":
        critic_targets = resolve_targets(shape, s.critic_lora_targets)
        n_critic = lora_params(shape, s.critic_lora_r, critic_targets) + head_params(shape)
    rows = s.rows
    gen_b = min(s.generation_batch_size or rows, rows)
    return StepSizes(
        dt=s.dtype_bytes,
        prompt_len=s.prompt_len,
        new_tokens=C,
        seq_len=s.prompt_len + C,
        chunk_size=s.logprob_chunk_size,
        chunk_tokens=s.logprob_chunk_tokens,
        rows=rows,
        generation_rows=gen_b,
        scoring_rows=min(s.scoring_batch_size or gen_b, rows),
        micro_batch=min(s.micro_batch_size, s.split_rows),
        # the trained adapter (the reward model's with its score head)
        n_policy=lora_params(shape, s.lora_r, targets) + (head_params(shape) if s.algo == "reward_model" else 0),
        n_critic=n_critic,
        dequantized=dequantized_weight_bytes(shape, s.quantization, s.dtype_bytes),
        kv_per_token=kv_bytes_per_token(shape, s.dtype_bytes),
        per_layer=layer_train_bytes_per_token(shape, s.dtype_bytes, targets),
    )
