"""The settings of reward entries that are more than a function: a remote reward server (``remote``) and an
LLM judge on the shared base (``judge``). A ``reward.functions`` entry names one of them (``name: remote`` /
``name: judge``) and carries its section; validation names the entry (``reward.functions[i].judge.rubric``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from lorarl.config.common import check

# the placeholder a rubric must hold, by judge mode: where the completion (pointwise) or the numbered list of the
# group's completions (group) goes
RUBRIC_PLACEHOLDER = {"pointwise": "completion", "group": "completions"}
_FIELD = re.compile(r"\{(\w+)\}")


def rubric_fields(rubric: str) -> list[str]:
    """The ``{name}`` placeholders of a rubric, in order (``{{`` is not special: rubrics are filled by name only)."""
    return _FIELD.findall(rubric)


@dataclass
class RemoteRewardConfig:
    """A reward computed by an HTTP server (``name: remote``): one POST per batch, a JSON list of scores back
    (wire format: docs/rewards.md)."""

    url: str = ""  # http(s)://host:port/path the batch is POSTed to
    timeout_s: float = 30.0  # per request; a request past it is retried, then the call fails (counted)
    retries: int = 2  # further attempts after a failed one (HTTP error, timeout, malformed answer)
    backoff_s: float = 0.5  # wait before retry k: backoff_s * 2**(k-1) seconds

    def validate(self, where: str, prefix: str) -> None:
        check(
            self.url.startswith(("http://", "https://")),
            where,
            f"{prefix}.url",
            f"must be an http:// or https:// URL, got {self.url!r}",
        )
        check(self.timeout_s > 0, where, f"{prefix}.timeout_s", "must be > 0")
        check(self.retries >= 0, where, f"{prefix}.retries", "must be >= 0")
        check(self.backoff_s >= 0, where, f"{prefix}.backoff_s", "must be >= 0")


@dataclass
class JudgeConfig:
    """An LLM judge scoring completions with a rubric (``name: judge``; lorarl.rewards.judge). The score it gives
    is mapped to [0, 1]: ``(s - min_score) / (max_score - min_score)``; an answer that does not parse is a failed
    value (NaN, left out, counted), never 0."""

    mode: Literal["pointwise", "group"] = "pointwise"  # each completion alone | the whole group in one prompt (RULER)
    model: Literal["base", "adapter", "folder"] = "base"  # base: the shared base with adapters disabled;
    #   adapter: a PEFT adapter folder (`path`) on the shared base; folder: another local model (`path`), loaded once
    path: str | None = None  # the judge adapter folder (model: adapter) or model folder / name (model: folder)
    rubric: str | None = None  # the judge's instructions with {completion} (pointwise) or {completions} (group);
    #   may also use {prompt} and dataset columns ({answer}); default: a generic rubric (lorarl.rewards.judge)
    answer_prefix: str = ""  # the start of the judge's answer, written after the generation prompt (e.g. "Score:"):
    #   the judge continues it, and the parser reads prefix + continuation; helps small judges keep the format
    min_score: float = 0.0  # the lowest score the judge may give
    max_score: float = 10.0  # the highest score the judge may give
    max_new_tokens: int | None = None  # judge answer length; default 16 (pointwise), 8 + 16 per completion (group)
    batch_size: int = 16  # judge prompts per generate call
    log_rows: int = 4  # judge prompts + answers appended to RUN_DIR/judge.jsonl per scoring call (0: none)

    def validate(self, where: str, prefix: str) -> None:
        needs_path = self.model in ("adapter", "folder")
        check(
            needs_path == bool(self.path),
            where,
            f"{prefix}.path",
            f"must be set for judge.model {self.model}" if needs_path else "is only read with model adapter | folder",
        )
        if self.rubric is not None:
            key = RUBRIC_PLACEHOLDER[self.mode]
            check(
                key in rubric_fields(self.rubric),
                where,
                f"{prefix}.rubric",
                f"must contain {{{key}}} (where the judge sees the {key}) for judge.mode {self.mode}",
            )
        check(self.max_score > self.min_score, where, f"{prefix}.max_score", "must be > min_score")
        check(
            self.max_new_tokens is None or self.max_new_tokens >= 1, where, f"{prefix}.max_new_tokens", "must be >= 1"
        )
        check(self.batch_size >= 1, where, f"{prefix}.batch_size", "must be >= 1")
        check(self.log_rows >= 0, where, f"{prefix}.log_rows", "must be >= 0")


SPECIAL_REWARDS = {"remote": "remote", "judge": "judge"}  # entry name -> the section it needs


def validate_reward_entry(spec, where: str, i: int) -> None:
    """A ``reward.functions[i]`` entry: ``remote`` / ``judge`` need their section, other names must not carry one."""
    prefix = f"reward.functions[{i}]"
    for name, section in SPECIAL_REWARDS.items():
        value = getattr(spec, section)
        if spec.name == name:
            check(value is not None, where, f"{prefix}.{section}", f"must be set for a reward named {name!r}")
            value.validate(where, f"{prefix}.{section}")
        else:
            check(value is None, where, f"{prefix}.{section}", f"is only read when {prefix}.name is {name!r}")
