"""``async def`` reward functions, run concurrently with each other: one event loop per scoring call, in a worker
thread, so the plain functions run in the calling thread meanwhile (TRL does the same: its async rewards run on a
background loop while the sync ones are called).

Each coroutine runs under ``asyncio.wait_for(timeout_s)``: a cooperative coroutine (awaiting I/O, ``asyncio.sleep``)
is cancelled at its limit. A coroutine that blocks its loop (``time.sleep`` inside ``async def``) cannot be
cancelled; the caller stops waiting for the whole loop ``timeout_s + GRACE_S`` after the start, and every
coroutine without a result by then counts as timed out (its thread is abandoned, as :func:`call_with_timeout`
abandons a thread). A reward function is async when it is a coroutine function or an object whose ``__call__``
is one (``functools.partial`` unwrapped).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GRACE_S = 1.0  # seconds past the limit before a loop that does not yield is given up on


class AsyncRewardTimeout(Exception):
    """An async reward function ran past its time limit."""


def unwrap_partial(fn: Any) -> Any:
    """The function under any ``functools.partial`` layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def is_async_reward(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, or an object with an async
    ``__call__`` (partials unwrapped)."""
    target = unwrap_partial(fn)
    call = getattr(type(target), "__call__", None)  # noqa: B004  (an object's async __call__, not callability)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


@dataclass
class PendingRewards:
    """Async reward calls started by :func:`start_async_rewards`; :meth:`wait` returns ``{k: (ok, value or
    exception)}`` for every job ``k``."""

    jobs: dict[int, Callable[[], Any]]
    timeout_s: float | None
    results: dict[int, tuple[bool, Any]] = field(default_factory=dict)
    thread: threading.Thread | None = None
    started: float = 0.0

    def wait(self) -> dict[int, tuple[bool, Any]]:
        if self.thread is None:
            return {}
        if self.timeout_s:
            self.thread.join(max(self.started + self.timeout_s + GRACE_S - time.monotonic(), 0.0))
        else:
            self.thread.join()
        out = dict(self.results)  # a snapshot: an abandoned loop may still write later
        for k in self.jobs:
            if k not in out:
                out[k] = (False, AsyncRewardTimeout(f"timed out after {self.timeout_s:g} s (its event loop blocked)"))
        return out


def start_async_rewards(jobs: dict[int, Callable[[], Any]], timeout_s: float | None) -> PendingRewards:
    """Start ``jobs`` (``k`` -> a callable returning a coroutine) on one new event loop in a daemon thread, all at
    once, each under ``timeout_s`` (None or <= 0: no limit)."""
    timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
    pending = PendingRewards(jobs=dict(jobs), timeout_s=timeout_s)
    if not jobs:
        return pending

    async def one(k: int, make: Callable[[], Any]) -> None:
        try:
            coro = make()
            value = await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)
            pending.results[k] = (True, value)
        except asyncio.TimeoutError:
            pending.results[k] = (False, AsyncRewardTimeout(f"timed out after {timeout_s:g} s"))
        except Exception as e:  # isolated like a sync reward's failure: recorded, counted by the scorer
            pending.results[k] = (False, e)

    async def main() -> None:
        await asyncio.gather(*(one(k, make) for k, make in pending.jobs.items()))

    def run() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()  # shuts its default executor down without waiting for threads still in a blocking call

    pending.started = time.monotonic()
    pending.thread = threading.Thread(target=run, daemon=True, name="lorarl-async-rewards")
    pending.thread.start()
    return pending
