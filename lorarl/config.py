"""Recipes: YAML files validated into dataclasses.

A recipe is a YAML mapping whose top-level keys are the sections below (``model``, ``lora``, ``data``, ...). Every
key is checked when the recipe loads: unknown keys (with a did-you-mean), wrong types and out-of-range values raise
:class:`RecipeError` naming the key and the file. Command-line overrides ``section.key=value`` are applied before
validation; the value is parsed as YAML (``train.steps=10``, ``lora.target_modules=[q_proj,v_proj]``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from lorarl.errors import RecipeError

Quantization = Literal["nf4", "none", "auto"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """The one shared base model."""

    name: str = "smollm2-135m"  # a name from `lorarl models`, a local transformers folder, or a hub name
    quantization: Quantization = "auto"  # nf4 on CUDA, none on CPU
    dtype: DType = "auto"  # compute dtype: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = True
    trust_remote_code: bool = False
    init_adapter: str | None = None  # start from a trained PEFT adapter; the reference is then that adapter, frozen
    logprob_chunk_size: int = 256  # positions per chunk when computing log-probs from hidden states

    def validate(self, where: str) -> None:
        _check(self.logprob_chunk_size >= 1, where, "model.logprob_chunk_size", "must be >= 1")


@dataclass
class LoraSettings:
    """LoRA settings of one adapter (PEFT LoraConfig)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = "all-linear"  # noqa: UP007

    def validate(self, where: str, prefix: str = "lora") -> None:
        _check(self.r >= 1, where, f"{prefix}.r", "must be >= 1")
        _check(self.alpha > 0, where, f"{prefix}.alpha", "must be > 0")
        _check(0.0 <= self.dropout < 1.0, where, f"{prefix}.dropout", "must be in [0, 1)")


@dataclass
class DataConfig:
    """Prompts. ``source`` is ``arithmetic`` (built-in generator), a .jsonl file, or a `datasets` folder.

    Rows follow TRL's fields: ``prompt`` (a string or a list of chat messages), plus any extra columns, which are
    passed to reward functions by name (e.g. ``answer``). Preference data has ``chosen`` / ``rejected``.
    """

    source: str = "arithmetic"
    eval_source: str | None = None  # held-out rows; for `arithmetic` a disjoint generated split is used
    train_size: int = 2000
    eval_size: int = 200
    seed: int = 1234
    operations: list[str] = field(default_factory=lambda: ["+"])  # arithmetic only
    digits: int = 2  # arithmetic only
    system_prompt: str | None = None  # prepended as a system message to conversational prompts
    prompt_template: str = "What is {a} {op} {b}?"  # arithmetic only: the user message, with {a} {op} {b}
    max_prompt_tokens: int = 512
    on_bad_row: Literal["skip", "fail"] = "fail"

    def validate(self, where: str) -> None:
        _check(self.train_size >= 1, where, "data.train_size", "must be >= 1")
        _check(self.eval_size >= 1, where, "data.eval_size", "must be >= 1")
        _check(1 <= self.digits <= 6, where, "data.digits", "must be in 1..6")
        bad = [op for op in self.operations if op not in ("+", "-", "*")]
        _check(
            not bad and self.operations,
            where,
            "data.operations",
            f"must be a non-empty list of + - *, got {self.operations}",
        )
        _check(self.max_prompt_tokens >= 1, where, "data.max_prompt_tokens", "must be >= 1")
        try:
            self.prompt_template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            _check(False, where, "data.prompt_template", f"must only use the fields {{a}} {{op}} {{b}} ({e!r})")


@dataclass
class RewardSpec:
    """One reward function: a built-in name or ``module:function`` with TRL's signature, and its weight."""

    name: str = "numeric_match"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationConfig:
    """Sampling during rollouts. Log-probs are computed at the same temperature."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self, where: str) -> None:
        _check(self.max_new_tokens >= 1, where, "generation.max_new_tokens", "must be >= 1")
        _check(self.temperature > 0, where, "generation.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, where, "generation.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, where, "generation.top_k", "must be >= 0")


@dataclass
class TrainConfig:
    """The optimisation loop shared by all algorithms."""

    steps: int = 100
    prompts_per_step: int = 8
    micro_batch_size: Union[int, Literal["auto"]] = 8  # noqa: UP007  sequences per forward/backward
    learning_rate: float = 1e-4
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 0  # 0: only the final adapter
    keep_last: int = 2
    log_every: int = 1
    max_nonfinite_in_row: int = 3  # NaN/inf losses or gradients in a row before the run stops
    max_reward_failure_fraction: float = 0.5  # failed reward calls (exception, timeout) before the run stops
    reward_timeout_s: float = 60.0  # per call of one reward function on one batch; 0 = no limit

    def validate(self, where: str) -> None:
        _check(self.steps >= 1, where, "train.steps", "must be >= 1")
        _check(self.prompts_per_step >= 1, where, "train.prompts_per_step", "must be >= 1")
        _check(
            self.micro_batch_size == "auto" or self.micro_batch_size >= 1,
            where,
            "train.micro_batch_size",
            "must be >= 1 or 'auto'",
        )
        _check(self.learning_rate > 0, where, "train.learning_rate", "must be > 0")
        _check(self.warmup_steps >= 0, where, "train.warmup_steps", "must be >= 0")
        _check(self.weight_decay >= 0, where, "train.weight_decay", "must be >= 0")
        _check(self.max_grad_norm > 0, where, "train.max_grad_norm", "must be > 0")
        _check(self.save_every >= 0, where, "train.save_every", "must be >= 0")
        _check(self.keep_last >= 1, where, "train.keep_last", "must be >= 1")
        _check(self.log_every >= 1, where, "train.log_every", "must be >= 1")
        _check(self.max_nonfinite_in_row >= 1, where, "train.max_nonfinite_in_row", "must be >= 1")
        _check(
            0 < self.max_reward_failure_fraction <= 1, where, "train.max_reward_failure_fraction", "must be in (0, 1]"
        )
        _check(self.reward_timeout_s >= 0, where, "train.reward_timeout_s", "must be >= 0 (0: no limit)")


@dataclass
class GRPOConfig:
    """GRPO (DeepSeekMath) with DAPO / Dr. GRPO / DeepSeek-V3.2 options."""

    group_size: int = 8
    num_iterations: int = 1  # policy updates per rollout batch
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # > clip_eps_low is DAPO's clip-higher
    loss_reduction: Literal["seq_mean_token_mean", "token_mean", "seq_sum_norm"] = "seq_mean_token_mean"
    std_scaling: Literal["group", "batch", "none"] = "group"
    unbiased_std: bool = False  # False: population std
    kl_coef: float = 0.0  # 0 never runs the reference
    kl_estimator: Literal["k3", "k3_unbiased"] = "k3"
    mask_truncated: bool = False  # completions without EOS contribute no loss (DAPO overlong filtering)
    entropy_coef: float = 0.0
    ref_refresh_every: int = 0  # iterative GRPO: copy the policy into the reference adapter every N steps

    def validate(self, where: str) -> None:
        _check(self.group_size >= 2, where, "grpo.group_size", "must be >= 2 (advantages are relative within a group)")
        _check(self.num_iterations >= 1, where, "grpo.num_iterations", "must be >= 1")
        _check(self.clip_eps_low > 0, where, "grpo.clip_eps_low", "must be > 0")
        _check(self.clip_eps_high > 0, where, "grpo.clip_eps_high", "must be > 0")
        _check(self.kl_coef >= 0, where, "grpo.kl_coef", "must be >= 0")
        _check(self.entropy_coef >= 0, where, "grpo.entropy_coef", "must be >= 0")
        _check(self.ref_refresh_every >= 0, where, "grpo.ref_refresh_every", "must be >= 0")


@dataclass
class PPOConfig:
    """PPO with a LoRA critic and a LoRA reward model on the same base (InstructGPT-style RLHF)."""

    epochs: int = 2  # K epochs over each rollout batch
    minibatch_size: int = 8
    clip_eps: float = 0.2
    value_clip: float | None = 0.2
    value_loss: Literal["mse", "huber"] = "mse"
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    kl_coef: float = 0.05
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    target_approx_kl: float | None = None  # early stop of the epoch loop
    reward_source: Literal["reward_model", "rules", "both"] = "reward_model"
    reward_adapter: str | None = None  # run dir or adapter folder made by recipes/reward_model.yaml
    reward_normalize: bool = False
    reward_clip: float | None = None
    no_eos_penalty: float | None = None  # replaces the score of responses that did not end with EOS
    critic_init: Literal["fresh", "reward"] = "fresh"
    critic_lora: LoraSettings = field(default_factory=LoraSettings)
    ptx_coef: float = 0.0  # InstructGPT pretraining-loss term
    ptx_source: str | None = None  # .jsonl with a `text` column
    ptx_batch_size: int = 4  # texts of ptx_source per minibatch
    critic_learning_rate: float | None = None  # the critic's own optimizer; default train.learning_rate
    reward_model_weight: float = 1.0  # reward_source "both": total = weight * RM score + weighted rule rewards
    huber_delta: float = 1.0  # value_loss "huber"

    def validate(self, where: str) -> None:
        _check(self.epochs >= 1, where, "ppo.epochs", "must be >= 1")
        _check(self.ptx_batch_size >= 1, where, "ppo.ptx_batch_size", "must be >= 1")
        _check(
            self.critic_learning_rate is None or self.critic_learning_rate > 0,
            where,
            "ppo.critic_learning_rate",
            "must be > 0 or null",
        )
        _check(self.huber_delta > 0, where, "ppo.huber_delta", "must be > 0")
        _check(self.reward_clip is None or self.reward_clip > 0, where, "ppo.reward_clip", "must be > 0 or null")
        _check(
            self.target_approx_kl is None or self.target_approx_kl > 0,
            where,
            "ppo.target_approx_kl",
            "must be > 0 or null",
        )
        _check(not self.adaptive_kl or self.kl_coef > 0, where, "ppo.kl_coef", "must be > 0 when ppo.adaptive_kl is on")
        _check(self.minibatch_size >= 1, where, "ppo.minibatch_size", "must be >= 1")
        _check(self.clip_eps > 0, where, "ppo.clip_eps", "must be > 0")
        _check(self.value_clip is None or self.value_clip > 0, where, "ppo.value_clip", "must be > 0 or null")
        _check(self.vf_coef >= 0, where, "ppo.vf_coef", "must be >= 0")
        _check(0 <= self.gamma <= 1, where, "ppo.gamma", "must be in [0, 1]")
        _check(0 <= self.lam <= 1, where, "ppo.lam", "must be in [0, 1]")
        _check(self.kl_coef >= 0, where, "ppo.kl_coef", "must be >= 0")
        _check(self.kl_target > 0, where, "ppo.kl_target", "must be > 0")
        _check(self.kl_horizon >= 1, where, "ppo.kl_horizon", "must be >= 1")
        _check(self.ptx_coef >= 0, where, "ppo.ptx_coef", "must be >= 0")
        _check(self.ptx_coef == 0 or self.ptx_source, where, "ppo.ptx_source", "is required when ppo.ptx_coef > 0")
        self.critic_lora.validate(where, "ppo.critic_lora")


@dataclass
class RewardModelConfig:
    """Bradley-Terry reward model: the `reward` adapter plus a score head."""

    epochs: int = 1
    batch_size: int = 8
    margin: bool = False  # use a `margin` column when present
    center_coef: float = 0.0  # reward centering term coef * (r_c + r_r)^2
    max_length: int = 512  # pairs whose longer side has more tokens are dropped (counted), like TRL
    eval_every: int = 0  # held-out pairwise accuracy every N steps (0: only at the end)
    # sequences of a micro-batch are sorted by length and scored in forwards of at most this many padded tokens
    # (less padding: a 50-token answer is not padded to its 160-token neighbour); 0 = one forward per micro-batch
    max_tokens_per_forward: int = 4096

    def validate(self, where: str) -> None:
        _check(self.epochs >= 1, where, "reward_model.epochs", "must be >= 1")
        _check(self.max_tokens_per_forward >= 0, where, "reward_model.max_tokens_per_forward", "must be >= 0")
        _check(self.batch_size >= 1, where, "reward_model.batch_size", "must be >= 1")
        _check(self.center_coef >= 0, where, "reward_model.center_coef", "must be >= 0")
        _check(self.max_length >= 2, where, "reward_model.max_length", "must be >= 2")
        _check(self.eval_every >= 0, where, "reward_model.eval_every", "must be >= 0")


@dataclass
class EvalConfig:
    n: int = 200
    batch_size: int = 32
    max_new_tokens: int | None = None  # default: generation.max_new_tokens

    def validate(self, where: str) -> None:
        _check(self.n >= 1, where, "eval.n", "must be >= 1")
        _check(self.batch_size >= 1, where, "eval.batch_size", "must be >= 1")


@dataclass
class Recipe:
    algo: Literal["grpo", "ppo", "reward_model"] = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    source_path: str | None = None  # where the recipe was read from (set by load_recipe, not a YAML key)

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate(where)
        for i, spec in enumerate(self.rewards):
            _check(bool(spec.name), where, f"rewards[{i}].name", "must not be empty")
        if self.algo == "grpo":
            _check(bool(self.rewards), where, "rewards", "GRPO needs at least one reward function")


_NOT_YAML_KEYS = {"source_path"}


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.2), not as the string PyYAML's YAML 1.1 gives."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)


def _check(ok: bool, where: str, key: str, message: str) -> None:
    if not ok:
        raise RecipeError(f"{where}: {key} {message}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, mappings -> dataclasses)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise RecipeError(f"{where}: {key} must be one of {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key, where)
            except RecipeError as e:
                errors.append(e)
        raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise RecipeError(f"{where}: {key} must be null, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: {key} must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise RecipeError(f"{where}: {key} must be {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, prefix: str, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {prefix or 'the recipe'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_YAML_KEYS]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]}?)" if close else ""
            if not close and prefix:
                elsewhere = _sections_with_key(str(key))
                hint = f" (did you mean {' or '.join(f'{s}.{key}' for s in elsewhere)}?)" if elsewhere else ""
            raise RecipeError(f"{where}: unknown key {full}{hint}")
        kwargs[key] = _coerce(value, hints[key], full, where)
    return cls(**kwargs)


def _sections_with_key(key: str) -> list[str]:
    """Recipe sections that have ``key`` (for a key put in the wrong section: train.gradient_checkpointing)."""
    hints = typing.get_type_hints(Recipe)
    return [
        f.name
        for f in dataclasses.fields(Recipe)
        if dataclasses.is_dataclass(hints[f.name]) and key in {g.name for g in dataclasses.fields(hints[f.name])}
    ]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"grpo.kl_coef=0.04"`` -> (["grpo", "kl_coef"], 0.04). The value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"override {text!r} has no key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({e.problem})") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of the raw recipe mapping with ``section.key=value`` overrides applied."""
    out = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"override {text!r}: {part} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def recipe_from_dict(data: dict, where: str = "<recipe>", overrides: list[str] | None = None) -> Recipe:
    data = apply_overrides(data or {}, overrides or [])
    recipe = _build(Recipe, data, "", where)
    recipe.validate(where)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError naming the file and key on any problem."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise RecipeError(f"{where}: recipe file not found")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{where}:{loc} unreadable YAML ({getattr(e, 'problem', e)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{where}: cannot read recipe ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping of sections")
    recipe = recipe_from_dict(data, where, overrides)
    recipe.source_path = str(path.resolve())
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain data (saved beside checkpoints as recipe.yaml)."""
    d = dataclasses.asdict(recipe)
    for k in _NOT_YAML_KEYS:
        d.pop(k, None)
    return d
