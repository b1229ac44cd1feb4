"""How an exported model calls tools: the model card's "Tool use" section and, where Ollama can carry it, the
Modelfile's tool template.

A run whose recipe has an ``agent:`` section trained the model to call tools in one format
(:mod:`lorarl.agents.formats`): ``hermes`` / ``llama3_json`` (the chat template renders the tools) or the
``system_prompt`` convention (lorarl writes the tools' JSON schemas into the system message). :func:`tool_use` resolves
what the run trained with -- the format (``auto`` read from the exported tokenizer's template), the tools' JSON schemas
(``get_json_schema``, as in training) and, for the system-prompt convention, the exact system message -- with
lorarl.agents' own functions, so the card says what the model saw, not a copy of it.

Ollama: for the system-prompt convention on a ChatML template (SmolLM2, Qwen2), :func:`system_prompt_go_template`
writes a TEMPLATE whose tool calls (``.ToolCalls``: ``.Function.Name``, ``.Function.Arguments``) and ``tool``
messages render as the model was trained: calls as ``<tool_call>{...}</tool_call>``, consecutive results as one user
message of ``<tool_response>`` blocks; the SYSTEM is the exact system message with the tools (``.Tools`` sent by a
client are not rendered: the model knows only the tools it trained with, in the system message). The pieces are
checked by :func:`render_tool_conversation` (the same text, in Python) against the tokenizer's own rendering of a
tool conversation in lorarl's format. Hermes / Llama 3.1 templates render the client's ``.Tools`` with the
template's own text, which a hand-written Go template cannot be checked to reproduce here: no TEMPLATE is written and
Ollama uses the GGUF's chat template (it maps the templates it knows, Qwen2.5's and Llama 3.1's with their tool
support, to its own); the card says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lorarl.errors import LorarlError

CHATML_TOOL_NOTE = (
    "Ollama renders an earlier call's arguments as compact JSON (Go's encoding, keys sorted); the model wrote them "
    'with a space after ":" and ",". Only re-rendered history differs, and by white space only.'
)


@dataclass
class ToolUse:
    """What a run trained its model to call: the format, the ``agent.tools`` entries, the tools' JSON schemas, the
    exact system message (system-prompt convention only) and why something could not be resolved."""

    format: str
    tools: list[str]
    schemas: list[dict]
    system_message: str | None = None
    environment: str | None = None
    max_turns: int = 1
    notes: list[str] = field(default_factory=list)


def tool_use(src, tok: Any) -> ToolUse | None:
    """The run's tool use (None: its recipe has no ``agent`` section). ``tok`` is the exported tokenizer (its chat
    template decides ``agent.format: auto``). A tool that cannot be imported here still gets a section, with a note."""
    from lorarl.agents.formats import make_format
    from lorarl.agents.setup import resolve_agent

    recipe = src.recipe
    if recipe is None or recipe.agent is None:
        return None
    cfg = recipe.agent
    fmt = make_format(cfg.format, getattr(tok, "chat_template", None))
    use = ToolUse(fmt.name, list(cfg.tools), [], environment=cfg.environment, max_turns=cfg.max_turns)
    try:
        resolved = resolve_agent(cfg, src.recipe_path)
    except LorarlError as e:
        use.notes.append(f"the tools could not be imported here to write their schemas ({e})")
        return use
    use.schemas = [t.schema for t in resolved.tools] + resolved.env_schemas
    if fmt.name == "system_prompt":
        head = [{"role": "system", "content": recipe.data.system_prompt}] if recipe.data.system_prompt else []
        use.system_message = fmt.prompt_messages(head + [{"role": "user", "content": "x"}], use.schemas)[0]["content"]
    return use


# ---- the system-prompt convention on ChatML, in Ollama's Go template and in Python ----------------------------------

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def _call_text(name: str, arguments: str) -> str:
    return '<tool_call>{"name": "' + name + '", "arguments": ' + arguments + "}</tool_call>"


def render_tool_conversation(messages: list[dict], add_generation_prompt: bool) -> str:
    """The text :func:`system_prompt_go_template` renders, in Python, for Ollama-style ``messages`` (``system`` /
    ``user`` / ``assistant`` with optional ``tool_calls`` ``[{"function": {"name", "arguments"}}]`` / ``tool``);
    arguments are written with ``json.dumps`` (the model's own spacing). A last assistant message is left open."""
    out = []
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        prev = messages[i - 1]["role"] if i else ""
        nxt = messages[i + 1]["role"] if not last else ""
        role, content = m["role"], m.get("content") or ""
        if role in ("system", "user"):
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            calls = [
                _call_text(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                for c in m.get("tool_calls") or []
            ]
            body = "\n".join(([content] if content else []) + calls)
            out.append(f"{IM_START}assistant\n{body}" + ("" if last else f"{IM_END}\n"))
        elif role == "tool":
            out.append(
                (f"{IM_START}user\n" if prev != "tool" else "\n") + f"<tool_response>\n{content}\n</tool_response>"
            )
            out.append(f"{IM_END}\n" if nxt != "tool" else "")
        if last and role != "assistant" and add_generation_prompt:
            out.append(f"{IM_START}assistant\n")
    return "".join(out)


def system_prompt_go_template() -> str:
    """Ollama's TEMPLATE (Go text/template over ``.Messages``) for the system-prompt convention on ChatML: the same
    text as :func:`render_tool_conversation` (``.ToolCalls`` as ``<tool_call>`` blocks; a run of ``tool`` messages as
    one user message of ``<tool_response>`` blocks). No ``{{-`` trim markers: every newline is the format's own.
    It names ``.Tools`` and renders nothing for it: Ollama offers tool calling (and parses the model's calls into
    ``tool_calls``) only for templates that use ``.Tools``; the tools reach the model through SYSTEM."""
    call = '<tool_call>{"name": "{{ $c.Function.Name }}", "arguments": {{ json $c.Function.Arguments }}}</tool_call>'
    return (
        '{{ if .Tools }}{{ end }}{{ $prev := "" }}'
        "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        '{{ $next := "" }}{{ if not $last }}{{ $next = (index (slice $.Messages $i) 1).Role }}{{ end }}'
        '{{ if or (eq .Role "system") (eq .Role "user") }}' + IM_START + "{{ .Role }}\n{{ .Content }}" + IM_END + "\n"
        '{{ else if eq .Role "assistant" }}' + IM_START + "assistant\n{{ .Content }}"
        "{{ if .ToolCalls }}{{ if .Content }}\n{{ end }}"
        "{{ range $j, $c := .ToolCalls }}{{ if $j }}\n{{ end }}" + call + "{{ end }}{{ end }}"
        "{{ if not $last }}" + IM_END + "\n{{ end }}"
        '{{ else if eq .Role "tool" }}{{ if ne $prev "tool" }}' + IM_START + "user\n{{ else }}\n{{ end }}"
        "<tool_response>\n{{ .Content }}\n</tool_response>"
        '{{ if ne $next "tool" }}' + IM_END + "\n{{ end }}{{ end }}"
        '{{ if and $last (ne .Role "assistant") }}' + IM_START + "assistant\n{{ end }}"
        "{{ $prev = .Role }}{{ end }}"
    )


def check_tool_template(use: ToolUse, tok: Any) -> bool:
    """True when :func:`render_tool_conversation` reproduces the tokenizer's rendering of a two-call tool
    conversation in lorarl's format (the system message with the tools, calls, two results in one turn, an answer)."""
    from lorarl.agents.formats import ToolCall, make_format

    if use.format != "system_prompt" or use.system_message is None or not use.schemas:
        return False
    fmt = make_format("system_prompt", getattr(tok, "chat_template", None))
    name = use.schemas[0]["function"]["name"]
    calls = [ToolCall(name, {"expression": "12 * 34"}), ToolCall(name, {"expression": "1 + 1"})]
    results = [(name, "408"), (name, "2")]
    thanks = {"role": "user", "content": "Thanks."}
    lorarl_msgs = [
        {"role": "system", "content": use.system_message},
        {"role": "user", "content": "What is 12 * 34?"},
        fmt.assistant_message("", calls),
        *fmt.tool_messages(results),
        {"role": "assistant", "content": "408"},
        thanks,
    ]
    ollama_msgs = [
        *lorarl_msgs[:2],
        {"role": "assistant", "content": "", "tool_calls": [{"function": vars(c)} for c in calls]},
        *[{"role": "tool", "content": text} for _, text in results],
        *lorarl_msgs[-2:],
    ]
    try:  # the prompt after the results, and the whole conversation then a new user turn
        pairs = ((lorarl_msgs[:4], ollama_msgs[:5]), (lorarl_msgs, ollama_msgs))
        return all(
            render_tool_conversation(ours, True)
            == tok.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
            for theirs, ours in pairs
        )
    except Exception:  # a template that refuses the probe is not this format
        return False


def ollama_tool_template(use: ToolUse, chat_format: str | None, tok: Any) -> tuple[str | None, str]:
    """``(Go TEMPLATE or None, why)`` for the Modelfile of a run that trained with tools: written for the
    system-prompt convention on a ChatML template when :func:`check_tool_template` passes; else None and why not."""
    if use.format != "system_prompt":
        return None, (
            f"the model calls tools in the {use.format} format of its own chat template, which renders the tools "
            "itself; no TEMPLATE is written and Ollama uses the GGUF's chat template (it maps the templates it knows, "
            "Qwen2.5's and Llama 3.1's, to its own, tool calls included): check `ollama show --template NAME`"
        )
    if chat_format != "chatml":
        return None, "the system-prompt convention's tool template is written for ChatML templates only"
    if not check_tool_template(use, tok):
        return None, "the tool template did not reproduce the tokenizer's rendering of a tool conversation"
    return system_prompt_go_template(), "the system-prompt convention on ChatML, checked against the tokenizer"


def card_lines(use: ToolUse, modelfile: dict | None = None) -> list[str]:
    """The model card's "Tool use" section: the format, how a call and its result are written, the exact system
    message and the tools' JSON schemas (system-prompt convention), and what the Modelfile carries (GGUF exports)."""
    names = ", ".join(f"`{t}`" for t in use.tools) or "(none)"
    lines = [
        "",
        "## Tool use",
        "",
        f"The run trained the model to call tools (recipe `agent:` section): tools {names}"
        + (f", environment `{use.environment}`" if use.environment else "")
        + f", up to {use.max_turns} model turns, tool-call format `{use.format}` (lorarl's `docs/agents.md`).",
        "",
    ]
    if use.format == "llama3_json":
        lines += [
            'The model\'s whole message is a JSON call `{"name": ..., "parameters": {...}}` (optionally after '
            "`<|python_tag|>`; several separated by `;`). Pass the tools with `apply_chat_template(messages, "
            'tools=SCHEMAS)` and send each result back as a `{"role": "tool", "content": ...}` message.',
        ]
    else:
        lines += [
            'The model writes each call as `<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>` and ends '
            "its turn; a turn without a call is the answer.",
        ]
    if use.format == "hermes":
        lines += [
            "",
            "The chat template renders the tools: pass them with `apply_chat_template(messages, tools=SCHEMAS)` and "
            'send each result back as a `{"role": "tool", "name": TOOL, "content": RESULT}` message.',
        ]
    if use.format == "system_prompt":
        lines += [
            "",
            "The chat template has no tool support, so the tools are in the system message (lorarl's system-prompt "
            "convention). Use exactly this system message:",
            "",
            "```text",
            use.system_message or "(not available: the tools could not be imported)",
            "```",
            "",
            "Send the results back as ONE user message, one block per call, joined by new lines: "
            "`<tool_response>\\nRESULT\\n</tool_response>`.",
        ]
    if use.schemas:
        lines += ["", "The tools' JSON schemas (`transformers.utils.get_json_schema`, what the model saw):", ""]
        lines += ["```json", json.dumps(use.schemas, indent=2, ensure_ascii=False), "```"]
    if modelfile is not None:
        tools = modelfile.get("tools") or {}
        if tools.get("template"):
            lines += [
                "",
                "Ollama: the Modelfile's TEMPLATE renders tool calls (`.ToolCalls`) and `tool` messages as above, and "
                "its SYSTEM is the system message with the tools (a client's own `tools` are not rendered: the "
                "model knows the tools it trained with). Pass the same tools in a request (`tools=[...]`, the "
                "schemas above) so that Ollama parses the model's `<tool_call>` blocks into `tool_calls`: it does so "
                "only for requests with tools, and only for templates that name `.Tools` (this one does, rendering "
                "nothing for it). A system message of your own replaces SYSTEM and with it the tools. "
                + CHATML_TOOL_NOTE,
            ]
        else:
            lines += ["", f"Ollama: no tool template in the Modelfile: {tools.get('why', 'not a GGUF export')}."]
    lines += [f"- {n}" for n in use.notes]
    return lines
