"""Peak memory of the real step, phase by phase.

The step code marks its phases (:mod:`lorarl.phases`: ``generation``, ``scoring``, ``rewards``, ``training``,
``critic_training``, ``optimizer`` nested in a training phase). :class:`PhasePeaks` installs hooks at those
boundaries, so the benchmarks and the planner's validation measure the step that trains, not a copy of it:

* CUDA: ``torch.cuda.max_memory_allocated`` is read and reset at every boundary, and what was read is folded into
  every phase open at that moment, so each phase's peak is the most bytes allocated while it was open, the outer
  phase including its inner ones (weights, adapters, optimizer states included: they are allocated).
* CPU: torch keeps no peak of its CPU allocator. The step runs under the profiler with memory events; each
  boundary drops a marker (``record_function``), and a phase's peak is the largest running sum of the allocation
  events between its markers, plus the bytes of the tensors alive before the step (:func:`tensor_bytes`: weights,
  adapters, heads, optimizer states) -- the quantity ``torch.cuda.max_memory_allocated`` counts on a GPU, free of
  the C allocator's retained heap and of file mappings that RSS also counts.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lorarl.algos.base import step_seed
from lorarl.phases import PhaseLog, recording

MARK = "lorarl.phase/"  # the profiler marker of a phase on CPU


def tensor_bytes(bases: Iterable[Any], optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Bytes of the distinct storages alive in ``bases`` (SharedBase objects: base weights and buffers, every
    adapter and head, bitsandbytes quantization states) and in the optimizers' states."""
    tensors: list[torch.Tensor] = []
    for base in {id(b): b for b in bases}.values():
        tensors += list(base.module.parameters()) + list(base.module.buffers())
        for name in base.adapters:
            tensors += base.trainable_parameters(name)  # the adapter + its head (the head is not in module)
        for m in base.module.modules():  # NF4 absmax / code tensors are attributes, not parameters
            qs = getattr(getattr(m, "weight", None), "quant_state", None)
            if qs is not None:
                state2 = getattr(qs, "state2", None)
                tensors += [t for t in (qs.absmax, qs.code, getattr(state2, "absmax", None)) if t is not None]
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def allocation_curve(prof) -> tuple[list[int], list[int]]:
    """A CPU profile's allocation events in time order: ``(times_ns, running sum of bytes after each event)``."""
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    times, live, cur = [], [], 0
    for e in events:
        cur += e.nbytes()
        times.append(e.start_ns())
        live.append(cur)
    return times, live


def curve_peak(times: list[int], live: list[int], start: int, end: int) -> int:
    """Most bytes alive (above the profile's start) between ``start`` and ``end`` ns of an allocation curve."""
    i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
    before = live[i - 1] if i > 0 else 0
    return max([before, *live[i:j]])


class PhasePeaks:
    """Peak allocated bytes of each phase of a step (the largest over its repeats) and of the whole step; see the
    module docstring for how. ``persistent`` (CPU) returns the bytes alive before the step.

    After :meth:`measure`: ``peaks`` {phase: bytes}, ``step_peak`` bytes, ``seconds`` {phase: wall seconds, summed
    over repeats}, ``first_allocated`` {phase: bytes allocated when it first began (CUDA)}, ``extra`` {phase:
    CUDA allocator and device figures: ``max_reserved``, ``reserved_now``, ``device_used_now``}."""

    def __init__(self, device: torch.device | str, persistent: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self.persistent = persistent
        self.peaks: dict[str, int] = {}
        self.step_peak = 0
        self.seconds: dict[str, float] = {}
        self.first_allocated: dict[str, int] = {}
        self.extra: dict[str, dict[str, int]] = {}
        self._open: list[str] = []
        self._marks: list[Any] = []

    @contextlib.contextmanager
    def measure(self) -> Iterator[PhasePeaks]:
        """Measure the body (one step)."""
        with self._measure_cuda() if self.device.type == "cuda" else self._measure_cpu():
            yield self

    @contextlib.contextmanager
    def _measure_cuda(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with recording(PhaseLog(on_enter=self._cuda_enter, on_exit=self._cuda_exit)) as log:
            yield
        torch.cuda.synchronize(self.device)
        self._cuda_fold()
        self.seconds = dict(log.seconds)

    @contextlib.contextmanager
    def _measure_cpu(self) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        base = self.persistent() if self.persistent else 0
        log = PhaseLog(on_enter=self._cpu_enter, on_exit=self._cpu_exit)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, recording(log):
            yield
        times, live = allocation_curve(prof)
        self.step_peak = base + max([0, *live])
        for e in prof.profiler.kineto_results.events():
            if e.name().startswith(MARK):
                name = e.name()[len(MARK) :]
                peak = base + curve_peak(times, live, e.start_ns(), e.start_ns() + e.duration_ns())
                self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self.seconds = dict(log.seconds)

    # ---- CUDA: read, fold into the open phases, reset ------------------------------------------------------
    def _cuda_fold(self) -> None:
        peak = int(torch.cuda.max_memory_allocated(self.device))
        reserved = int(torch.cuda.max_memory_reserved(self.device))
        for name in self._open:
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            extra = self.extra.setdefault(name, {})
            extra["max_reserved"] = max(extra.get("max_reserved", 0), reserved)
        self.step_peak = max(self.step_peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def _cuda_enter(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        self._cuda_fold()
        self.first_allocated.setdefault(name, int(torch.cuda.memory_allocated(self.device)))
        self._open.append(name)

    def _cuda_exit(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        self._cuda_fold()
        del self._open[len(self._open) - 1 - self._open[::-1].index(name)]
        free, total = torch.cuda.mem_get_info(self.device)
        extra = self.extra.setdefault(name, {})
        extra["reserved_now"] = max(extra.get("reserved_now", 0), int(torch.cuda.memory_reserved(self.device)))
        extra["device_used_now"] = max(extra.get("device_used_now", 0), int(total - free))

    # ---- CPU: profiler markers (phases nest, so they close in the order they opened, reversed) -------------
    def _cpu_enter(self, name: str) -> None:
        mark = torch.profiler.record_function(MARK + name)
        mark.__enter__()
        self._marks.append(mark)

    def _cpu_exit(self, name: str) -> None:
        self._marks.pop().__exit__(None, None, None)


def run_step(algo: Any, step: int, meter: PhasePeaks | None = None) -> tuple[dict, float]:
    """Step ``step`` of ``algo`` as the run loop runs it -- the RNG seeded from ``(train.seed, step)``, the step's
    batch, the algorithm's own ``step`` -- measured by ``meter`` when given. Returns ``(metrics, wall seconds)``."""
    torch.manual_seed(step_seed(algo.recipe.train.seed, step))
    batch = algo.batch(step)
    t0 = time.perf_counter()
    with meter.measure() if meter is not None else contextlib.nullcontext():
        metrics = algo.step(batch)
    return metrics, time.perf_counter() - t0
