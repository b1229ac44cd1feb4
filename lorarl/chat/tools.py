"""Tool use in the chat panes: a pane whose run trained with an ``agent:`` section answers through the tool loop,
with the tools the run trained with, and shows its calls and results folded above the final answer.

The run's ``recipe.yaml`` (:meth:`~lorarl.chat.catalog.Catalog.run_recipe`) gives the ``agent`` section; it is
resolved with :func:`lorarl.agents.build_agent` (the same tools, format and template check as training; a missing
tool is one error naming it). Only the tools named there can run: :func:`lorarl.agents.tools.call_tool` refuses any
other name, and the ``python`` tool runs in lorarl's sandbox with its limits. An ``agent.environment`` is not
offered in chat: its tools need a dataset row to ``reset`` with, so such a pane says so instead of answering.

A turn, for every tool pane of one model at once (one batched ``generate`` per turn, after token ids):

1. the prompt is the conversation rendered by the agent's renderer (the tools in the system message or the
   template's ``tools=``, as in training; the run's ``data.system_prompt`` when the chat has no system prompt);
2. the model's turn is parsed by the agent's format (:meth:`~lorarl.agents.formats.ToolFormat.parse`); each call
   runs through ``call_tool`` (timeout, output cap, errors as ``{"error": ...}``), a malformed call is answered with
   an error; the results are appended as the template's tool-message ids
   (:meth:`~lorarl.agents.render.ChatRenderer.tool_suffix_ids`) -- the ids training appended;
3. a turn without a call is the answer. Budgets as in training: ``agent.max_turns`` turns,
   ``agent.max_tokens_per_turn`` per turn (default: the chat's max new tokens), ``agent.max_total_tokens`` after the
   prompt; a pane that runs out says so in its answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError
from lorarl.user_code import guarded


@dataclass
class ToolStep:
    """One call a pane's model made: the tool's ``name``, its ``arguments`` (None for a malformed call), the
    ``result`` text the model read back, and ``error`` (None when the call worked)."""

    name: str
    arguments: dict | None
    result: str
    error: str | None = None

    def message(self) -> dict:
        """A folded Chatbot message (gradio's ``metadata`` title: a collapsed block titled with the call)."""
        args = json.dumps(self.arguments, ensure_ascii=False) if self.arguments is not None else "(malformed)"
        title = f"🛠️ {self.name}({args})" if self.arguments is not None else "🛠️ malformed tool call"
        meta: dict[str, Any] = {"title": title, "status": "done"}
        if self.error:
            meta["log"] = "error"
        return {"role": "assistant", "content": f"```\n{self.result}\n```", "metadata": meta}


def tool_messages(steps: list[ToolStep], answer: str) -> list[dict]:
    """A tool pane's reply as Chatbot messages: one folded message per call, then the answer."""
    return [s.message() for s in steps] + [{"role": "assistant", "content": answer}]


class RunTools:
    """The resolved agent of each run that trained with tools, built once per (run, tokenizer)."""

    def __init__(self, catalog, shared):
        self.catalog, self.shared = catalog, shared
        self._agents: dict[tuple, Any] = {}

    def agent(self, entry, tok, eos_ids: list[int]):
        """The :class:`~lorarl.agents.Agent` ``entry``'s pane answers with (None: its run trained without tools);
        ``tok`` / ``eos_ids``: the tokenizer and end-of-turn ids of the model that answers the pane."""
        found = self.catalog.run_recipe(entry.run) if entry.kind != "base" else None
        if found is None:
            return None
        recipe, path = found
        code = self.catalog.tools_code(entry.run)
        self.catalog.consent.require(code, f"pane {entry.id}")  # a run's own tools run only once allowed
        key = (entry.run, id(tok), path.stat().st_mtime_ns, code.digest if code else "")
        if key not in self._agents:
            with guarded(self.catalog.consent.check_load):  # (each load checked again: lorarl.chat.consent)
                self._agents[key] = self._build(recipe, path, tok, eos_ids, entry.run)
        return self._agents[key]

    def _build(self, recipe: dict, path: Path, tok, eos_ids: list[int], run: str):
        from lorarl.agents import build_agent
        from lorarl.config.agent import AgentConfig

        section = dict(recipe["agent"])
        try:
            cfg = AgentConfig(**section)
        except TypeError as e:
            raise LorarlError(f"{run}: the agent section of {path} is not understood ({e})") from None
        cfg.validate(str(path))
        if cfg.environment:
            raise LorarlError(
                f"{run}: trained with agent.environment {cfg.environment!r}, whose tools need a dataset row to reset "
                "with; the chat offers tools only (agent.tools)"
            )
        data = recipe.get("data") if isinstance(recipe.get("data"), dict) else {}
        agent = build_agent(cfg, tok, list(eos_ids), path, system_prompt=data.get("system_prompt"))
        return agent


@dataclass
class _Pane:
    """One tool pane's state during the loop."""

    row: int  # the pane's index in the request
    agent: Any
    context: list[int]  # the prompt ids and everything after them
    total: int = 0  # tokens after the prompt (model + tool)
    done: bool = False


def _malformed(why: str) -> str:
    return json.dumps({"error": f"malformed tool call: {why[:300]}"}, ensure_ascii=False)


def _end_turn(pane: _Pane, answer, sampled: list[int], eos: set[int], tok) -> None:
    """After a turn: the pane's answer, or its calls run and their results appended as the template's ids."""
    from lorarl.agents.tools import call_tool

    cfg = pane.agent.cfg
    cut = next((k for k, t in enumerate(sampled) if t in eos), None)
    own = sampled if cut is None else sampled[:cut]
    answer.turns += 1
    answer.token_ids = own
    answer.text = tok.decode(own, skip_special_tokens=True)
    pane.total += len(own) + (cut is not None)
    if cut is None:  # cut by the token budget (or Stop): no complete turn to act on
        answer.finished, pane.done = False, True
        return
    parsed = pane.agent.fmt.parse(tok.decode(own, skip_special_tokens=False))
    if not parsed.calls and not parsed.malformed:
        answer.finished, pane.done = True, True
        return
    if answer.turns >= cfg.max_turns:
        answer.text += f"\n\n(no answer: the model still called tools after agent.max_turns = {cfg.max_turns} turns)"
        answer.finished, pane.done = False, True
        return
    tools = {t.name: t for t in pane.agent.resolved.tools}
    results = []
    for call in parsed.calls:
        res = call_tool(tools, call.name, call.arguments, cfg.tool_timeout_s, cfg.max_tool_output_chars)
        answer.steps.append(ToolStep(call.name, call.arguments, res.text, res.error))
        results.append((res.name, res.text))
    for why in parsed.malformed:
        answer.steps.append(ToolStep("error", None, _malformed(why), why))
        results.append(("error", _malformed(why)))
    suffix = pane.agent.renderer.tool_suffix_ids(results)
    pane.context = pane.context + sampled[: cut + 1] + suffix
    pane.total += len(suffix)
    if pane.total >= cfg.max_total_tokens:
        answer.text = f"(no answer: agent.max_total_tokens = {cfg.max_total_tokens} reached)"
        answer.finished, pane.done = False, True
    else:
        answer.text = ""  # the next turn is written from scratch


def answer_with_tools(engine, model, tok, adapter_names, rows: list[int], agents: list, request) -> None:
    """Answer panes ``rows`` (all on ``model``; ``agents[k]`` is row ``k``'s agent) through the tool loop, one
    batched ``generate`` per turn for the panes still going (see the module docstring)."""
    from lorarl.model.shared import SharedBase
    from lorarl.model.tokens import eos_token_ids

    eos = set(eos_token_ids(model.module if isinstance(model, SharedBase) else model, tok))
    panes = []
    for row, agent in zip(rows, agents):
        messages = [dict(m) for m in request.conversations[row]]
        if agent.system_prompt and messages and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": agent.system_prompt}] + messages
        panes.append(_Pane(row, agent, agent.renderer.prompt_ids(messages)))
    first = True
    while not request.stop.is_set():
        live = [k for k, p in enumerate(panes) if not p.done]
        if not live:
            break
        per_turn = {k: panes[k].agent.cfg.max_tokens_per_turn or request.generation.max_new_tokens for k in live}
        room = {k: panes[k].agent.cfg.max_total_tokens - panes[k].total for k in live}
        budget = max(1, max(min(per_turn[k], room[k]) for k in live))

        def on_text(r: int, text: str, live=live) -> None:
            answer = request.answers[panes[live[r]].row]
            answer.text = text
            if request.on_update is not None:
                request.on_update(answer.pane, text)

        names = [adapter_names[k] for k in live] if adapter_names is not None else None
        prompts = [panes[k].context for k in live]
        out = engine.generate_ids(model, tok, names, prompts, request, budget, on_text, seed=first)
        first = False
        for j, k in enumerate(live):
            pane, answer = panes[k], request.answers[panes[k].row]
            limit = min(per_turn[k], room[k])
            before = len(answer.steps)
            _end_turn(pane, answer, out[j][:limit], eos, tok)
            if request.on_steps is not None and len(answer.steps) != before:
                request.on_steps(answer.pane, list(answer.steps))
            if request.on_update is not None:
                request.on_update(answer.pane, answer.text)
    for p in panes:  # stopped between turns: what was written stays, unfinished
        if not p.done:
            request.answers[p.row].finished = False
