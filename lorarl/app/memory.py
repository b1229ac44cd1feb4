"""The workbench's memory rule: on one GPU the chat's model and a training run compete for the same memory.

The rule (issue 25: "the page says why chat is paused while the run trains, with the figures; never an
out-of-memory crash of either"), on CUDA only (on a CPU host memory is not shared this way and the planner models
GPU memory, so nothing is paused or refused):

* **one door**: every piece of work that starts beside the chat -- a launch, a resume, both retrains, an export
  in this app's process -- goes through :meth:`MemoryGuard.start`, which holds the chat engine's lock (no answer is
  being generated), hands the chat's cached blocks back to the device (``torch.cuda.empty_cache``) and measures;
* the **room** for a run is ``min(total - chat_allocated, free + chat_reserved - chat_allocated)``
  (:func:`room_for_run`): the device total less the chat's model, and no more than the driver says is free
  (``torch.cuda.mem_get_info``: this counts the chat's CUDA context and any other process);
* a launch is **refused** when the planner's peak of the run (:func:`lorarl.plan.plan_recipe`'s ``peak_total_gb``,
  with the CUDA context and the allocator's slack) exceeds the room. A new run whose recipe says
  ``train.micro_batch_size: auto`` gets the micro-batch the planner picks *for the room* as an override (the run
  would otherwise pick one for the whole GPU); a resume keeps its recipe as it is (bit-identical) and is planned as
  the run plans itself, against the device total;
* while a run trains, chat generation is **paused** when ``run_peak + chat_peak > total`` (:func:`pause_reason`;
  ``chat_peak``: the most this process has reserved, i.e. its model and its largest generation);
* **no estimate is never "no protection"**: when the planner cannot estimate the live run (an algorithm it does not
  model, a recipe it cannot read, a run still starting), chat is paused for as long as the run trains, with the
  measured free memory in the line; a launch the planner cannot estimate starts with that pause announced. A
  failed estimate is never cached (the next look tries again); a run launched here is planned from the recipe and
  overrides known at launch, before its ``recipe.yaml`` exists;
* an export runs in this app's process: refused while a run trains (its memory is not planned), and chat is paused
  while it runs.

The rules are pure functions (:func:`room_for_run`, :func:`pause_reason`, :func:`launch_refusal`);
:class:`MemoryGuard` reads the figures (injected in tests: ``figures``, ``planner``, ``release``).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError
from lorarl.plan.recipes import PLANNED_RECIPES  # the steps the planner models; others: no estimate (chat paused)

GB = 1e9  # the planner's unit (lorarl.plan.terms.GB)


@dataclass(frozen=True)
class DeviceFigures:
    """What the device holds, in bytes: its ``total``; ``free`` as the driver reports it (every process);
    this process's (the chat's) reserved peak, current reservation and allocation."""

    total: int
    chat_peak: int
    chat_allocated: int
    free: int | None = None
    chat_reserved: int | None = None


@dataclass(frozen=True)
class Plan:
    """The planner's figures for one run: ``peak`` in bytes; ``micro_batch`` the micro-batch it picked for the
    budget when the recipe says ``auto`` (None when the recipe gives a number)."""

    peak: float
    micro_batch: int | None = None


@dataclass(frozen=True)
class Work:
    """One piece of work that would start beside the chat (see :meth:`MemoryGuard.start`).

    ``label``: how the page names it (``launch of run a``); ``run_dir``: the run folder it trains, None for work in
    this app's process (an export); ``recipe`` and ``overrides``: what the run trains (None: nothing to plan);
    ``pin``: a new run (an ``auto`` micro-batch is fixed for the room beside the chat); False for a resume."""

    label: str
    run_dir: Path | None = None
    recipe: Path | None = None
    overrides: tuple[str, ...] = ()
    pin: bool = True


@dataclass
class Admission:
    """What :meth:`MemoryGuard.start` decided: the overrides the work starts with, and a note for the page."""

    overrides: list[str] = field(default_factory=list)
    note: str = ""


def room_for_run(fig: DeviceFigures) -> float:
    """Bytes a run can use beside the chat: ``min(total - chat_allocated, free + chat_reserved - chat_allocated)``
    (the second term only when the driver's ``free`` is known: what is free now plus the chat's cached blocks, which
    :meth:`MemoryGuard.start` hands back). Example: 80 GB total, chat 2 GB allocated / 3 GB reserved, 70 GB free
    (the chat's context and another process hold the rest) -> min(78, 71) = 71 GB."""
    room = float(fig.total - fig.chat_allocated)
    if fig.free is not None:
        reserved = fig.chat_reserved if fig.chat_reserved is not None else fig.chat_allocated
        room = min(room, float(fig.free + reserved - fig.chat_allocated))
    return max(0.0, room)


def pause_reason(run_name: str, run_peak: float, chat: float, total: float) -> str | None:
    """Why chat generation is paused while run ``run_name`` trains, or None when both fit.

    Paused iff ``run_peak + chat > total`` (bytes; ``run_peak``: the planner's peak of the run, ``chat``: the
    chat's reserved peak, ``total``: the device's memory). Example: a 70 GB run and a 10 GB chat on an 80 GB device
    -> paused (80 GB is not more than 80 GB: fits; 80.1 GB: paused)."""
    if run_peak + chat <= total:
        return None
    return (
        f"chat paused while run {run_name} trains: its planned peak {run_peak / GB:.2f} GB + the chat's "
        f"{chat / GB:.2f} GB > the GPU's {total / GB:.2f} GB (answers resume when the run stops or finishes)"
    )


def launch_refusal(run_peak: float, room: float, total: float) -> str | None:
    """Why a run is refused on this GPU, or None: refused iff ``run_peak > room`` (:func:`room_for_run`: the chat's
    model weights stay loaded, so the run would run out of memory)."""
    if run_peak <= room:
        return None
    return (
        f"not started: the run's planned peak {run_peak / GB:.2f} GB > the {room / GB:.2f} GB left beside the chat's "
        f"loaded model on the GPU's {total / GB:.2f} GB; lower the run's sizes or start `lorarl train` in a terminal "
        "with the app closed"
    )


def no_estimate_pause(run_name: str, why: str, fig: DeviceFigures) -> str:
    """The chat's line while run ``run_name`` trains and the planner cannot estimate it: paused, with the figures."""
    free = f"; {fig.free / GB:.2f} GB of the GPU's {fig.total / GB:.2f} GB free now" if fig.free is not None else ""
    return (
        f"chat paused while run {run_name} trains: the planner cannot estimate its peak ({why}), so the chat "
        f"leaves it the GPU{free} (answers resume when the run stops or finishes)"
    )


def cuda_figures() -> DeviceFigures | None:
    """This process's figures on CUDA device 0, or None without CUDA (no rule on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    reserved = int(torch.cuda.memory_reserved(0))
    peak = max(int(torch.cuda.max_memory_reserved(0)), reserved)
    return DeviceFigures(int(total), peak, int(torch.cuda.memory_allocated(0)), int(free), reserved)


def release_cuda_cache() -> None:
    """Hand this process's cached, unallocated CUDA blocks back to the device."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planned(recipe_path: Path, overrides: list[str] | None = None, budget_gb: float = 80.0) -> Plan:
    """The planner's peak (bytes, with CUDA context and slack) of a recipe at ``budget_gb`` and, for an ``auto``
    micro-batch, its pick. Raises (LorarlError or the loader's error) when it cannot tell: an unreadable recipe, or
    an algorithm the planner does not model (it would be modelled as GRPO). The planner's table is swallowed."""
    from lorarl.config import load_recipe
    from lorarl.plan import plan_recipe

    recipe = load_recipe(recipe_path, list(overrides or []))
    if recipe.algo not in PLANNED_RECIPES:
        raise LorarlError(f"the planner models {', '.join(PLANNED_RECIPES)} runs, not {recipe.algo}")
    with contextlib.redirect_stdout(io.StringIO()):
        result = plan_recipe(recipe_path, budget_gb=budget_gb, overrides=list(overrides or []))
    auto = result["micro_batch_size"] == "auto"
    return Plan(float(result["peak_total_gb"]) * GB, int(result["picked_micro_batch_size"]) if auto else None)


def planned_peak(recipe_path: Path, overrides: list[str] | None = None, budget_gb: float = 80.0) -> float:
    """:func:`planned`'s peak in bytes."""
    return planned(recipe_path, overrides, budget_gb).peak


def _why(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class MemoryGuard:
    """Applies the rule for one app. ``live()`` names the live run's folder (or None); ``figures()`` reads the
    device (None on a CPU); ``planner(recipe, overrides, budget_gb)`` returns a :class:`Plan` (or a peak in bytes)
    and raises or returns None when it cannot tell; ``release()`` hands the chat's cached blocks back; ``lock``:
    the chat engine's lock (held while work starts, so no answer is being generated while the figures are read)."""

    def __init__(self, live, figures=cuda_figures, planner=None, release=release_cuda_cache, lock=None):
        self.live, self.figures, self.release = live, figures, release
        self.planner = planner or planned
        self.engine_lock = lock if lock is not None else threading.RLock()
        self._cache: dict[tuple[Path, int], float] = {}  # (run folder, recipe.yaml mtime_ns) -> peak: successes only
        self._launched: dict[Path, float] = {}  # run folder -> peak planned at launch (before its recipe.yaml exists)
        self._busy: str | None = None  # work running in this app's process (an export)
        self._lock = threading.Lock()

    # ---- planning -------------------------------------------------------------------------------------------------
    def _plan(self, recipe: Path, overrides, budget_gb: float) -> tuple[Plan | None, str]:
        """``(plan, "")`` or ``(None, why the planner cannot tell)``."""
        try:
            got = self.planner(recipe, list(overrides), budget_gb)
        except Exception as e:  # noqa: BLE001 - any failure means "no estimate", handled by pausing, never cached
            return None, _why(e)
        if got is None:
            return None, "no figure"
        return (got if isinstance(got, Plan) else Plan(float(got))), ""

    def run_peak(self, run_dir: Path, total_gb: float) -> tuple[float | None, str]:
        """``(peak, "")`` of the live run, or ``(None, why)``. Planned from its own ``recipe.yaml`` as the run plans
        itself (budget: the device total), cached per file version on success only; before that file exists (or
        when it cannot be planned) the peak planned when this app launched it."""
        run_dir = Path(run_dir)
        recipe = run_dir / "recipe.yaml"
        why = "the run has not written its recipe.yaml yet"
        try:
            key = (run_dir, recipe.stat().st_mtime_ns)
        except OSError:
            key = None
        if key is not None:
            with self._lock:
                if key in self._cache:
                    return self._cache[key], ""
            plan, why = self._plan(recipe, [], total_gb)
            if plan is not None:
                with self._lock:
                    self._cache[key] = plan.peak
                return plan.peak, ""
        with self._lock:
            if run_dir in self._launched:
                return self._launched[run_dir], ""
        return None, why

    def room_gb(self) -> float | None:
        """The room beside the chat in GB (:func:`room_for_run`), None on a CPU: the budget of the plan line."""
        fig = self.figures()
        return None if fig is None else room_for_run(fig) / GB

    # ---- the chat's side ------------------------------------------------------------------------------------------
    def chat_pause(self) -> str | None:
        """The line chat generation answers instead of generating, or None (CPU, no live run, or both fit)."""
        fig = self.figures()
        if fig is None:
            return None
        if self._busy is not None:
            return f"chat paused while {self._busy} runs in this app's process (it loads models beside the chat)"
        run = self.live()
        if run is None:
            return None
        peak, why = self.run_peak(Path(run), fig.total / GB)
        if peak is None:
            reason = no_estimate_pause(Path(run).name, why, fig)
        else:
            reason = pause_reason(Path(run).name, peak, fig.chat_peak, fig.total)
        if reason is not None:
            self.release()  # the chat's cached generation blocks go back to the run
        return reason

    # ---- the one door -----------------------------------------------------------------------------------------------
    def start(self, work: Work, go: Callable[[list[str]], Any]) -> tuple[Any, Admission]:
        """Start ``work`` beside the chat: the one way a launch, a resume, a retrain or an export starts.

        ``go(overrides)`` starts it (a run: spawns its process; an export: runs it, outside the engine's lock, with
        chat paused meanwhile). Raises LorarlError (one line, with the figures) when it does not fit. On a CPU ``go``
        runs with the overrides as given."""
        if self.figures() is None:
            return go(list(work.overrides)), Admission(list(work.overrides))
        with self.engine_lock:  # no answer is being generated while the chat's memory is measured and released
            with self._lock:
                if self._busy is not None:
                    raise LorarlError(f"not started: {self._busy} is running in this app's process; wait for it")
            self.release()
            fig = self.figures()
            if work.run_dir is not None:
                admission = self._admit(work, fig)
                try:
                    return go(admission.overrides), admission
                except BaseException:
                    with self._lock:  # not started (the runner refused it): no launch-time peak left behind
                        self._launched.pop(Path(work.run_dir), None)
                    raise
            self._claim(work, fig)
        try:
            return go(list(work.overrides)), Admission(list(work.overrides))
        finally:
            with self._lock:
                self._busy = None
            self.release()

    def _admit(self, work: Work, fig: DeviceFigures) -> Admission:
        """The overrides a run starts with and its note, or LorarlError when it does not fit (see the module)."""
        room = room_for_run(fig)
        overrides = list(work.overrides)
        if work.recipe is None:
            plan, why = None, "no recipe to plan"
        elif work.pin:
            plan, why = self._plan(work.recipe, overrides, room / GB)
        else:
            plan, why = self._plan(work.recipe, overrides, fig.total / GB)  # a resume picks as the run did
        if plan is None:
            with self._lock:
                self._launched.pop(Path(work.run_dir), None)
            free = f"{room / GB:.2f} GB free for it beside the chat (measured)"
            return Admission(
                overrides, f"the planner cannot estimate this run ({why}); {free}; chat paused while it trains"
            )
        refusal = launch_refusal(plan.peak, room, fig.total)
        if refusal:
            raise LorarlError(refusal)
        note = f"planned peak {plan.peak / GB:.2f} GB of the {room / GB:.2f} GB beside the chat"
        if work.pin and plan.micro_batch is not None:
            overrides.append(f"train.micro_batch_size={plan.micro_batch}")
            note += f"; micro-batch {plan.micro_batch} (the planner's pick for that room)"
        with self._lock:
            self._launched[Path(work.run_dir)] = plan.peak
        return Admission(overrides, note)

    def _claim(self, work: Work, fig: DeviceFigures) -> None:
        """Mark in-process work (an export) as running; refused while a run trains (its memory is not planned)."""
        run = self.live()
        if run is not None:
            free = f" ({fig.free / GB:.2f} GB free now)" if fig.free is not None else ""
            raise LorarlError(
                f"not started: {work.label} loads models in this app's process, beside run {Path(run).name} which "
                f"trains on the GPU{free}; wait until it ends"
            )
        with self._lock:
            self._busy = work.label
