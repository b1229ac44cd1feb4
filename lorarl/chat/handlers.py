"""The UI's callbacks, and :func:`wire` connecting them to the layout's components. Every UI event is private (not
callable from clients); the public API is :mod:`lorarl.chat.api`.

Send and Regenerate stream: the engine answers in a background thread (:class:`_Job`) while the handler yields a
frame of every pane (:class:`_Frames`) each time some pane's text changed, at most ~25 a second. Stop sets the
session's stop event; a cancelled or disconnected request stops its generation too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr

from lorarl.chat.catalog import BASE_ID, NO_REWARD
from lorarl.chat.engine import Answer, ChatEngine
from lorarl.chat.inputs import (
    check_seed,
    display_history,
    generation_from_ui,
    parse_columns,
    plain_history,
    system_messages,
)
from lorarl.chat.layout import Widgets
from lorarl.chat.scoring import RewardResult, columns_request, missing_columns
from lorarl.chat.session import MAX_PANES, ChatSession
from lorarl.chat.tools import tool_messages
from lorarl.config import GenerationConfig
from lorarl.errors import LorarlError

GENERATING, SCORING = "generating…", "scoring…"
FRAME_GAP_S = 0.04  # at most ~25 screen updates a second


def _session_id(request: gr.Request | None) -> str:
    """The browser session a request belongs to (``api`` for clients without one)."""
    return getattr(request, "session_hash", None) or "api"


class _Job:
    """One turn's generation, then its scoring, in a background thread; ``changed`` is set whenever there is news."""

    def __init__(self, engine: ChatEngine, panes: list[str], conversations: list[list[dict]], stop: threading.Event):
        self.engine, self.panes, self.conversations, self.stop = engine, panes, conversations, stop
        self.texts = [""] * len(panes)
        self.steps: list[list] = [[] for _ in panes]  # tool panes: the calls and results so far (ToolStep)
        self.changed = threading.Event()
        self.answers: list[Answer] = []
        self.rewards: list[RewardResult] | None = None
        self.error: Exception | None = None
        self.scoring = False
        self.thread: threading.Thread | None = None

    def _on_update(self, i: int, text: str) -> None:
        self.texts[i] = text
        self.changed.set()

    def _on_steps(self, i: int, steps: list) -> None:
        self.steps[i] = steps
        self.changed.set()

    def _work(self, generation: GenerationConfig, seed: int, reward: str, columns: dict) -> None:
        try:
            self.answers = self.engine.generate(
                self.panes,
                self.conversations,
                generation,
                seed=seed,
                stop=self.stop,
                on_update=self._on_update,
                on_steps=self._on_steps,
            )
            if reward and reward != NO_REWARD and not self.stop.is_set():
                self.scoring = True
                self.changed.set()
                self.rewards = self.engine.score(reward, self.conversations, self.answers, columns)
        except Exception as e:  # shown to the user by the handler
            self.error = e
        finally:
            self.changed.set()

    def start(self, generation: GenerationConfig, seed: int, reward: str, columns: dict) -> None:
        args = (generation, seed, reward, columns)
        self.thread = threading.Thread(target=self._work, args=args, daemon=True, name="lorarl-chat-generate")
        self.thread.start()

    def notes(self) -> Iterator[str]:
        """While the job runs: one status note each time something changed (then a short pause)."""
        while self.thread.is_alive():
            if not self.changed.wait(0.25):
                continue
            self.changed.clear()
            yield SCORING if self.scoring else GENERATING
            time.sleep(FRAME_GAP_S)
        self.thread.join()


@dataclass
class _Frames:
    """The outputs of a generation event (every pane's chat and reward, the prompt box, the status, the turn) for
    the ``n`` panes answering: their histories end with the new user turn and the answer being written."""

    n: int
    hist: list[list[dict]]
    turn: dict  # system prompt and panes of this request (what a vote records)

    def __post_init__(self) -> None:
        self.start = [len(h) - 1 for h in self.hist]  # where each pane's reply begins (after the new user turn)

    def frame(
        self,
        texts: list[str],
        msg: Any,
        note: str,
        done: bool = False,
        reward_md: list[str] | None = None,
        steps: list[list] | None = None,
    ):
        for i in range(self.n):
            text = texts[i] if (texts[i] or done) else "…"
            # a tool pane's reply: its calls and results folded (gradio's metadata titles), then the answer
            self.hist[i] = self.hist[i][: self.start[i]] + tool_messages(steps[i] if steps else [], text)
        bots = [self.hist[i] if i < self.n else gr.update() for i in range(MAX_PANES)]
        rewards = [(reward_md[i] if reward_md else "") if i < self.n else gr.update() for i in range(MAX_PANES)]
        return [*bots, *rewards, msg, note, self.turn]

    def restore(self, before: list[list[dict]]) -> list:
        """The panes as they were before the request (after an error), the rest unchanged."""
        rest = [gr.update()] * (MAX_PANES - self.n)
        return [*before[: self.n], *rest, *[gr.update()] * MAX_PANES, gr.update(), "error", {}]


def _last_user_message(hist: list[list[dict]]) -> str | None:
    for h in hist:
        users = [m["content"] for m in h if m["role"] == "user"]
        if users:
            return users[-1]
    return None


def _without_last_turn(h: list[dict], message: str) -> list[dict]:
    """A pane's history without its last exchange for ``message`` (what Regenerate answers again): the last user
    turn and the assistant messages after it (a tool pane's folded calls and its answer)."""
    user = {"role": "user", "content": message}
    for k in range(len(h) - 1, -1, -1):
        if h[k]["role"] == "user":
            return h[:k] if h[k] == user else h
    return h


class Handlers:
    """The callbacks of the UI's events, on top of one :class:`~lorarl.chat.session.ChatSession`.

    Parameters are explicit (no ``*args``) where gradio must pass the request: it finds it by the annotation.
    """

    def __init__(self, session: ChatSession):
        self.session = session
        self.engine = session.engine
        self.catalog = session.catalog

    def status_line(self, extra: str = "") -> str:
        return (extra + " · " if extra else "") + self.catalog.summary()

    # ---- Send / Regenerate ----------------------------------------------------------------------------------
    def on_send(
        self, message, n, p0, p1, p2, p3, h0, h1, h2, h3, sys_p, temp, tp, mx, sd, rw, colj, request: gr.Request
    ):
        message = (message or "").strip()
        if not message:
            raise gr.Error("type a message first")
        settings = (sys_p, temp, tp, mx, sd, rw, colj)
        yield from self._stream(message, int(n), [p0, p1, p2, p3], [h0, h1, h2, h3], settings, request)

    def on_regen(self, n, p0, p1, p2, p3, h0, h1, h2, h3, sys_p, temp, tp, mx, sd, rw, colj, request: gr.Request):
        n = int(n)
        hist = [display_history(h) for h in (h0, h1, h2, h3)]
        message = _last_user_message(hist[:n])
        if message is None:
            raise gr.Error("nothing to regenerate yet")
        hist[:n] = [_without_last_turn(h, message) for h in hist[:n]]
        settings = (sys_p, temp, tp, mx, sd, rw, colj)
        yield from self._stream(message, n, [p0, p1, p2, p3], hist, settings, request)

    def _check(self, panes: list[str], temp, tp, mx, sd, rw, colj) -> tuple[GenerationConfig, int, dict, str]:
        """The request's sampling settings, seed and reward columns, checked (and its panes known, and any code
        from run folders its panes and reward would run allowed: :mod:`lorarl.chat.consent`); the last item is
        the line asking for the columns the reward reads when the box lacks them (then nothing is scored)."""
        try:
            generation, seed, columns = generation_from_ui(temp, tp, mx), check_seed(sd), parse_columns(colj)
            for p in panes:
                self.catalog.get(p)
            self.session.check_memory()
            self.session.check_code(panes, rw)
            missing = missing_columns(self.catalog.get_scorer(rw), columns)
        except LorarlError as e:
            raise gr.Error(str(e)) from None
        return generation, seed, columns, columns_request(rw, missing) if missing else ""

    def _stream(self, message: str, n: int, pick: list[str], hist: list, settings: Sequence, request: gr.Request):
        """Answer ``message`` in the first ``n`` panes, yielding a frame each time their texts change."""
        sys_p, temp, tp, mx, sd, rw, colj = settings
        generation, seed, columns, ask = self._check(pick[:n], temp, tp, mx, sd, rw, colj)
        rw = NO_REWARD if ask else rw  # the reward's columns are missing: asked for, not scored
        hist = [display_history(h) for h in hist]
        before = [list(h) for h in hist]
        user = [{"role": "user", "content": message}]
        convs = [system_messages(sys_p) + plain_history(hist[i]) + user for i in range(n)]
        for i in range(n):
            hist[i] = hist[i] + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        frames = _Frames(n, hist, {"system": sys_p or "", "panes": list(pick[:n])})
        stop_ev = self.session.stop_event(_session_id(request))
        job = _Job(self.engine, list(pick[:n]), convs, stop_ev)
        t0 = time.monotonic()
        job.start(generation, seed, rw, columns)
        yield frames.frame(job.texts, "", GENERATING)
        try:
            for note in job.notes():
                yield frames.frame(job.texts, gr.update(), note, steps=job.steps)
            stopped = stop_ev.is_set()
        finally:
            stop_ev.set()  # a cancelled or disconnected request stops its generation
        if job.error is not None:  # put the panes back as they were, then say what went wrong
            yield frames.restore(before)
            raise gr.Error(str(job.error))
        for i, a in enumerate(job.answers):
            job.texts[i] = a.text
        bodies = [c[len(system_messages(sys_p)) :] for c in convs]
        self.session.record_turn(_session_id(request), sys_p or "", pick[:n], bodies, job.answers)  # what votes keep
        ntok = sum(len(a.token_ids) for a in job.answers)
        note = f"{'stopped' if stopped else 'done'}: {ntok} tokens in {time.monotonic() - t0:.1f} s, " + (
            "greedy (the same answer for any seed)" if generation.temperature == 0 else f"seed {seed}"
        )
        note += f" · not scored: {ask}" if ask else ""
        reward_md = [r.markdown() for r in job.rewards] if job.rewards else None
        steps = [a.steps for a in job.answers]
        yield frames.frame(job.texts, gr.update(), note, done=True, reward_md=reward_md, steps=steps)

    # ---- the other controls ---------------------------------------------------------------------------------
    def on_stop(self, request: gr.Request):
        self.session.stop(_session_id(request))
        return "stopped"

    def on_clear(self):
        return [[] for _ in range(MAX_PANES)] + ["" for _ in range(MAX_PANES)] + ["cleared", {}]

    def on_pick(self, value):
        try:
            entry = self.engine.prepare(value)
            note = self.code_note([value], NO_REWARD)
        except LorarlError as e:
            raise gr.Error(str(e)) from None
        return [], "", f"ready: {entry.label}" + (f" · {note}" if note else "")

    def code_note(self, panes: list[str], reward: str) -> str:
        """What run-folder code the panes / reward would run and is not allowed yet (shown before it is asked for)."""
        todo = [(w, c) for w, c in self.session.code_for(panes, reward) if not self.catalog.consent.allowed(c)]
        if not todo:
            return ""
        what = "; ".join(f"{w} runs code from the {c.where} folder: {c.describe()}" for w, c in todo)
        return f"⚠ {what}: read it, then press “Allow run code” to let it run"

    def on_reward(self, reward, n, p0, p1, p2, p3, colj=None):
        """The reward dropdown changed: say what code it (and the panes) would run, and which columns it reads that
        the "reward columns" box lacks."""
        try:
            missing = missing_columns(self.catalog.get_scorer(reward), parse_columns(colj) if colj else {})
            notes = [
                self.code_note([p0, p1, p2, p3][: int(n)], reward),
                columns_request(reward, missing) if missing else "",
            ]
        except LorarlError as e:
            return f"**error:** {e}"
        return " · ".join(n for n in notes if n) or self.status_line()

    def next_seed(self, seed):
        """Regenerate's seed: the next one (a fixed seed would give the same answer again); a negative seed (random)
        stays as it is."""
        try:
            value = check_seed(seed)
        except LorarlError as e:
            raise gr.Error(str(e)) from None
        return value + 1 if value >= 0 else value

    def on_allow_code(self, reward, n, p0, p1, p2, p3):
        """The "Allow run code" button: allow the code the chosen reward and the shown panes name (and say exactly what)."""
        try:
            return self.session.allow_code([p0, p1, p2, p3][: int(n)], reward)
        except LorarlError as e:
            raise gr.Error(str(e)) from None

    def on_panes(self, n):
        return [gr.Column(visible=i < int(n)) for i in range(MAX_PANES)]

    def on_refresh(self, *picked):
        self.catalog.scan()
        new = self.catalog.choices()
        valid = {c[1] for c in new}
        picks = [gr.Dropdown(choices=new, value=v if v in valid else BASE_ID) for v in picked]
        return [*picks, gr.Dropdown(choices=self.catalog.scorer_choices()), self.status_line("list refreshed")]

    def vote_handler(self, verdict: str) -> Callable:
        """The callback of a vote button: ``verdict`` (left | right | tie) on the two chosen panes' last answers."""

        def on_vote(li, ri, tr, h0, h1, h2, h3, request: gr.Request):
            # the panes' texts (h0..h3) are the browser's copy: the vote stores the turn the server generated
            li, ri = int(li) - 1, int(ri) - 1
            if li == ri:
                raise gr.Error("pick two different panes to compare")
            tr = dict(tr or {})
            try:
                path, what = self.session.vote_turn(_session_id(request), verdict, li, ri)
            except LorarlError as e:
                raise gr.Error(str(e)) from None
            tr["voted"] = what
            return f"saved vote ({what}) to `{path}`", tr

        return on_vote

    def rate_handler(self, pane: int, label: bool) -> Callable:
        """The callback of pane ``pane``'s 👍 (``label`` True) / 👎 button: its last answer rated alone."""

        def on_rate(request: gr.Request):
            try:
                path, what = self.session.rate_turn(_session_id(request), pane, label)
            except LorarlError as e:
                raise gr.Error(str(e)) from None
            return f"saved vote ({what}) to `{path}`"

        return on_rate


def wire(w: Widgets, h: Handlers) -> list:
    """Connect the components' events to the handlers (all private: not part of the client API). Returns the vote
    events (the workbench refreshes its votes line after each)."""
    p = w.panes
    private = {"api_visibility": "private"}
    settings = w.settings.inputs()
    ask = [w.msg, w.n_panes, *p.pickers, *p.bots, *settings]
    e_send = w.send.click(h.on_send, ask, w.outputs, **private)
    e_submit = w.msg.submit(h.on_send, ask, w.outputs, **private)
    seed = w.settings.seed  # Regenerate samples again with the next seed (shown in the box), then answers
    e_regen = w.regen.click(h.next_seed, seed, seed, **private).then(
        h.on_regen, [w.n_panes, *p.pickers, *p.bots, *settings], w.outputs, **private
    )
    w.stop.click(h.on_stop, None, w.status, cancels=[e_send, e_submit, e_regen], queue=False, **private)
    w.clear.click(h.on_clear, None, [*p.bots, *p.rewards, w.status, w.turn], **private)
    for picker, bot, reward in zip(p.pickers, p.bots, p.rewards):
        picker.change(h.on_pick, picker, [bot, reward, w.status], **private)
    w.n_panes.change(h.on_panes, w.n_panes, p.cols, **private)
    code_in = [w.settings.reward, w.n_panes, *p.pickers]
    w.settings.reward.change(h.on_reward, [*code_in, w.settings.columns], w.status, **private)
    w.allow_code.click(h.on_allow_code, code_in, w.status, **private)
    w.refresh.click(h.on_refresh, p.pickers, [*p.pickers, w.settings.reward, w.status], **private)
    votes = []
    for verdict in ("left", "right", "tie"):
        inputs = [w.votes["left_pane"], w.votes["right_pane"], w.turn, *p.bots]
        votes.append(w.votes[verdict].click(h.vote_handler(verdict), inputs, [w.status, w.turn], **private))
    for i, (up, down) in enumerate(zip(p.ups, p.downs)):
        votes.append(up.click(h.rate_handler(i, True), None, w.status, **private))
        votes.append(down.click(h.rate_handler(i, False), None, w.status, **private))
    return votes
