"""The reward shown under each answer: a run's rule rewards (its recipe's ``reward.functions``, through
:class:`lorarl.rewards.RewardScorer`; extra columns such as ``answer`` come from the "reward columns" box) or a
reward-model run's adapter + score head (``runs/NAME/reward``), scored like training scores: the prompt rendered as
the rollout renders it, the answer's tokens and one EOS (:func:`lorarl.data.preferences.encode_response`), read by
:func:`lorarl.rewards.source.reward_model_scores` as the ``reward`` role of the shared base."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from lorarl.chat.catalog import ScorerEntry, folder_stamp


class ScoredAnswer(Protocol):
    """What scoring reads of an answer (:class:`lorarl.chat.engine.Answer`, which sits above this module): its text
    and its token ids without the EOS."""

    text: str
    token_ids: list[int]


@dataclass
class RewardResult:
    """One answer's reward: the total, each part (rule function or "reward model"), or why there is none."""

    total: float | None = None
    parts: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None

    def markdown(self) -> str:
        """What the pane shows under the answer."""
        if self.error:
            return f"reward: n/a ({self.error})"
        if self.total is None:
            return "reward: n/a"
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.parts.items())
        return f"**reward {self.total:.3f}**" + (f" ({parts})" if parts and len(self.parts) > 1 else "")


def missing_columns(scorer: ScorerEntry | None, columns: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``(reward function, column)`` for each dataset column a scorer's built-in rule reward reads
    (:func:`lorarl.rewards.builtins.builtin_columns`: ``answer`` for ``numeric_match``) that ``columns`` (the
    "reward columns" box) lacks; [] for a reward model or nothing missing."""
    from lorarl.rewards.builtins import builtin_columns

    if scorer is None or scorer.kind != "rules":
        return []
    given = columns or {}
    return [(s.name, c) for s in scorer.specs for c in builtin_columns(s.name) if c not in given]


def columns_request(scorer_id: str, missing: list[tuple[str, str]]) -> str:
    """The line asking for the columns a reward reads, with an example of the box's JSON."""
    what = ", ".join(f"{fn} reads the column {col!r}" for fn, col in missing)
    example = json.dumps({col: "..." for _, col in missing})
    return f"reward {scorer_id}: {what}; give it in “Reward columns” (e.g. {example}: the expected answer)"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _value(x: torch.Tensor) -> float | None:
    return None if torch.isnan(x) else float(x)


class AnswerScorer:
    """Scores answers with the catalog's scorers on the shared base. Rule scorers are built once each; the reward
    adapter is loaded as the ``reward`` role (one at a time: choosing another reward model, or a run saving new
    weights, replaces it). ``lock`` is the engine's: scoring and generation never run at once."""

    def __init__(self, shared, lock: threading.RLock):
        self.shared = shared
        self.lock = lock
        self._rules: dict[str, Any] = {}  # scorer id -> RewardScorer
        self._reward_key: str | None = None  # "scorer id@files stamp" of the adapter loaded as the reward role

    def score(
        self,
        scorer: ScorerEntry,
        conversations: Sequence[list[dict]],
        answers: Sequence[ScoredAnswer],
        columns: dict[str, Any] | None = None,
        code_digest: str = "",
    ) -> list[RewardResult]:
        """One :class:`RewardResult` per answer (``conversations[i]`` ends with the user turn ``answers[i]`` answers);
        ``code_digest``: the allowed code of a rules scorer (:mod:`lorarl.chat.consent`): other code, other build."""
        if scorer.kind == "rules":
            return self._score_rules(scorer, conversations, answers, columns or {}, code_digest)
        return self._score_reward_model(scorer, conversations, answers)

    def _score_rules(self, scorer: ScorerEntry, conversations, answers, columns: dict, digest: str) -> list:
        from lorarl.rewards import RewardScorer, trl_completions
        from lorarl.rewards.registry import RewardContext

        key = f"{scorer.id}@{digest}"
        fn = self._rules.get(key)
        if fn is None:  # relative file.py rewards are found beside the run's recipe.yaml (then the working folder)
            context = RewardContext(recipe_path=str(scorer.recipe_path) if scorer.recipe_path else None)
            fn = self._rules[key] = RewardScorer(list(scorer.specs), timeout_s=10.0, context=context)
        n = len(answers)
        res = fn(
            [list(c) for c in conversations],
            trl_completions([a.text for a in answers], conversational=True),
            {str(k): [v] * n for k, v in columns.items()},
            completion_ids=[a.token_ids for a in answers],
        )
        out = []
        for i in range(n):
            parts = {name: _value(res.per_function[i, k]) for k, name in enumerate(res.names)}
            total = _value(res.total[i])
            err = "; ".join(f"{k}: {v}" for k, v in res.failures.items()) if total is None and res.failures else None
            out.append(RewardResult(total, parts, err))
        return out

    def _load_reward_adapter(self, scorer: ScorerEntry) -> None:
        """Make ``scorer``'s adapter + head the shared base's ``reward`` role (unless it already is)."""
        from lorarl.rewards.source import REWARD

        folder = Path(scorer.folder).resolve()
        key = f"{scorer.id}@{folder_stamp(folder)}"
        if key == self._reward_key and self.shared.has_adapter(REWARD):
            return
        self.shared.remove_adapter(REWARD)
        self.shared.add_adapter(REWARD, init_from=folder, trainable=False, head=True)
        self._reward_key = key

    def _score_reward_model(self, scorer: ScorerEntry, conversations, answers) -> list[RewardResult]:
        from lorarl.data import encode_prompt, prompt_text
        from lorarl.data.preferences import encode_response
        from lorarl.model.tokens import pad_left
        from lorarl.rewards.source import reward_model_scores

        with self.lock:
            self._load_reward_adapter(scorer)
            tok = self.shared.tokenizer
            # tokenized exactly as the reward model was trained (lorarl.data.preferences.encode_pair): the prompt as
            # the rollout renders it (the run's system prompt when the chat has none), the answer's tokens, one EOS
            rows = [
                encode_prompt(prompt_text(list(conv), tok, scorer.system_prompt), tok, templated=True)
                + encode_response(a.text, tok)
                for conv, a in zip(conversations, answers)
            ]
            ids, mask = pad_left(rows, self.shared.pad_id)
            scores = reward_model_scores(self.shared, ids, mask.long(), batch_size=len(rows)).tolist()
        return [RewardResult(float(s), {"reward model": float(s)}) for s in scores]
