"""The plan validation's report: predicted against measured per phase, the largest error, the Markdown table
(pure functions over the JSON records :mod:`lorarl.bench.plan_validation` writes)."""

from __future__ import annotations

PHASE_COMPARE = {"training": ("training", "optimizer"), "critic_training": ("critic_training", "optimizer")}


def compare(est: dict, measured: dict, extra: dict[str, dict] | None = None) -> dict:
    """Predicted vs measured per phase (ratio = predicted / measured), with each phase's ``extra`` figures
    (seconds; on CUDA reserved and device-level bytes). A training phase includes its optimizer step, so it is
    compared with the larger of the two predictions."""
    rows = {}
    for phase, peak in measured["phases"].items():
        keys = PHASE_COMPARE.get(phase, (phase,))
        preds = [est["phases"][k] for k in keys if k in est["phases"]]
        pred = max(preds) if preds else None
        rows[phase] = {
            "predicted": pred,
            "measured": peak,
            "ratio": round(pred / peak, 4) if pred and peak else None,
            "moment": est["moments"].get(phase),
            **(extra or {}).get(phase, {}),
        }
    used = [r["device_used_now"] for r in rows.values() if "device_used_now" in r and not r.get("shared_gpu")]
    device = {}
    if used:  # whole-device use (context + everything the allocator holds) vs the planner's budget figure
        device = {
            "predicted_total": est["peak_total_bytes"],
            "measured_device_used": max(used),
            "ratio": round(est["peak_total_bytes"] / max(used), 4),
        }
    return {"phases": rows, "device": device, "estimate": est, "measured": measured}


def max_abs_error(results: list[dict]) -> float | None:
    errs = [
        abs(r["ratio"] - 1)
        for res in results
        for run in res["runs"].values()
        for r in run["phases"].values()
        if r["ratio"] is not None
    ]
    return round(max(errs), 4) if errs else None


def format_table(results: list[dict]) -> str:
    lines = [
        "| model | algo | phase (peak moment) | predicted GiB | measured GiB | predicted / measured | phase s |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for algo, run in res["runs"].items():
            for phase, r in run["phases"].items():
                pred = f"{r['predicted'] / 2**30:.2f}" if r["predicted"] else "-"
                meas = f"{r['measured'] / 2**30:.2f}"
                ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
                secs = f"{r['seconds']:.1f}" if "seconds" in r else "-"
                lines.append(
                    f"| {res['model']} | {algo} | {phase} ({r.get('moment')}) | {pred} | {meas} | {ratio} | {secs} |"
                )
            dev = run.get("device") or {}
            if dev:
                lines.append(
                    f"| {res['model']} | {algo} | device total (context + allocator) | "
                    f"{dev['predicted_total'] / 2**30:.2f} | {dev['measured_device_used'] / 2**30:.2f} | "
                    f"{dev['ratio']:.3f} | - |"
                )
    return "\n".join(lines)
