"""LLM-as-judge rewards on the one base (``reward.functions: [{name: judge, judge: {...}}]``).

The judge is

* ``model: base`` -- the shared base with every adapter disabled (no extra memory);
* ``model: adapter`` -- a PEFT adapter folder (``judge.path``) loaded frozen as the ``judge`` adapter of the shared
  base (a LoRA adapter's memory);
* ``model: folder`` -- another local model folder or model name (``judge.path``), loaded once beside the base
  (its weights count in ``lorarl plan``).

It answers greedily (no sampling), through transformers' ``generate`` (the ``hf`` decode engine) under its role,
inside :meth:`SharedBase.role`, which puts the previous adapter, train/eval mode, dropout and ``requires_grad``
flags back afterwards: the rollout that follows samples from the policy adapter as before. Prompts are chat
templated (one user message) when the judge's tokenizer has a template.

Prompts and answer formats are in :mod:`lorarl.rewards.judge_prompts`; an answer that does not parse gives NaN for
its row(s): a failed value, left out of the group statistics, counted by the scorer against
``reward.max_failure_fraction``, never a 0. The first ``judge.log_rows`` judge prompts of each scoring call, their
answers and the scores read from them are appended to ``RUN_DIR/judge.jsonl`` (one JSON object per line).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from lorarl.config import GenerationConfig, ModelConfig
from lorarl.config.rewards import JudgeConfig
from lorarl.core.messages import completion_text
from lorarl.errors import LorarlError
from lorarl.model import SharedBase
from lorarl.model.tokens import completion_mask
from lorarl.rewards.call_args import CALL_ARGS
from lorarl.rewards.judge_prompts import (
    DEFAULT_RUBRICS,
    JudgeParseError,
    default_answer_tokens,
    group_prompt,
    parse_group,
    parse_pointwise,
    pointwise_prompt,
    prompt_text_of,
    to_unit,
)
from lorarl.rollout.engines import HFEngine
from lorarl.runfiles import open_nofollow
from lorarl.runs import find_adapter, resolve_path

JUDGE = "judge"  # the adapter name of a judge adapter on the shared base
NOT_COLUMNS = ("completion_ids", *CALL_ARGS)  # fields the scorer passes that are not dataset columns


def encode_judge_prompt(text: str, tokenizer, answer_prefix: str = "") -> list[int]:
    """A judge prompt's token ids: one chat-templated user message (generation prompt added) when the tokenizer has
    a chat template, else the text and a newline; then ``answer_prefix``, the start of the answer."""
    if getattr(tokenizer, "chat_template", None):
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(templated + answer_prefix, add_special_tokens=False)["input_ids"]
    return tokenizer(text + ("\n" + answer_prefix if answer_prefix else ""))["input_ids"]


class JudgeModel:
    """Greedy answers of role ``role`` of ``shared`` (``base``: adapters disabled; ``judge``: the judge adapter)."""

    def __init__(self, shared: SharedBase, role: str):
        self.shared, self.role = shared, role

    @torch.no_grad()
    def generate(self, texts: list[str], max_new_tokens: int, batch_size: int, answer_prefix: str = "") -> list[str]:
        """One greedy answer per judge prompt, continuing ``answer_prefix`` (returned with it; text up to the first
        EOS, special tokens dropped)."""
        if not texts:
            return []
        shared, tok = self.shared, self.shared.tokenizer
        ids = [encode_judge_prompt(t, tok, answer_prefix) for t in texts]
        gen = GenerationConfig(max_new_tokens=max_new_tokens)
        with shared.role(self.role, train=False):
            sampled = HFEngine().sample(
                shared, ids, 1, gen, greedy=True, max_new_tokens=max_new_tokens, batch_size=batch_size
            )
        mask, _ = completion_mask(sampled.completion_ids, shared.eos_ids)
        rows = [row[m].tolist() for row, m in zip(sampled.completion_ids, mask)]
        return [answer_prefix + text for text in tok.batch_decode(rows, skip_special_tokens=True)]


def judge_model(cfg: JudgeConfig, shared: SharedBase, recipe_path: str | None = None) -> JudgeModel:
    """Where ``cfg``'s judge runs (set up once): the bare base, the frozen ``judge`` adapter on it, or a second
    model loaded with the base's quantization and dtype."""
    if cfg.model == "base":
        return JudgeModel(shared, "base")
    if cfg.model == "adapter":
        folder = find_adapter(resolve_path(cfg.path, recipe_path, "judge.path"), what="judge.path")
        if not shared.has_adapter(JUDGE):
            try:
                shared.add_adapter(JUDGE, init_from=folder, trainable=False, head=False)
            except (RuntimeError, ValueError, KeyError) as e:  # PEFT: shapes / targets of another base
                raise LorarlError(f"judge.path {folder}: not an adapter of this base model ({e})") from None
        return JudgeModel(shared, JUDGE)
    try:
        name = str(resolve_path(cfg.path, recipe_path, "judge.path"))
    except LorarlError:
        name = cfg.path  # a model name (`lorarl models`, a hub name): the loader resolves it
    m = shared.cfg
    other = SharedBase.load(
        ModelConfig(
            name=name,
            quantization=m.quantization,
            dtype=m.dtype,
            gradient_checkpointing=False,
            trust_remote_code=m.trust_remote_code,
        ),
        device=shared.device,
    )
    return JudgeModel(other, "base")


class JudgeReward:
    """A reward function (TRL's signature, plus ``group_size`` from the scorer) scoring completions with an LLM
    judge; values in ``[0, 1]``, NaN where the judge's answer did not parse."""

    wants_group_size = True  # the scorer passes group_size= (group mode judges each group in one prompt)

    def __init__(self, cfg: JudgeConfig, model: JudgeModel):
        self.cfg, self.model = cfg, model
        self.rubric = cfg.rubric or DEFAULT_RUBRICS[cfg.mode]
        self.__name__ = JUDGE
        self.log_path: Path | None = None
        self.last_value_error: str | None = None
        self.calls = 0
        self._failed, self._seconds, self._judge_prompts = 0, 0.0, 0

    def log_to(self, run_dir: Path) -> None:
        self.log_path = Path(run_dir) / "judge.jsonl"

    def max_new_tokens(self, group_size: int) -> int:
        if self.cfg.max_new_tokens:
            return self.cfg.max_new_tokens
        return default_answer_tokens(self.cfg.mode, group_size)

    def prompts_for(
        self, prompts: list, texts: list[str], columns: dict, group_size: int
    ) -> tuple[list[str], list[list[int]]]:
        """The judge prompts of a batch and the rows each one scores: ``(judge prompts, groups of row indices)``."""
        lo, hi = self.cfg.min_score, self.cfg.max_score

        def fields(i: int) -> dict:
            row = {k: v[i] for k, v in columns.items() if k not in NOT_COLUMNS and isinstance(v, (list, tuple))}
            return {**row, "prompt": prompt_text_of(prompts[i])}

        if self.cfg.mode == "pointwise":
            groups = [[i] for i in range(len(texts))]
            return [
                pointwise_prompt(self.rubric, {**fields(i), "completion": t}, lo, hi) for i, t in enumerate(texts)
            ], groups
        if len(texts) % group_size:
            raise ValueError(f"{len(texts)} completions are not whole groups of {group_size}")
        groups = [list(range(s, s + group_size)) for s in range(0, len(texts), group_size)]
        return [group_prompt(self.rubric, fields(g[0]), [texts[i] for i in g], lo, hi) for g in groups], groups

    def __call__(self, prompts: list, completions: list, group_size: int = 1, **columns) -> list[float]:
        t0 = time.monotonic()
        self.calls += 1
        lo, hi = self.cfg.min_score, self.cfg.max_score
        texts = [completion_text(c) for c in completions]
        judge_prompts, groups = self.prompts_for(prompts, texts, columns, group_size)
        answers = self.model.generate(
            judge_prompts, self.max_new_tokens(group_size), self.cfg.batch_size, self.cfg.answer_prefix
        )
        values = [float("nan")] * len(texts)
        errors: list[str | None] = []
        for rows, answer in zip(groups, answers):
            try:
                if self.cfg.mode == "pointwise":
                    scores = [parse_pointwise(answer, lo, hi)]
                else:
                    scores = parse_group(answer, len(rows), lo, hi)
                for i, s in zip(rows, scores):
                    values[i] = to_unit(s, lo, hi)
                errors.append(None)
            except JudgeParseError as e:
                errors.append(str(e))
        failed = [e for e in errors if e]
        self._failed = sum(math.isnan(v) for v in values)
        self.last_value_error = f"judge answer did not parse: {failed[0]}" if failed else None
        self._seconds, self._judge_prompts = time.monotonic() - t0, len(judge_prompts)
        self._log(judge_prompts, answers, groups, values, errors)
        return values

    def _log(self, judge_prompts, answers, groups, values, errors) -> None:
        if self.log_path is None or self.cfg.log_rows <= 0:
            return
        with open_nofollow(self.log_path, "a") as f:
            for prompt, answer, rows, error in list(zip(judge_prompts, answers, groups, errors))[: self.cfg.log_rows]:
                scores = [None if math.isnan(values[i]) else values[i] for i in rows]
                record = {"call": self.calls, "rows": rows, "mode": self.cfg.mode, "prompt": prompt, "answer": answer}
                f.write(json.dumps({**record, "scores": scores, "error": error}) + "\n")

    def step_metrics(self) -> dict[str, float]:
        """``rewards/judge/failed_rows`` (answers that did not parse, in rows), ``rewards/judge/seconds`` and
        ``rewards/judge/prompts`` (judge prompts generated) of the last call."""
        return {"failed_rows": float(self._failed), "seconds": self._seconds, "prompts": float(self._judge_prompts)}


def make_judge(cfg: JudgeConfig, shared: SharedBase, recipe_path: str | None = None) -> JudgeReward:
    """The ``judge`` reward of a recipe entry, its model set up once on (or beside) ``shared``."""
    return JudgeReward(cfg, judge_model(cfg, shared, recipe_path))
