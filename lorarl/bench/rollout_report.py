"""``bench rollout``'s figures and lines: pure functions over the timings :mod:`lorarl.bench.rollout` takes (one
batch size's per-engine records in, its row of ratios against the weight-streaming bound and its printed line out).
"""

from __future__ import annotations

import statistics


def per_step(full: list[dict], one: list[dict], key: str, stat=statistics.median) -> float:
    """``(stat t(C) - stat t(1)) / (s - 1)`` in ms (``s``: steps of the ``C``-token calls; ``stat`` the median,
    or ``min``: the best of the repeats, which other processes' load can only make worse)."""
    steps = max(statistics.median(r["steps"] for r in full), 2)
    return 1000 * (stat([r[key] for r in full]) - stat([r[key] for r in one])) / (steps - 1)


def ratio(a: float, b: float) -> float | None:
    """``a / b`` to 3 places (None when ``b <= 0``: a per-step difference drowned in noise)."""
    return round(a / b, 3) if b > 0 else None


def batch_row(
    label: str, batch: int, res: dict, weights: int, bound_ms: float, skip: str | None, target: float | None
) -> dict:
    """One batch size's row from the engines' records ``res`` (``hf``, ``fast`` and, unless ``skip`` says why not,
    ``fast_kernel``): ``speedup = hf / fast`` ms per step (``speedup_best`` of the best repeats, ``cpu_speedup`` of
    process CPU time), ``X_over_bound = X ms per step / bound_ms`` to 2 places, ``kernel_speedup = fast /
    fast_kernel``, and ``kernel_meets_target``: ``kernel_over_bound <= target`` (issue 32's target, when given)."""
    hf, fast = res["hf"], res["fast"]
    row = {
        "model": label,
        "batch": batch,
        "hf": hf,
        "fast": fast,
        "speedup": ratio(hf["ms_per_step"], fast["ms_per_step"]),
        "speedup_best": ratio(hf["best_ms_per_step"], fast["best_ms_per_step"]),
        "cpu_speedup": ratio(hf["cpu_ms_per_step"], fast["cpu_ms_per_step"]),
        "weight_bytes_per_step": weights,
        "bound_ms": round(bound_ms, 6),
        "fast_over_bound": round(fast["ms_per_step"] / bound_ms, 2),
        "hf_over_bound": round(hf["ms_per_step"] / bound_ms, 2),
        "fast_kernel": res.get("fast_kernel"),
        "fast_kernel_skipped": skip,
        "target_over_bound": target,
    }
    if not skip:
        kern = res["fast_kernel"]
        row["kernel_over_bound"] = round(kern["ms_per_step"] / bound_ms, 2)
        row["kernel_speedup"] = ratio(fast["ms_per_step"], kern["ms_per_step"])
        if target is not None:
            row["kernel_meets_target"] = row["kernel_over_bound"] <= target
    return row


def format_row(row: dict) -> str:
    """A row's printed line: each engine's ms per step and tokens per second, the ratios, the bound, CPU time."""
    hf, fast = row["hf"], row["fast"]
    return (
        f"  {row['model']:<14} B={row['batch']:<3} hf {hf['ms_per_step']:8.2f} ms/step {hf['tokens_per_s']:9.1f} tok/s"
        f" | fast {fast['ms_per_step']:8.2f} ms/step {fast['tokens_per_s']:9.1f} tok/s"
        f" | hf/fast {row['speedup']} (best {row['speedup_best']}, cpu {row['cpu_speedup']})"
        f" | bound {row['bound_ms']:.3f} ms (fast x{row['fast_over_bound']}, hf x{row['hf_over_bound']})"
        f" | cpu ms/step hf {hf['cpu_ms_per_step']:.1f} fast {fast['cpu_ms_per_step']:.1f} | {kernel_text(row)}"
    )


def kernel_text(row: dict) -> str:
    """The ``fast_kernel`` engine's part of a row's line: ms/step, x the bound against the target, or why it did not
    run."""
    if row.get("fast_kernel") is None:
        return f"fast_kernel not run: {row.get('fast_kernel_skipped')}"
    target = row.get("target_over_bound")
    goal = f" (target <= x{target}: {'met' if row['kernel_meets_target'] else 'NOT met'})" if target else ""
    return (
        f"fast_kernel {row['fast_kernel']['ms_per_step']:.2f} ms/step, x{row['kernel_over_bound']} the bound{goal},"
        f" fast/fast_kernel {row['kernel_speedup']}"
    )
