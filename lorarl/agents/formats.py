"""Tool-call formats: how a model writes a call, how its tools reach the prompt, how results come back.

Three formats, registered in :data:`FORMATS` by name (``agent.format``; ``auto`` picks from the chat template,
:func:`detect_format`):

* ``hermes`` -- Qwen2.5 / Qwen3 / Hermes templates: the template renders the tools (``tools=`` schemas) in the
  system prompt; the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several allowed in
  one turn); each result goes back as a ``{"role": "tool", "name", "content"}`` message, which the template wraps.
* ``llama3_json`` -- Llama 3.1 / 3.2 templates: tools rendered by the template; the model's whole message is a JSON
  call ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``; several calls separated by
  ``;`` or new lines); results go back as ``tool`` messages (the template writes them as ``ipython``).
* ``system_prompt`` -- for templates with no tool support (the embedded SmolLM2): lorarl writes the tools into
  the system message (:func:`system_prompt_text`, the exact text is in ``docs/agents.md``); calls are parsed as in
  ``hermes``; each result goes back in a user message ``<tool_response>\\n{result}\\n</tool_response>``.

A call whose JSON does not parse or lacks a string ``name`` / an object of arguments is *malformed*: it is counted
and answered with an error message, like a failed tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lorarl.core.messages import MAX_JSON_DEPTH, decode_json, json_depth
from lorarl.errors import LorarlError


@dataclass
class ToolCall:
    """One parsed call: the tool's ``name`` and its ``arguments`` (a dict)."""

    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    """A model turn read by a format: the ``calls`` it made, the ``malformed`` call texts (each with why), and
    its ``content`` (the text outside the calls)."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    content: str = ""


def _as_call(obj: Any, args_key: str) -> ToolCall | str:
    """A decoded JSON object -> a ToolCall, or why it is not one."""
    if not isinstance(obj, dict):
        return "a call must be a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a call needs a string 'name'"
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
        try:
            text = args.strip()
            args, stop = decode_json(text)
            if stop != len(text):
                raise ValueError("extra data")
        except ValueError:
            return f"the {args_key} of {name!r} are not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the {args_key} of {name!r} must be a JSON object"
    return ToolCall(name, args)


OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
MAX_CALLS_PER_TURN = 32  # tagged blocks read from one turn; the rest of the turn is one malformed call
__all__ = ["MAX_JSON_DEPTH", "decode_json", "json_depth"]  # lorarl.core.messages' bounded JSON, as before


def parse_tagged(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks (hermes, system_prompt). An opening tag without its closing tag is
    malformed too. Example: ``'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'`` -> one call
    ``f(x=1)``, content ``"a"``. Linear in the text: each tag is found once, from where the last block ended (the
    first ``</tool_call>`` after an opening tag closes it); past :data:`MAX_CALLS_PER_TURN` blocks the rest of the turn
    is one malformed call."""
    out = ParsedTurn()
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        if len(out.calls) + len(out.malformed) >= MAX_CALLS_PER_TURN:
            out.malformed.append(f"more than {MAX_CALLS_PER_TURN} calls in one turn: " + text[start : start + 200])
            break
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end < 0:
            out.malformed.append(f"{OPEN_TAG} without {CLOSE_TAG}: " + text[start : start + 200])
            break
        body = text[start + len(OPEN_TAG) : end].strip()
        try:
            obj, stop = decode_json(body)
            extra = body[stop:].strip()
            call = _as_call(obj, "arguments") if not extra else f"not JSON (Extra data: {extra[:20]!r})"
        except ValueError as e:
            call = f"not JSON ({e})"
        if isinstance(call, ToolCall):
            out.calls.append(call)
        else:
            out.malformed.append(f"{call}: {body[:200]}")
        pos = end + len(CLOSE_TAG)
    out.content = "".join(content).strip()
    return out


def parse_llama_json(text: str) -> ParsedTurn:
    """Llama 3.1 JSON calls: the message (after an optional ``<|python_tag|>``) is one or more JSON objects
    ``{"name": ..., "parameters": {...}}`` separated by ``;`` or white space. A message that does not start with
    ``{`` is a plain answer (no call); one that starts with ``{`` but does not decode is malformed."""
    out = ParsedTurn()
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        out.content = text.strip()
        return out
    i = 0
    while i < len(body):
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i >= len(body):
            break
        if len(out.calls) + len(out.malformed) >= MAX_CALLS_PER_TURN:
            out.malformed.append(f"more than {MAX_CALLS_PER_TURN} calls in one turn: {body[i : i + 200]}")
            break
        try:
            obj, end = decode_json(body, i)
        except ValueError as e:
            out.malformed.append(f"not JSON ({e}): {body[i : i + 200]}")
            break
        call = _as_call(obj, "parameters")
        if isinstance(call, ToolCall):
            out.calls.append(call)
        else:
            out.malformed.append(f"{call}: {body[i:end][:200]}")
        i = end
    return out


def system_prompt_text(schemas: list[dict]) -> str:
    """The system-prompt convention for templates without tool support (documented in ``docs/agents.md``)."""
    lines = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in schemas)
    return (
        "You can use tools. The tools, as JSON schemas:\n"
        f"{lines}\n"
        "To call a tool, write\n"
        '<tool_call>{"name": "TOOL_NAME", "arguments": {ARGUMENTS_AS_JSON}}</tool_call>\n'
        "and end your message. The result comes back in the next message as "
        "<tool_response>RESULT</tool_response>. When you know the answer, reply without a tool call."
    )


class ToolFormat:
    """A format (see the module docstring): ``parse`` a model turn, shape the prompt and the tool messages."""

    name: ClassVar[str]
    template_tools: ClassVar[bool] = True  # the chat template renders the tools (tools= schemas)

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError

    def prompt_messages(self, messages: list[dict], schemas: list[dict]) -> list[dict]:
        """The messages the prompt is rendered from (the template adds the tools itself)."""
        return list(messages)

    def assistant_message(self, content: str, calls: list[ToolCall]) -> dict:
        """An assistant turn with ``calls`` in TRL's conversational format (``tool_calls``), for SFT traces."""
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return msg

    def tool_messages(self, results: list[tuple[str, str]]) -> list[dict]:
        """``[(tool name, text)]`` -> the messages that carry them (TRL's ``tool`` messages)."""
        return [{"role": "tool", "name": n, "content": t} for n, t in results]


class HermesFormat(ToolFormat):
    name = "hermes"

    def parse(self, text: str) -> ParsedTurn:
        return parse_tagged(text)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedTurn:
        return parse_llama_json(text)


class SystemPromptFormat(ToolFormat):
    name = "system_prompt"
    template_tools = False

    def parse(self, text: str) -> ParsedTurn:
        return parse_tagged(text)

    def prompt_messages(self, messages: list[dict], schemas: list[dict]) -> list[dict]:
        text = system_prompt_text(schemas)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + list(messages[1:])
        return [{"role": "system", "content": text}] + list(messages)

    def assistant_message(self, content: str, calls: list[ToolCall]) -> dict:
        blocks = [
            "<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + "</tool_call>"
            for c in calls
        ]
        return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}

    def tool_messages(self, results: list[tuple[str, str]]) -> list[dict]:
        body = "\n".join(f"<tool_response>\n{t}\n</tool_response>" for _, t in results)
        return [{"role": "user", "content": body}]


FORMATS: dict[str, type[ToolFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "system_prompt": SystemPromptFormat,
}


def detect_format(chat_template: str | None) -> str:
    """The format a chat template speaks: ``hermes`` when it writes ``<tool_call>``, ``llama3_json`` when it has
    Llama 3.1's ``ipython`` role / ``<|python_tag|>``, else ``system_prompt`` (no tool support)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3_json"
    return "system_prompt"


def make_format(name: str, chat_template: str | None) -> ToolFormat:
    """The format ``name`` (``auto``: :func:`detect_format`)."""
    if name == "auto":
        name = detect_format(chat_template)
    if name not in FORMATS:
        raise LorarlError(f"agent.format: unknown format {name!r} (one of auto, {', '.join(FORMATS)})")
    return FORMATS[name]()
