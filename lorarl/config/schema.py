"""The recipe's sections: one dataclass each, every field documented where it is declared, ranges checked in
``validate``. A recipe holds the shared sections and only its own algorithm's section (``grpo``, ``ppo``,
``reward_model``); sections that mix concerns are grouped into sub-sections (``ppo.kl``, ``ppo.critic``, ...).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from lorarl.errors import RecipeError

Quantization = Literal["nf4", "none", "auto"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Tracker = Literal["tensorboard", "trackio", "wandb"]  # train.report_to (lorarl.metrics)


def check(ok: bool, where: str, key: str, message: str) -> None:
    """Raise RecipeError ``"<file>: <key> <message>"`` unless ``ok``."""
    if not ok:
        raise RecipeError(f"{where}: {key} {message}")


@dataclass
class ModelConfig:
    """The one shared base model."""

    name: str = "smollm2-135m"  # a name from `lorarl models`, a local transformers folder, or a hub name
    quantization: Quantization = "auto"  # nf4 on CUDA, none on CPU (NF4 wrecks a 135M model: measured)
    dtype: DType = "auto"  # compute dtype: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = True  # recompute activations in backward (memory for ~1/3 more time)
    trust_remote_code: bool = False  # run code shipped with a hub model (off: only transformers' own code)
    init_adapter: str | None = None  # start from a trained PEFT adapter; the reference is then that adapter, frozen
    logprob_chunk_size: int = 256  # positions per chunk when computing log-probs from hidden states

    def validate(self, where: str) -> None:
        check(self.logprob_chunk_size >= 1, where, "model.logprob_chunk_size", "must be >= 1")


@dataclass
class LoraSettings:
    """LoRA settings of one adapter (PEFT LoraConfig)."""

    r: int = 16  # rank
    alpha: float = 32.0  # scaling alpha / r
    dropout: float = 0.0  # LoRA dropout (off while sampling and scoring; see README "What is sampled is scored")
    target_modules: Union[str, list[str]] = "all-linear"  # noqa: UP007  PEFT's target_modules

    def validate(self, where: str, prefix: str = "lora") -> None:
        check(self.r >= 1, where, f"{prefix}.r", "must be >= 1")
        check(self.alpha > 0, where, f"{prefix}.alpha", "must be > 0")
        check(0.0 <= self.dropout < 1.0, where, f"{prefix}.dropout", "must be in [0, 1)")


@dataclass
class ArithmeticConfig:
    """The built-in arithmetic task (``data.source: arithmetic``)."""

    operations: list[str] = field(default_factory=lambda: ["+"])  # any of + - *
    digits: int = 2  # digits of each operand
    prompt_template: str = "What is {a} {op} {b}?"  # the user message, with {a} {op} {b}

    def validate(self, where: str) -> None:
        check(1 <= self.digits <= 6, where, "data.arithmetic.digits", "must be in 1..6")
        bad = [op for op in self.operations if op not in ("+", "-", "*")]
        check(
            not bad and bool(self.operations),
            where,
            "data.arithmetic.operations",
            f"must be a non-empty list of + - *, got {self.operations}",
        )
        try:
            self.prompt_template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            check(
                False, where, "data.arithmetic.prompt_template", f"must only use the fields {{a}} {{op}} {{b}} ({e!r})"
            )


# data.answer_pattern presets: a regex whose one group is the answer (GSM8K solutions end with "#### 72")
ANSWER_PATTERNS = {"gsm8k": r"####\s*(.+?)\s*$"}


@dataclass
class DataConfig:
    """Prompts (RL) or preference pairs (reward model). Rows follow TRL's fields: ``prompt`` (a string or chat
    messages) plus extra columns, passed to reward functions by name (e.g. ``answer``); ``chosen`` / ``rejected``."""

    source: str = "arithmetic"  # `arithmetic`, a hub dataset, a parquet/csv/json(l) file or folder, a datasets folder
    eval_source: str | None = None  # held-out rows; for `arithmetic` a disjoint generated split is used
    subset: str | None = None  # the dataset's configuration (load_dataset's `name`): `main` for openai/gsm8k
    split: str | None = None  # the training split; default `train` (or the only split)
    eval_split: str | None = None  # the held-out split; default the first of test / validation / eval
    columns: dict[str, str] = field(default_factory=dict)  # lorarl name -> dataset column: {prompt: question}
    answer_pattern: str | None = None  # regex with one group applied to the answer column, or a preset: gsm8k
    as_chat: bool = False  # a string prompt becomes one user message (chat template + system_prompt apply)
    verifier: Literal["numeric", "math"] = "numeric"  # the answer check behind accuracy (numeric: the last number)
    train_size: int = 2000  # rows generated for training (arithmetic)
    eval_size: int = 200  # held-out rows generated (arithmetic)
    seed: int = 1234  # seed of the generated split
    system_prompt: str | None = None  # prepended as a system message to conversational prompts
    max_prompt_tokens: int = 512  # longer prompts are bad rows
    on_bad_row: Literal["skip", "fail"] = "fail"  # a bad row stops the run, or is skipped and counted
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)  # the built-in task's settings

    def validate(self, where: str) -> None:
        check(self.train_size >= 1, where, "data.train_size", "must be >= 1")
        check(self.eval_size >= 1, where, "data.eval_size", "must be >= 1")
        check(self.max_prompt_tokens >= 1, where, "data.max_prompt_tokens", "must be >= 1")
        for name, column in self.columns.items():
            check(isinstance(column, str) and bool(column), where, f"data.columns.{name}", "must be a column name")
        if self.answer_pattern is not None:
            pattern = ANSWER_PATTERNS.get(self.answer_pattern, self.answer_pattern)
            try:
                groups = re.compile(pattern).groups
            except re.error as e:
                groups = f"not a valid regex ({e})"
            check(
                groups == 1,
                where,
                "data.answer_pattern",
                f"must be a preset ({', '.join(ANSWER_PATTERNS)}) or a regex with one group, got {pattern!r}: "
                f"{groups if isinstance(groups, str) else f'{groups} groups'}",
            )
        self.arithmetic.validate(where)


@dataclass
class RewardSpec:
    """One reward function: a built-in name or ``module:function`` with TRL's signature, and its weight."""

    name: str = (
        "numeric_match"  # built-in (numeric_match, math_match, format, partial_credit, length_penalty, code_tests)
    )
    weight: float = 1.0  # its weight in the total
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments bound to the function


@dataclass
class RewardConfig:
    """Where an RL step's scores come from: rule / Python reward functions, the trained reward adapter, or both."""

    source: Literal["rules", "reward_model", "both"] = "rules"  # what scores a response
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])  # TRL-signature functions, weighted
    adapter: str | None = None  # the reward adapter + score head (recipes/reward_model.yaml's run dir or adapter)
    model_weight: float = 1.0  # source both: total = model_weight * reward-model score + weighted functions
    timeout_s: float = 60.0  # per call of one reward function on one batch; 0 = no limit
    max_failure_fraction: float = 0.5  # failed reward calls (exception, timeout) before the run stops

    def validate(self, where: str) -> None:
        for i, spec in enumerate(self.functions):
            check(bool(spec.name), where, f"reward.functions[{i}].name", "must not be empty")
        check(
            self.source == "reward_model" or bool(self.functions),
            where,
            "reward.functions",
            f"must name at least one function with reward.source {self.source}",
        )
        check(self.timeout_s >= 0, where, "reward.timeout_s", "must be >= 0 (0: no limit)")
        check(0 < self.max_failure_fraction <= 1, where, "reward.max_failure_fraction", "must be in (0, 1]")


@dataclass
class GenerationConfig:
    """Sampling during rollouts. Log-probs are computed at the same temperature from the untruncated softmax."""

    max_new_tokens: int = 64  # completion length cap
    temperature: float = 1.0  # sampling temperature (log-probs use it too)
    top_p: float = 1.0  # nucleus sampling: chat / evaluation only; training recipes keep 1.0
    top_k: int = 0  # top-k sampling: chat / evaluation only; training recipes keep 0
    engine: Literal["hf", "fast"] = "hf"  # decode engine (lorarl.rollout.engines): hf = transformers' generate, fast
    eos_check_every: int = 8  # fast engine on CUDA: read "all rows ended?" on the host every k steps (CPU: every step)
    cuda_graphs: bool = True  # fast engine on CUDA: capture the decode step once and replay it

    def validate(self, where: str) -> None:
        check(self.max_new_tokens >= 1, where, "generation.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, where, "generation.temperature", "must be > 0")
        check(0 < self.top_p <= 1, where, "generation.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, where, "generation.top_k", "must be >= 0")
        check(self.eos_check_every >= 1, where, "generation.eos_check_every", "must be >= 1")

    def validate_for_training(self, where: str) -> None:
        """Rollouts that train: sampling must be the plain ``softmax(logits / T)`` the log-probs describe."""
        why = "for training: the log-probs of the update describe softmax(logits / temperature), untruncated"
        check(self.top_p == 1.0, where, "generation.top_p", f"must be 1.0 {why} (top_p is for chat / eval)")
        check(self.top_k == 0, where, "generation.top_k", f"must be 0 {why} (top_k is for chat / eval)")


@dataclass
class TrainConfig:
    """The optimisation loop shared by all algorithms."""

    steps: int = 100  # optimizer steps of the run (the LR schedule spans them)
    prompts_per_step: int = 8  # prompts per RL step
    micro_batch_size: Union[int, Literal["auto"]] = 8  # noqa: UP007  rows per forward/backward; auto: the planner's
    learning_rate: float = 1e-4  # AdamW learning rate (the policy's; ppo.critic.learning_rate for the critic)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"  # decay to 0 at the end of the run
    warmup_steps: int = 0  # linear warm-up, in optimizer updates
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (total norm)
    seed: int = 0  # seeds data order and sampling: runs are reproducible per (seed, step)
    save_every: int = 0  # step checkpoints every N steps; 0: only the final adapters
    keep_last: int = 2  # step checkpoints kept
    log_every: int = 1  # metrics rows every N steps
    max_nonfinite_in_row: int = 3  # NaN/inf losses or gradients in a row before the run stops
    keep_best: str | None = None  # keep the adapters of the best evaluation by this metric in DIR/best (eval/accuracy)
    keep_best_mode: Literal["max", "min"] = "max"  # whether larger or smaller keep_best values are better
    report_to: list[Tracker] = field(default_factory=lambda: ["tensorboard"])  # trackers besides metrics.jsonl; []
    project: str = "lorarl"  # the trackio / wandb project the run is logged under (the run's name: its directory)

    def validate(self, where: str) -> None:
        check(self.steps >= 1, where, "train.steps", "must be >= 1")
        check(len(set(self.report_to)) == len(self.report_to), where, "train.report_to", "names a tracker twice")
        check(bool(self.project.strip()), where, "train.project", "must not be empty")
        check(self.prompts_per_step >= 1, where, "train.prompts_per_step", "must be >= 1")
        check(
            self.micro_batch_size == "auto" or self.micro_batch_size >= 1,
            where,
            "train.micro_batch_size",
            "must be >= 1 or 'auto'",
        )
        check(self.learning_rate > 0, where, "train.learning_rate", "must be > 0")
        check(self.warmup_steps >= 0, where, "train.warmup_steps", "must be >= 0")
        check(self.weight_decay >= 0, where, "train.weight_decay", "must be >= 0")
        check(self.max_grad_norm > 0, where, "train.max_grad_norm", "must be > 0")
        check(self.save_every >= 0, where, "train.save_every", "must be >= 0")
        check(self.keep_last >= 1, where, "train.keep_last", "must be >= 1")
        check(self.log_every >= 1, where, "train.log_every", "must be >= 1")
        check(self.max_nonfinite_in_row >= 1, where, "train.max_nonfinite_in_row", "must be >= 1")


@dataclass
class GRPOKLConfig:
    """GRPO's KL term to the reference (DeepSeekMath; 0 never runs the reference)."""

    coef: float = 0.0  # beta of the k3 KL term; 0: no reference forward at all
    estimator: Literal["k3", "k3_unbiased"] = "k3"  # k3: gradient of KL(ref||pi) on-policy; k3_unbiased: KL(pi||ref)
    ref_refresh_every: int = 0  # iterative GRPO: copy the policy into the reference adapter every N steps

    def validate(self, where: str) -> None:
        check(self.coef >= 0, where, "grpo.kl.coef", "must be >= 0")
        check(self.ref_refresh_every >= 0, where, "grpo.kl.ref_refresh_every", "must be >= 0")


@dataclass
class GRPOConfig:
    """GRPO (DeepSeekMath) with DAPO / Dr. GRPO / DeepSeek-V3.2 options."""

    group_size: int = 8  # completions per prompt (G)
    num_iterations: int = 1  # policy updates per rollout batch (mu); > 1 records old log-probs
    clip_eps_low: float = 0.2  # PPO-clip lower range
    clip_eps_high: float = 0.2  # upper range; > clip_eps_low is DAPO's clip-higher
    loss_reduction: Literal["seq_mean_token_mean", "token_mean", "seq_sum_norm"] = "seq_mean_token_mean"  # GRPO/DAPO/Dr
    std_scaling: Literal["group", "batch", "none"] = "group"  # advantage scale; none = Dr. GRPO
    unbiased_std: bool = False  # False: population std
    mask_truncated: bool = False  # completions without EOS contribute no loss (DAPO overlong filtering)
    entropy_coef: float = 0.0  # entropy bonus
    kl: GRPOKLConfig = field(default_factory=GRPOKLConfig)  # the KL term to the reference

    def validate(self, where: str) -> None:
        check(self.group_size >= 2, where, "grpo.group_size", "must be >= 2 (advantages are relative within a group)")
        check(self.num_iterations >= 1, where, "grpo.num_iterations", "must be >= 1")
        check(self.clip_eps_low > 0, where, "grpo.clip_eps_low", "must be > 0")
        check(self.clip_eps_high > 0, where, "grpo.clip_eps_high", "must be > 0")
        check(self.entropy_coef >= 0, where, "grpo.entropy_coef", "must be >= 0")
        self.kl.validate(where)


@dataclass
class PPOKLConfig:
    """PPO's per-token KL penalty in the reward (Ziegler et al.; InstructGPT), fixed or adaptive."""

    coef: float = 0.05  # beta; 0 (fixed) never runs the reference
    adaptive: bool = False  # Ziegler et al.'s proportional controller moves beta towards `target`
    target: float = 6.0  # target KL per sequence (nats) of the adaptive controller
    horizon: int = 10000  # the controller's horizon, in responses

    def validate(self, where: str) -> None:
        check(self.coef >= 0, where, "ppo.kl.coef", "must be >= 0")
        check(not self.adaptive or self.coef > 0, where, "ppo.kl.coef", "must be > 0 when ppo.kl.adaptive is on")
        check(self.target > 0, where, "ppo.kl.target", "must be > 0")
        check(self.horizon >= 1, where, "ppo.kl.horizon", "must be >= 1")


@dataclass
class CriticConfig:
    """PPO's critic: its own LoRA adapter + fp32 value head, its own optimizer, the value loss."""

    init: Literal["fresh", "reward"] = "fresh"  # a fresh adapter, or a trainable copy of the reward adapter + head
    lora: LoraSettings = field(default_factory=LoraSettings)  # the critic adapter (init: fresh)
    learning_rate: float | None = None  # the critic's AdamW; default train.learning_rate
    vf_coef: float = 0.1  # value-loss coefficient (scales the critic's gradient before clipping; Adam is scale-free)
    value_clip: float | None = 0.2  # clip V around V_old (null: unclipped)
    loss: Literal["mse", "huber"] = "mse"  # 0.5 squared error or Huber
    huber_delta: float = 1.0  # loss huber

    def validate(self, where: str) -> None:
        check(
            self.learning_rate is None or self.learning_rate > 0,
            where,
            "ppo.critic.learning_rate",
            "must be > 0 or null",
        )
        check(self.vf_coef >= 0, where, "ppo.critic.vf_coef", "must be >= 0")
        check(self.value_clip is None or self.value_clip > 0, where, "ppo.critic.value_clip", "must be > 0 or null")
        check(self.huber_delta > 0, where, "ppo.critic.huber_delta", "must be > 0")
        self.lora.validate(where, "ppo.critic.lora")


@dataclass
class ScoreConfig:
    """How PPO shapes the sequence score before the KL penalty is added."""

    normalize: bool = False  # running mean / std of the scores
    clip: float | None = None  # clip the (normalised) score to +- clip
    no_eos_penalty: float | None = None  # replaces the score of responses that did not end with EOS

    def validate(self, where: str) -> None:
        check(self.clip is None or self.clip > 0, where, "ppo.score.clip", "must be > 0 or null")


@dataclass
class PtxConfig:
    """InstructGPT's pretraining-loss term (PPO-ptx)."""

    coef: float = 0.0  # gamma; 0: off
    source: str | None = None  # a .jsonl with a `text` column
    batch_size: int = 4  # texts per minibatch

    def validate(self, where: str) -> None:
        check(self.coef >= 0, where, "ppo.ptx.coef", "must be >= 0")
        check(self.batch_size >= 1, where, "ppo.ptx.batch_size", "must be >= 1")
        check(self.coef == 0 or bool(self.source), where, "ppo.ptx.source", "is required when ppo.ptx.coef > 0")


@dataclass
class PPOConfig:
    """PPO with a LoRA critic and a LoRA reward model on the same base (InstructGPT-style RLHF)."""

    epochs: int = 2  # K passes over each rollout batch
    minibatch_size: int = 8  # responses per optimizer step
    clip_eps: float = 0.2  # PPO-clip range
    entropy_coef: float = 0.0  # entropy bonus
    gamma: float = 1.0  # discount (1: an episodic response, the score arrives at its end)
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # normalise advantages over the batch's tokens
    target_approx_kl: float | None = None  # stop the epochs before an update once the approx KL passes this
    kl: PPOKLConfig = field(default_factory=PPOKLConfig)  # the KL penalty
    critic: CriticConfig = field(default_factory=CriticConfig)  # the critic
    score: ScoreConfig = field(default_factory=ScoreConfig)  # score normalisation / clipping / no-EOS penalty
    ptx: PtxConfig = field(default_factory=PtxConfig)  # the pretraining-loss term

    def validate(self, where: str) -> None:
        check(self.epochs >= 1, where, "ppo.epochs", "must be >= 1")
        check(self.minibatch_size >= 1, where, "ppo.minibatch_size", "must be >= 1")
        check(self.clip_eps > 0, where, "ppo.clip_eps", "must be > 0")
        check(self.entropy_coef >= 0, where, "ppo.entropy_coef", "must be >= 0")
        check(0 <= self.gamma <= 1, where, "ppo.gamma", "must be in [0, 1]")
        check(0 <= self.lam <= 1, where, "ppo.lam", "must be in [0, 1]")
        check(
            self.target_approx_kl is None or self.target_approx_kl > 0,
            where,
            "ppo.target_approx_kl",
            "must be > 0 or null",
        )
        for sub in (self.kl, self.critic, self.score, self.ptx):
            sub.validate(where)


@dataclass
class RewardModelConfig:
    """Bradley-Terry reward model: the `reward` adapter plus a score head."""

    epochs: int = 1  # passes over the pairs (train.steps may stop it first)
    batch_size: int = 8  # pairs per optimizer step
    margin: bool = False  # use a `margin` column when present (Llama 2)
    center_coef: float = 0.0  # reward centering term coef * (r_c + r_r)^2
    max_length: int = 512  # pairs whose longer side has more tokens are dropped (counted), like TRL
    max_tokens_per_forward: int = 4096  # length-sorted forwards of at most this many padded tokens; 0 = one forward

    def validate(self, where: str) -> None:
        check(self.epochs >= 1, where, "reward_model.epochs", "must be >= 1")
        check(self.max_tokens_per_forward >= 0, where, "reward_model.max_tokens_per_forward", "must be >= 0")
        check(self.batch_size >= 1, where, "reward_model.batch_size", "must be >= 1")
        check(self.center_coef >= 0, where, "reward_model.center_coef", "must be >= 0")
        check(self.max_length >= 2, where, "reward_model.max_length", "must be >= 2")


@dataclass
class EvalConfig:
    """Held-out evaluation (greedy for policies; pairwise accuracy for reward models)."""

    n: int = 200  # held-out examples
    batch_size: int = 32  # rows per generate / scoring forward
    max_new_tokens: int | None = None  # default: generation.max_new_tokens
    every: int = 0  # evaluate during training every N steps and at the last (logged as eval/...); 0: only at the end
    #               for reward models, never for policies (run `lorarl eval`)

    def validate(self, where: str) -> None:
        check(self.n >= 1, where, "eval.n", "must be >= 1")
        check(self.batch_size >= 1, where, "eval.batch_size", "must be >= 1")
        check(self.every >= 0, where, "eval.every", "must be >= 0")


@dataclass
class HealthConfig:
    """Health checks that stop or warn on the step a run goes wrong (lorarl.health); 0 turns a check off."""

    parity_every: int = 25  # compare sampler and trainer log-probs on step 1 and every N steps
    parity_rows: int = 8  # rows scored for the parity check
    parity_tolerance: float = 0.05  # mean |delta log-prob| per token above which the run stops (nats)
    learning_after: int = 5  # steps with updates after which an adapter that has not moved is reported
    no_signal_steps: int = 5  # steps in a row with most groups at zero reward spread before a warning
    no_signal_fraction: float = 0.9  # "most groups": this fraction of zero-spread groups
    alarm_window: int = 3  # held-out evaluations compared by the reward-hacking alarm (needs eval.every)
    length_drift: float = 3.0  # warn when mean completion length moves by this factor from the first steps

    def validate(self, where: str) -> None:
        for name in ("parity_every", "parity_rows", "learning_after", "no_signal_steps", "alarm_window"):
            check(getattr(self, name) >= 0, where, f"health.{name}", "must be >= 0 (0: off)")
        check(self.parity_tolerance > 0, where, "health.parity_tolerance", "must be > 0")
        check(0 < self.no_signal_fraction <= 1, where, "health.no_signal_fraction", "must be in (0, 1]")
        check(self.length_drift == 0 or self.length_drift > 1, where, "health.length_drift", "must be > 1 (0: off)")


@dataclass
class SFTConfig:
    """Supervised fine-tuning of the policy adapter: loss on completion tokens only (lorarl.algos.sft)."""

    epochs: int = 1  # passes over the examples (train.steps may stop it first)
    batch_size: int = 16  # examples per optimizer step
    max_length: int = 1024  # prompt + completion tokens; longer rows are bad rows (data.on_bad_row)

    def validate(self, where: str) -> None:
        check(self.epochs >= 1, where, "sft.epochs", "must be >= 1")
        check(self.batch_size >= 1, where, "sft.batch_size", "must be >= 1")
        check(self.max_length >= 2, where, "sft.max_length", "must be >= 2")


@dataclass
class RejectionSamplingConfig:
    """Sample G completions per prompt, keep the verified ones as a TRL dataset (lorarl.algos.rejection_sampling).
    Samples with model.init_adapter (else the base); train.steps x train.prompts_per_step prompts in all."""

    group_size: int = 8  # completions sampled per prompt (G)
    min_reward: float = 1.0  # keep completions whose total reward (reward section) is at least this
    max_per_prompt: int = 0  # best-of-G: keep at most this many per prompt, highest reward first; 0: all that pass
    drop_truncated: bool = True  # never keep a completion cut at generation.max_new_tokens (no EOS)

    def validate(self, where: str) -> None:
        check(self.group_size >= 1, where, "rejection_sampling.group_size", "must be >= 1")
        check(self.max_per_prompt >= 0, where, "rejection_sampling.max_per_prompt", "must be >= 0 (0: no limit)")


# The algorithm sections, and the shared sections each algorithm reads (others are refused in a recipe).
ALGO_SECTIONS: dict[str, type] = {
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
    "reward_model": RewardModelConfig,
    "sft": SFTConfig,
    "rejection_sampling": RejectionSamplingConfig,
}
SHARED_SECTIONS = ("model", "lora", "data", "reward", "generation", "train", "eval", "health")
USES = {
    "grpo": SHARED_SECTIONS,
    "ppo": SHARED_SECTIONS,
    "reward_model": ("model", "lora", "data", "train", "eval", "health"),
    "sft": SHARED_SECTIONS,  # reward and generation: the held-out evaluation scores and decodes like RL
    "rejection_sampling": SHARED_SECTIONS,
}
TRAINS_ON_SAMPLES = ("grpo", "ppo")


@dataclass
class Recipe:
    """A whole recipe: the algorithm, the shared sections, and the algorithm's own section (the others are None)."""

    algo: Literal["grpo", "ppo", "reward_model", "sft", "rejection_sampling"] = "grpo"  # which algorithm trains
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    reward_model: RewardModelConfig | None = None
    sft: SFTConfig | None = None
    rejection_sampling: RejectionSamplingConfig | None = None
    source_path: str | None = None  # where the recipe was read from (set by load_recipe, not a YAML key)

    def __post_init__(self) -> None:
        if getattr(self, self.algo, None) is None:
            setattr(self, self.algo, ALGO_SECTIONS[self.algo]())

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if section is not None and hasattr(section, "validate"):
                section.validate(where)
        if self.algo in TRAINS_ON_SAMPLES:
            self.generation.validate_for_training(where)
