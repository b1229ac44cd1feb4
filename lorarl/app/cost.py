"""The Train tab's cost block: one figure per resource, each named (what it is, on which device, where it comes
from), a time estimate, and a warning when the recipe is meant for a GPU this machine lacks.

A recipe states what it was measured (or planned) to cost in one machine-readable line of its comment header::

    # Cost on cpu (2 shared cores, as measured above): 13 s/step, 5.2 GB peak RSS
    # Cost on cuda (24 GB, planned, not measured): 20.1 GB peak with CUDA context and slack

(:func:`recipe_costs`; ``N-M s/step`` for a range). The block then says, on this machine:

* memory: on CUDA the planner's peak against the room a launch gets (the figure the launch is checked against,
  :func:`lorarl.app.recipes.plan_line`); on a CPU the recipe's measured peak RSS on a CPU when it has one, else
  the planner's tensor peak, named as such (it models GPU allocations, not a CPU process's RSS);
* time: ``train.steps x`` the recipe's measured s/step on this kind of device (with a note when the fields that
  set a step's size were changed), else that no step time is known until Watch measures step 1;
* a warning when every cost line of the recipe is for CUDA and this machine has none.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from lorarl.app.results import format_seconds

COST_LINE = re.compile(r"^Cost on (cpu|cuda)(?: \(([^)]*)\))?: (.+)$")
STEP_TIME = re.compile(r"(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))? s/step")
PEAK = re.compile(r"(\d+(?:\.\d+)?) GB peak( RSS)?")
# fields whose change makes a step cost more or less than the recipe measured
STEP_SIZE_KEYS = ("grpo.group_size", "generation.max_new_tokens", "train.prompts_per_step", "model.name")


@dataclass(frozen=True)
class Cost:
    """One ``Cost on DEVICE (WHERE): ...`` line: the device kind, where / how it was measured, the s/step (low,
    high) and the peak in GB (``rss``: a process's peak RSS; else a GPU peak)."""

    device: str
    where: str
    step_s: tuple[float, float] | None
    peak_gb: float | None
    rss: bool


def recipe_costs(header: str) -> list[Cost]:
    """The ``Cost on ...`` lines of a recipe's comment header (``# `` already removed, as
    :func:`lorarl.app.recipes.recipe_header` gives it). Example: ``Cost on cpu (2 cores): 11-13 s/step, 7 GB peak
    RSS`` -> ``Cost("cpu", "2 cores", (11.0, 13.0), 7.0, True)``."""
    out = []
    for line in header.splitlines():
        m = COST_LINE.match(line.strip())
        if not m:
            continue
        device, where, rest = m.group(1), m.group(2) or "", m.group(3)
        t, p = STEP_TIME.search(rest), PEAK.search(rest)
        step = (float(t.group(1)), float(t.group(2) or t.group(1))) if t else None
        out.append(Cost(device, where, step, float(p.group(1)) if p else None, bool(p and p.group(2))))
    return out


def time_estimate(cost: Cost, steps: int) -> str:
    """``about 8m40s for 40 steps (13 s/step, ...)``; a range when the recipe gives one."""
    low, high = cost.step_s
    each = f"{low:g} s/step" if low == high else f"{low:g}-{high:g} s/step"
    total = (
        format_seconds(low * steps) if low == high else f"{format_seconds(low * steps)}-{format_seconds(high * steps)}"
    )
    return f"about {total} for {steps} steps ({each} measured on {cost.device} ({cost.where}): the recipe's header)"


def machine_line(cuda_name: str | None, host_gb: float | None) -> str:
    """This machine in a few words: the GPU, or the CPU cores and the host memory available."""
    if cuda_name:
        return f"CUDA: {cuda_name}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    have = f", {host_gb:.1f} GB available" if host_gb is not None else ""
    return f"CPU only ({cores} cores{have})"


def cost_markdown(
    costs: list[Cost],
    *,
    device: str,
    machine: str,
    steps: int,
    planner: str,
    changed: list[str],
    model: str,
) -> str:
    """The cost block (see the module docstring). ``device``: ``cuda`` or ``cpu`` (this machine); ``planner``:
    the planner's line (:func:`lorarl.app.recipes.plan_line`); ``changed``: the override keys of this launch;
    ``model``: the recipe's ``model.name``."""
    here = [c for c in costs if c.device == device]
    lines = [f"**Cost on this machine** ({machine})"]
    if costs and not here and device == "cpu" and all(c.device == "cuda" for c in costs):
        meant = "; ".join(c.where for c in costs if c.where) or "a GPU"
        lines.append(
            f"- ⚠ **meant for a CUDA GPU** ({meant}); this machine has none: on a CPU {model} would train in fp32, "
            "far slower and with far more memory than the recipe's figures"
        )
    sized = [k for k in changed if k in STEP_SIZE_KEYS]
    note = f"; measured at the recipe's own sizes: your {', '.join(sized)} change the step's size" if sized else ""
    measured = next((c for c in here if c.peak_gb is not None), None)
    if device == "cpu" and measured is not None and measured.rss:
        where = f"measured on cpu ({measured.where}): the recipe's header"
        lines.append(f"- memory: {measured.peak_gb:g} GB peak RSS {where}{note}")
    else:
        lines.append(f"- memory: {planner.removeprefix('plan: ')}")
    timed = next((c for c in here if c.step_s is not None), None)
    if timed is not None:
        lines.append(f"- time: {time_estimate(timed, steps)}{note}")
    else:
        lines.append(f"- time: no step time measured on {device} for this recipe; Watch shows it after step 1")
    return "\n".join(lines)
