"""The recipe's sections: one dataclass each, every field documented where it is declared, ranges checked in
``validate``. A recipe holds the shared sections and only its own algorithm's section (``grpo``, ``ppo``,
``reward_model``); sections that mix concerns are grouped into sub-sections (``ppo.kl``, ``ppo.critic``, ...).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from lorarl.config.agent import AgentConfig
from lorarl.config.algorithms import (
    ALGO_SECTIONS,
    TRAINS_ON_SAMPLES,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    OnlineDPOConfig,
    PPOConfig,
    RejectionSamplingConfig,
    RewardModelConfig,
    RLOOConfig,
    SFTConfig,
)
from lorarl.config.common import LoraSettings, check
from lorarl.config.rewards import JudgeConfig, RemoteRewardConfig, validate_reward_entry

Quantization = Literal["nf4", "none", "auto"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu"]
Tracker = Literal["tensorboard", "trackio", "wandb"]  # train.report_to (lorarl.metrics)


@dataclass
class ModelConfig:
    """The one shared base model."""

    name: str = "smollm2-135m"  # a name from `lorarl models`, a local transformers folder, or a hub name
    quantization: Quantization = "auto"  # CUDA: bf16 if its weights <= 5% of the card, else nf4; CPU: none
    dtype: DType = "auto"  # compute dtype: fp32 on CPU; on CUDA bf16 where native, else fp16 (loss-scaled)
    device: Device = "auto"  # auto: CUDA when there is a GPU, else the CPU; cpu: the CPU even beside a GPU
    gradient_checkpointing: bool = True  # recompute activations in backward (memory for ~1/3 more time)
    trust_remote_code: bool = False  # run code shipped with a hub model (off: only transformers' own code)
    init_adapter: str | None = None  # start from a trained PEFT adapter; the reference is then that adapter, frozen
    logprob_chunk_size: int = 256  # positions per chunk when computing log-probs from hidden states
    logprob_chunk_tokens: int = 2048  # at most rows x positions per chunk (fewer positions when rows are many)

    def validate(self, where: str) -> None:
        check(self.logprob_chunk_size >= 1, where, "model.logprob_chunk_size", "must be >= 1")
        check(self.logprob_chunk_tokens >= 1, where, "model.logprob_chunk_tokens", "must be >= 1")


@dataclass
class ArithmeticConfig:
    """The built-in arithmetic task (``data.source: arithmetic``)."""

    operations: list[str] = field(default_factory=lambda: ["+"])  # any of + - *
    digits: int = 2  # digits of each operand (of the first, when digits_b is set)
    digits_b: int | None = None  # digits of the second operand (3 x 2 multiplication: digits 3, digits_b 2)
    prompt_template: str = "What is {a} {op} {b}?"  # the user message, with {a} {op} {b}

    def validate(self, where: str) -> None:
        check(1 <= self.digits <= 6, where, "data.arithmetic.digits", "must be in 1..6")
        check(self.digits_b is None or 1 <= self.digits_b <= 6, where, "data.arithmetic.digits_b", "must be in 1..6")
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
MAX_NEW_TOKENS = 131_072  # generation.max_new_tokens: the longest context of any model lorarl loads
MAX_ROWS_PER_STEP = 65_536  # train.prompts_per_step x the algorithm's group_size: completions sampled in one step
MAX_TOKENS_PER_STEP = 2**26  # those completions x generation.max_new_tokens: tokens one step may sample
# data.train_size / data.eval_size: generated rows, each templated and tokenized when the run loads (about 0.5 ms a row
# on 2 CPU cores: 100,000 rows take 50 s and 180 MB; 2**31 took 8.8 GB and ended in a MemoryError)
MAX_GENERATED_ROWS = 100_000


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
    train_size: int = 2000  # rows generated for training (arithmetic; at most MAX_GENERATED_ROWS)
    eval_size: int = 200  # held-out rows generated (arithmetic)
    seed: int = 1234  # seed of the generated split
    system_prompt: str | None = None  # prepended as a system message to conversational prompts
    max_prompt_tokens: int = 512  # longer prompts are bad rows
    on_bad_row: Literal["skip", "fail"] = "fail"  # a bad row stops the run, or is skipped and counted
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)  # the built-in task's settings

    def validate(self, where: str) -> None:
        for key in ("train_size", "eval_size"):
            check(
                1 <= getattr(self, key) <= MAX_GENERATED_ROWS,
                where,
                f"data.{key}",
                f"must be in [1, {MAX_GENERATED_ROWS}] (rows generated and tokenized when the run loads; a run cycles "
                "through them; for more distinct rows give data.source a file)",
            )
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
        "numeric_match"  # built-in (numeric_match, math_match, format, partial_credit, length_penalty, code_tests),
        #                  module:function, or remote / judge (with the section of that name below)
    )
    weight: float = 1.0  # its weight in the total
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments bound to the function
    remote: RemoteRewardConfig | None = None  # name: remote -- an HTTP reward server (docs/rewards.md)
    judge: JudgeConfig | None = None  # name: judge -- an LLM judge on the shared base (docs/rewards.md)


@dataclass
class RewardConfig:
    """Where an RL step's scores come from: rule / Python reward functions, the trained reward adapter, or both."""

    source: Literal["rules", "reward_model", "both"] = "rules"  # what scores a response
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])  # TRL-signature functions, weighted
    adapter: str | None = None  # the reward adapter + score head (recipes/reward_model.yaml's run dir or adapter)
    model_weight: float = 1.0  # source both: total = model_weight * reward-model score + weighted functions
    timeout_s: float = 60.0  # per call of one reward function on one batch; 0 = no limit
    # the run stops once one function was called 4 times and more than this fraction of its calls (exception,
    # timeout, malformed result) or of its values (NaN, not a finite float32) failed; per function (docs/rewards.md)
    max_failure_fraction: float = 0.5
    # the run stops (exit 2) when one function has no usable value in this many steps in a row (every call failed,
    # or every value it returned); a run that ends with a function that failed on all its steps fails too; 0: never
    max_failed_steps: int = 2

    def validate(self, where: str) -> None:
        for i, spec in enumerate(self.functions):
            check(bool(spec.name), where, f"reward.functions[{i}].name", "must not be empty")
            validate_reward_entry(spec, where, i)
        check(self.timeout_s >= 0, where, "reward.timeout_s", "must be >= 0 (0: no limit)")
        check(0 < self.max_failure_fraction <= 1, where, "reward.max_failure_fraction", "must be in (0, 1]")
        check(self.max_failed_steps >= 0, where, "reward.max_failed_steps", "must be >= 0 (0: never stop for it)")


@dataclass
class GenerationConfig:
    """Sampling during rollouts. Log-probs are computed at the same temperature from the untruncated softmax."""

    max_new_tokens: int = 64  # completion length cap
    temperature: float = 1.0  # sampling temperature (log-probs use it too)
    top_p: float = 1.0  # nucleus sampling: chat / evaluation only; training recipes keep 1.0
    top_k: int = 0  # top-k sampling: chat / evaluation only; training recipes keep 0
    # decode engine (lorarl.rollout.engines): hf = transformers' generate; fast = static cache + CUDA graphs
    # (docs/rollout_engine.md); auto = fast on CUDA (3.3-10x hf's decode step on an H200), hf on CPU (no faster there)
    engine: Literal["auto", "hf", "fast"] = "auto"
    eos_check_every: int = 8  # fast engine on CUDA: read "all rows ended?" on the host every k steps (CPU: every step)
    cuda_graphs: bool = True  # fast engine on CUDA: capture the decode step once and replay it
    # fast engine on an NF4 base: auto = each LoRA layer's base through lorarl's Triton NF4 matmul (up to 256 rows;
    # lorarl.kernels, docs/rollout_engine.md) where Triton and CUDA are there; off = bitsandbytes' matmul_4bit
    nf4_kernel: Literal["auto", "off"] = "auto"
    # fast engine with CUDA graphs: keep the static KV cache and captured steps between rollouts (true: no new
    # capture per step), or free them after each rollout so scoring and training get that memory (false; TRL's
    # vllm_enable_sleep_mode, in spirit); auto = keep when the planner puts the step inside the card with them held
    keep_cache: Union[bool, Literal["auto"]] = "auto"  # noqa: UP007
    # rows decoded at once in a training rollout, and per no-grad scoring pass of its log-probs (GRPO, PPO, online
    # DPO, rejection sampling); auto: all of the step's rows, or on CUDA the largest divisor of them whose generation
    # and scoring fit the card by the planner (`lorarl plan` prints it). Not TRL's generation_batch_size (the rows
    # sampled per generation across optimizer steps; lorarl samples one step's rows, in batches of this size)
    batch_size: Union[int, Literal["auto"]] = "auto"  # noqa: UP007

    def engine_for(self, device_type: str) -> str:
        """The engine this config decodes with on a ``device_type`` device: ``auto`` is ``fast`` on CUDA (its
        captured decode step ran 3.3-10x faster than ``generate``'s on an H200, NF4 and bf16, batch 1-64:
        docs/measurements/gpu/) and ``hf`` elsewhere (on CPU the fast engine saves no arithmetic, 0.54-1.14x:
        docs/measurements/rollout_cpu.md); ``hf`` and ``fast`` are themselves.

        >>> [GenerationConfig(engine=e).engine_for(d) for e, d in [("auto", "cuda"), ("auto", "cpu"), ("hf", "cuda")]]
        ['fast', 'hf', 'hf']
        """
        if self.engine == "auto":
            return "fast" if device_type == "cuda" else "hf"
        return self.engine

    def validate(self, where: str) -> None:
        check(
            1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
            where,
            "generation.max_new_tokens",
            f"must be in [1, {MAX_NEW_TOKENS}]",
        )
        check(self.temperature > 0, where, "generation.temperature", "must be > 0")
        check(0 < self.top_p <= 1, where, "generation.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, where, "generation.top_k", "must be >= 0")
        check(self.eos_check_every >= 1, where, "generation.eos_check_every", "must be >= 1")
        check(
            self.batch_size == "auto" or (isinstance(self.batch_size, int) and self.batch_size >= 1),
            where,
            "generation.batch_size",
            "must be >= 1 or 'auto'",
        )

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
    deterministic: bool = False  # torch's deterministic algorithms (CUDA: + CUBLAS_WORKSPACE_CONFIG); CPU runs are bit-identical without it
    save_every: int = 0  # step checkpoints every N steps; 0: only the final adapters
    keep_last: int = 2  # step checkpoints kept
    log_every: int = 1  # metrics rows every N steps
    log_completions: int = 4  # GRPO / PPO: sampled completions per step appended to DIR/completions.jsonl (TRL's
    #   log_completions; the first N rows of the step: prompt, completion, reward, advantage); 0: off
    max_nonfinite_in_row: int = 3  # NaN/inf losses or gradients in a row before the run stops
    keep_best: str | None = None  # keep the adapters of the best evaluation by this metric in DIR/best (eval/accuracy)
    keep_best_mode: Literal["max", "min"] = "max"  # whether larger or smaller keep_best values are better
    report_to: list[Tracker] = field(default_factory=lambda: ["tensorboard"])  # trackers besides metrics.jsonl; []
    project: str = "lorarl"  # the trackio / wandb project the run is logged under (the run's name: its directory)

    def validate(self, where: str) -> None:
        check(self.steps >= 1, where, "train.steps", "must be >= 1")
        check(len(set(self.report_to)) == len(self.report_to), where, "train.report_to", "names a tracker twice")
        check(bool(self.project.strip()), where, "train.project", "must not be empty")
        check(
            1 <= self.prompts_per_step <= MAX_ROWS_PER_STEP,
            where,
            "train.prompts_per_step",
            f"must be in [1, {MAX_ROWS_PER_STEP}]",
        )
        check(
            self.micro_batch_size == "auto" or self.micro_batch_size >= 1,
            where,
            "train.micro_batch_size",
            "must be >= 1 or 'auto'",
        )
        check(self.learning_rate > 0, where, "train.learning_rate", "must be > 0")
        check(self.learning_rate <= 1, where, "train.learning_rate", "must be <= 1 (an AdamW step of 1 per weight)")
        check(self.warmup_steps >= 0, where, "train.warmup_steps", "must be >= 0")
        check(self.weight_decay >= 0, where, "train.weight_decay", "must be >= 0")
        check(self.max_grad_norm > 0, where, "train.max_grad_norm", "must be > 0")
        check(self.save_every >= 0, where, "train.save_every", "must be >= 0")
        check(self.keep_last >= 1, where, "train.keep_last", "must be >= 1")
        check(self.log_every >= 1, where, "train.log_every", "must be >= 1")
        check(self.log_completions >= 0, where, "train.log_completions", "must be >= 0 (0: off)")
        check(self.max_nonfinite_in_row >= 1, where, "train.max_nonfinite_in_row", "must be >= 1")


@dataclass
class EvalConfig:
    """Held-out evaluation (greedy for policies; pairwise accuracy for reward models)."""

    n: int = 200  # held-out examples
    batch_size: int = 32  # rows per generate / scoring forward
    max_new_tokens: int | None = None  # default: generation.max_new_tokens
    every: int = 0  # evaluate during training every N steps and at the last (logged as eval/...); 0: only at the last
    #               step for algorithms that evaluate at the end (reward_model, dpo, online_dpo: final_eval), never
    #               for the others (grpo, ppo, sft, rejection_sampling: run `lorarl eval`)

    def validate(self, where: str) -> None:
        check(self.n >= 1, where, "eval.n", "must be >= 1")
        check(self.batch_size >= 1, where, "eval.batch_size", "must be >= 1")
        check(self.every >= 0, where, "eval.every", "must be >= 0")


@dataclass
class HealthConfig:
    """Health checks that stop or warn on the step a run goes wrong (lorarl.health); 0 turns a check off."""

    parity_every: int = 25  # compare sampler and trainer log-probs on step 1 and every N steps
    parity_rows: int = 8  # rows scored for the parity check
    parity_tolerance: float | None = None  # mean |delta log-prob| per token (nats) above which the run stops, or
    #   tis.mode auto corrects; null: by precision, fp32 1e-3, bf16 / NF4 0.1, fp16 0.05 (lorarl.health)
    learning_after: int = 5  # steps with updates after which an adapter that has not moved is reported
    no_signal_steps: int = 5  # steps in a row with most groups at zero reward spread before a warning
    no_signal_fraction: float = 0.9  # "most groups": this fraction of zero-spread groups
    alarm_window: int = 3  # held-out evaluations compared by the reward-hacking alarm (needs eval.every)
    length_drift: float = 3.0  # warn when mean completion length moves by this factor from the first steps
    chosen_falling_steps: int = 5  # DPO / KTO: steps in a row with rewards/chosen < 0 (the preferred / desirable
    #   answers less likely than under the reference) before a warning

    def validate(self, where: str) -> None:
        for name in (
            "parity_every", "parity_rows", "learning_after", "no_signal_steps", "alarm_window", "chosen_falling_steps"
        ):  # fmt: skip
            check(getattr(self, name) >= 0, where, f"health.{name}", "must be >= 0 (0: off)")
        check(
            self.parity_tolerance is None or self.parity_tolerance > 0, where, "health.parity_tolerance", "must be > 0"
        )
        check(0 < self.no_signal_fraction <= 1, where, "health.no_signal_fraction", "must be in (0, 1]")
        check(self.length_drift == 0 or self.length_drift > 1, where, "health.length_drift", "must be > 1 (0: off)")


@dataclass
class Recipe:
    """A whole recipe: the algorithm, the shared sections, and the algorithm's own section (the others are None)."""

    # which algorithm trains
    algo: Literal[
        "grpo", "ppo", "reward_model", "sft", "rejection_sampling", "dpo", "online_dpo", "rloo", "distill", "kto"
    ] = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    agent: AgentConfig | None = None  # tools / environment and multi-turn budgets (lorarl.agents); None: single-turn
    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    reward_model: RewardModelConfig | None = None
    sft: SFTConfig | None = None
    rejection_sampling: RejectionSamplingConfig | None = None
    dpo: DPOConfig | None = None
    online_dpo: OnlineDPOConfig | None = None
    rloo: RLOOConfig | None = None
    distill: DistillConfig | None = None
    kto: KTOConfig | None = None
    source_path: str | None = None  # where the recipe was read from (set by load_recipe, not a YAML key)

    def __post_init__(self) -> None:
        if getattr(self, self.algo, None) is None:
            setattr(self, self.algo, ALGO_SECTIONS[self.algo]())

    def check_step_size(self, where: str) -> None:
        """What one step samples stays bounded: rows = ``train.prompts_per_step * <algo>.group_size`` <=
        :data:`MAX_ROWS_PER_STEP` and rows * ``generation.max_new_tokens`` <= :data:`MAX_TOKENS_PER_STEP` (a
        recipe past them would take the machine's memory or never finish a step; the planner sizes what fits)."""
        group = getattr(getattr(self, self.algo), "group_size", 1)
        rows = self.train.prompts_per_step * group
        key = f"train.prompts_per_step x {self.algo}.group_size" if group != 1 else "train.prompts_per_step"
        check(rows <= MAX_ROWS_PER_STEP, where, key, f"= {rows} completions per step; at most {MAX_ROWS_PER_STEP}")
        tokens = rows * self.generation.max_new_tokens
        check(
            tokens <= MAX_TOKENS_PER_STEP,
            where,
            f"{key} x generation.max_new_tokens",
            f"= {tokens} tokens sampled per step; at most {MAX_TOKENS_PER_STEP}",
        )

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if section is not None and hasattr(section, "validate"):
                section.validate(where)
        if self.algo in TRAINS_ON_SAMPLES:
            self.generation.validate_for_training(where)
        if self.dpo is not None and self.algo == "dpo":
            self.dpo.check_micro_batch(self.train.micro_batch_size, where)
        self.check_step_size(where)
        env_reward = self.agent is not None and bool(self.agent.environment)  # its get_reward (checked at import)
        check(
            self.reward.source == "reward_model" or bool(self.reward.functions) or env_reward,
            where,
            "reward.functions",
            f"must name at least one function with reward.source {self.reward.source} (or an agent.environment "
            "with get_reward)",
        )
