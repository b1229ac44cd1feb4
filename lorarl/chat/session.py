"""The app's logic without Gradio: stop events per browser session, one-shot answers for the ``/respond`` API, and
votes written to the preference files. The UI's handlers and the API both go through :class:`ChatSession`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from lorarl.chat.catalog import NO_REWARD
from lorarl.chat.engine import ChatEngine
from lorarl.chat.inputs import system_messages
from lorarl.chat.votes import append_jsonl, preference_record
from lorarl.config import GenerationConfig
from lorarl.errors import LorarlError

MAX_PANES = 4


class ChatSession:
    """Stop events, ``/respond`` and votes on top of one :class:`~lorarl.chat.engine.ChatEngine`."""

    def __init__(self, engine: ChatEngine, preferences: Path, ties: Path):
        self.engine = engine
        self.catalog = engine.catalog
        self.preferences = preferences
        self.ties = ties
        self._stops: dict[str, threading.Event] = {}
        # the workbench's memory rule (lorarl.app.memory): the line answered instead of generating, or None
        self.pause: Callable[[], str | None] | None = None

    def check_memory(self) -> None:
        """LorarlError with the reason when generation is paused (a training run needs the GPU's memory)."""
        reason = self.pause() if self.pause is not None else None
        if reason:
            raise LorarlError(reason)

    def stop_event(self, session: str) -> threading.Event:
        """A fresh stop event for browser session ``session`` (its Stop button sets it)."""
        ev = threading.Event()
        self._stops[session] = ev
        return ev

    def stop(self, session: str) -> bool:
        """Stop ``session``'s running generation; False when it has none."""
        ev = self._stops.get(session)
        if ev is None:
            return False
        ev.set()
        return True

    def respond(
        self,
        prompt: str,
        panes: Sequence[str],
        system: str = "",
        generation: GenerationConfig | None = None,
        reward: str = NO_REWARD,
        columns: dict | None = None,
        *,
        seed: int = 0,
    ) -> dict:
        """Answer one single-turn ``prompt`` with each checkpoint in ``panes`` -> ``{"panes", "answers",
        "finished", "rewards", "tool_calls"}`` (``rewards`` None when ``reward`` is ``none``; ``tool_calls``: per
        pane, the calls a pane of a run trained with tools made, ``{"name", "arguments", "result", "error"}``)."""
        if not prompt or not prompt.strip():
            raise LorarlError("empty prompt")
        if not 1 <= len(panes) <= MAX_PANES:
            raise LorarlError(f"choose 1 to {MAX_PANES} panes, got {len(panes)}")
        self.check_memory()
        msgs = system_messages(system) + [{"role": "user", "content": prompt}]
        convs = [list(msgs) for _ in panes]
        answers = self.engine.generate(list(panes), convs, generation, seed=seed)
        rewards = self.engine.score(reward, convs, answers, columns)
        return {
            "panes": [a.checkpoint for a in answers],
            "answers": [a.text for a in answers],
            "finished": [a.finished for a in answers],
            "rewards": [r.total for r in rewards] if rewards is not None else None,
            "tool_calls": [[dataclasses.asdict(s) for s in a.steps] for a in answers],
        }

    def vote(
        self, verdict: str, system: str, left: list[dict], right: list[dict], left_model: str, right_model: str
    ) -> str:
        """Append the vote to the preference file (ties: the ties file); return the path written."""
        record, tie = preference_record(system, left, right, left_model, right_model, verdict)
        path = self.ties if tie else self.preferences
        append_jsonl(path, record)
        return str(path)
