"""Tools by name, their JSON schemas, and calling them so that nothing a tool or a model does can stop a rollout.

A tool is a Python function named in ``agent.tools`` as a built-in (:data:`~lorarl.agents.builtins.BUILTIN_TOOLS`),
``package.module:function`` or ``path/to/file.py:function``. Its JSON schema is transformers' ``get_json_schema``
of the function (type hints and a Google-style docstring: what chat templates render in the prompt), so a function
written for TRL's ``tools=`` works unchanged.

:func:`call_tool` checks the model's arguments against the schema (unknown or missing parameters, JSON types),
runs the function under a wall-clock limit and turns its result into text (strings as they are, anything
JSON-serialisable as JSON); every failure -- a raise, a timeout, a non-text result, bad arguments -- comes back as a
:class:`ToolResult` with ``error`` set, whose text the model reads as the tool's answer.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.agents.builtins import BUILTIN_TOOLS
from lorarl.errors import LorarlError
from lorarl.user_code import load_object


@dataclass
class Tool:
    """A callable tool: ``name`` as the model calls it, the function, and its JSON schema
    (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict


@dataclass
class ToolResult:
    """What one call returned: ``text`` (the tool message's content) and ``error`` (None when it worked)."""

    name: str
    text: str
    error: str | None = None


def tool_schema(fn: Callable, what: str) -> dict:
    """transformers' ``get_json_schema(fn)``; a function it cannot describe (no docstring, an argument without a
    type hint or without a line in ``Args:``) is one :class:`LorarlError` naming ``what``."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException / TypeHintParsingException
        raise LorarlError(f"{what}: cannot build its JSON schema ({e})") from None


def load_tool(spec: str, recipe_path: str | Path | None = None) -> Tool:
    """One ``agent.tools`` entry -> a :class:`Tool`."""
    if spec in BUILTIN_TOOLS:
        fn = BUILTIN_TOOLS[spec]
    elif ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTIN_TOOLS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise LorarlError(
            f"agent.tools: unknown tool {spec!r}{hint}: use a built-in ({', '.join(BUILTIN_TOOLS)}), "
            "module:function or path/to/file.py:function"
        )
    else:
        fn = load_object(spec, "agent.tools: tool", recipe_path)
        if not callable(fn):
            raise LorarlError(f"agent.tools: tool {spec!r} is not callable")
    schema = tool_schema(fn, f"agent.tools: tool {spec!r}")
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: list[str], recipe_path: str | Path | None = None) -> list[Tool]:
    """Every ``agent.tools`` entry as a :class:`Tool`; two tools with one name are refused."""
    tools = [load_tool(s, recipe_path) for s in specs]
    names = [t.name for t in tools]
    for n in names:
        if names.count(n) > 1:
            raise LorarlError(f"agent.tools: two tools are named {n!r}")
    return tools


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, spec: dict) -> bool:
    types = spec.get("type")
    if types is None:
        return True  # "any" (no hint transformers could map) accepts everything
    types = types if isinstance(types, list) else [types]
    for t in types:
        allowed = _JSON_TYPES.get(t)
        if allowed is None:
            return True
        if isinstance(value, bool) and t in ("integer", "number"):
            continue  # JSON true is not a number
        if isinstance(value, allowed):
            return True
    return False


def argument_error(schema: dict, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's JSON schema (None when they do): not an object, an unknown
    parameter, a missing required one, a value of the wrong JSON type, a value outside its ``enum``."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    for k in arguments:
        if k not in props:
            return f"unknown parameter {k!r} (parameters: {', '.join(props) or 'none'})"
    for k in params.get("required", []):
        if k not in arguments:
            return f"missing required parameter {k!r}"
    for k, v in arguments.items():
        spec = props[k]
        if not _type_ok(v, spec):
            return f"parameter {k!r} must be {spec.get('type')}, got {type(v).__name__}"
        if "enum" in spec and v not in spec["enum"]:
            return f"parameter {k!r} must be one of {spec['enum']}"
    return None


def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the text of its tool message: a string as it is, anything JSON-serialisable as
    JSON; cut to ``max_chars`` (saying so). Raises TypeError for anything else (an object, bytes, a function)."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(value).__name__}, which is neither text nor JSON") from None
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [cut: {len(text)} characters in all]"
    return text


def call_tool(tools: dict[str, Tool], name: str, arguments: Any, timeout_s: float, max_chars: int = 2000) -> ToolResult:
    """Call tool ``name`` with ``arguments`` (a dict from the model's JSON). Never raises: an unknown tool, bad
    arguments, an exception, a run past ``timeout_s`` seconds or a result that is not text or JSON is a
    :class:`ToolResult` whose ``text`` is ``{"error": "..."}`` (TRL's shape) and whose ``error`` says what."""

    def fail(msg: str) -> ToolResult:
        return ToolResult(name, json.dumps({"error": msg}), msg)

    tool = tools.get(name)
    if tool is None:
        return fail(f"unknown tool {name!r} (tools: {', '.join(tools) or 'none'})")
    why = argument_error(tool.schema, arguments)
    if why is not None:
        return fail(f"{name}: {why}")
    try:
        if inspect.iscoroutinefunction(tool.fn):  # an async tool (TRL runs them too): awaited under the time limit
            value = run_coroutine(tool.fn(**arguments), timeout_s)
        else:
            value = call_stoppable(lambda: resolve_awaitable(tool.fn(**arguments)), timeout_s)
        return ToolResult(name, result_text(value, max_chars))
    except Exception as e:  # the tool's problem is told to the model, never raised (RewardTimeout included)
        msg = str(e) or type(e).__name__
        if type(e).__name__ in ("RewardTimeout", "TimeoutError"):
            msg = f"timed out after {timeout_s:g} s"
        return fail(f"{name}: {msg}")


class ToolStopped(BaseException):
    """Raised inside a tool's helper thread once its call is past its time limit (a BaseException, so a tool's
    ``except Exception`` does not swallow it)."""


def call_stoppable(fn: Callable[[], Any], timeout_s: float | None) -> Any:
    """``fn()`` under a ``timeout_s`` wall-clock limit on any thread (None or <= 0: no limit); past it raises
    ``TimeoutError``. On the main thread a SIGALRM interrupts the call (:func:`lorarl.rewards.scorer.call_with_timeout`).
    On any other thread (the chat, ``agent.tool_workers`` > 1) ``fn`` runs in a helper thread; at the limit the caller
    gets ``TimeoutError`` and the helper is stopped: :class:`ToolStopped` is raised inside it (CPython's
    ``PyThreadState_SetAsyncExc``), which ends Python code at its next bytecode, so no thread is left running a
    timed-out tool. One C call that holds the interpreter lock (a huge integer power) cannot be interrupted by any
    thread: the built-in tools bound their work instead (:data:`lorarl.agents.builtins.MAX_BITS`)."""
    from lorarl.rewards.scorer import call_with_timeout

    if not timeout_s or timeout_s <= 0 or threading.current_thread() is threading.main_thread():
        return call_with_timeout(fn, timeout_s)
    done: Future = Future()

    def target() -> None:
        try:
            done.set_result(fn())
        except ToolStopped:  # the caller has gone on with its time-out
            pass
        except BaseException as e:  # handed to the caller by done.result()
            done.set_exception(e)

    helper = threading.Thread(target=target, daemon=True, name="lorarl-tool-call")
    helper.start()
    try:
        return done.result(timeout=timeout_s)
    except FutureTimeout:
        stop_thread(helper)
        raise TimeoutError(f"timed out after {timeout_s:g} s") from None


def stop_thread(thread: threading.Thread) -> None:
    """Raise :class:`ToolStopped` inside ``thread`` at its next Python bytecode (a no-op once it has ended)."""
    import ctypes

    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolStopped))


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def tools_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every async tool, async environment method and async ``get_reward`` runs on, in a daemon
    thread started once per process (as TRL runs its async tools): objects an environment's async ``reset`` binds to
    the loop (an HTTP client session, a lock, a subprocess) still work in its later tool calls."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lorarl-tools-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run_coroutine(coro: Any, timeout_s: float | None = None) -> Any:
    """Run ``coro`` on :func:`tools_loop` and return its value; past ``timeout_s`` seconds it is cancelled and
    ``TimeoutError`` raised."""
    future = asyncio.run_coroutine_threadsafe(coro, tools_loop())
    try:
        return future.result(timeout=timeout_s if timeout_s and timeout_s > 0 else None)
    except FutureTimeout:
        future.cancel()
        raise TimeoutError(f"timed out after {timeout_s:g} s") from None


def resolve_awaitable(value: Any) -> Any:
    """``value``, or what it resolves to when a synchronous function returned an awaitable."""
    if inspect.isawaitable(value):

        async def wait() -> Any:
            return await value

        return run_coroutine(wait())
    return value


@dataclass
class PendingCall:
    """One call of a turn: the row's tools, the name the model called and its arguments."""

    tools: dict[str, Tool]
    name: str
    arguments: Any


def call_tools(
    rows: list[list[PendingCall]], timeout_s: float, max_chars: int = 2000, workers: int = 1
) -> list[list[ToolResult]]:
    """Every call of one turn: ``rows[r]`` is row ``r``'s calls in the order the model made them. Rows run
    concurrently on up to ``workers`` threads (tools that wait on a process, a sandbox or the network overlap); the
    calls of one row run one after the other, in order (an environment's calls may depend on each other). With
    ``workers`` 1 (the default) every call runs in this thread, where a time limit interrupts Python code (SIGALRM);
    in worker threads a call past its limit is stopped by :func:`call_stoppable`, and tools must be thread-safe. Results come
    back in the same layout; :func:`call_tool` never raises."""

    def run_row(calls: list[PendingCall]) -> list[ToolResult]:
        return [call_tool(c.tools, c.name, c.arguments, timeout_s, max_chars) for c in calls]

    busy = [r for r, calls in enumerate(rows) if calls]
    out: list[list[ToolResult]] = [[] for _ in rows]
    if workers <= 1 or len(busy) <= 1:
        for r in busy:
            out[r] = run_row(rows[r])
        return out
    with ThreadPoolExecutor(max_workers=min(workers, len(busy)), thread_name_prefix="lorarl-tool") as pool:
        for r, results in zip(busy, pool.map(run_row, [rows[r] for r in busy])):
            out[r] = results
    return out
