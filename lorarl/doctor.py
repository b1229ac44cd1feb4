"""``lorarl doctor RUN``: a short health report of a run, read from its files (``recipe.yaml``, ``metrics.jsonl``).

It answers the questions a user asks of a run that does not learn: did the reward and the accuracy move, did
held-out accuracy follow, how many groups had no reward spread, how far did the policy go from the reference
(KL, clip fractions), did entropy collapse, did completions drift in length or hit the cap, did the sampler and the
trainer agree (parity), and which warnings the health checks raised during the run. The text report is followed by
one JSON line (the same figures) as the last stdout line.
"""

from __future__ import annotations

import math
from pathlib import Path

from lorarl.errors import LorarlError
from lorarl.runs import is_run_dir, read_metrics

# report field -> the metric it reads (the first one a run logs: GRPO's TRL name, then PPO's)
SERIES = {
    "reward": ("reward",),
    "accuracy": ("accuracy",),
    "frac_reward_zero_std": ("frac_reward_zero_std",),
    "kl": ("kl", "objective/kl"),
    "clip_fraction": ("clip_ratio/high_mean", "policy/clipfrac_avg"),
    "entropy": ("entropy", "policy/entropy_avg"),
    "completion_length": ("completions/mean_length",),
    "clipped_ratio": ("completions/clipped_ratio",),
    "eval_accuracy": ("eval/accuracy",),
    "preference_accuracy": ("rewards/accuracies",),  # DPO: implicit-reward accuracy on the training pairs
    "eval_preference_accuracy": ("eval/rewards/accuracies",),  # ... on the held-out pairs
    "reward_margin": ("rewards/margins",),
}


def _values(rows: list[dict], keys: tuple[str, ...]) -> list[float]:
    for key in keys:
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if vals:
            return vals
    return []


def trend(values: list[float], fraction: float = 0.2) -> dict | None:
    """``{start, end, change}``: the means of the first and last ``fraction`` of ``values`` (at least one each).

    Example: ``[0, 0, 1, 1, 1]``, fraction 0.2 -> start 0.0, end 1.0, change +1.0.
    """
    if not values:
        return None
    k = max(1, int(len(values) * fraction))
    start, end = sum(values[:k]) / k, sum(values[-k:]) / k
    return {"start": round(start, 6), "end": round(end, 6), "change": round(end - start, 6)}


def findings(report: dict) -> list[str]:
    """Plain-words verdicts from a report (empty: nothing stands out)."""
    out = []
    reward, acc, ev = report.get("reward"), report.get("accuracy"), report.get("eval_accuracy")
    if reward and abs(reward["change"]) < 1e-9:
        out.append("the training reward did not move")
    if reward and ev and reward["change"] > 0 and ev["change"] < 0:
        out.append("training reward rose while held-out accuracy fell: look for reward hacking")
    if acc is not None and acc.get("end", 0) == 0 and acc.get("start", 0) == 0:
        out.append("no completion was ever correct: start easier (an SFT cold start) or use a partial-credit reward")
    zs = report.get("frac_reward_zero_std")
    if zs and zs["end"] >= 0.9:
        out.append(f"{zs['end']:.0%} of the groups had zero reward spread at the end: GRPO had little to learn from")
    length = report.get("completion_length")
    if length and length["start"] > 0 and not 1 / 3 <= length["end"] / length["start"] <= 3:
        out.append(f"completion length drifted {length['start']:.1f} -> {length['end']:.1f} tokens")
    trunc = report.get("clipped_ratio")
    if trunc and trunc["end"] > 0.5:
        out.append(f"{trunc['end']:.0%} of the completions hit generation.max_new_tokens at the end")
    ent = report.get("entropy")
    if ent and ent["start"] > 0 and ent["end"] < 0.1 * ent["start"]:
        out.append(f"entropy collapsed {ent['start']:.3f} -> {ent['end']:.3f}")
    if report.get("parity_max_mean_abs") is not None and report["parity_max_mean_abs"] > report["parity_tolerance"]:
        out.append("generator / trainer parity was above its tolerance")
    pref = report.get("eval_preference_accuracy") or report.get("preference_accuracy")
    if pref and pref["end"] <= 0.55:
        out.append(
            f"implicit-reward accuracy ended at {pref['end']:.0%} (chance: 50%): the policy barely prefers the chosen "
            "responses; raise train.learning_rate or train.steps, or check the pairs"
        )
    if report.get("graph_capture_failures") or report.get("eager_fallbacks"):
        out.append(
            f"the fast engine decoded eagerly: {report['graph_capture_failures']} CUDA graph capture(s) failed, "
            f"{report['eager_fallbacks']} decode batch(es) ran without a graph (rollout/graph_capture_failures, "
            "rollout/eager_fallbacks in metrics.jsonl)"
        )
    out += [f"health warning: {w}" for w in report.get("warnings", [])]
    return out


def graph_counts(rows: list[dict]) -> dict:
    """The fast engine's CUDA-graph counters of a run (the largest logged value of each: they count up from the
    start of each process, so a resumed run's rows start again at 0); None when the run never asked for graphs."""
    out = {}
    for key in ("graph_captures", "graph_capture_failures", "eager_fallbacks"):
        vals = _values(rows, (f"rollout/{key}",))
        out[key] = int(max(vals)) if vals else None
    return out


def diagnose(run: str | Path) -> dict:
    """The report of run directory ``run`` (see the module docstring)."""
    run = Path(run)
    if not run.is_dir() or not is_run_dir(run):
        raise LorarlError(f"{run}: not a run directory (no recipe.yaml or metrics.jsonl)")
    rows = read_metrics(run)
    if not rows:
        raise LorarlError(f"{run}: metrics.jsonl has no rows yet")
    recipe = None
    if (run / "recipe.yaml").is_file():
        from lorarl.config import load_run_recipe

        recipe = load_run_recipe(run / "recipe.yaml")
    report: dict = {"run": str(run), "algo": recipe.algo if recipe else None, "steps": rows[-1].get("step")}
    for key, metrics in SERIES.items():
        report[key] = trend(_values(rows, metrics), fraction=0.34 if key == "eval_accuracy" else 0.2)
    parity = _values(rows, ("sampling/sampling_logp_difference/mean",))
    report["parity_checks"] = len(parity)
    report["parity_max_mean_abs"] = max(parity) if parity else None
    logged = _values(rows, ("health/parity_tolerance",))  # the tolerance the run resolved (by precision when null)
    report["parity_tolerance"] = logged[-1] if logged else (recipe and recipe.health.parity_tolerance) or 0.05
    warnings: list[str] = []
    for r in rows:
        for w in str(r.get("health/warning") or "").split(" | "):
            if w and w not in warnings:
                warnings.append(w)
    report["warnings"] = warnings
    report["skipped_updates"] = rows[-1].get("skipped_updates")
    report.update(graph_counts(rows))
    report["findings"] = findings(report)
    return report


def format_report(report: dict) -> str:
    """The human-readable part of ``lorarl doctor``."""
    lines = [f"run {report['run']} ({report['algo']}, {report['steps']} steps)"]
    keys = ("reward", "accuracy", "eval_accuracy", "frac_reward_zero_std", "kl", "clip_fraction", "entropy")
    for key in keys + ("preference_accuracy", "eval_preference_accuracy", "reward_margin"):
        t = report.get(key)
        if t:
            lines.append(f"  {key:<20} {t['start']:>10.4f} -> {t['end']:<10.4f} ({t['change']:+.4f})")
    for key in ("completion_length", "clipped_ratio"):
        t = report.get(key)
        if t:
            lines.append(f"  {key:<20} {t['start']:>10.2f} -> {t['end']:<10.2f}")
    if report["parity_checks"]:
        lines.append(
            f"  parity           {report['parity_checks']} checks, worst mean |delta log-prob| "
            f"{report['parity_max_mean_abs']:.2e} (tolerance {report['parity_tolerance']:g})"
        )
    if report.get("graph_captures") is not None:
        lines.append(
            f"  CUDA graphs      {report['graph_captures']} captured, {report['graph_capture_failures']} failed, "
            f"{report['eager_fallbacks']} decode batches eager"
        )
    lines.append("findings:" if report["findings"] else "findings: nothing stands out")
    lines += [f"  - {f}" for f in report["findings"]]
    return "\n".join(lines)
