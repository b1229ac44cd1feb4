"""The algorithms' own recipe sections (``grpo``, ``ppo`` with its sub-sections, ``reward_model``, ``sft``,
``rejection_sampling``, ``dpo``, ``online_dpo``, ``kto``): one dataclass each, every field documented where it is declared, ranges checked in
``validate``. The shared sections and :class:`~lorarl.config.schema.Recipe` are in :mod:`lorarl.config.schema`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from lorarl.config.common import LoraSettings, check


@dataclass
class GRPOKLConfig:
    """GRPO's KL term to the reference (DeepSeekMath; 0 never runs the reference)."""

    coef: float = 0.0  # beta of the k3 KL term; 0: no reference forward at all
    estimator: Literal["k3", "k3_unbiased"] = "k3"  # k3: gradient of KL(ref||pi) on-policy; k3_unbiased: KL(pi||ref)
    ref_refresh_every: int = 0  # iterative GRPO: copy the policy into the reference adapter every N steps

    def validate(self, where: str) -> None:
        check(self.coef >= 0, where, "grpo.kl.coef", "must be >= 0")
        check(self.ref_refresh_every >= 0, where, "grpo.kl.ref_refresh_every", "must be >= 0")


# GRPO's clip range when grpo.clip_eps_low / clip_eps_high are not given, per importance-sampling level:
# token: PPO's 0.2; sequence: the GSPO paper's (Zheng et al. 2025, v2 Sec. 5.1; TRL's paper index uses the same)
DEFAULT_CLIP = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal are dropped and more prompts are
    sampled until the step has train.prompts_per_step informative groups, or max_rounds generation rounds ran."""

    enabled: bool = False  # off: every group of the step's prompts is trained on, as GRPO
    max_rounds: int = 3  # generation rounds per step at most, the first included; still short: train on what was kept

    def validate(self, where: str) -> None:
        check(self.max_rounds >= 1, where, "grpo.dynamic_sampling.max_rounds", "must be >= 1")


@dataclass
class TISConfig:
    """Truncated importance sampling for a sampler whose log-probs differ from the trainer's (bf16 / NF4 kernels,
    the fast engine): the policy-gradient loss of each token is weighted by min(exp(logp_old - logp_sampler), cap),
    as verl's rollout_is: token and TRL's vllm_importance_sampling_correction (token_truncate) do."""

    mode: Literal["auto", "always", "off"] = "auto"  # auto: from the first parity check above
    #   health.parity_tolerance (at most 5x it, base in bf16 / fp16 / NF4) instead of stopping the run; always:
    #   every step; off: never (a parity failure stops the run)
    cap: float = 2.0  # C, the truncation (verl's rollout_is_threshold default 2; Yao et al. 2025 use 2)

    def validate(self, where: str, prefix: str) -> None:
        check(self.cap >= 1, where, f"{prefix}.tis.cap", "must be >= 1 (a cap below 1 down-weights matching tokens)")


@dataclass
class GRPOConfig:
    """GRPO (DeepSeekMath) with DAPO / Dr. GRPO / DeepSeek-V3.2 / GSPO options."""

    group_size: int = 8  # completions per prompt (G)
    num_iterations: int = 1  # policy updates per rollout batch (mu); > 1 records old log-probs
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's geometric-mean ratio,
    #   clipped per sequence (TRL's key); needs loss_reduction seq_mean_token_mean (GSPO) or seq_mean_token_sum (LUSPO)
    clip_eps_low: float | None = None  # PPO-clip lower range; null: 0.2 (token level) or 3e-4 (sequence, GSPO paper)
    clip_eps_high: float | None = None  # upper range; > clip_eps_low is DAPO's clip-higher; null: 0.2 or 4e-4
    # the per-token policy term: clip (PPO / GRPO, GSPO at sequence level), cispo (clipped, detached IS weight x
    # log-prob; MiniMax-M1), sapo (a soft gate instead of the clip), vespo (a gamma weight of the sequence IS weight)
    policy_loss: Literal["clip", "cispo", "sapo", "vespo"] = "clip"
    cispo_eps_max: float = 5.0  # policy_loss cispo: the cap on the IS ratio itself (ScaleRL's 5; TRL's epsilon_high)
    sapo_temperature_pos: float = 1.0  # policy_loss sapo: the gate's temperature where the advantage is > 0 (TRL's)
    sapo_temperature_neg: float = 1.05  # ... and where it is <= 0
    vespo_k_pos: float = 2.0  # policy_loss vespo: the power k of the gamma weight for advantages >= 0 (TRL's)
    vespo_lambda_pos: float = 3.0  # ... its decay lambda
    vespo_k_neg: float = 3.0  # ... k for advantages < 0
    vespo_lambda_neg: float = 2.0  # ... lambda for advantages < 0
    loss_reduction: Literal[
        "seq_mean_token_mean", "token_mean", "seq_sum_norm", "seq_mean_token_sum", "micro_batch_token_mean"
    ] = "seq_mean_token_mean"  # GRPO / DAPO / Dr. GRPO (all rows x max_new_tokens, masked rows included) / LUSPO (each
    #   sequence's token sum, mean over rows) / BNPO (each micro-batch's own token mean); docs/grpo_options.md
    std_scaling: Literal["group", "batch", "none"] = "group"  # advantage scale; none = Dr. GRPO
    unbiased_std: bool = False  # False: population std
    mask_truncated: bool = False  # completions without EOS contribute no loss (DAPO overlong filtering)
    entropy_coef: float = 0.0  # entropy bonus: coef x the token mean of the entropy whatever loss_reduction is (TRL's
    #   entropy_coef; verl reduces it like the loss); docs/grpo_options.md
    kl: GRPOKLConfig = field(default_factory=GRPOKLConfig)  # the KL term to the reference
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)  # DAPO dynamic sampling
    tis: TISConfig = field(default_factory=TISConfig)  # sampler / trainer mismatch correction

    def __post_init__(self) -> None:
        low, high = DEFAULT_CLIP.get(self.importance_sampling_level, DEFAULT_CLIP["token"])
        self.clip_eps_low = low if self.clip_eps_low is None else self.clip_eps_low
        self.clip_eps_high = high if self.clip_eps_high is None else self.clip_eps_high

    def validate(self, where: str) -> None:
        check(self.group_size >= 2, where, "grpo.group_size", "must be >= 2 (advantages are relative within a group)")
        check(self.num_iterations >= 1, where, "grpo.num_iterations", "must be >= 1")
        check(self.clip_eps_low > 0, where, "grpo.clip_eps_low", "must be > 0")
        check(self.clip_eps_high > 0, where, "grpo.clip_eps_high", "must be > 0")
        check(self.entropy_coef >= 0, where, "grpo.entropy_coef", "must be >= 0")
        check(self.cispo_eps_max > 0, where, "grpo.cispo_eps_max", "must be > 0")
        for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            check(getattr(self, key) > 0, where, f"grpo.{key}", "must be > 0")
        for key in ("vespo_k_pos", "vespo_k_neg"):
            check(getattr(self, key) >= 0, where, f"grpo.{key}", "must be >= 0")
        check(
            self.importance_sampling_level == "token"
            or self.loss_reduction in ("seq_mean_token_mean", "seq_mean_token_sum"),
            where,
            "grpo.importance_sampling_level",
            f"sequence (GSPO) needs grpo.loss_reduction: seq_mean_token_mean (or LUSPO's seq_mean_token_sum), got "
            f"{self.loss_reduction}: GSPO's objective is a mean over sequences; token_mean / seq_sum_norm / "
            "micro_batch_token_mean would sum the sequence loss once per token, weighting each sequence by its length",
        )
        check(
            self.importance_sampling_level == "token" or self.policy_loss != "vespo",
            where,
            "grpo.importance_sampling_level",
            "must be token with grpo.policy_loss vespo: VESPO weighs the sequence's importance weight itself (from "
            "the token ratios)",
        )
        self.kl.validate(where)
        self.dynamic_sampling.validate(where)
        self.tis.validate(where, "grpo")


@dataclass
class RLOOKLConfig:
    """RLOO's KL penalty, TRL 1.16's RLOOTrainer convention: folded into each sequence's reward, never a loss term."""

    coef: float = 0.05  # TRL's beta (default 0.05, TRL's): reward - coef * sum_t (log pi_old - log pi_ref) over the
    #   sequence (k1, summed; GRPO's grpo.kl.coef is a per-token k3 loss term instead); 0: the reference never runs
    ref_refresh_every: int = 0  # copy the policy into a reference adapter every N steps (TRL's sync_ref_model, alpha 1)

    def validate(self, where: str) -> None:
        check(self.coef >= 0, where, "rloo.kl.coef", "must be >= 0")
        check(self.ref_refresh_every >= 0, where, "rloo.kl.ref_refresh_every", "must be >= 0")


@dataclass
class RLOOConfig:
    """RLOO (Ahmadian et al. 2024, REINFORCE leave-one-out) as TRL 1.16's RLOOTrainer: group_size completions per
    prompt; each one's baseline is the mean reward of the other group_size - 1; one clipped ratio per sequence."""

    group_size: int = 2  # completions per prompt (TRL's num_generations; its default 2)
    num_iterations: int = 1  # policy updates per rollout batch; > 1 clips the sequence ratio pi / pi_old
    clip_eps_low: float = 0.2  # TRL's epsilon: the sequence ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]
    clip_eps_high: float | None = None  # TRL's epsilon_high; null: clip_eps_low
    normalize_advantages: bool = False  # TRL's: (A - mean) / (std + 1e-4) over the step's advantages
    reward_clip_range: list[float] | None = None  # TRL's: [min, max] each reward is clipped to before the KL penalty
    mask_truncated: bool = False  # TRL's mask_truncated_completions: completions without EOS train nothing (their
    #   reward still counts in their siblings' baselines)
    kl: RLOOKLConfig = field(default_factory=RLOOKLConfig)  # the KL penalty in the reward

    def __post_init__(self) -> None:
        self.clip_eps_high = self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high

    def validate(self, where: str) -> None:
        check(self.group_size >= 2, where, "rloo.group_size", "must be >= 2 (the baseline is the other completions')")
        check(self.num_iterations >= 1, where, "rloo.num_iterations", "must be >= 1")
        check(self.clip_eps_low > 0, where, "rloo.clip_eps_low", "must be > 0")
        check(self.clip_eps_high > 0, where, "rloo.clip_eps_high", "must be > 0")
        clip = self.reward_clip_range
        check(
            clip is None or (len(clip) == 2 and clip[0] <= clip[1]),
            where,
            "rloo.reward_clip_range",
            f"must be [min, max] with min <= max, got {clip}",
        )
        self.kl.validate(where)


@dataclass
class PPOKLConfig:
    """PPO's per-token KL penalty in the reward (Ziegler et al.; InstructGPT), fixed or adaptive."""

    coef: float = 0.05  # beta; 0 (fixed) never runs the reference
    adaptive: bool = False  # Ziegler et al.'s proportional controller moves beta towards `target`
    target: float = 6.0  # target KL per sequence (nats) of the adaptive controller
    horizon: int = 10000  # the controller's horizon, in responses
    # the per-token KL estimate in the reward (verl's algorithm.kl_penalty): k1 log pi - log ref (InstructGPT),
    # k2 0.5 (log pi - log ref)^2 (verl's mse), k3 ref/pi - log(ref/pi) - 1 (verl's low_var_kl); all on pi_old's samples
    estimator: Literal["k1", "k2", "k3"] = "k1"

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
    tis: TISConfig = field(default_factory=TISConfig)  # sampler / trainer mismatch correction (as grpo.tis)

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
        self.tis.validate(where, "ppo")


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


PackingStrategy = Literal["bfd", "bfd_split", "wrapped"]  # TRL's SFTConfig.packing_strategy


@dataclass
class SFTConfig:
    """Supervised fine-tuning of the policy adapter: loss on completion tokens only (lorarl.algos.sft)."""

    epochs: int = 1  # passes over the examples (train.steps may stop it first)
    batch_size: int = 16  # examples per optimizer step (with packing: packed rows per step, as TRL)
    max_length: int = 1024  # prompt + completion tokens; longer rows are bad rows (data.on_bad_row); packed row length
    packing: bool = False  # pack examples into rows of max_length tokens, no attention across examples (TRL's packing)
    # bfd: best-fit decreasing, whole examples; bfd_split: longer examples cut into max_length pieces first;
    # wrapped: one stream cut every max_length tokens, attending across examples (as TRL's; lorarl.data.packing)
    packing_strategy: PackingStrategy = "bfd"
    # nll: the token-mean NLL of the completion tokens (TRL's default); dft: Dynamic Fine-Tuning (Wu et al. 2025), each
    # token's NLL weighted by its probability held constant (TRL's loss_type "dft"; lorarl.algos.sft.completion_dft)
    loss_type: Literal["nll", "dft"] = "nll"

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


DPOLossName = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "simpo",
    "sft",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
]
REFERENCE_FREE = ("simpo", "sft")  # every other loss reads the reference's log-probs
LABEL_SMOOTHED = ("sigmoid", "simpo", "robust", "exo_pair", "aot", "aot_unpaired")  # those that read label_smoothing
# the losses of the chosen - rejected score difference: the only ones f-DPO's divergences apply to (TRL's set)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
SORTED_LOSSES = ("aot", "aot_unpaired")  # sort the pairs of a micro-batch: the sort's span is the micro-batch


class PreferenceLosses:
    """What DPO and online DPO share: their ``loss_type`` (one name or TRL 1.x's list) with ``loss_weights``."""

    @property
    def loss_types(self) -> tuple[str, ...]:
        """``loss_type`` as a tuple (one name or TRL's list)."""
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    @property
    def losses(self) -> tuple[tuple[str, float], ...]:
        """``((loss type, weight), ...)``: ``loss_weights`` or 1 each."""
        weights = self.loss_weights if self.loss_weights is not None else [1.0] * len(self.loss_types)
        return tuple(zip(self.loss_types, (float(w) for w in weights)))

    def check_losses(self, where: str, section: str, sft_alone: str) -> None:
        """One clear line for a loss list that names nothing, a loss twice, ``sft`` alone (``sft_alone`` says what to
        use instead) or the wrong number of weights."""
        types = self.loss_types
        check(len(types) >= 1, where, f"{section}.loss_type", "names at least one loss")
        check(len(set(types)) == len(types), where, f"{section}.loss_type", f"names a loss twice: {list(types)}")
        check(any(t != "sft" for t in types), where, f"{section}.loss_type", sft_alone)
        if self.loss_weights is not None:
            check(
                len(self.loss_weights) == len(types),
                where,
                f"{section}.loss_weights",
                f"has {len(self.loss_weights)} weight(s) for {len(types)} loss type(s) {list(types)}",
            )
            check(all(w >= 0 for w in self.loss_weights), where, f"{section}.loss_weights", "must be >= 0")


@dataclass
class DPOConfig(PreferenceLosses):
    """Direct preference optimization of the policy adapter on preference pairs (lorarl.algos.dpo); the reference
    is the base with adapters off, or model.init_adapter frozen. Losses by TRL's names (lorarl.core.preference_losses)."""

    # sigmoid = DPO; simpo: reference-free SimPO; a list combines them as TRL 1.x does, weighted by loss_weights,
    # e.g. [sigmoid, sft] (RPO: an NLL term on the chosen responses; `sft` only beside a preference loss)
    loss_type: Union[DPOLossName, list[DPOLossName]] = "sigmoid"  # noqa: UP007  the loader reads typing.Union
    loss_weights: list[float] | None = None  # one weight per loss_type entry (default: 1 each)
    beta: float = 0.1  # DPO's beta (IPO's tau; SimPO's beta, typically 2-2.5)
    label_smoothing: float = 0.0  # the chance a label is flipped, in [0, 0.5): conservative DPO / SimPO (sigmoid,
    #   simpo), robust (Robust DPO), aot / aot_unpaired; EXO's eps (exo_pair: > 0, the paper's 1e-3)
    simpo_gamma: float = 0.5  # SimPO's target reward margin gamma (loss_type simpo)
    discopop_tau: float = 0.05  # DiscoPOP's temperature (loss_type discopop; the paper's 0.05)
    # f-DPO: the divergence to the reference, through f'(pi / ref) in place of the log-ratio (TRL's key; sigmoid,
    # sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft only)
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5  # alpha of alpha_divergence (TRL's form; 1 is the reverse KL)
    use_weighting: bool = False  # WPO: each pair's loss x w(y_w) w(y_l), from the policy's own probabilities
    ld_alpha: float | None = None  # LD-DPO: weight in [0, 1] of the tokens past the pair's shorter response; null: 1
    precompute_ref_log_probs: bool = False  # reference log-probs of every training pair once, before step 1
    epochs: int = 1  # passes over the pairs (train.steps may stop it first)
    batch_size: int = 16  # pairs per optimizer step
    max_length: int = 512  # prompt + longer response in tokens; longer pairs are skipped and counted
    max_tokens_per_forward: int = 2048  # length-sorted forwards of at most this many padded tokens; 0 = one forward
    task_source: str | None = None  # held-out prompts for the greedy task evaluation (e.g. arithmetic); null: none

    @property
    def needs_reference(self) -> bool:
        """Whether any loss reads the reference's log-probs (simpo and sft do not)."""
        return any(t not in REFERENCE_FREE for t in self.loss_types)

    def validate(self, where: str) -> None:
        types = self.loss_types
        self.check_losses(
            where, "dpo", "sft needs a preference loss beside it (e.g. [sigmoid, sft]); for SFT alone use algo: sft"
        )
        check(self.beta > 0, where, "dpo.beta", "must be > 0")
        check(0 <= self.label_smoothing < 0.5, where, "dpo.label_smoothing", "must be in [0, 0.5)")
        unsmoothed = [t for t in types if t not in (*LABEL_SMOOTHED, "sft")]
        check(
            self.label_smoothing == 0 or not unsmoothed,
            where,
            "dpo.label_smoothing",
            f"applies to loss_type {', '.join(LABEL_SMOOTHED)} only, not {', '.join(unsmoothed)}: set it to 0",
        )
        check(
            "exo_pair" not in types or self.label_smoothing > 0,
            where,
            "dpo.label_smoothing",
            "must be > 0 with loss_type exo_pair (EXO's eps: log eps is in the loss; the paper uses 1e-3)",
        )
        check(self.discopop_tau > 0, where, "dpo.discopop_tau", "must be > 0")
        no_f = [t for t in types if t not in F_DIVERGENCE_LOSSES]
        check(
            self.f_divergence_type == "reverse_kl" or not no_f,
            where,
            "dpo.f_divergence_type",
            f"{self.f_divergence_type} applies to loss_type {', '.join(F_DIVERGENCE_LOSSES)} only, not "
            f"{', '.join(no_f)} (f-DPO's partition term cancels only in a chosen - rejected difference, as TRL says)",
        )
        check(
            self.ld_alpha is None or 0 <= self.ld_alpha <= 1,
            where,
            "dpo.ld_alpha",
            "must be in [0, 1] (1: plain DPO, 0: the longer response's excess tokens dropped) or null",
        )
        weighted_off = [t for t in types if t in (*SORTED_LOSSES, "sft")]
        check(
            not self.use_weighting or not weighted_off,
            where,
            "dpo.use_weighting",
            f"WPO's per-pair weights do not apply to loss_type {', '.join(weighted_off)}: aot / aot_unpaired sort the "
            "pairs (TRL refuses them too) and sft is a token mean over the batch (its weight would be the batch's "
            "mean weight, a product micro-batches cannot split)",
        )
        check(self.epochs >= 1, where, "dpo.epochs", "must be >= 1")
        check(self.batch_size >= 1, where, "dpo.batch_size", "must be >= 1")
        check(self.max_length >= 2, where, "dpo.max_length", "must be >= 2")
        check(self.max_tokens_per_forward >= 0, where, "dpo.max_tokens_per_forward", "must be >= 0")

    def check_micro_batch(self, micro_batch_size: int | str, where: str) -> None:
        """aot / aot_unpaired sort the pairs of each micro-batch (TRL: of each per_device_train_batch_size): the sort's
        span must be the recipe's choice, not the memory planner's."""
        sorted_types = [t for t in self.loss_types if t in SORTED_LOSSES]
        check(
            not sorted_types or micro_batch_size != "auto",
            where,
            "train.micro_batch_size",
            f"must be a number with dpo.loss_type {', '.join(sorted_types)}: the loss sorts the pairs of each "
            "micro-batch (TRL: per_device_train_batch_size), so auto would let the memory planner change the loss; "
            "set it to dpo.batch_size to sort the whole batch",
        )


OnlineDPOLossName = Literal["sigmoid", "hinge", "ipo", "sft"]


@dataclass
class OnlineDPOConfig(PreferenceLosses):
    """Online DPO (TRL's OnlineDPOTrainer; lorarl.algos.online_dpo): each step samples group_size completions per
    prompt with the policy (generation section), ranks them with the reward section (rule functions, the reward
    adapter, or both) and trains the DPO loss on (highest, lowest) against the reference (adapters off, or
    model.init_adapter frozen). train.prompts_per_step prompts per step from data.source, as RL."""

    # sigmoid = DPO (TRL's default), hinge, ipo; a list adds TRL 1.x's weighted terms, e.g. [sigmoid, sft] (RPO)
    loss_type: Union[OnlineDPOLossName, list[OnlineDPOLossName]] = "sigmoid"  # noqa: UP007  the loader reads Union
    loss_weights: list[float] | None = None  # one weight per loss_type entry (default: 1 each)
    beta: float = 0.1  # DPO's beta (IPO's tau)
    missing_eos_penalty: float | None = None  # TRL's: subtracted from the reward of a completion cut without EOS
    max_tokens_per_forward: int = 2048  # length-sorted forwards of at most this many padded tokens; 0 = one forward
    # completions sampled per prompt: 2 = TRL's pairs; more = best-of-n against worst-of-n (OpenRLHF's iterative DPO)
    group_size: int = 2

    def validate(self, where: str) -> None:
        check(self.group_size >= 2, where, "online_dpo.group_size", "must be >= 2 (a pair needs two completions)")
        self.check_losses(where, "online_dpo", "sft needs a preference loss beside it (e.g. [sigmoid, sft])")
        check(self.beta > 0, where, "online_dpo.beta", "must be > 0")
        check(
            self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
            where,
            "online_dpo.missing_eos_penalty",
            "must be >= 0 (it is subtracted)",
        )
        check(self.max_tokens_per_forward >= 0, where, "online_dpo.max_tokens_per_forward", "must be >= 0")


@dataclass
class DistillConfig:
    """On-policy distillation (TRL's DistillationTrainer; lorarl.algos.distill): the student (the policy adapter on
    the one base) samples completions of train.prompts_per_step prompts at generation.temperature (TRL's
    `temperature`, which also softens both distributions in the loss), the frozen teacher scores every token, and
    the loss is the generalized JSD of the two next-token distributions per token, token mean over the step (GKD,
    Agarwal et al. 2024). No reward: the reward section scores the held-out evaluation only."""

    # a model folder or name (a second frozen model loaded like the base: NF4 on CUDA when large; a merged export is
    # one), or a PEFT adapter folder (adapter_config.json: loaded frozen on the one base). Same tokenizer as the base,
    # or refused. TRL's teacher_model / teacher_model_name_or_path
    teacher: str = ""
    beta: float = 1.0  # TRL's: 0 = forward KL(teacher || student), 1 = reverse KL (TRL's default), else JSD(beta)

    def validate(self, where: str) -> None:
        check(
            bool(self.teacher.strip()),
            where,
            "distill.teacher",
            "must name the teacher: a model folder or name, a merged export, or a PEFT adapter folder",
        )
        check(0.0 <= self.beta <= 1.0, where, "distill.beta", "must be in [0, 1] (0 forward KL, 1 reverse KL)")


KTOLossName = Literal["kto", "apo_zero_unpaired"]


@dataclass
class KTOConfig:
    """KTO (Ethayarajh et al. 2024; TRL's KTOTrainer; lorarl.algos.kto) of the policy adapter on unpaired rows
    (prompt, completion, label; preference pairs give two rows each) against the reference (the base with adapters
    off, or model.init_adapter frozen). Losses by TRL's names (lorarl.core.kto_losses)."""

    # kto: the paper's loss with the KL reference point from mismatched pairs; apo_zero_unpaired: APO-zero unpaired
    # (no KL term)
    loss_type: KTOLossName = "kto"
    beta: float = 0.1  # KTO's beta, as TRL's: a larger beta keeps the policy nearer the reference
    desirable_weight: float = 1.0  # w_d: the desirable rows' losses x this (TRL's; Eq. 8 balances unequal counts)
    undesirable_weight: float = 1.0  # w_u: the undesirable rows' losses x this
    precompute_ref_log_probs: bool = False  # the reference's log-probs of every training row once, before step 1
    #   (the KL pairs' reference log-probs are still computed each step: the pairs follow the shuffled batch)
    epochs: int = 1  # passes over the rows (train.steps may stop it first)
    batch_size: int = 16  # rows per optimizer step; the KL estimate pairs each prompt with another row's completion
    #   of the same batch, over the whole batch (TRL: over each per-device micro-batch)
    max_length: int = 512  # prompt + completion in tokens; longer rows are skipped and counted (TRL truncates)
    max_tokens_per_forward: int = 2048  # length-sorted forwards of at most this many padded tokens; 0 = one forward
    task_source: str | None = None  # held-out prompts for the greedy task evaluation (e.g. arithmetic); null: none

    def validate(self, where: str) -> None:
        check(self.beta > 0, where, "kto.beta", "must be > 0")
        check(self.desirable_weight >= 0, where, "kto.desirable_weight", "must be >= 0")
        check(self.undesirable_weight >= 0, where, "kto.undesirable_weight", "must be >= 0")
        check(
            self.desirable_weight > 0 or self.undesirable_weight > 0,
            where,
            "kto.desirable_weight",
            "and kto.undesirable_weight are both 0: nothing would be trained",
        )
        check(self.epochs >= 1, where, "kto.epochs", "must be >= 1")
        check(self.batch_size >= 1, where, "kto.batch_size", "must be >= 1")
        check(
            self.loss_type != "kto" or self.batch_size >= 2,
            where,
            "kto.batch_size",
            "must be >= 2 with loss_type kto: its KL estimate pairs each prompt with another row's completion of the "
            "batch (TRL refuses per_device_train_batch_size 1 too); apo_zero_unpaired has no KL term",
        )
        check(self.max_length >= 2, where, "kto.max_length", "must be >= 2")
        check(self.max_tokens_per_forward >= 0, where, "kto.max_tokens_per_forward", "must be >= 0")


# The algorithm sections, and the shared sections each algorithm reads (others are refused in a recipe).
ALGO_SECTIONS: dict[str, type] = {
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
    "reward_model": RewardModelConfig,
    "sft": SFTConfig,
    "rejection_sampling": RejectionSamplingConfig,
    "dpo": DPOConfig,
    "online_dpo": OnlineDPOConfig,
    "rloo": RLOOConfig,
    "distill": DistillConfig,
    "kto": KTOConfig,
}
SHARED_SECTIONS = ("model", "lora", "data", "reward", "generation", "train", "eval", "health")
USES = {
    "grpo": SHARED_SECTIONS + ("agent",),
    "ppo": SHARED_SECTIONS + ("agent",),
    "reward_model": ("model", "lora", "data", "train", "eval", "health"),
    "sft": SHARED_SECTIONS + ("agent",),  # reward, generation, agent: held-out evaluation decodes like RL
    "rejection_sampling": SHARED_SECTIONS,
    "dpo": SHARED_SECTIONS,  # reward and generation: the held-out task evaluation (dpo.task_source)
    "online_dpo": SHARED_SECTIONS,  # prompts, the reward that ranks the samples, sampling
    "rloo": SHARED_SECTIONS,  # single-turn, as TRL's RLOOTrainer (no tools)
    "distill": SHARED_SECTIONS,  # prompts and sampling; the reward scores the held-out evaluation only
    "kto": SHARED_SECTIONS,  # reward and generation: the held-out task evaluation (kto.task_source)
}
TRAINS_ON_SAMPLES = ("grpo", "ppo", "rloo", "distill")
