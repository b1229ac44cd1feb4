"""Tool-use traces for the shipped calculator task (3-digit x 2-digit multiplication): the cold-start SFT data.

Each trace answers a TRAINING problem of :func:`lorarl.tasks.arithmetic.make_problems` (held-out problems never
appear) in TRL's conversational format with tool calls: one ``calculator`` call with the expression, the tool's
answer (computed by the built-in calculator itself, so the trace shows exactly what the tool returns), and a final
answer that states the result::

    {"prompt": [{"role": "user", "content": "What is 123 * 45?"}],
     "completion": [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "123 * 45"}}}]},
        {"role": "tool", "name": "calculator", "content": "5535"},
        {"role": "assistant", "content": "123 * 45 = 5535"}],
     "answer": "5535", "a": 123, "op": "*", "b": 45}

:func:`lorarl.agents.traces.encode_trace` turns a trace into the ids a rollout with the same tools produces.
"""

from __future__ import annotations

from lorarl.agents.builtins import calculator
from lorarl.tasks.arithmetic import make_problems


def calculator_trace(a: int, op: str, b: int) -> list[dict]:
    """The completion messages of one trace: the call, the tool's result, the final answer."""
    expression = f"{a} {op} {b}"
    result = calculator(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"{expression} = {result}"},
    ]


def make_tool_traces(n: int, **problems) -> list[dict]:
    """``n`` trace rows on the training problems of :func:`make_problems` (``problems``: its ``seed``,
    ``operations``, ``digits``, ``digits_b``, ``template``)."""
    rows = make_problems("train", n, **problems)
    for row in rows:
        row["completion"] = calculator_trace(row["a"], row["op"], row["b"])
    return rows
