"""TRL 1.16's ``GRPOTrainer`` / ``RLOOTrainer`` / ``DPOTrainer`` / ``SFTTrainer`` / ``RewardTrainer`` as thin adapters: TRL's config
(every field through :data:`lorarl.trl.fields.TABLE`) and ``peft.LoraConfig`` in, a lorarl recipe dict out, then
:func:`lorarl.train` underneath. One base is loaded once: ``model`` is a name or folder; a second model TRL would
load (``ref_model``, a reward model) is the base with adapters off or a reward adapter on the same base.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError
from lorarl.runfiles import refuse_links, write_atomic
from lorarl.trl.fields import check_finite, default_config, refuse, translate

log = logging.getLogger("lorarl.trl")
MAX_STEPS_ENV = "LORARL_TRL_MAX_STEPS"  # stop every lorarl.trl run after N steps (lorarl train --max-steps N)
# LoraConfig fields lorarl reads; any other field with a non-default value is refused
LORA_READ = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "modules_to_save"}
LORA_IGNORED = {"peft_type", "auto_mapping", "base_model_name_or_path", "revision", "inference_mode"}


def model_name(model: Any, where: str = "model") -> str:
    """``model`` as lorarl's ``model.name``: a name / folder as given, or a model object's local folder
    (``name_or_path``), which lorarl loads again as its one shared base."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    try:
        from peft import PeftModel

        if isinstance(model, PeftModel):
            raise LorarlError(
                f"{where}: a PeftModel; lorarl loads the base once and trains its own adapter: pass the base's name "
                "or folder and peft_config (a trained adapter to start from: the recipe key model.init_adapter)"
            )
    except ImportError:  # pragma: no cover - peft is a dependency
        pass
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path:
        raise LorarlError(
            f"{where}: a {type(model).__name__} with no name_or_path; lorarl loads the base itself from a name or "
            "folder: save it with save_pretrained(folder) and pass the folder"
        )
    if getattr(model, "hf_quantizer", None) is not None:
        raise LorarlError(
            f"{where}: a quantized {type(model).__name__}; lorarl quantizes the base itself (NF4 on CUDA): pass "
            f"model={str(path)!r}"
        )
    log.warning(
        "%s: a %s object is taken by its folder %r: lorarl loads that folder once as the shared base (changes made "
        "to the object in memory are not seen)",
        where,
        type(model).__name__,
        str(path),
    )
    return str(path)


def _same_model(a: str, b: str) -> bool:
    """Whether two model names / folders are the same model (embedded names resolved to their folders)."""
    from lorarl.model.registry import resolve_model

    try:
        ra, rb = resolve_model(a), resolve_model(b)
    except LorarlError:
        return a == b
    return ra == rb or (Path(ra).exists() and Path(rb).exists() and Path(ra).resolve() == Path(rb).resolve())


def default_target_modules(name: str) -> list[str] | str:
    """PEFT's default ``target_modules`` for the model type of ``name`` (what ``LoraConfig(target_modules=None)``
    picks), or ``all-linear`` when PEFT has none for it."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    from transformers import AutoConfig

    from lorarl.model.registry import resolve_model

    try:
        model_type = AutoConfig.from_pretrained(resolve_model(name)).model_type
    except (OSError, ValueError):
        return "all-linear"
    modules = DEFAULTS.get(model_type)
    return list(modules) if modules else "all-linear"


def lora_section(peft_config: Any, name: str, algo: str) -> dict:
    """The recipe's ``lora`` section of a ``peft.LoraConfig`` (None: lorarl's LoRA defaults, with a notice: TRL
    would fine-tune every weight)."""
    if peft_config is None:
        log.warning(
            "peft_config=None: TRL would fine-tune every weight; lorarl trains a LoRA adapter (r 16, alpha 32, all "
            "linear layers): pass peft_config=LoraConfig(...) to choose"
        )
        return {}
    import dataclasses

    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise LorarlError(f"peft_config: a {type(peft_config).__name__}; lorarl trains LoRA (peft.LoraConfig)")
    ref = LoraConfig()
    for f in dataclasses.fields(peft_config):
        if f.name in LORA_READ | LORA_IGNORED:
            continue
        value = getattr(peft_config, f.name)
        if repr(value) != repr(getattr(ref, f.name)):
            refuse(f"LoraConfig.{f.name}", value, "lorarl's LoRA reads r, lora_alpha, lora_dropout, target_modules")
    keep = set(peft_config.modules_to_save or []) - ({"score"} if algo == "reward_model" else set())
    if keep:
        refuse(
            "LoraConfig.modules_to_save",
            peft_config.modules_to_save,
            "lorarl trains LoRA adapters only (the reward model's score head is always trained)",
        )
    targets = peft_config.target_modules
    if targets is None:
        targets = default_target_modules(name)
    elif not isinstance(targets, str):
        targets = sorted(targets)
    return {
        "r": int(peft_config.r),
        "alpha": float(peft_config.lora_alpha),
        "dropout": float(peft_config.lora_dropout),
        "target_modules": targets,
    }


def quantization(quantization_config: Any) -> dict:
    """``model.quantization`` of TRL's ``quantization_config`` (a BitsAndBytesConfig): NF4 4-bit only."""
    if quantization_config is None:
        return {}
    four = getattr(quantization_config, "load_in_4bit", False)
    if four and getattr(quantization_config, "bnb_4bit_quant_type", "nf4") == "nf4":
        return {"quantization": "nf4"}
    refuse(
        "quantization_config", quantization_config, "lorarl quantizes the base to NF4 4-bit only (model.quantization)"
    )


def nest(keys: dict) -> dict:
    """``{"train.steps": 5}`` -> ``{"train": {"steps": 5}}``."""
    out: dict = {}
    for dotted, value in keys.items():
        *path, last = dotted.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _rows(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _refuse_given(**given: Any) -> None:
    """One line for each trainer argument lorarl cannot honour, when it was given."""
    why = {
        "data_collator": "lorarl batches and pads its rows itself",
        "compute_metrics": "lorarl's evaluation computes its own metrics",
        "callbacks": "lorarl's run loop takes no transformers callbacks (read trainer.state.log_history after train)",
        "optimizers": "lorarl trains with AdamW and train.lr_scheduler (args.learning_rate, lr_scheduler_type)",
        "optimizer_cls_and_kwargs": "lorarl trains with AdamW",
        "preprocess_logits_for_metrics": "lorarl's evaluation computes its own metrics",
        "compute_loss_func": "lorarl's losses are the algorithm's (args.loss_type)",
        "formatting_func": "lorarl reads TRL's dataset fields (prompt + completion, messages)",
        "reward_processing_classes": "a reward adapter uses the shared base's tokenizer",
        "rollout_func": "lorarl's rollouts are its own (tools= / environment_factory= for multi-turn)",
    }
    for name, value in given.items():
        if value is None or value == (None, None) or (name == "callbacks" and not value):
            continue
        refuse(name, value, why[name])


class _Trainer:
    """What the four trainers share: the recipe from TRL's config, :func:`lorarl.train`, the run's history."""

    config_name = ""
    algo = ""
    suffix = ""
    adapter = "policy"  # the trained adapter's folder in the run

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        args: Any,
        train_dataset: Any,
        eval_dataset: Any,
        processing_class: Any,
        peft_config: Any,
        quantization_config: Any,
    ):
        import trl
        from transformers import TrainerState

        self.model_name = model_name(model)
        if processing_class is not None:
            tok = getattr(processing_class, "name_or_path", None)
            if not tok or not _same_model(tok, self.model_name):
                refuse(
                    "processing_class",
                    type(processing_class).__name__ + (f"({tok!r})" if tok else ""),
                    "lorarl uses the shared base's own tokenizer; pass one loaded from the model's folder or none",
                )
        cls = getattr(trl, self.config_name)
        if args is None:
            args = default_config(cls, f"{self.model_name.rstrip('/').split('/')[-1]}-{self.suffix}")
        elif type(args).__name__ != self.config_name:
            raise LorarlError(f"args: a {type(args).__name__}; {type(self).__name__} takes TRL's {self.config_name}")
        self.args = args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if train_dataset is None:
            raise LorarlError(f"train_dataset: {type(self).__name__} needs one (TRL's dataset fields)")
        self.peft_config = peft_config
        self.state = TrainerState()
        self.run = None
        self._lora = lora_section(peft_config, self.model_name, self.algo)
        self._model = {"name": self.model_name, **quantization(quantization_config)}
        self.recipe = self._recipe({})
        for notice in self._notices:
            log.warning(notice)

    # -- the recipe ---------------------------------------------------------------------------------------------

    def rows_per_step(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps

    def _units(self) -> int | None:
        """What an epoch passes over (TRL's train dataset rows, as prepared), None when the dataset has no length."""
        return _rows(self.train_dataset)

    def _steps(self) -> tuple[int, int]:
        """``(the run's optimizer steps, steps per epoch)`` as TRL counts them on one device."""
        n = self._units()
        per_step = self.rows_per_step()
        per_epoch = math.ceil(n / per_step) if n else 1
        check_finite(f"{self.config_name}.num_train_epochs", self.args.num_train_epochs)  # read before translate
        if self.args.max_steps > 0:
            return self.args.max_steps, per_epoch
        if n is None:
            refuse(
                f"{self.config_name}.max_steps", self.args.max_steps, "a dataset without a length needs max_steps > 0"
            )
        return max(1, math.ceil(self.args.num_train_epochs * n / per_step)), per_epoch

    def _recipe(self, extra: dict) -> dict:
        steps, per_epoch = self._steps()
        ctx = {"steps": steps, "steps_per_epoch": per_epoch, "algo": self.algo, **self._context(), **extra}
        keys, self._notices = translate(self.args, ctx)
        recipe = nest(keys)
        recipe["algo"] = self.algo
        recipe["model"] = {**recipe.get("model", {}), **self._model}
        if self._lora:
            recipe["lora"] = self._lora
        n_eval = _rows(self.eval_dataset) if self.eval_dataset is not None else None
        if n_eval:
            recipe.setdefault("eval", {})["n"] = n_eval
        return recipe

    def _context(self) -> dict:
        """What the field table reads beside the config (the dataset's kind)."""
        return {}

    def _train_kwargs(self) -> dict:
        return {"train_dataset": self.train_dataset, "eval_dataset": self.eval_dataset}

    # -- TRL's trainer methods ----------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, **_: Any):
        """Train (:func:`lorarl.train` into ``args.output_dir``); fills ``state.log_history`` with the run's metrics
        rows (TRL's names) and returns transformers' ``TrainOutput``. ``resume_from_checkpoint`` true or a folder:
        continue the run in ``args.output_dir`` from its newest checkpoint."""
        from transformers.trainer_utils import TrainOutput

        from lorarl.api import train

        cap = os.environ.get(MAX_STEPS_ENV)
        self.run = train(
            self.recipe,
            self.args.output_dir,
            resume=bool(resume_from_checkpoint),
            max_steps=int(cap) if cap else None,
            progress=not self.args.disable_tqdm,
            **self._train_kwargs(),
        )
        history = [dict(row) for row in self.run.metrics]
        self.state.log_history = history
        self.state.global_step = history[-1]["step"] if history else 0
        self.state.max_steps = self.recipe["train"]["steps"]
        losses = [row["loss"] for row in history if isinstance(row.get("loss"), (int, float))]
        summary = self.run.summary
        metrics = {"train_runtime": summary.get("wall_s"), "train_loss": sum(losses) / len(losses) if losses else None}
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _need_run(self, what: str):
        if self.run is None:
            raise LorarlError(f"{what}: call train() first (lorarl evaluates and saves the trained run)")
        return self.run

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """The run's held-out evaluation (what ``lorarl eval`` computes), keys prefixed as TRL's
        (``eval_accuracy``), appended to ``state.log_history``."""
        run = self._need_run("evaluate()")
        if eval_dataset is not None:
            refuse("evaluate(eval_dataset=...)", type(eval_dataset).__name__, "pass eval_dataset to the trainer")
        result = run.evaluate()
        metrics = {
            f"{metric_key_prefix}_{k}": v for k, v in result.items() if isinstance(v, (int, float)) and v is not None
        }
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained adapter (PEFT's folder: adapter_config.json + adapter_model.safetensors, and the reward
        model's score head) into ``output_dir`` (default ``args.output_dir``), as TRL's save_model does."""
        run = self._need_run("save_model()")
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        src = run.path / self.adapter
        if not src.is_dir():
            raise LorarlError(f"{src}: no trained adapter (the run stopped before its end?)")
        for p in src.iterdir():  # never through a link planted in output_dir (lorarl.runfiles)
            dest = refuse_links(out / p.name)
            if p.is_dir():
                shutil.copytree(p, dest, dirs_exist_ok=True)
            else:
                write_atomic(dest, p.read_bytes())


class GRPOTrainer(_Trainer):
    """TRL's ``GRPOTrainer`` (1.16's signature) on lorarl: ``reward_funcs`` callables with TRL's signature (a
    string: a built-in reward name, ``module:function``, or a lorarl reward adapter folder, scored on the shared
    base), ``tools`` / ``environment_factory`` as TRL takes them."""

    config_name, algo, suffix = "GRPOConfig", "grpo", "GRPO"

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ):
        _refuse_given(
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            rollout_func=rollout_func,
        )
        if reward_funcs is None:
            raise LorarlError(
                f"reward_funcs: {type(self).__name__} needs at least one (a callable with TRL's signature)"
            )
        self.tools, self.environment_factory = tools, environment_factory
        self.reward_funcs, self._adapter = self._split_rewards(reward_funcs)
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config)

    @staticmethod
    def _split_rewards(reward_funcs: Any) -> tuple[list, str | None]:
        """``(functions, reward adapter folder or None)``: a folder among ``reward_funcs`` is a reward adapter (a
        RewardTrainer / lorarl reward_model run) scored on the shared base; a model object or a hub name is refused."""
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        kept, adapter = [], None
        for i, fn in enumerate(funcs):
            if isinstance(fn, (str, os.PathLike)) and Path(fn).is_dir():
                if adapter is not None:
                    refuse(f"reward_funcs[{i}]", str(fn), "lorarl scores with one reward adapter")
                adapter = str(fn)
            elif isinstance(fn, str) and "/" in fn and ":" not in fn:
                refuse(
                    f"reward_funcs[{i}]",
                    fn,
                    "a hub reward model; lorarl scores with a reward adapter on the one shared base: train one with "
                    "lorarl.trl.RewardTrainer and pass its output_dir",
                )
            elif not isinstance(fn, str) and not callable(fn) or hasattr(fn, "config"):
                refuse(
                    f"reward_funcs[{i}]",
                    type(fn).__name__,
                    "a model object; lorarl scores with a reward adapter on the one shared base: pass its folder",
                )
            else:
                kept.append(fn)
        return kept, adapter

    def rows_per_step(self) -> int:
        a = self.args
        return max(1, a.per_device_train_batch_size * a.gradient_accumulation_steps // a.num_generations)

    def _recipe(self, extra: dict) -> dict:
        recipe = super()._recipe({"agent": bool(self.tools or self.environment_factory), **extra})
        if self._adapter:
            reward = recipe.setdefault("reward", {})
            reward["adapter"] = self._adapter
            reward["source"] = "both" if self.reward_funcs else "reward_model"
        return recipe

    def _train_kwargs(self) -> dict:
        weights = self.args.reward_weights
        kw = {
            **super()._train_kwargs(),
            "tools": self.tools,
            "environment_factory": self.environment_factory,
        }
        if self.reward_funcs:
            kw["reward_funcs"] = self.reward_funcs
            if weights is not None:
                if self._adapter:  # TRL orders the weights as reward_funcs; the adapter's is reward.model_weight
                    refuse(
                        f"{self.config_name}.reward_weights",
                        weights,
                        "with a reward adapter use the recipe key reward.model_weight",
                    )
                kw["reward_weights"] = weights
        return kw


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer`` (1.16's signature) on lorarl: ``algo: rloo`` (:mod:`lorarl.algos.rloo`), the reward
    functions taken as :class:`GRPOTrainer` takes them (TRL's RLOOTrainer has no tools)."""

    config_name, algo, suffix = "RLOOConfig", "rloo", "RLOO"

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
        )


class _ReferenceTrainer(_Trainer):
    """TRL 1.16's ``DPOTrainer`` / ``KTOTrainer`` signature (the same for both): the reference is the base with
    adapters off (``ref_model`` None or the same model as ``model``)."""

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        _refuse_given(
            data_collator=data_collator, compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers
        )
        model = model_name(model)  # (once: a model object's notice is given here)
        if ref_model is not None:
            ref = model_name(ref_model, "ref_model")
            if not _same_model(ref, model):
                refuse(
                    "ref_model",
                    ref,
                    f"lorarl's {self.suffix} reference is the policy's own base with adapters off (one base in "
                    "memory); a different reference model is not supported",
                )
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config)


class DPOTrainer(_ReferenceTrainer):
    """TRL's ``DPOTrainer`` (1.16's signature) on lorarl: the reference is the base with adapters off (``ref_model``
    None or the same model as ``model``)."""

    config_name, algo, suffix = "DPOConfig", "dpo", "DPO"


class KTOTrainer(_ReferenceTrainer):
    """TRL's ``KTOTrainer`` (1.16's signature) on lorarl: unpaired rows (``prompt``, ``completion``, ``label``) or
    preference pairs, unpaired as TRL does; the reference is the base with adapters off."""

    config_name, algo, suffix = "KTOConfig", "kto", "KTO"


class _SupervisedTrainer(_Trainer):
    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        **more: Any,
    ):
        _refuse_given(
            data_collator=data_collator,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **more,
        )
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config)


class SFTTrainer(_SupervisedTrainer):
    """TRL's ``SFTTrainer`` (1.16's signature) on lorarl: prompt + completion or ``messages`` rows, the loss on the
    completion (for ``messages``: the last assistant message); ``text`` rows (``dataset_text_field``), every token
    trained as TRL's language modeling; ``packing`` with TRL's packer (``sft.packing``)."""

    config_name, algo, suffix = "SFTConfig", "sft", "SFT"

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Any = None,
    ):
        self.rows_kind = sft_rows_kind(train_dataset, args.dataset_text_field if args is not None else "text")
        if self.rows_kind == "text" and args is not None and args.assistant_only_loss:
            refuse(
                "SFTConfig.assistant_only_loss",
                True,
                "the dataset is not conversational (text rows, trained on every token), as TRL refuses it",
            )
        columns = getattr(train_dataset, "column_names", None)
        if (
            isinstance(columns, list)
            and self.rows_kind == "messages"
            and not (args is not None and args.assistant_only_loss)
        ):
            log.warning(
                "SFTTrainer: lorarl trains each messages row's LAST assistant message (TRL trains every token of the "
                "conversation unless assistant_only_loss)"
            )
        super().__init__(
            model,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class,
            compute_metrics,
            callbacks,
            optimizers,
            optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics,
            quantization_config,
            peft_config,
            compute_loss_func=compute_loss_func,
            formatting_func=formatting_func,
        )

    def _context(self) -> dict:
        return {"sft_rows": self.rows_kind}

    def _units(self) -> int | None:
        """Without packing the dataset's rows; with packing the packed rows lorarl's SFT (TRL's packer) makes of
        them, as TRL's SFTTrainer counts its packed dataset (the rows are tokenized once more here, to count)."""
        from lorarl.data.packing import STRATEGIES, packed_row_count

        a = self.args
        unusable = a.packing_strategy not in STRATEGIES or a.max_length is None  # refused by the field table next
        if not a.packing or a.max_steps > 0 or unusable:
            return super()._units()
        if _rows(self.train_dataset) is None:  # no length: max_steps is needed, as without packing
            return None
        from lorarl.config import DataConfig
        from lorarl.model import load_tokenizer
        from lorarl.model.registry import resolve_model
        from lorarl.model.tokens import end_of_turn_id

        tok = load_tokenizer(resolve_model(self.model_name))
        columns = {"text": a.dataset_text_field} if self.rows_kind == "text" and a.dataset_text_field != "text" else {}
        return packed_row_count(
            list(self.train_dataset),
            DataConfig(columns=columns),
            tok,
            end_of_turn_id(None, tok),
            a.max_length,
            a.packing_strategy,
        )


def sft_rows_kind(dataset: Any, text_field: str = "text") -> str | None:
    """The SFT format of ``dataset``'s columns, read as TRL reads them: ``prompt`` (prompt + completion), else
    ``messages``, else ``text`` (its ``text_field`` column: language modeling); None when the columns are unknown.
    Columns with none of them are refused (one line)."""
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list):
        rows = dataset if isinstance(dataset, (list, tuple)) else None
        columns = list(rows[0]) if rows and isinstance(rows[0], dict) else None
    if columns is None:
        return None
    for kind, column in (("prompt", "prompt"), ("messages", "messages"), ("text", text_field)):
        if column in columns:
            return kind
    refuse(
        "train_dataset",
        f"columns {columns}",
        f"lorarl's SFT reads prompt + completion, messages, or a text column (dataset_text_field={text_field!r})",
    )


class RewardTrainer(_SupervisedTrainer):
    """TRL's ``RewardTrainer`` (1.16's signature) on lorarl: a reward LoRA adapter + score head on the shared base
    (Bradley-Terry; a ``margin`` column is used when present, as TRL)."""

    config_name, algo, suffix = "RewardConfig", "reward_model", "Reward"
    adapter = "reward"

    def _recipe(self, extra: dict) -> dict:
        recipe = super()._recipe(extra)
        recipe.setdefault("reward_model", {})["margin"] = True
        return recipe
