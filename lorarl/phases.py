"""Named phases of a step -- ``generation``, ``scoring``, ``rewards``, ``training``, ``critic_training``,
``optimizer`` -- marked where the real step runs them, so whoever drives a step can observe each phase without a
copy of the step: the run loop logs their wall times (``time/<phase>``), the benchmarks and the planner's GPU
validation install hooks that read each phase's peak memory.

    with phase("generation"):
        ...

With no :class:`PhaseLog` installed a phase costs two ``perf_counter`` calls. Phases may nest (``optimizer`` runs
inside ``training``); each records its own time, the outer one including the inner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Hook = Callable[[str], None]


@dataclass
class PhaseLog:
    """Wall seconds per phase name (summed over repeats), and optional hooks called on entering / leaving a phase
    (e.g. resetting and reading ``torch.cuda.max_memory_allocated``)."""

    on_enter: Hook | None = None
    on_exit: Hook | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


_active: list[PhaseLog] = []


@contextlib.contextmanager
def recording(log: PhaseLog | None = None) -> Iterator[PhaseLog]:
    """Install ``log`` (a fresh one by default) for the body: every :func:`phase` inside reports to it."""
    log = log if log is not None else PhaseLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the body as phase ``name`` for every installed :class:`PhaseLog`."""
    logs = list(_active)
    for log in logs:
        if log.on_enter is not None:
            log.on_enter(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        for log in logs:
            log.seconds[name] = log.seconds.get(name, 0.0) + dt
            log.counts[name] = log.counts.get(name, 0) + 1
            if log.on_exit is not None:
                log.on_exit(name)
