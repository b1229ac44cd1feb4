"""The workbench's memory rule: on one GPU the chat's model and a training run compete for the same memory.

The rule (issue 25: "the page says why chat is paused while the run trains, with the figures; never an
out-of-memory crash of either"):

* while a run trains, chat generation is **paused** when ``run_peak + chat > device_total``, where ``run_peak`` is
  the memory planner's predicted peak of the live run's recipe (:func:`lorarl.plan.plan_recipe`, ``peak_total_gb``:
  with the CUDA context and the allocator's slack) and ``chat`` the most this app's process has reserved on the
  device so far (its model and its largest generation); the chat's cached blocks are then handed back to the
  device (``torch.cuda.empty_cache``) so that the run can use them;
* a launch is **refused** when ``run_peak + chat_allocated > device_total``: the chat's model weights alone leave
  the run too little room;
* on a CPU neither applies (host memory is not shared this way; the planner models GPU memory).

The rule itself is pure (:func:`pause_reason`, :func:`launch_refusal`); :class:`MemoryGuard` reads the figures.
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass
from pathlib import Path

GB = 1e9  # the planner's unit (lorarl.plan.terms.GB)


@dataclass(frozen=True)
class DeviceFigures:
    """What the device holds, in bytes: its total, and this process's (the chat's) reserved peak and allocation."""

    total: int
    chat_peak: int
    chat_allocated: int


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


def launch_refusal(run_peak: float, chat_allocated: float, total: float) -> str | None:
    """Why a launch is refused on this GPU, or None: refused iff ``run_peak + chat_allocated > total`` (the chat's
    model weights stay loaded, so the run would run out of memory)."""
    if run_peak + chat_allocated <= total:
        return None
    return (
        f"not launched: the run's planned peak {run_peak / GB:.2f} GB + the chat's loaded model "
        f"{chat_allocated / GB:.2f} GB > the GPU's {total / GB:.2f} GB; lower the run's sizes or start `lorarl train` "
        "in a terminal with the app closed"
    )


def cuda_figures() -> DeviceFigures | None:
    """This process's figures on CUDA device 0, or None without CUDA (no pause on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    peak = max(torch.cuda.max_memory_reserved(0), torch.cuda.memory_reserved(0))
    return DeviceFigures(int(total), int(peak), int(torch.cuda.memory_allocated(0)))


def planned_peak(recipe_path: Path, overrides: list[str] | None = None, budget_gb: float = 80.0) -> float:
    """The planner's predicted peak (bytes, with CUDA context and slack) of a recipe; the planner's table, which
    it prints, is swallowed."""
    from lorarl.plan import plan_recipe

    with contextlib.redirect_stdout(io.StringIO()):
        result = plan_recipe(recipe_path, budget_gb=budget_gb, overrides=list(overrides or []))
    return float(result["peak_total_gb"]) * GB


class MemoryGuard:
    """Applies the rule for one app: ``live()`` names the live run's folder (or None); ``figures()`` reads the
    device (None on a CPU); ``planner(recipe, overrides, budget_gb)`` predicts a recipe's peak in bytes (None or an
    exception: it cannot tell). Planner peaks of live runs are cached per run folder."""

    def __init__(self, live, figures=cuda_figures, planner=None):
        self.live, self.figures = live, figures
        self.planner = planner or planned_peak
        self._peaks: dict[Path, float | None] = {}
        self._lock = threading.Lock()

    def run_peak(self, run_dir: Path, budget_gb: float) -> float | None:
        """The live run's planned peak (its own ``recipe.yaml``; ``budget_gb`` picks an ``auto`` micro-batch as the
        run did), None when the planner cannot tell."""
        with self._lock:
            if run_dir not in self._peaks:
                try:
                    self._peaks[run_dir] = self.planner(run_dir / "recipe.yaml", [], budget_gb)
                except Exception:  # noqa: BLE001 - an unplannable recipe: no figure, so no pause on a guess
                    self._peaks[run_dir] = None
            return self._peaks[run_dir]

    def chat_pause(self) -> str | None:
        """The line chat generation answers instead of generating, or None (CPU, no live run, or both fit)."""
        fig = self.figures()
        if fig is None:
            return None
        run = self.live()
        if run is None:
            return None
        peak = self.run_peak(Path(run), fig.total / GB)
        if peak is None:
            return None
        reason = pause_reason(Path(run).name, peak, fig.chat_peak, fig.total)
        if reason is not None:
            import torch

            torch.cuda.empty_cache()  # the chat's cached generation blocks go back to the run
        return reason

    def launch_check(self, recipe_path: Path, overrides: list[str]) -> str | None:
        """Why launching this recipe would not fit beside the chat's model, or None (always None on a CPU)."""
        fig = self.figures()
        if fig is None:
            return None
        try:
            peak = self.planner(recipe_path, overrides, fig.total / GB)
        except Exception:  # noqa: BLE001 - the launch's own validation reports a bad recipe
            return None
        if peak is None:
            return None
        return launch_refusal(peak, fig.chat_allocated, fig.total)
