"""Every field of TRL 1.16's ``GRPOConfig`` / ``DPOConfig`` / ``SFTConfig`` / ``RewardConfig`` / ``KTOConfig`` (their own fields and
the transformers ``TrainingArguments`` they inherit), and what :mod:`lorarl.trl` does with it: one table, :data:`TABLE`.

An entry is one of

* :class:`Map` -- the value becomes recipe keys (``train.learning_rate``); always applied, default or not (TRL's
  defaults are TRL's: ``GRPOConfig().learning_rate`` is 1e-6 and stays 1e-6). ``why`` says where lorarl's convention
  differs from TRL's for the same key.
* :class:`Note` -- accepted; a value other than the config's default gets one notice (logger ``lorarl.trl``) that
  it has no effect here (a logging or distributed-training detail), and why.
* :class:`Refuse` -- a value other than the config's default raises :class:`~lorarl.errors.LorarlError` with one line
  naming the field and why (lorarl would otherwise silently do something else); the default passes silently.

docs/trl_dropin.md's field table is :func:`markdown_table` (tests/test_trl_dropin.py checks the two are equal).
``python -m lorarl.trl.fields`` prints it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorarl.errors import LorarlError

KEEP_ALL = 1_000_000_000  # train.keep_last for TRL's save_total_limit None (keep every checkpoint)
TRACKERS = ("tensorboard", "trackio", "wandb")  # train.report_to's trackers


@dataclass(frozen=True)
class Map:
    """The field becomes recipe keys: ``convert(value, ctx)`` -> ``{"section.key": value}`` (default: ``key``)."""

    key: str
    why: str = ""
    convert: Callable[[Any, dict], dict] | None = None

    def apply(self, value: Any, ctx: dict) -> dict:
        return self.convert(value, ctx) if self.convert else {self.key: value}


@dataclass(frozen=True)
class Note:
    """Accepted; a non-default value gets one notice (``why``)."""

    why: str


@dataclass(frozen=True)
class Refuse:
    """A non-default value is refused with one line (``why``)."""

    why: str


class Refused(LorarlError):
    """A TRL config field (or trainer argument) lorarl cannot honour; the message names it."""


def refuse(where: str, value: Any, why: str) -> None:
    """Raise :class:`Refused`: ``"<Config>.<field>=<value>: <why>"``."""
    raise Refused(f"{where}={value!r}: {why}")


def check_finite(where: str, value: Any) -> None:
    """Refuse a NaN or infinite float: TRL's configs take one, and a step count made of it raises."""
    if isinstance(value, float) and not math.isfinite(value):
        refuse(where, value, "must be a finite number")


# ---- converters -------------------------------------------------------------------------------------------------


def _steps_of(value: float, ctx: dict) -> int:
    """A step count TRL may give as a ratio of the run's steps (``0 < value < 1``): ``ceil(value * steps)``."""
    if 0 < value < 1:
        return max(1, math.ceil(value * ctx["steps"]))
    return int(value)


def precision(bf16: bool, fp16: bool, device: str, capability: tuple[int, int] | None) -> tuple[str, str]:
    """``(model.dtype, why or "")`` of TRL's mixed-precision flags with the meaning they have in TRL on the device the
    run uses (``device``: ``cpu`` or ``cuda``; ``capability``: the GPU's compute capability). ``why`` is a notice
    where lorarl's choice is not the flag's name:

    * CPU: ``bf16`` -> bfloat16 (accelerate autocasts bf16 on the CPU); ``fp16`` -> float32 (accelerate autocasts
      fp16 on GPUs only: TRL runs without autocast there; notice); neither -> float32.
    * CUDA: ``bf16`` -> bfloat16 where the GPU has it natively (compute capability 8.0 and up), else float16 with
      dynamic loss scaling (transformers accepts bf16 there, emulated many times slower; lorarl refuses emulated
      bf16 at load: notice); ``fp16`` -> float16 (loss-scaled, as transformers' GradScaler); neither -> float32.

    Example: ``precision(True, False, "cuda", (7, 5))`` (a T4) -> ``("float16", "... no native bfloat16 ...")``.
    """
    from lorarl.model.precision import native_bf16

    if device != "cuda":
        if fp16:
            return (
                "float32",
                "no fp16 on the CPU (accelerate autocasts it on GPUs only; TRL runs without autocast): float32",
            )
        return ("bfloat16" if bf16 else "float32"), ""
    if fp16:
        return "float16", ""
    if bf16 and not native_bf16(capability):
        cc = ".".join(map(str, capability or ()))
        return "float16", (
            f"this GPU (compute capability {cc}) has no native bfloat16 (emulated, many times slower): lorarl computes "
            "in float16 with dynamic loss scaling (model.dtype auto)"
        )
    return ("bfloat16" if bf16 else "float32"), ""


def run_device(args: Any) -> tuple[str, tuple[int, int] | None]:
    """``(device type, compute capability or None)`` a run of TRL config ``args`` uses on this machine: the CPU with
    ``use_cpu`` or without a visible GPU, else CUDA (as transformers' ``TrainingArguments.device``)."""
    import torch

    if args.use_cpu or not torch.cuda.is_available():
        return "cpu", None
    return "cuda", tuple(torch.cuda.get_device_capability())


def _dtype(_value: Any, ctx: dict) -> dict:
    a = ctx["args"]
    dtype, why = precision(bool(a.bf16), bool(a.fp16), *run_device(a))
    if why:
        flag = "fp16" if a.fp16 else "bf16"
        ctx["notices"].append(f"{ctx['cls']}.{flag}=True: {why}")
    return {"model.dtype": dtype}


def _scheduler(value: Any, ctx: dict) -> dict:
    name = str(getattr(value, "value", value))
    if name == "constant_with_warmup":
        name = "constant"
    if name not in ("constant", "linear", "cosine"):
        refuse(
            f"{ctx['cls']}.lr_scheduler_type",
            name,
            "lorarl's schedules are constant, constant_with_warmup, linear and cosine (train.lr_scheduler)",
        )
    return {"train.lr_scheduler": name}


def _warmup(value: float, ctx: dict) -> dict:
    # transformers' "constant" schedule has no warm-up (constant_with_warmup has); lorarl's constant warms up
    if str(getattr(ctx["args"].lr_scheduler_type, "value", ctx["args"].lr_scheduler_type)) == "constant":
        return {"train.warmup_steps": 0}
    return {"train.warmup_steps": _steps_of(value, ctx)}


def _report_to(value: Any, ctx: dict) -> dict:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n != "none"]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        refuse(f"{ctx['cls']}.report_to", value, f"lorarl logs to {', '.join(TRACKERS)} (train.report_to); name them")
    return {"train.report_to": names}


def _save(value: Any, ctx: dict) -> dict:
    strategy = str(getattr(value, "value", value))
    a = ctx["args"]
    if strategy == "no":
        return {"train.save_every": 0}
    if strategy == "steps":
        return {"train.save_every": _steps_of(a.save_steps, ctx)}
    if strategy == "epoch":
        return {"train.save_every": ctx["steps_per_epoch"]}
    refuse(f"{ctx['cls']}.save_strategy", strategy, "lorarl saves every N steps (train.save_every) or at the end")


def _eval_every(value: Any, ctx: dict) -> dict:
    strategy = str(getattr(value, "value", value))
    a = ctx["args"]
    if strategy == "no":
        return {"eval.every": 0}
    if strategy == "steps":
        return {"eval.every": _steps_of(a.eval_steps if a.eval_steps is not None else a.logging_steps, ctx)}
    return {"eval.every": ctx["steps_per_epoch"]}  # epoch


def _int_epochs(section: str) -> Callable[[Any, dict], dict]:
    def convert(value: float, ctx: dict) -> dict:
        return {f"{section}.epochs": max(1, math.ceil(value))}

    return convert


def _batch(section: str) -> Callable[[Any, dict], dict]:
    """Rows per optimizer step = per_device_train_batch_size x gradient_accumulation_steps (one device)."""

    def convert(value: int, ctx: dict) -> dict:
        return {
            f"{section}.batch_size": value * ctx["args"].gradient_accumulation_steps,
            "train.micro_batch_size": value,
        }

    return convert


def _grpo_batch(value: int, ctx: dict) -> dict:
    a = ctx["args"]
    rows = value * a.gradient_accumulation_steps
    if rows % a.num_generations:
        refuse(
            f"{ctx['cls']}.per_device_train_batch_size",
            value,
            f"x gradient_accumulation_steps ({a.gradient_accumulation_steps}) = {rows} completions per step must be a "
            f"multiple of num_generations ({a.num_generations})",
        )
    return {"train.prompts_per_step": rows // a.num_generations, "train.micro_batch_size": value}


# TRL's GRPO loss_type -> (grpo.policy_loss, grpo.loss_reduction): TRL's one name is lorarl's two keys
GRPO_LOSS_TYPES = {
    "grpo": ("clip", "seq_mean_token_mean"),
    "dapo": ("clip", "token_mean"),
    "dr_grpo": ("clip", "seq_sum_norm"),
    "bnpo": ("clip", "micro_batch_token_mean"),
    "luspo": ("clip", "seq_mean_token_sum"),
    "cispo": ("cispo", "token_mean"),
    "sapo": ("sapo", "seq_mean_token_mean"),
    "vespo": ("vespo", "token_mean"),
}


def _grpo_loss(value: str, ctx: dict) -> dict:
    if value not in GRPO_LOSS_TYPES:
        refuse(f"{ctx['cls']}.loss_type", value, f"TRL 1.16's GRPO loss types are {', '.join(GRPO_LOSS_TYPES)}")
    policy, reduction = GRPO_LOSS_TYPES[value]
    keys = {"grpo.policy_loss": policy, "grpo.loss_reduction": reduction}
    if value == "cispo":  # TRL's epsilon_high is CISPO's eps_max (None -> epsilon, as TRL reads it)
        a = ctx["args"]
        keys["grpo.cispo_eps_max"] = a.epsilon if a.epsilon_high is None else a.epsilon_high
    return keys


def _scale_rewards(value: Any, ctx: dict) -> dict:
    table = {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}
    if value not in table:
        refuse(f"{ctx['cls']}.scale_rewards", value, "must be group, batch, none, True or False")
    return {"grpo.std_scaling": table[value]}


REF_REFRESH_ALGOS = ("grpo", "rloo")  # whose reference is an adapter a refresh can copy the policy into


def _sync_ref(value: bool, ctx: dict) -> dict:
    """TRL's ``sync_ref_model`` (with ``ref_model_mixup_alpha`` 1.0: a copy every ``ref_model_sync_steps``) ->
    ``<algo>.kl.ref_refresh_every``; refused elsewhere (DPO, KTO: the reference is the base with adapters off)."""
    a = ctx["args"]
    if not value:
        return {}
    if ctx["algo"] not in REF_REFRESH_ALGOS or a.ref_model_mixup_alpha != 1.0:
        refuse(
            f"{ctx['cls']}.sync_ref_model",
            value,
            "lorarl's reference refresh copies the policy into the reference (<algo>.kl.ref_refresh_every, GRPO and "
            "RLOO only): set ref_model_mixup_alpha=1.0 on GRPO or RLOO, or leave it off",
        )
    return {f"{ctx['algo']}.kl.ref_refresh_every": a.ref_model_sync_steps}


def _ref_sync_fields(section: str) -> dict[str, Map]:
    """GRPO's and RLOO's ``sync_ref_model`` / ``ref_model_mixup_alpha`` / ``ref_model_sync_steps`` entries."""
    key = f"{section}.kl.ref_refresh_every"
    return {
        "sync_ref_model": Map(
            key,
            "with ref_model_mixup_alpha 1.0: copy the policy into the reference every ref_model_sync_steps",
            _sync_ref,
        ),
        "ref_model_mixup_alpha": Map(key, "read with sync_ref_model (only 1.0, a copy)", lambda v, c: {}),
        "ref_model_sync_steps": Map(key, "read with sync_ref_model", lambda v, c: {}),
    }


# TRL 1.16's DPOTrainer loss types (its _compute_loss): lorarl has each under the same name
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip


def _dpo_losses(value: Any, ctx: dict) -> dict:
    names = [value] if isinstance(value, str) else list(value)
    bad = [n for n in names if n not in DPO_LOSS_TYPES]
    if bad:
        refuse(
            f"{ctx['cls']}.loss_type", value, f"TRL 1.16's DPO loss types are {', '.join(DPO_LOSS_TYPES)}, not {bad}"
        )
    return {"dpo.loss_type": names if len(names) > 1 else names[0]}


def _model_init_kwargs(value: Any, ctx: dict) -> dict:
    if not value:
        return {}
    extra = sorted(set(value) - {"dtype", "torch_dtype", "trust_remote_code"})
    if extra:
        refuse(f"{ctx['cls']}.model_init_kwargs", value, f"lorarl loads the one shared base itself; {extra} not read")
    out = {}
    dtype = value.get("dtype", value.get("torch_dtype"))
    if dtype is not None and str(dtype) != "auto":
        name = str(dtype).replace("torch.", "")
        if name not in ("float32", "bfloat16", "float16"):
            refuse(f"{ctx['cls']}.model_init_kwargs", value, "dtype must be float32, bfloat16, float16 or auto")
        out["model.dtype"] = name
    if "trust_remote_code" in value:
        out["model.trust_remote_code"] = bool(value["trust_remote_code"])
    return out


def _log_completions(value: bool, ctx: dict) -> dict:
    n = ctx["args"].num_completions_to_print
    return {"train.log_completions": (n or 4) if value else 0}


def _one_generation(value: Any, ctx: dict) -> dict:
    a = ctx["args"]
    if a.steps_per_generation != a.gradient_accumulation_steps:
        refuse(
            f"{ctx['cls']}.steps_per_generation",
            a.steps_per_generation,
            f"lorarl samples once per optimizer step: it must equal gradient_accumulation_steps "
            f"({a.gradient_accumulation_steps}); num_iterations reuses a step's samples",
        )
    if a.generation_batch_size != a.per_device_train_batch_size * a.gradient_accumulation_steps:
        refuse(
            f"{ctx['cls']}.generation_batch_size",
            a.generation_batch_size,
            "lorarl samples one optimizer step's completions at a time (per_device_train_batch_size x "
            "gradient_accumulation_steps)",
        )
    return {}


def _use_cpu(value: bool, ctx: dict) -> dict:
    return {"model.device": "cpu"} if value else {}


def _clip_high(value: Any, ctx: dict) -> dict:
    return {"grpo.clip_eps_high": ctx["args"].epsilon if value is None else value}


def _max_turns(value: Any, ctx: dict) -> dict:
    return {} if value is None or not ctx.get("agent") else {"agent.max_turns": value + 1}


def _is_level(value: str, ctx: dict) -> dict:
    if value not in ("token", "sequence"):
        refuse(f"{ctx['cls']}.importance_sampling_level", value, "lorarl's levels are token and sequence (GSPO)")
    return {"grpo.importance_sampling_level": value}


def _center(value: Any, ctx: dict) -> dict:
    return {"reward_model.center_coef": float(value or 0.0)}


def _completion_only(value: Any, ctx: dict) -> dict:
    if value is False and ctx.get("sft_rows") != "text":  # text rows train every token, whatever the value (TRL)
        refuse(
            f"{ctx['cls']}.completion_only_loss",
            value,
            "lorarl's SFT loss is on completion tokens only (the prompt is never trained on; text rows: every token)",
        )
    return {}


def _text_field(value: str, ctx: dict) -> dict:
    return {"data.columns.text": value} if ctx.get("sft_rows") == "text" and value != "text" else {}


def _sft_length(value: Any, ctx: dict) -> dict:
    if value is None:  # TRL: no truncation (packing refuses None too); lorarl's rows and plan need a bound
        refuse(
            f"{ctx['cls']}.max_length",
            value,
            "lorarl needs a length (the longest row it trains, the packed rows' length, what the memory plan "
            "counts): set one",
        )
    return {"sft.max_length": value}


def _packing_strategy(value: str, ctx: dict) -> dict:
    from lorarl.data.packing import STRATEGIES

    if value not in STRATEGIES:
        refuse(f"{ctx['cls']}.packing_strategy", value, f"TRL's packing strategies are {', '.join(STRATEGIES)}")
    return {"sft.packing_strategy": value}


def _train_steps(value: int, ctx: dict) -> dict:
    return {"train.steps": ctx["steps"]}


# ---- the table --------------------------------------------------------------------------------------------------

NO_EFFECT = "no effect on one process / one device"
LOG_DETAIL = "a logging detail lorarl does not have (metrics.jsonl, train.report_to)"
HUB = "lorarl never pushes to the hub: `lorarl export` / Run.export write a folder you push"
KERNEL = "a kernel / compiler choice; lorarl picks its own (generation.engine, fused AdamW where available)"
NO_VLLM = "lorarl samples with its own engine on the shared base (generation.engine), never vLLM"
TRUNC = "lorarl never truncates a row: one longer than max_length is skipped and counted (DPO, reward model) or a bad row (SFT)"

TRAINING_ARGUMENTS: dict[str, Map | Note | Refuse] = {
    "output_dir": Map(
        "(run folder)", "the run folder (recipe.yaml, metrics.jsonl, policy/ or reward/ ...)", lambda v, c: {}
    ),
    "do_train": Note("Trainer scripts' flag; train() trains"),
    "do_eval": Note("Trainer scripts' flag; evaluate() evaluates"),
    "do_predict": Note("Trainer scripts' flag"),
    "eval_strategy": Map("eval.every", "steps / epoch: evaluation every N steps during training", _eval_every),
    "prediction_loss_only": Note("lorarl's evaluation returns its own metrics"),
    "per_device_train_batch_size": Map("train.micro_batch_size", "rows per forward/backward (see the section's batch)"),
    "per_device_eval_batch_size": Map("eval.batch_size"),
    "gradient_accumulation_steps": Map(
        "(batch)", "x per_device_train_batch_size = rows per optimizer step (one device)", lambda v, c: {}
    ),
    "eval_accumulation_steps": Note(NO_EFFECT),
    "eval_delay": Refuse("lorarl evaluates every eval.every steps from the start"),
    "torch_empty_cache_steps": Note("a memory detail"),
    "learning_rate": Map(
        "train.learning_rate",
        "AdamW's; TRL's default is kept (GRPOConfig 1e-6, DPOConfig 1e-6, SFTConfig 2e-5, RewardConfig 1e-4): LoRA usually wants 1e-4 to 1e-3",
    ),
    "weight_decay": Map("train.weight_decay"),
    "adam_beta1": Refuse("lorarl's AdamW uses torch's betas (0.9, 0.999)"),
    "adam_beta2": Refuse("lorarl's AdamW uses torch's betas (0.9, 0.999)"),
    "adam_epsilon": Refuse("lorarl's AdamW uses torch's eps 1e-8"),
    "max_grad_norm": Map("train.max_grad_norm"),
    "num_train_epochs": Map(
        "train.steps", "with max_steps <= 0: the steps of that many passes over train_dataset", lambda v, c: {}
    ),
    "max_steps": Map("train.steps", "> 0: the run's optimizer steps; else from num_train_epochs", _train_steps),
    "lr_scheduler_type": Map("train.lr_scheduler", "constant, constant_with_warmup, linear, cosine", _scheduler),
    "lr_scheduler_kwargs": Refuse("lorarl's schedules take no arguments"),
    "warmup_steps": Map(
        "train.warmup_steps", "a value < 1 is a ratio of the run's steps, as transformers; none for constant", _warmup
    ),
    "log_level": Note(LOG_DETAIL),
    "log_level_replica": Note(NO_EFFECT),
    "log_on_each_node": Note(NO_EFFECT),
    "logging_first_step": Note("lorarl logs every train.log_every steps, step 1 included"),
    "logging_steps": Map(
        "train.log_every",
        "a value < 1 is a ratio of the run's steps",
        lambda v, c: {"train.log_every": _steps_of(v, c)},
    ),
    "logging_strategy": Note("lorarl logs every train.log_every steps (logging_steps)"),
    "logging_nan_inf_filter": Note("lorarl stops a run after train.max_nonfinite_in_row non-finite steps"),
    "save_strategy": Map(
        "train.save_every", "steps: every save_steps; epoch: every epoch's steps; no: at the end only", _save
    ),
    "save_steps": Map("train.save_every", "read through save_strategy", lambda v, c: {}),
    "save_total_limit": Map(
        "train.keep_last", "None keeps every checkpoint, as TRL", lambda v, c: {"train.keep_last": v or KEEP_ALL}
    ),
    "enable_jit_checkpoint": Note("lorarl checkpoints on SIGTERM itself (`lorarl train --resume`)"),
    "save_on_each_node": Note(NO_EFFECT),
    "save_only_model": Note("lorarl's checkpoints always hold what a resume needs"),
    "restore_callback_states_from_checkpoint": Note("lorarl takes no callbacks"),
    "use_cpu": Map(
        "model.device",
        "True -> cpu: the CPU even beside a GPU, as transformers; False -> auto (CUDA when there is a GPU)",
        _use_cpu,
    ),
    "seed": Map("train.seed"),
    "data_seed": Refuse("lorarl's data order follows seed (train.seed)"),
    "bf16": Map(
        "model.dtype",
        "on the run's device, as TRL: bf16 -> bfloat16 (float16 on a GPU without native bf16, with a notice), "
        "fp16 -> float16 on CUDA and float32 on the CPU (accelerate autocasts fp16 on GPUs only; a notice), neither "
        "-> float32 (the base is NF4 on CUDA, model.quantization auto)",
        _dtype,
    ),
    "fp16": Map("model.dtype", "read with bf16", lambda v, c: {}),
    "bf16_full_eval": Note("evaluation runs in model.dtype"),
    "fp16_full_eval": Note("evaluation runs in model.dtype"),
    "tf32": Map(
        "(torch's TF32 switch)",
        "transformers sets torch's TF32 matmul switch for the process when the config is built (True needs an "
        "Ampere or newer GPU, as TRL); lorarl's float32 matmuls follow it",
        lambda v, c: {},
    ),
    "local_rank": Note(NO_EFFECT),
    "ddp_backend": Note(NO_EFFECT),
    "debug": Note(LOG_DETAIL),
    "dataloader_drop_last": Note("lorarl's batches are whole steps"),
    "eval_steps": Map("eval.every", "read through eval_strategy", lambda v, c: {}),
    "dataloader_num_workers": Note(NO_EFFECT),
    "dataloader_prefetch_factor": Note(NO_EFFECT),
    "run_name": Note("the run's name is its folder (output_dir)"),
    "disable_tqdm": Map("(progress)", "off: no progress bar (lorarl.train(progress=False))", lambda v, c: {}),
    "remove_unused_columns": Note("lorarl keeps every column (reward functions get them by name)"),
    "label_names": Note(NO_EFFECT),
    "load_best_model_at_end": Refuse("lorarl keeps the final adapters (train.keep_best keeps the best in DIR/best)"),
    "metric_for_best_model": Refuse("use the recipe key train.keep_best (lorarl.train)"),
    "greater_is_better": Refuse("use the recipe key train.keep_best_mode (lorarl.train)"),
    "ignore_data_skip": Note("a resumed lorarl run continues its seeded data order"),
    "fsdp": Note(NO_EFFECT),
    "fsdp_config": Note(NO_EFFECT),
    "accelerator_config": Note(NO_EFFECT),
    "parallelism_config": Note(NO_EFFECT),
    "deepspeed": Note(NO_EFFECT + " (one GPU; the base is shared NF4)"),
    "label_smoothing_factor": Refuse("a cross-entropy label smoothing lorarl's losses do not have"),
    "optim": Refuse("lorarl trains with AdamW (torch)"),
    "optim_args": Refuse("lorarl trains with AdamW (torch)"),
    "optim_target_modules": Refuse("lorarl trains LoRA adapters only"),
    "length_column_name": Note(NO_EFFECT),
    "report_to": Map("train.report_to", "tensorboard / trackio / wandb; none -> [] (metrics.jsonl always)", _report_to),
    "project": Map("train.project"),
    "trackio_space_id": Note(LOG_DETAIL),
    "trackio_bucket_id": Note(LOG_DETAIL),
    "trackio_static_space_id": Note(LOG_DETAIL),
    "ddp_find_unused_parameters": Note(NO_EFFECT),
    "ddp_bucket_cap_mb": Note(NO_EFFECT),
    "ddp_broadcast_buffers": Note(NO_EFFECT),
    "ddp_static_graph": Note(NO_EFFECT),
    "ddp_timeout": Note(NO_EFFECT),
    "dataloader_pin_memory": Note(NO_EFFECT),
    "dataloader_persistent_workers": Note(NO_EFFECT),
    "dataloader_multiprocessing_context": Note(NO_EFFECT),
    "dataloader_in_order": Note(NO_EFFECT),
    "skip_memory_metrics": Note(LOG_DETAIL),
    "push_to_hub": Refuse(HUB),
    "resume_from_checkpoint": Note("pass train(resume_from_checkpoint=True), as TRL's scripts do"),
    "hub_model_id": Note(HUB),
    "hub_strategy": Note(HUB),
    "hub_token": Note(HUB),
    "hub_private_repo": Note(HUB),
    "hub_always_push": Note(HUB),
    "hub_revision": Note(HUB),
    "gradient_checkpointing": Map("model.gradient_checkpointing"),
    "gradient_checkpointing_kwargs": Note("lorarl checkpoints non-reentrantly"),
    "activation_checkpointing": Map(
        "model.gradient_checkpointing",
        "transformers 5's name for gradient_checkpointing",
        lambda v, c: {"model.gradient_checkpointing": True} if v else {},
    ),
    "activation_checkpointing_kwargs": Note("lorarl checkpoints non-reentrantly"),
    "include_for_metrics": Note(LOG_DETAIL),
    "eval_do_concat_batches": Note(NO_EFFECT),
    "auto_find_batch_size": Map(
        "train.micro_batch_size",
        "True -> auto (the planner's largest that fits)",
        lambda v, c: {"train.micro_batch_size": "auto"} if v else {},
    ),
    "full_determinism": Map("train.deterministic"),
    "torch_compile": Note(KERNEL),
    "torch_compile_backend": Note(KERNEL),
    "torch_compile_mode": Note(KERNEL),
    "include_num_input_tokens_seen": Note(LOG_DETAIL),
    "neftune_noise_alpha": Refuse("NEFTune's embedding noise is not implemented"),
    "eval_on_start": Refuse("lorarl evaluates every eval.every steps and at the end"),
    "eval_use_gather_object": Note(NO_EFFECT),
    "average_tokens_across_devices": Note(NO_EFFECT),
    "batch_eval_metrics": Note("lorarl takes no compute_metrics"),
    "use_liger_kernel": Note(KERNEL),
    "liger_kernel_config": Note(KERNEL),
    "train_sampling_strategy": Refuse("lorarl draws rows in a seeded random order"),
    "use_cache": Note("lorarl decodes with its own cache (generation.engine)"),
}

TRL_COMMON: dict[str, Map | Note | Refuse] = {
    "model_init_kwargs": Map(
        "model.dtype", "only dtype and trust_remote_code are read; other keys are refused", _model_init_kwargs
    ),
    "trust_remote_code": Map("model.trust_remote_code"),
    "router_aux_loss_coef": Note("a mixture-of-experts loss term lorarl does not add"),
    "disable_dropout": Note("lorarl samples and scores with dropout off; training uses peft_config.lora_dropout"),
    "cast_lm_head_to_fp32": Note("lorarl's log-probs are always computed in fp32"),
    "dataset_num_proc": Note(NO_EFFECT),
    "pad_to_multiple_of": Note("a padding detail (padding is masked out)"),
    "padding_free": Note("a padding detail (padding is masked out)"),
    "activation_offloading": Note("a memory detail"),
    "pad_token": Note("a padding detail (padding is masked out)"),
    "eos_token": Refuse("completions end with the chat template's end-of-turn token, as rollouts do"),
    "chat_template_path": Refuse("lorarl renders prompts with the base's own chat template"),
    "truncation_mode": Note(TRUNC),
    "shuffle_dataset": Refuse("lorarl draws rows in a seeded random order (GRPO); other algorithms keep theirs"),
    "precompute_ref_batch_size": Note("reference log-probs are computed in dpo.max_tokens_per_forward chunks"),
}

GRPO_OWN: dict[str, Map | Note | Refuse] = {
    "num_generations": Map("grpo.group_size"),
    "num_generations_eval": Note("lorarl's held-out evaluation decodes one greedy answer per prompt"),
    "max_completion_length": Map("generation.max_new_tokens"),
    "ds3_gather_for_generation": Note(NO_EFFECT),
    "generation_batch_size": Map(
        "(one step's completions)",
        "must be per_device_train_batch_size x gradient_accumulation_steps (TRL's default)",
        _one_generation,
    ),
    "steps_per_generation": Map(
        "(one step)",
        "must be gradient_accumulation_steps (TRL's default): lorarl samples once per optimizer step (num_iterations reuses the samples)",
        _one_generation,
    ),
    "temperature": Map("generation.temperature"),
    "top_p": Refuse("training samples must follow softmax(logits / temperature) untruncated (the log-probs' model)"),
    "top_k": Refuse("training samples must follow softmax(logits / temperature) untruncated (the log-probs' model)"),
    "min_p": Refuse("training samples must follow softmax(logits / temperature) untruncated (the log-probs' model)"),
    "generation_kwargs": Refuse("lorarl's sampling is the generation section (temperature, max_new_tokens)"),
    "chat_template_kwargs": Refuse("lorarl renders prompts with the chat template's defaults"),
    "repetition_penalty": Refuse("training samples must follow softmax(logits / temperature) (the log-probs' model)"),
    "cache_implementation": Note("lorarl decodes with its own cache (generation.engine)"),
    "use_vllm": Note(NO_VLLM),
    "vllm_mode": Note(NO_VLLM),
    "vllm_model_impl": Note(NO_VLLM),
    "vllm_enable_sleep_mode": Note(NO_VLLM),
    "vllm_structured_outputs_regex": Refuse("lorarl does not constrain sampling to a regex"),
    "vllm_server_base_url": Note(NO_VLLM),
    "vllm_server_host": Note(NO_VLLM),
    "vllm_server_port": Note(NO_VLLM),
    "vllm_server_timeout": Note(NO_VLLM),
    "vllm_group_port": Note(NO_VLLM),
    "vllm_gpu_memory_utilization": Note(NO_VLLM),
    "vllm_max_model_length": Note(NO_VLLM),
    "vllm_tensor_parallel_size": Note(NO_VLLM),
    "vllm_importance_sampling_correction": Note(
        NO_VLLM + "; lorarl's correction for its own sampler is grpo.tis (auto)"
    ),
    "vllm_importance_sampling_mode": Note(NO_VLLM),
    "vllm_importance_sampling_clip_max": Note(NO_VLLM),
    "vllm_importance_sampling_clip_min": Note(NO_VLLM),
    "vllm_importance_sampling_cap": Note(NO_VLLM),
    "beta": Map(
        "grpo.kl.coef",
        "same convention: the coefficient of the per-token k3 KL in the loss; 0 never runs the reference (the base with adapters off)",
    ),
    "num_iterations": Map("grpo.num_iterations"),
    "epsilon": Map(
        "grpo.clip_eps_low",
        "always set from TRL (lorarl's own default for sequence level is GSPO's 3e-4, TRL's is epsilon)",
    ),
    "epsilon_high": Map("grpo.clip_eps_high", "None -> epsilon, as TRL", _clip_high),
    "delta": Refuse("two-sided clipping (delta) is not implemented"),
    "sapo_temperature_neg": Map("grpo.sapo_temperature_neg", "read by loss_type sapo (grpo.policy_loss sapo)"),
    "sapo_temperature_pos": Map("grpo.sapo_temperature_pos", "read by loss_type sapo (grpo.policy_loss sapo)"),
    "vespo_k_pos": Map("grpo.vespo_k_pos", "read by loss_type vespo (grpo.policy_loss vespo)"),
    "vespo_lambda_pos": Map("grpo.vespo_lambda_pos", "read by loss_type vespo"),
    "vespo_k_neg": Map("grpo.vespo_k_neg", "read by loss_type vespo"),
    "vespo_lambda_neg": Map("grpo.vespo_lambda_neg", "read by loss_type vespo"),
    "importance_sampling_level": Map(
        "grpo.importance_sampling_level",
        "token or sequence (GSPO); sequence goes with loss_type grpo, luspo or sapo (refused at load with dapo, "
        "dr_grpo, bnpo and cispo, where TRL warns, and with vespo)",
        _is_level,
    ),
    "reward_weights": Map("reward.functions[i].weight", "one weight per reward function, as TRL", lambda v, c: {}),
    "multi_objective_aggregation": Refuse(
        "lorarl sums the weighted rewards, then normalises per group (TRL's default)"
    ),
    "scale_rewards": Map("grpo.std_scaling", "group / batch / none (True = group, False = none)", _scale_rewards),
    "loss_type": Map(
        "grpo.policy_loss + grpo.loss_reduction",
        "grpo -> clip + seq_mean_token_mean, dapo -> clip + token_mean, dr_grpo -> clip + seq_sum_norm, bnpo -> clip + "
        "micro_batch_token_mean, luspo -> clip + seq_mean_token_sum, cispo -> cispo + token_mean (grpo.cispo_eps_max = "
        "epsilon_high, or epsilon when None, as TRL reads it: set epsilon_high=5.0 as ScaleRL does), sapo -> sapo + "
        "seq_mean_token_mean, vespo -> vespo + token_mean",
        _grpo_loss,
    ),
    "mask_truncated_completions": Map("grpo.mask_truncated"),
    **_ref_sync_fields("grpo"),
    "top_entropy_quantile": Refuse("training on the highest-entropy tokens only is not implemented"),
    "entropy_coef": Map("grpo.entropy_coef"),
    "use_adaptive_entropy": Refuse("an adaptive entropy coefficient is not implemented (entropy_coef is fixed)"),
    "entropy_coef_min": Note("read by use_adaptive_entropy only"),
    "entropy_coef_max": Note("read by use_adaptive_entropy only"),
    "entropy_coef_delta": Note("read by use_adaptive_entropy only"),
    "entropy_target": Note("read by use_adaptive_entropy only"),
    "max_tool_calling_iterations": Map(
        "agent.max_turns",
        "with tools: iterations + 1 model turns; None -> lorarl's agent.max_turns (4), not unlimited",
        _max_turns,
    ),
    "off_policy_mask_threshold": Refuse("DeepSeek-V3.2's off-policy sequence masking is not implemented"),
    "use_bias_correction_kl": Map(
        "grpo.kl.estimator",
        "True -> k3_unbiased (k3 x the token ratio), False -> k3",
        lambda v, c: {"grpo.kl.estimator": "k3_unbiased" if v else "k3"},
    ),
    "log_completions": Map(
        "train.log_completions",
        "True -> num_completions_to_print (or 4) rows per step in DIR/completions.jsonl; False -> 0",
        _log_completions,
    ),
    "log_multimodal": Note(LOG_DETAIL),
    "num_completions_to_print": Map("train.log_completions", "read with log_completions", lambda v, c: {}),
    "log_unique_prompts": Note(LOG_DETAIL),
    "log_completions_hub_repo": Note(HUB),
    "use_transformers_continuous_batching": Note("lorarl decodes with generation.engine"),
    "transformers_continuous_batching_config": Note("lorarl decodes with generation.engine"),
    "use_transformers_paged": Note("lorarl decodes with generation.engine"),
}

DPO_OWN: dict[str, Map | Note | Refuse] = {
    "max_length": Map("dpo.max_length", TRUNC),
    "precompute_ref_log_probs": Map("dpo.precompute_ref_log_probs"),
    "loss_type": Map(
        "dpo.loss_type",
        "every TRL 1.16 type by its name, or a list of them with loss_weights (TRL 1.x); aot / aot_unpaired sort the "
        "pairs of each micro-batch (per_device_train_batch_size), as TRL",
        _dpo_losses,
    ),
    "loss_weights": Map("dpo.loss_weights"),
    "ld_alpha": Map("dpo.ld_alpha", "LD-DPO: policy and reference sums alike; sft's NLL reads the plain log-probs"),
    "f_divergence_type": Map(
        "dpo.f_divergence_type", "refused at load with the loss types TRL refuses (nca_pair, bco_pair, sppo_hard, ...)"
    ),
    "f_alpha_divergence_coef": Map("dpo.f_alpha_divergence_coef", "TRL's alpha form, (u^(alpha-1) - 1) / (alpha - 1)"),
    "label_smoothing": Map(
        "dpo.label_smoothing",
        "read by robust, exo_pair, aot, aot_unpaired as TRL; lorarl's sigmoid reads it too (conservative DPO, TRL "
        "0.x), TRL 1.16's sigmoid does not",
    ),
    "beta": Map("dpo.beta", "same convention: DPO's beta (IPO's tau)"),
    "use_weighting": Map(
        "dpo.use_weighting",
        "WPO, from the policy's own forward; refused at load with aot, aot_unpaired (as TRL) and sft",
    ),
    "discopop_tau": Map("dpo.discopop_tau"),
    "sync_ref_model": Map(
        "(refused when True)",
        "TR-DPO's reference sync: lorarl's DPO reference is the base with adapters off, fixed",
        _sync_ref,
    ),
    "ref_model_mixup_alpha": Note("read with sync_ref_model only"),
    "ref_model_sync_steps": Note("read with sync_ref_model only"),
}


def _sft_loss(value: str, ctx: dict) -> dict:
    if value not in ("nll", "dft"):  # TRL's SFTTrainer refuses the config's third choice, chunked_nll, too
        refuse(f"{ctx['cls']}.loss_type", value, "TRL 1.16's SFTTrainer trains loss types nll and dft")
    return {"sft.loss_type": value}


SFT_OWN: dict[str, Map | Note | Refuse] = {
    "dataset_text_field": Map(
        "data.columns.text",
        "the column of a language-modeling dataset (no prompt / messages column): every token trained, EOS appended",
        _text_field,
    ),
    "dataset_kwargs": Refuse("lorarl prepares the dataset itself"),
    "max_length": Map(
        "sft.max_length",
        "lorarl never truncates: a longer row is a bad row (data.on_bad_row), unless packing_strategy bfd_split or "
        "wrapped splits it; with packing, the packed rows' length; None is refused",
        _sft_length,
    ),
    "shuffle_dataset": Note("lorarl's SFT order is its own (seeded by train.seed)"),
    "packing": Map(
        "sft.packing",
        "rows packed into max_length-token rows (TRL's packer), each example attending only to itself (bfd); "
        "per_device_train_batch_size counts packed rows, as TRL",
    ),
    "packing_strategy": Map(
        "sft.packing_strategy", "bfd, bfd_split, wrapped (wrapped attends across examples, as TRL's)", _packing_strategy
    ),
    "eval_packing": Note("lorarl's SFT evaluation decodes held-out prompts: nothing to pack"),
    "completion_only_loss": Map(
        "(always)",
        "None / True: the completion only (lorarl always); False is refused, except on text rows (every token)",
        _completion_only,
    ),
    "assistant_only_loss": Note(
        "messages rows train the LAST assistant message only (TRL trains every token unless assistant_only_loss)"
    ),
    "loss_type": Map("sft.loss_type", "nll or dft (Dynamic Fine-Tuning), as TRL's SFTTrainer", _sft_loss),
}

# ---- KTOConfig -----------------------------------------------------------------------------------------------------


def _kto_loss(value: str, ctx: dict) -> dict:
    if value not in ("kto", "apo_zero_unpaired"):
        refuse(f"{ctx['cls']}.loss_type", value, "TRL's KTO losses are kto and apo_zero_unpaired")
    return {"kto.loss_type": value}


KTO_OWN: dict[str, Map | Note | Refuse] = {
    "per_device_train_batch_size": Map(
        "kto.batch_size",
        "x gradient_accumulation_steps = rows per optimizer step; itself train.micro_batch_size. The KL estimate's "
        "mismatched pairs span the whole step's rows (TRL: each per-device batch), so 1 is accepted with "
        "gradient_accumulation_steps > 1 (TRL refuses 1)",
        _batch("kto"),
    ),
    "max_length": Map("kto.max_length", TRUNC),
    "precompute_ref_log_probs": Map(
        "kto.precompute_ref_log_probs",
        "the training rows' reference log-probs once, kept in the checkpoint; the KL pairs' are computed each step "
        "(lorarl pairs them within each shuffled batch)",
    ),
    "precompute_ref_batch_size": Note("reference log-probs are computed in kto.max_tokens_per_forward chunks"),
    "loss_type": Map("kto.loss_type", "kto or apo_zero_unpaired, as TRL", _kto_loss),
    "beta": Map("kto.beta", "same convention: the implicit reward is beta x the log-ratio"),
    "desirable_weight": Map(
        "kto.desirable_weight", "same convention: the desirable rows' losses x it (a mean over rows)"
    ),
    "undesirable_weight": Map("kto.undesirable_weight", "same convention"),
    "train_sampling_strategy": Note(
        "lorarl shuffles each epoch (train.seed) and builds the KL estimate's mismatched pairs within each drawn batch, "
        "so TRL's sequential order (its pairs are fixed at preprocessing) is not needed"
    ),
    "sync_ref_model": Map(
        "(refused when True)",
        "TR-DPO's reference sync (TRL refuses it with PEFT too): lorarl's reference is the base with adapters off, "
        "fixed",
        _sync_ref,
    ),
    "ref_model_mixup_alpha": Note("read with sync_ref_model only"),
    "ref_model_sync_steps": Note("read with sync_ref_model only"),
}

REWARD_OWN: dict[str, Map | Note | Refuse] = {
    "max_length": Map("reward_model.max_length", "longer pairs are dropped and counted, as TRL"),
    "center_rewards_coefficient": Map("reward_model.center_coef", "None -> 0", _center),
}


# ---- RLOOConfig (TRL's RLOOTrainer -> algo rloo, lorarl.algos.rloo) ---------------------------------------------


def _rloo_clip_high(value: Any, ctx: dict) -> dict:
    return {"rloo.clip_eps_high": ctx["args"].epsilon if value is None else value}


def _rloo_reward_clip(value: Any, ctx: dict) -> dict:
    return {"rloo.reward_clip_range": None if value is None else [float(v) for v in value]}


# RLOOConfig's fields that are GRPOConfig's too and mean the same for both (sampling, vLLM, rewards, logging)
RLOO_FROM_GRPO = (
    "num_generations_eval",
    "max_completion_length",
    "ds3_gather_for_generation",
    "generation_batch_size",
    "steps_per_generation",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "generation_kwargs",
    "chat_template_kwargs",
    "repetition_penalty",
    "cache_implementation",
    *(name for name in GRPO_OWN if name.startswith("vllm_") and "importance_sampling" not in name),
    "use_vllm",
    "reward_weights",
    "log_completions",
    "log_multimodal",
    "num_completions_to_print",
    "log_unique_prompts",
    "use_transformers_continuous_batching",
    "transformers_continuous_batching_config",
    "use_transformers_paged",
)
RLOO_OWN: dict[str, Map | Note | Refuse] = {
    **{name: GRPO_OWN[name] for name in RLOO_FROM_GRPO},
    "num_generations": Map("rloo.group_size", "the completions whose rewards form each leave-one-out baseline"),
    "beta": Map(
        "rloo.kl.coef",
        "same convention as TRL's RLOO: beta x the sequence's summed log-ratio log pi_old - log pi_ref is subtracted from its reward (no KL loss term; GRPO's beta is a per-token k3 loss term); 0 never runs the reference",
    ),
    "num_iterations": Map("rloo.num_iterations"),
    "epsilon": Map("rloo.clip_eps_low", "the clip of the sequence's probability ratio, as TRL's RLOO"),
    "epsilon_high": Map("rloo.clip_eps_high", "None -> epsilon, as TRL", _rloo_clip_high),
    "normalize_advantages": Map("rloo.normalize_advantages"),
    "reward_clip_range": Map(
        "rloo.reward_clip_range", "(min, max) -> [min, max], before the KL penalty, as TRL", _rloo_reward_clip
    ),
    "mask_truncated_completions": Map("rloo.mask_truncated"),
    **_ref_sync_fields("rloo"),
}


def _section_batch(algo: str) -> dict:
    if algo in ("grpo", "rloo"):
        return {
            "per_device_train_batch_size": Map(
                "train.prompts_per_step",
                "x gradient_accumulation_steps / num_generations = prompts per step; itself train.micro_batch_size",
                _grpo_batch,
            )
        }
    return {
        "per_device_train_batch_size": Map(
            f"{algo}.batch_size",
            "x gradient_accumulation_steps = rows per optimizer step; itself train.micro_batch_size",
            _batch(algo),
        ),
        "num_train_epochs": Map(
            f"{algo}.epochs", "whole passes (rounded up); train.steps stops a fractional one", _int_epochs(algo)
        ),
    }


def _table(algo: str, own: dict) -> dict[str, Map | Note | Refuse]:
    return {**TRAINING_ARGUMENTS, **TRL_COMMON, **_section_batch(algo), **own}


CONFIGS = {
    "GRPOConfig": "grpo",
    "DPOConfig": "dpo",
    "SFTConfig": "sft",
    "RewardConfig": "reward_model",
    "RLOOConfig": "rloo",
    "KTOConfig": "kto",
}
TABLE: dict[str, dict[str, Map | Note | Refuse]] = {
    "GRPOConfig": _table("grpo", GRPO_OWN),
    "DPOConfig": _table("dpo", DPO_OWN),
    "SFTConfig": _table("sft", SFT_OWN),
    "RewardConfig": _table("reward_model", REWARD_OWN),
    "RLOOConfig": _table("rloo", RLOO_OWN),
    "KTOConfig": _table("kto", KTO_OWN),
}


# ---- DistillationConfig (TRL's DistillationTrainer -> algo: distill) ---------------------------------------------


def _distill_batch(value: int, ctx: dict) -> dict:
    """Prompts per optimizer step = per_device_train_batch_size x gradient_accumulation_steps (one completion each)."""
    return {"train.prompts_per_step": value * ctx["args"].gradient_accumulation_steps, "train.micro_batch_size": value}


def _teacher_kwargs(value: Any, ctx: dict) -> dict:
    extra = sorted(set(value or {}) - {"dtype", "torch_dtype", "trust_remote_code"})
    if extra:
        refuse(
            f"{ctx['cls']}.teacher_model_init_kwargs",
            value,
            f"lorarl loads the teacher like the base (model.quantization, model.dtype); {extra} not read",
        )
    return {}


def _no_tools(value: Any, ctx: dict) -> dict:
    if value is not None:
        refuse(f"{ctx['cls']}.max_tool_calling_iterations", value, "lorarl's distillation samples one turn (no tools)")
    return {}


DISTILL_OWN: dict[str, Map | Note | Refuse] = {
    "per_device_train_batch_size": Map(
        "train.prompts_per_step",
        "x gradient_accumulation_steps = prompts per optimizer step, one completion each; "
        "itself train.micro_batch_size",
        _distill_batch,
    ),
    "learning_rate": Map(
        "train.learning_rate",
        "AdamW's; TRL's default is kept (DistillationConfig 1e-6): LoRA usually wants 1e-4 to 1e-3",
    ),
    "teacher_model_name_or_path": Map(
        "distill.teacher",
        "used when the trainer's teacher_model is None (TRL reads it in its script only): a model folder or name, a "
        "merged export, or a PEFT adapter folder (frozen on the one base)",
        lambda v, c: {"distill.teacher": v} if v else {},
    ),
    "teacher_model_revision": Refuse("lorarl loads the teacher's folder or name as it is (no revision)"),
    "teacher_model_init_kwargs": Map(
        "(teacher loading)",
        "dtype / trust_remote_code accepted; the teacher is loaded like the base (NF4 on CUDA, model.dtype: TRL's "
        "script loads it unquantized in the dtype given); other keys refused",
        _teacher_kwargs,
    ),
    "max_completion_length": Map("generation.max_new_tokens"),
    "ds3_gather_for_generation": Note(NO_EFFECT),
    "shuffle_dataset": Refuse("lorarl draws the prompts of each step in a seeded random order (train.seed)"),
    "temperature": Map(
        "generation.temperature", "same convention: the student samples at it and both distributions are softened by it"
    ),
    **{k: GRPO_OWN[k] for k in ("top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs")},
    **{k: GRPO_OWN[k] for k in ("repetition_penalty", "cache_implementation", "use_vllm", "vllm_mode")},
    **{k: v for k, v in GRPO_OWN.items() if k.startswith("vllm_")},
    "beta": Map(
        "distill.beta",
        "same convention: 0 forward KL(teacher || student), 1 reverse KL (TRL's default), between: the generalized "
        "JSD; not GRPO's KL coefficient",
    ),
    "max_tool_calling_iterations": Map("(refused unless None)", "lorarl's distillation samples one turn", _no_tools),
    **{k: GRPO_OWN[k] for k in ("log_completions", "num_completions_to_print", "log_unique_prompts")},
}
CONFIGS["DistillationConfig"] = "distill"
TABLE["DistillationConfig"] = {**TRAINING_ARGUMENTS, **TRL_COMMON, **DISTILL_OWN}


def config_classes() -> dict[str, type]:
    import trl

    return {name: getattr(trl, name) for name in CONFIGS}


def entry(cls_name: str, field_name: str) -> Map | Note | Refuse:
    try:
        return TABLE[cls_name][field_name]
    except KeyError:
        raise LorarlError(
            f"{cls_name}.{field_name}: a field lorarl.trl does not know (TRL newer than 1.16?); lorarl/trl/fields.py "
            "lists every field it handles"
        ) from None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors / arrays: compare their text
        return repr(a) == repr(b)


def default_config(cls: type, output_dir: str) -> Any:
    """``cls(output_dir)`` as TRL's trainer makes it, with bf16 off where this machine has no bf16 GPU (TRL's default
    bf16 is refused by transformers there)."""
    import torch

    kw: dict = {}
    if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        kw = {"bf16": False}
    with warnings.catch_warnings():  # transformers 5 warns about TRL's own gradient_checkpointing default
        warnings.simplefilter("ignore", FutureWarning)
        return cls(output_dir=output_dir, **kw)


@functools.lru_cache(maxsize=16)
def _reference(cls: type, bf16: bool, fp16: bool, use_cpu: bool) -> Any:
    """The default config compared against (read only). Device and precision flags are the config's: transformers
    refuses bf16 where there is no bf16 GPU unless ``use_cpu``, and ``use_cpu`` changes other fields' values
    (``dataloader_pin_memory``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return cls(output_dir="trainer_output", bf16=bf16, fp16=fp16, use_cpu=use_cpu)


def translate(args: Any, ctx: dict) -> tuple[dict, list[str]]:
    """``(recipe keys, notices)`` of a TRL config ``args``: every field through :data:`TABLE`. ``ctx`` carries
    ``steps`` (the run's optimizer steps), ``steps_per_epoch``, ``agent`` (tools given); a refused value raises."""
    cls_name = type(args).__name__
    if cls_name not in TABLE:
        raise LorarlError(f"args: a {cls_name}; lorarl.trl takes TRL's {', '.join(TABLE)}")
    ref = _reference(type(args), bool(args.bf16), bool(args.fp16), bool(args.use_cpu))
    keys: dict = {}
    notices: list[str] = []
    ctx = {**ctx, "args": args, "cls": cls_name, "notices": notices}  # a Map's converter may add a notice
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        check_finite(f"{cls_name}.{f.name}", value)
        rule = entry(cls_name, f.name)
        if isinstance(rule, Map):
            keys.update(rule.apply(value, ctx))
        elif not _same(value, getattr(ref, f.name)):
            if isinstance(rule, Refuse):
                refuse(f"{cls_name}.{f.name}", value, rule.why)
            notices.append(f"{cls_name}.{f.name}={value!r} has no effect in lorarl: {rule.why}")
    return keys, notices


SHORT = {
    "GRPOConfig": "GRPO",
    "DPOConfig": "DPO",
    "SFTConfig": "SFT",
    "RewardConfig": "Reward",
    "RLOOConfig": "RLOO",
    "KTOConfig": "KTO",
    "DistillationConfig": "Distillation",
}
DOC_START, DOC_END = "<!-- fields: generated by python -m lorarl.trl.fields -->\n", "<!-- /fields -->"


def _cell(rule: Map | Note | Refuse) -> str:
    if isinstance(rule, Map):
        text = f"mapped: `{rule.key}`" + (f"; {rule.why}" if rule.why else "")
    elif isinstance(rule, Note):
        text = f"noted: {rule.why}"
    else:
        text = f"**refused** unless default: {rule.why}"
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The field table of docs/trl_dropin.md: one row per field (per config where the configs' entries differ), in
    the configs' own field order."""
    classes = config_classes()
    fields = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in classes.items()}
    order: list[str] = []
    for names in fields.values():
        order += [n for n in names if n not in order]
    lines = ["| field | config | what lorarl does |", "|---|---|---|"]
    for name in order:
        groups: dict[str, list[str]] = {}
        for cls_name in CONFIGS:
            if name in fields[cls_name]:
                groups.setdefault(_cell(entry(cls_name, name)), []).append(SHORT[cls_name])
        for cell, configs in groups.items():
            which = "all" if len(configs) == len(CONFIGS) else ", ".join(configs)
            lines.append(f"| `{name}` | {which} | {cell} |")
    return "\n".join(lines) + "\n"


def write_docs(path: str) -> None:
    """Replace the generated table in ``path`` (between its two markers) with :func:`markdown_table`."""
    from pathlib import Path

    doc = Path(path).read_text(encoding="utf-8")
    head, tail = doc[: doc.index(DOC_START) + len(DOC_START)], doc[doc.index(DOC_END) :]
    Path(path).write_text(head + markdown_table() + tail, encoding="utf-8")


if __name__ == "__main__":  # python -m lorarl.trl.fields [docs/trl_dropin.md]: print the table, or rewrite the doc's
    import sys

    if len(sys.argv) > 1:
        write_docs(sys.argv[1])
    else:
        print(markdown_table(), end="")
