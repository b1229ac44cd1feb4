"""The frozen teacher of on-policy distillation (:mod:`lorarl.algos.distill`), in one of two forms:

* **an adapter on the one base** -- a PEFT adapter folder (``adapter_config.json``; a lorarl run folder stands for
  its ``policy/`` adapter) is loaded frozen as the adapter ``teacher`` beside the student's ``policy``: no second
  model in memory, the teacher is the base with its LoRA on (the trained GRPO adapter of the quickstart, say);
* **a second model** -- any other folder or name (a merged export is one) is loaded once, frozen, with the
  student's ``model.quantization`` (``auto``: by the teacher's own size, NF4 for a large one on CUDA) and dtype, as
  its own :class:`SharedBase` (no adapters). Its tokenizer must be the student's, token for token: the loss compares the
  two next-token distributions id by id. A different one is refused in one line naming both models.

Neither form may adapt ``lm_head``: the loss projects both models' hidden states through their own output heads
outside the role that ran them (as TRL's DistillationTrainer, which refuses it too).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from lorarl.config import ModelConfig
from lorarl.errors import LorarlError
from lorarl.model.logprobs import TokenBatch, completion_hidden
from lorarl.model.shared import SharedBase

TEACHER = "teacher"  # the adapter name of a teacher on the one base
HEAD_MODULES = ("lm_head", "embed_out", "output")  # what transformers' causal LMs call their output projection


@dataclass
class Teacher:
    """A frozen teacher: the :class:`SharedBase` it runs on and the role it runs as (``teacher``: the adapter on the
    student's base; ``base``: a second model's own base), ``kind`` ``adapter`` or ``model``, ``source`` as given."""

    shared: SharedBase
    role: str
    kind: str
    source: str

    @torch.no_grad()
    def hidden(self, batch: TokenBatch) -> Tensor:
        """The teacher's last hidden states ``[B, T, H_T]`` that predict each completion token of ``batch`` (eval
        mode, no gradient; the forward paths of :func:`~lorarl.model.logprobs.completion_hidden`), copied out of the
        forward's ``[B, P + T, H_T]`` output so that it is freed."""
        with self.shared.role(self.role, train=False):
            return completion_hidden(self.shared, batch).contiguous()

    def head(self) -> nn.Module:
        """Hidden states -> the teacher's logits (its output projection and logit transform)."""
        return self.shared.output_head()


def adapts_head(targets, modules_to_save=None) -> bool:
    """Whether a LoRA ``target_modules`` (a list, or a regex / ``all-linear`` string) or ``modules_to_save`` names the
    output projection (PEFT's ``all-linear`` leaves it out). Example: ``["q_proj", "lm_head"]`` -> True."""
    names = [targets] if isinstance(targets, str) else list(targets or [])
    names += list(modules_to_save or [])
    return any(n != "all-linear" and any(h in n for h in HEAD_MODULES) for n in names)


def adapter_folder(spec: str) -> Path | None:
    """The PEFT adapter folder ``spec`` names: itself when it holds ``adapter_config.json``, a lorarl run folder's
    ``policy/`` adapter; None for anything else (a model folder or name)."""
    p = Path(spec).expanduser()
    for folder in (p, p / "policy"):
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def load_teacher(spec: str, shared: SharedBase, where: str = "distill.teacher") -> Teacher:
    """The teacher ``spec`` names for the student ``shared`` (module docstring): an adapter folder (or run folder)
    loaded frozen on ``shared``, else a second model loaded as ``shared``'s base is. Raises LorarlError with one line
    for an adapter that adapts the output head, a teacher whose tokenizer differs from the student's, or output
    heads that do not cover the tokenizer."""
    folder = adapter_folder(spec)
    if folder is not None:
        cfg = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        if adapts_head(cfg.get("target_modules"), cfg.get("modules_to_save")):
            raise LorarlError(
                f"{where}: the adapter {folder} adapts the output head (target_modules / modules_to_save "
                f"{cfg.get('target_modules')} / {cfg.get('modules_to_save')}); distillation projects both models' "
                "hidden states through the base's own head: use an adapter without lm_head"
            )
        try:
            shared.add_adapter(TEACHER, init_from=folder, trainable=False)
        except (RuntimeError, ValueError, KeyError) as e:  # PEFT: shapes of another base
            raise LorarlError(f"{where}: the adapter {folder} does not fit the base {shared.base_path} ({e})") from None
        recorded = cfg.get("base_model_name_or_path")
        if recorded and not same_folder(recorded, shared.base_path):
            print(
                f"{where}: the adapter {folder} was trained on {recorded}; it runs on {shared.base_path}",
                file=sys.stderr,
            )
        return Teacher(shared, TEACHER, "adapter", str(spec))
    check_same_tokenizer(spec, shared, where)
    teacher = SharedBase.load(teacher_config(spec, shared.cfg), device=shared.device)
    check_head_widths(teacher, shared, spec, where)
    return Teacher(teacher, "base", "model", str(spec))


def same_folder(a: str, b: str | None) -> bool:
    """Whether two model names / folders are one model (embedded names resolved to their folders)."""
    from lorarl.model.registry import resolve_model

    if b is None:
        return False
    try:
        ra, rb = Path(resolve_model(a)), Path(resolve_model(b))
    except LorarlError:
        return a == b
    return ra == rb or (ra.exists() and rb.exists() and ra.resolve() == rb.resolve())


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between two tokenizers, or None when they map every string to the same ids: their vocabularies
    (token -> id, added tokens included) and their special tokens' ids.

    Example: a teacher tokenizer with one added token -> ``"49152 vs 49153 tokens"``."""
    vs, vt = student.get_vocab(), teacher.get_vocab()
    if len(vs) != len(vt):
        return f"{len(vs)} vs {len(vt)} tokens"
    if vs != vt:
        token = next(t for t in vs if vt.get(t) != vs[t])
        return f"token {token!r} is id {vs[token]} vs {vt.get(token)}"
    for name in ("eos_token_id", "bos_token_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} {a} vs {b}"
    return None


def check_same_tokenizer(spec: str, shared: SharedBase, where: str) -> None:
    """Refuse (one line naming both models) a teacher model whose tokenizer is not the student's."""
    from lorarl.model.loading import load_tokenizer
    from lorarl.model.registry import resolve_model

    try:
        tok = load_tokenizer(resolve_model(spec), shared.cfg.trust_remote_code)
    except (OSError, ValueError, LorarlError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LorarlError(
            f"{where}: {spec} is not a model folder or name, a merged export or a PEFT adapter folder that can be "
            f"read here ({why})"
        ) from None
    diff = tokenizer_difference(shared.tokenizer, tok)
    if diff is not None:
        raise LorarlError(
            f"{where}: the teacher {spec} and the student {shared.cfg.name} have different tokenizers ({diff}); "
            "distillation compares their next-token distributions id by id, so both must use one tokenizer"
        )


def check_head_widths(teacher: SharedBase, shared: SharedBase, spec: str, where: str) -> None:
    """Both output heads must give a logit to every token id of the tokenizer (they are compared over their common
    width, :func:`lorarl.core.distillation.generalized_jsd`)."""
    n_tok = len(shared.tokenizer)
    for who, model, name in (("teacher", teacher, spec), ("student", shared, shared.cfg.name)):
        width = model.base.get_output_embeddings().weight.shape[0]
        if width < n_tok:
            raise LorarlError(
                f"{where}: the {who} {name} has {width} output logits for a tokenizer of {n_tok} tokens; both heads "
                "must give every token id a logit"
            )


def teacher_config(spec: str, model_cfg: ModelConfig) -> ModelConfig:
    """The :class:`ModelConfig` a second-model teacher ``spec`` is loaded with: the student's base's quantization,
    dtype and chunk sizes, no activation checkpointing (it never runs a backward)."""
    return replace(model_cfg, name=str(spec), gradient_checkpointing=False, init_adapter=None)
