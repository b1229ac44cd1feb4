"""The app's logic without Gradio: stop events per browser session, one-shot answers for the ``/respond`` API, and
votes written to the preference files. The UI's handlers and the API both go through :class:`ChatSession`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from lorarl.chat.catalog import NO_REWARD
from lorarl.chat.consent import RunCode
from lorarl.chat.engine import ChatEngine
from lorarl.chat.inputs import system_messages
from lorarl.chat.votes import append_jsonl, preference_record, unpaired_path, unpaired_record
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
        self.unpaired = unpaired_path(preferences)  # single-answer 👍 / 👎 votes (KTO rows)
        self._stops: dict[str, threading.Event] = {}
        self._turns: dict[str, dict] = {}  # browser session -> its last answered turn, as the server generated it
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
        self.check_code(panes, reward)
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

    # ---- code named by run folders (lorarl.chat.consent) --------------------------------------------------------
    def code_for(self, panes: Sequence[str], reward: str) -> list[tuple[str, RunCode]]:
        """``(what, code)`` for each piece of run-folder code answering with ``panes`` and scoring with ``reward``
        would import: the ``rules:RUN`` reward's functions, the tools of each pane's run."""
        out = []
        scorer = self.catalog.get_scorer(reward) if reward and reward != NO_REWARD else None
        code = self.catalog.scorer_code(scorer)
        if code is not None:
            out.append((f"reward {reward}", code))
        for p in dict.fromkeys(panes):
            entry = self.catalog.get(p)
            code = self.catalog.tools_code(entry.run) if entry.kind != "base" else None
            if code is not None and all(c.digest != code.digest for _, c in out):
                out.append((f"pane {p}", code))
        return out

    def check_code(self, panes: Sequence[str], reward: str) -> None:
        """Refuse (one line naming the code) before anything is generated when run-folder code was not allowed."""
        for what, code in self.code_for(panes, reward):
            self.catalog.consent.require(code, what)

    def allow_code(self, panes: Sequence[str], reward: str) -> str:
        """Allow what :meth:`code_for` names (the Chat tab's "Allow run code"); returns the line saying what."""
        found = self.code_for(panes, reward)
        if not found:
            return "nothing to allow: the chosen reward and panes run no code from run folders"
        for _, code in found:
            self.catalog.consent.allow(code)
        return "allowed: " + "; ".join(f"{what} ({code.where}): {code.describe()}" for what, code in found)

    # ---- votes -----------------------------------------------------------------------------------------------
    def record_turn(self, session: str, system: str, panes: Sequence[str], convs: list[list[dict]], answers) -> None:
        """Remember browser session ``session``'s answered turn as the server generated it: each pane's
        conversation (without the system prompt, ending with the user turn) and its answer's text. A vote
        (:meth:`vote_turn`) stores these, never what the browser sends back."""
        self._turns[session] = {
            "system": system or "",
            "panes": list(panes),
            "convs": [[dict(m) for m in c] for c in convs],
            "answers": [a.text for a in answers],
            "voted": None,
            "rated": {},  # pane index -> True (👍) / False (👎): each answer is rated once
        }

    def vote_turn(self, session: str, verdict: str, left: int, right: int) -> tuple[str, str]:
        """Vote on panes ``left`` / ``right`` (0-based) of ``session``'s last turn (:meth:`record_turn`); returns
        ``(path written, what was recorded)``. Refused when there is no such turn or it was voted on."""
        turn = self._turns.get(session)
        if turn is None or max(left, right) >= len(turn["answers"]):
            raise LorarlError("those panes have not answered yet")
        if turn["voted"]:
            raise LorarlError(f"already voted on this answer ({turn['voted']}); send or regenerate to vote again")
        sides = [turn["convs"][i] + [{"role": "assistant", "content": turn["answers"][i]}] for i in (left, right)]
        path = self.vote(verdict, turn["system"], *sides, turn["panes"][left], turn["panes"][right])
        turn["voted"] = "tie" if verdict == "tie" else f"pane {(left if verdict == 'left' else right) + 1} preferred"
        return path, turn["voted"]

    def rate_turn(self, session: str, pane: int, label: bool) -> tuple[str, str]:
        """Rate pane ``pane``'s (0-based) last answer of ``session``'s last turn alone: 👍 (``label`` True) or 👎,
        appended as TRL's unpaired row to :attr:`unpaired`; returns ``(path written, what was recorded)``. Refused
        when the pane has not answered or its answer was rated already."""
        turn = self._turns.get(session)
        if turn is None or not 0 <= pane < len(turn["answers"]):
            raise LorarlError(f"pane {pane + 1} has not answered yet")
        if pane in turn["rated"]:
            was = "👍" if turn["rated"][pane] else "👎"
            raise LorarlError(f"pane {pane + 1}'s answer is rated already ({was}); send or regenerate to rate again")
        history = turn["convs"][pane] + [{"role": "assistant", "content": turn["answers"][pane]}]
        append_jsonl(self.unpaired, unpaired_record(turn["system"], history, turn["panes"][pane], label))
        turn["rated"][pane] = bool(label)
        return str(self.unpaired), f"pane {pane + 1} {'👍' if label else '👎'}"

    def vote(
        self, verdict: str, system: str, left: list[dict], right: list[dict], left_model: str, right_model: str
    ) -> str:
        """Append the vote to the preference file (ties: the ties file); return the path written."""
        record, tie = preference_record(system, left, right, left_model, right_model, verdict)
        path = self.ties if tie else self.preferences
        append_jsonl(path, record)
        return str(path)
