"""TRL 1.16's ``DistillationTrainer`` (on-policy distillation) as a thin adapter: TRL's ``DistillationConfig`` (every
field through :data:`lorarl.trl.fields.TABLE`) and ``peft.LoraConfig`` in, an ``algo: distill`` recipe out, then
:func:`lorarl.train` underneath (:mod:`lorarl.algos.distill`).

The student is the one base with a LoRA adapter; ``teacher_model`` is a model name or folder (a second frozen model,
loaded like the base: NF4 on CUDA when large), a merged export folder, or a PEFT adapter folder (loaded frozen on
the one base: no second model in memory). A model object is taken by its folder, as ``model`` is.
"""

from __future__ import annotations

from typing import Any

from lorarl.errors import LorarlError
from lorarl.trl.fields import refuse
from lorarl.trl.trainers import _refuse_given, _Trainer, model_name


def teacher_name(teacher_model: Any) -> str | None:
    """``teacher_model`` as ``distill.teacher``: a name / folder as given, a model object's folder; None when none
    was given. A PeftModel is refused (pass its adapter folder: lorarl loads it on the one base)."""
    if teacher_model is None:
        return None
    try:
        from peft import PeftModel

        if isinstance(teacher_model, PeftModel):
            refuse(
                "teacher_model",
                type(teacher_model).__name__,
                "a PeftModel; pass the adapter's folder (loaded frozen on the one base) or a merged model's folder",
            )
    except ImportError:  # pragma: no cover - peft is a dependency
        pass
    return model_name(teacher_model, "teacher_model")


class DistillationTrainer(_Trainer):
    """TRL's ``DistillationTrainer`` (1.16's signature) on lorarl: on-policy distillation of the student (``model``
    with a LoRA adapter) from ``teacher_model`` over prompt-only rows (TRL's ``prompt`` column)."""

    config_name, algo, suffix = "DistillationConfig", "distill", "Distillation"

    def __init__(
        # TRL 1.16's own constructor signature, argument for argument: a drop-in must take TRL's keywords in TRL's
        # order, so each trainer writes its signature out rather than sharing one
        self,
        model: Any,
        teacher_model: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
    ):
        _refuse_given(callbacks=callbacks, optimizers=optimizers)
        if tools:
            refuse("tools", [getattr(t, "__name__", t) for t in tools], "lorarl's distillation samples one turn")
        self.teacher = teacher_name(teacher_model)
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config)

    def _recipe(self, extra: dict) -> dict:
        recipe = super()._recipe(extra)
        section = recipe.setdefault("distill", {})
        if self.teacher is not None:  # the argument wins over args.teacher_model_name_or_path, as in TRL's script
            section["teacher"] = self.teacher
        if not section.get("teacher"):
            raise LorarlError(
                "teacher_model: DistillationTrainer needs a teacher (a model name or folder, a merged export, or a "
                "PEFT adapter folder; or args.teacher_model_name_or_path)"
            )
        return recipe
