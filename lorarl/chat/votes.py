"""Votes as preference pairs, in TRL's conversational format, ready for ``recipes/reward_model.yaml``; and single
answers rated 👍 / 👎 as TRL's unpaired rows, ready for KTO (``recipes/kto_arithmetic.yaml``).

"left better" / "right better" append ``{"prompt": [...], "chosen": [{"role": "assistant", ...}], "rejected":
[...]}`` plus ``chosen_model`` / ``rejected_model`` / ``created`` to ``RUNS/preferences.jsonl``. Ties go to a
separate file, ``RUNS/preferences_ties.jsonl`` (same fields, left pane as "chosen", ``"tie": true``), so the
preference file stays directly trainable. Each line is appended, flushed and fsynced. A pair needs one shared
prompt: when the two panes' earlier turns differ, the vote is refused (single-turn votes always work).

👍 / 👎 under one pane's answer append ``{"prompt": [...], "completion": [{"role": "assistant", ...}], "label":
true | false}`` plus ``model`` / ``created`` to ``RUNS/preferences_unpaired.jsonl`` (beside the preference file):
TRL's unpaired preference format, one row per vote, no second pane needed.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

from lorarl.chat.inputs import system_messages
from lorarl.errors import LorarlError
from lorarl.runfiles import open_nofollow

PREFERENCES_FILE = "preferences.jsonl"
VERDICTS = ("left", "right", "tie")

_write_lock = threading.Lock()


def ties_path(preferences: Path) -> Path:
    """Where ties go: beside the preference file, ``NAME_ties.jsonl``."""
    return preferences.with_name(preferences.stem + "_ties" + preferences.suffix)


def unpaired_path(preferences: Path) -> Path:
    """Where single-answer 👍 / 👎 votes go: beside the preference file, ``NAME_unpaired.jsonl``."""
    return preferences.with_name(preferences.stem + "_unpaired" + preferences.suffix)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line, flushed and fsynced (a crash never leaves half a line of an earlier vote)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with _write_lock, open_nofollow(path, "a") as f:  # a link planted in the runs folder is never written through
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def _check_answers(left: list[dict], right: list[dict]) -> None:
    for side, h in (("left", left), ("right", right)):
        if not h or h[-1]["role"] != "assistant" or len(h) < 2 or h[-2]["role"] != "user":
            raise LorarlError(f"the {side} pane has no answer to vote on yet")
    if left[:-1] != right[:-1]:
        raise LorarlError(
            "the two panes' earlier turns differ, so they do not share one prompt; Clear and ask again to vote"
        )


def preference_record(
    system: str,
    left: list[dict],
    right: list[dict],
    left_model: str,
    right_model: str,
    verdict: str,
) -> tuple[dict, bool]:
    """(record, is_tie) from two panes' histories, each ending with the assistant's answer to the same prompt.

    ``verdict``: ``left`` | ``right`` | ``tie``. Raises LorarlError when there is no answer to compare or the two
    panes' earlier turns differ (a preference pair needs one shared prompt).
    """
    if verdict not in VERDICTS:
        raise LorarlError(f"vote must be left, right or tie, got {verdict!r}")
    _check_answers(left, right)
    prompt = system_messages(system) + [dict(m) for m in left[:-1]]
    a, b = (left, right) if verdict != "right" else (right, left)
    ma, mb = (left_model, right_model) if verdict != "right" else (right_model, left_model)
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": a[-1]["content"]}],
        "rejected": [{"role": "assistant", "content": b[-1]["content"]}],
        "chosen_model": ma,
        "rejected_model": mb,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if verdict == "tie":
        record["tie"] = True
    return record, verdict == "tie"


def unpaired_record(system: str, history: list[dict], model: str, label: bool) -> dict:
    """One pane's answer rated alone: TRL's unpaired row ``{"prompt", "completion", "label"}`` (``label`` True for
    👍, False for 👎) plus ``model`` and ``created``, from the pane's history ending with the assistant's answer.
    Raises LorarlError when the pane has no answer yet."""
    if len(history) < 2 or history[-1]["role"] != "assistant" or history[-2]["role"] != "user":
        raise LorarlError("that pane has no answer to rate yet")
    return {
        "prompt": system_messages(system) + [dict(m) for m in history[:-1]],
        "completion": [{"role": "assistant", "content": history[-1]["content"]}],
        "label": bool(label),
        "model": model,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
