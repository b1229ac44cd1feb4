"""Supervised tool-use traces (the cold start before RL with tools), as the same ids a rollout produces.

A trace is a row in TRL's conversational format with tool calls: ``prompt`` (messages) and ``completion`` (the
assistant turns, with ``tool_calls``, and the ``tool`` messages between them), or ``messages`` (the prompt is
everything before the first assistant message)::

    {"prompt": [{"role": "user", "content": "What is 123 * 45?"}],
     "completion": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
                         {"name": "calculator", "arguments": {"expression": "123 * 45"}}}]},
                    {"role": "tool", "name": "calculator", "content": "5535"},
                    {"role": "assistant", "content": "123 * 45 = 5535"}]}

:func:`encode_trace` renders it exactly as the turn loop builds a trajectory: the prompt through the same renderer
(tools in the prompt, the system-prompt convention where the template has none), each assistant turn as the text the
template writes for it (calls in the model's format) tokenized on its own plus the end-of-turn id, and each run of
tool messages as :meth:`~lorarl.agents.render.ChatRenderer.tool_suffix_ids` -- the very ids a rollout appends. The
loss mask is True on the assistant turns only (tool tokens are context), as in RL.
"""

from __future__ import annotations

from typing import Any

from lorarl.agents.formats import ToolCall
from lorarl.agents.setup import Agent
from lorarl.errors import DataError


def conversation_messages(prompt: Any, system_prompt: str | None) -> list[dict]:
    """A row's prompt as messages: a string becomes one user message; ``system_prompt`` is prepended when the
    messages have no system message (what :func:`lorarl.data.prompt_text` does for single-turn prompts)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and (not messages or messages[0].get("role") != "system"):
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def _calls(message: dict, i: int) -> list[ToolCall]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"row {i}: a tool_calls entry needs a function name")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            import json

            args = json.loads(args)
        out.append(ToolCall(fn["name"], args))
    return out


def split_trace(row: Any, i: int) -> tuple[Any, list[dict]]:
    """``(prompt, completion messages)`` of a trace row (see the module docstring); DataError naming row ``i``."""
    if not isinstance(row, dict):
        raise DataError(f"row {i}: must be a mapping with prompt + completion, or messages")
    if "messages" in row:
        msgs = row["messages"]
        first = next((k for k, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"), None)
        if not first:
            raise DataError(f"row {i}: column 'messages' needs a prompt and then an assistant message")
        return msgs[:first], msgs[first:]
    completion = row.get("completion")
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, list) or not completion:
        raise DataError(f"row {i}: column 'completion' must be a list of messages (assistant and tool turns)")
    return row.get("prompt"), completion


def encode_trace(agent: Agent, tokenizer, row: Any, end_id: int, max_length: int, i: int):
    """``(prompt ids, completion ids, loss mask)`` of trace row ``i`` (see the module docstring)."""
    prompt, completion = split_trace(row, i)
    if prompt is None:
        raise DataError(f"row {i}: column 'prompt' is missing")
    renderer, fmt = agent.renderer, agent.fmt
    end_text = tokenizer.convert_ids_to_tokens(end_id)
    conv = conversation_messages(prompt, agent.system_prompt)
    prompt_ids = renderer.prompt_ids(conv)
    ids: list[int] = []
    mask: list[bool] = []
    k = 0
    while k < len(completion):
        msg = completion[k]
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "assistant":
            turn = fmt.assistant_message(msg.get("content") or "", _calls(msg, i))
            before = tokenizer.decode(renderer.render(conv, True), skip_special_tokens=False)
            after = tokenizer.decode(renderer.render(conv + [turn], False), skip_special_tokens=False)
            if not after.startswith(before) or end_text not in after[len(before) :]:
                raise DataError(f"row {i}: the chat template does not render assistant turn {k} after its prompt")
            text = after[len(before) :]
            text = text[: text.rindex(end_text)]
            turn_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end_id]
            ids += turn_ids
            mask += [True] * len(turn_ids)
            conv = conv + [turn]
            k += 1
        elif role == "tool":
            results = []
            while k < len(completion) and isinstance(completion[k], dict) and completion[k].get("role") == "tool":
                results.append((completion[k].get("name") or "tool", str(completion[k].get("content", ""))))
                k += 1
            suffix = renderer.tool_suffix_ids(results)
            ids += suffix
            mask += [False] * len(suffix)
            conv = conv + fmt.tool_messages(results)
        else:
            raise DataError(f"row {i}: completion message {k} must be an assistant or a tool message, got {role!r}")
    if not mask or not mask[-1]:
        raise DataError(f"row {i}: a trace must end with an assistant message")
    if len(prompt_ids) + len(ids) > max_length:
        raise DataError(f"row {i}: prompt + trace have {len(prompt_ids) + len(ids)} tokens, more than {max_length}")
    return prompt_ids, ids, mask


def load_tool_sft(recipe, tokenizer, eos_ids: list[int], end_id: int, max_length: int):
    """The SFT set of a recipe with an ``agent`` section: the shipped task's traces for ``data.source: arithmetic``
    (:func:`lorarl.tasks.tool_traces.make_tool_traces`, training problems only), else the rows of ``data.source`` in
    the trace format; each encoded by :func:`encode_trace` with its loss mask. Bad rows follow ``data.on_bad_row``."""
    from lorarl.agents.setup import build_agent
    from lorarl.data.prompts import encode_rows, read_rows
    from lorarl.data.sft import SFTSet

    cfg = recipe.data
    agent = build_agent(recipe.agent, tokenizer, eos_ids, recipe.source_path, system_prompt=cfg.system_prompt)
    if cfg.source == "arithmetic":
        from lorarl.tasks.arithmetic import task_options
        from lorarl.tasks.tool_traces import make_tool_traces

        rows = make_tool_traces(cfg.train_size, **task_options(cfg))
        where = f"arithmetic tool traces ({cfg.train_size} rows, seed {cfg.seed})"
    else:
        rows, where = read_rows(cfg, "train", recipe_path=recipe.source_path)

    def encode(row, i):
        return row, encode_trace(agent, tokenizer, row, end_id, max_length, i)

    good, encoded, skipped = encode_rows(rows, encode, where, cfg.on_bad_row, "SFT rows")
    return SFTSet(
        rows=good,
        prompt_ids=[p for p, _, _ in encoded],
        completion_ids=[c for _, c, _ in encoded],
        skipped=skipped,
        source=where,
        loss_masks=[m for _, _, m in encoded],
    )
