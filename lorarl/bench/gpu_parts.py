"""The parts of ``lorarl bench gpu`` (:mod:`lorarl.bench.gpu`): each a function ``part(ctx) -> dict`` that runs the
existing benchmark or validation it names, with the settings of ``ctx.settings`` (full GPU sizes, or the tiny
shapes of ``--smoke``), and returns ``{"result": ..., "headline": [lines]}``. Every headline line gives a figure as
a ratio against a peer or a bound measured in the same run.

* ``env``: :func:`lorarl.env_report.collect`;
* ``hf-profile``: torch.profiler on HF ``generate``'s decode step (:func:`lorarl.bench.rollout.profile_steps`) of
  a random-init NF4 model of a published shape: top operators by device time, wall / host / device ms per step,
  against the weight-streaming bound;
* ``rollout``: ``bench rollout`` (:func:`lorarl.bench.rollout.run`), one shape at a time, each kept in
  ``rollout.files/<shape>.json`` so a rerun resumes; CUDA-graph use, capture failures and eager fallbacks per row;
* ``kernel``: :func:`lorarl.bench.kernel_tiles.run`, lorarl's NF4 decode matmul at candidate tile sizes per decoder
  projection and batch size, against its default tiles, bitsandbytes' ``matmul_4bit`` and the weight-streaming bound;
* ``quickstart``: ``recipes/grpo_arithmetic.yaml`` through the real run loop with the fast engine; held-out
  accuracy against the base's, step time against the same steps with the hf engine, the parity metrics;
* ``step``: :func:`lorarl.bench.step.run`, a whole GRPO and PPO step at the 1.5B and 8B shapes in NF4 under a 24 GB
  budget against TRL's ``GRPOTrainer`` (continuous batching off and on), ratios lorarl / TRL;
* ``grpo-vs-trl``: :func:`lorarl.bench.grpo_vs_trl.run` (lorarl with the fast engine);
* ``plan``: :func:`lorarl.bench.plan_validation.validate` (packed GRPO training, the fast engine's static cache);
* ``deterministic``: :mod:`lorarl.bench.determinism` (the run with and without ``train.deterministic``, and the
  row gather's cost).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class PartContext:
    """What a part gets: the output folder, its own folder for raw files (``<out>/<part>.files``), the device, its
    settings, whether this is the smoke mode, and ``force`` (re-measure what a previous run kept)."""

    out: Path
    work: Path
    device: Any  # torch.device
    settings: dict
    smoke: bool
    force: bool = False


class PartError(RuntimeError):
    """A part that failed after measuring something: the error, and what it measured (kept in its JSON)."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


# ---- env ------------------------------------------------------------------------------------------------------------
def part_env(ctx: PartContext) -> dict:
    from lorarl.env_report import collect

    env = collect()
    dev, bnb = env["devices"], env["bitsandbytes_nf4"]
    names = ", ".join(f"{d['name']} (cc {d['capability']}, {d['memory_gb']} GB)" for d in dev["devices"]) or "no GPU"
    pk = env["packages"]
    return {
        "result": env,
        "headline": [
            f"{names}; driver {dev['driver']}, CUDA runtime {dev['cuda_runtime']}",
            f"torch {pk['torch']}, transformers {pk['transformers']}, peft {pk['peft']}, trl {pk['trl']}, "
            f"bitsandbytes {pk['bitsandbytes']}",
            f"NF4 Linear4bit on {bnb['device']}: {'ok' if bnb['ok'] else 'FAILED'}"
            + (f", max error / max output {bnb['relative_error']}" if bnb.get("relative_error") is not None else "")
            + (f" ({bnb['error']})" if bnb.get("error") else ""),
        ],
    }


# ---- hf-profile -----------------------------------------------------------------------------------------------------
def part_hf_profile(ctx: PartContext) -> dict:
    """HF ``generate``'s decode step under the profiler, per batch size, against the weight-streaming bound."""
    from lorarl.bench import rollout as rb
    from lorarl.bench.rollout_report import ratio
    from lorarl.rollout.engines import HFEngine

    s = ctx.settings
    shared = rb.random_shared(s["shape"], ctx.device, s["quantization"])
    rb.add_policy(shared)
    bandwidth = rb.measure_bandwidth(ctx.device, s.get("bandwidth_bytes"))
    weights = rb.weight_bytes_per_step(shared)
    bound_ms = 1000 * weights / bandwidth
    rows, lines = [], []
    for b in s["batches"]:
        prof = rb.profile_steps(shared, HFEngine(), b, s["prompt_len"], top=s["top"])
        row = {
            "batch": b,
            **prof,
            "bound_ms": round(bound_ms, 6),
            "wall_over_bound": ratio(prof["wall_ms_per_step"], bound_ms),
            "device_over_bound": ratio(prof["device_ms_per_step"], bound_ms),
        }
        rows.append(row)
        top = row["top_9_tokens"][0]["op"] if row["top_9_tokens"] else "-"
        busy = f"{100 * row['device_busy']:.0f}%" if row["device_busy"] is not None else "-"
        lines.append(
            f"{s['shape']}:{s['quantization']} B={b}: {prof['wall_ms_per_step']:.2f} ms/step wall (x"
            f"{row['wall_over_bound']} the {bound_ms:.3f} ms weight-streaming bound), device "
            f"{prof['device_ms_per_step']:.2f} ms (busy {busy}), host ops {prof['host_ms_per_step']:.2f} ms, "
            f"{prof['aten_ops_per_step']} aten ops/step; top op {top}"
        )
    return {
        "result": {
            "shape": s["shape"],
            "quantization": s["quantization"],
            "device": ctx.device.type,
            "bandwidth_bytes_per_s": bandwidth,
            "weight_bytes_per_step": weights,
            "rows": rows,
        },
        "headline": lines,
    }


# ---- rollout --------------------------------------------------------------------------------------------------------
def part_rollout(ctx: PartContext) -> dict:
    """``bench rollout`` one shape at a time (kept per shape, so a rerun resumes), with the targets checked."""
    from lorarl.bench import rollout as rb

    s = ctx.settings
    results = []
    for shape in s["shapes"]:
        kept = ctx.work / f"{shape}.json"
        if kept.is_file() and not ctx.force:
            print(f"[bench gpu] rollout {shape}: kept from a previous run ({kept})", flush=True)
            results.append(json.loads(kept.read_text()))
            continue
        res = rb.run(
            device=ctx.device.type,
            shapes=[shape],
            quantization=s["quantization"],
            batches=tuple(s["batches"]),
            prompt_len=s["prompt_len"],
            new_tokens=s["new_tokens"],
            repeats=s["repeats"],
        )
        write_json(kept, res)
        results.append(res)
    rows = [r for res in results for r in res["rows"]]
    lines = [rollout_line(r) for r in rows]
    targets = rollout_targets(rows, s.get("target_model"), s.get("target_batch", 16))
    if targets:
        lines.append(
            f"target ({targets['model']} B={targets['batch']}: <= 20 ms/step and >= 5x hf): "
            f"{targets['fast_ms_per_step']} ms/step, {targets['speedup']}x -> {'met' if targets['met'] else 'NOT met'}"
        )
    return {"result": {"runs": results, "rows": rows, "targets": targets}, "headline": lines}


def rollout_line(r: dict) -> str:
    from lorarl.bench.rollout_report import kernel_text

    fast = r["fast"]
    fails = fast.get("graph_failures") or {}
    graphs = "graphs" if fast.get("cuda_graphs") else ("EAGER fallback" if fast.get("eager_fallback") else "eager")
    extra = f", {len(fails)} capture failure(s): {next(iter(fails.values()))}" if fails else ""
    if fast.get("unsupported_reason"):
        extra += f", fell back to hf: {fast['unsupported_reason']}"
    return (
        f"{r['model']} B={r['batch']}: fast {fast['ms_per_step']:.2f} ms/step, hf {r['hf']['ms_per_step']:.2f} "
        f"(hf/fast {r['speedup']}); bound {r['bound_ms']:.3f} ms (fast x{r['fast_over_bound']}, hf "
        f"x{r['hf_over_bound']}); {graphs}{extra}; {kernel_text(r)}"
    )


def rollout_targets(rows: list[dict], model: str | None, batch: int) -> dict | None:
    """The rollout issue's target on ``model`` at ``batch``: fast <= 20 ms per decode step and >= 5x HF."""
    row = next((r for r in rows if model and r["model"].startswith(model) and r["batch"] == batch), None)
    if row is None:
        return None
    ms, speedup = row["fast"]["ms_per_step"], row["speedup"]
    return {
        "model": row["model"],
        "batch": batch,
        "fast_ms_per_step": ms,
        "speedup": speedup,
        "met": bool(ms <= 20 and speedup is not None and speedup >= 5),
    }


# ---- kernel ---------------------------------------------------------------------------------------------------------
def part_kernel(ctx: PartContext) -> dict:
    """The NF4 decode matmul's tiles (:mod:`lorarl.bench.kernel_tiles`; off CUDA under Triton's interpreter)."""
    from lorarl.bench import kernel_tiles

    s = ctx.settings
    res = kernel_tiles.run(s["shapes"], s["batches"], s["repeats"], ctx.device.type, s.get("bandwidth_bytes"))
    return {"result": res, "headline": kernel_tiles.headline(res)}


# ---- quickstart -----------------------------------------------------------------------------------------------------
def run_metrics(recipe, run_dir: Path, steps: int) -> list[dict]:
    from lorarl.algos import loop
    from lorarl.runs import read_metrics

    loop.train(recipe, run_dir, max_steps=steps)
    return [r for r in read_metrics(run_dir) if "step" in r]


def median_of(rows: list[dict], key: str, first: int = 2, last: int | None = None) -> float | None:
    """Median of ``key`` over steps ``first..last`` (the first step, a warm-up, left out by default)."""
    vals = [float(r[key]) for r in rows if key in r and first <= r["step"] <= (last or r["step"])]
    return round(statistics.median(vals), 4) if vals else None


def part_quickstart(ctx: PartContext) -> dict:
    """The quickstart recipe with the fast engine (held-out accuracy at the end, parity on step 1 and every
    ``health.parity_every``), the base's accuracy, and the first ``peer_steps`` steps again with the hf engine."""
    from lorarl.config import load_recipe
    from lorarl.evaluate import evaluate

    s = ctx.settings
    path = recipe_path(s["recipe"])
    steps = s.get("steps") or load_recipe(path, s["overrides"]).train.steps
    common = [*s["overrides"], f"train.steps={steps}", f"eval.n={s['eval_n']}"]
    recipe = load_recipe(path, [*common, "generation.engine=fast", f"eval.every={steps}"])
    rows = run_metrics(recipe, ctx.work / "fast", steps)
    base = evaluate(recipe, "base", n=s["eval_n"])
    peer_steps = min(s["peer_steps"], steps)
    peer = load_recipe(path, [*common, "generation.engine=hf", "eval.every=0", f"train.steps={peer_steps}"])
    peer_rows = run_metrics(peer, ctx.work / "hf", peer_steps)
    last = rows[-1]
    parity = [
        r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r
    ]
    parity_max = [
        r["sampling/sampling_logp_difference/max"] for r in rows if "sampling/sampling_logp_difference/max" in r
    ]
    res = {
        "steps": steps,
        "eval_n": s["eval_n"],
        "accuracy": last.get("eval/accuracy"),
        "base_accuracy": base.get("accuracy"),
        "fast_step_s": median_of(rows, "step_time", 2, peer_steps),
        "hf_step_s": median_of(peer_rows, "step_time", 2, peer_steps),
        "fast_generation_s": median_of(rows, "time/generation", 2, peer_steps),
        "hf_generation_s": median_of(peer_rows, "time/generation", 2, peer_steps),
        "median_step_s_all": median_of(rows, "step_time"),
        "parity_mean_abs": parity,
        "parity_max_abs": parity_max,
        "parity_tolerance": parity_tolerance(recipe, ctx.device.type),
        "peak_mem_gb": max((r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r), default=None),
        "engine_metrics": {k: v for k, v in last.items() if any(w in k for w in ("graph", "fallback", "engine"))},
        "recipe": str(path),
        "overrides": common,
    }
    for a, b, name in (
        ("fast_step_s", "hf_step_s", "step_ratio"),
        ("fast_generation_s", "hf_generation_s", "gen_ratio"),
    ):
        res[name] = round(res[a] / res[b], 4) if res[a] and res[b] else None
    acc, base_acc = res["accuracy"], res["base_accuracy"]
    return {
        "result": res,
        "headline": [
            f"held-out accuracy {fmt(acc)} after {steps} steps vs the base's {fmt(base_acc)} "
            f"(n {s['eval_n']}, x{round(acc / base_acc, 2) if acc is not None and base_acc else '-'})",
            f"step time fast {res['fast_step_s']} s vs hf {res['hf_step_s']} s on steps 2-{peer_steps} "
            f"(fast/hf {res['step_ratio']}; generation {res['gen_ratio']})",
            f"parity: worst mean |delta log-prob| {fmt(max(parity) if parity else None)} nats "
            f"(tolerance {res['parity_tolerance']}, {len(parity)} checks)",
        ],
    }


def parity_tolerance(recipe, device_type: str) -> float | None:
    """The tolerance the run's parity check used (:func:`lorarl.health.parity_tolerance` where it exists)."""
    from lorarl import health

    if hasattr(health, "parity_tolerance"):
        return health.parity_tolerance(recipe, device_type)
    return recipe.health.parity_tolerance


def fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def recipe_path(name: str) -> Path:
    """A recipe file: a path or a shipped recipe (``grpo_arithmetic.yaml``; RecipeError, one line, when neither)."""
    from lorarl.config.shipped import resolve_recipe

    return resolve_recipe(name)


# ---- step -----------------------------------------------------------------------------------------------------------
def part_step(ctx: PartContext) -> dict:
    """A whole GRPO and PPO step of lorarl against TRL's GRPOTrainer (:func:`lorarl.bench.step.run`)."""
    from lorarl.bench import step

    res = step.run(ctx.settings, ctx.device.type, ctx.work)
    return {"result": res, "headline": step.headline(res)}


# ---- grpo-vs-trl, plan, deterministic -------------------------------------------------------------------------------
def part_grpo_vs_trl(ctx: PartContext) -> dict:
    from lorarl.bench import grpo_vs_trl

    s = ctx.settings
    res = grpo_vs_trl.run(s["steps"], s["model"], ctx.work, s.get("timeout", 900), decode_engine=s["engine"])
    lo, tr = res["engines"]["lorarl"], res["engines"]["trl"]
    return {
        "result": res,
        "headline": [
            f"lorarl ({s['engine']} engine) {lo['median_s_per_step']} s/step vs TRL GRPOTrainer "
            f"{tr['median_s_per_step']} s/step: time ratio {res['time_ratio']} (target <= 0.3)",
            f"peak memory {lo['peak_memory_gb']} GB vs {tr['peak_memory_gb']} GB: memory ratio {res['memory_ratio']}",
        ],
    }


def part_plan(ctx: PartContext) -> dict:
    from lorarl.bench.plan_validation import validate

    summary = validate([*ctx.settings["argv"], "--out", str(ctx.work)])
    lines = [f"max |predicted / measured - 1| = {summary['max_abs_error']} over every phase"]
    for res in summary["results"]:
        for algo, run in res["runs"].items():
            ratios = ", ".join(f"{ph} {r['ratio']}" for ph, r in run["phases"].items())
            lines.append(f"{res['model']} {algo}: predicted / measured per phase: {ratios}")
    result = {k: v for k, v in summary.items() if k != "table"} | {"table": summary["table"]}
    if summary["failures"]:
        raise PartError(f"plan validation failed for {summary['failures']}", {"result": result, "headline": lines})
    return {"result": result, "headline": lines}


def part_deterministic(ctx: PartContext) -> dict:
    from lorarl.bench.determinism import gather_cost, run_cost

    s = ctx.settings
    path = str(recipe_path(s["recipe"]))
    cost = run_cost(path, s["overrides"], s["steps"], ctx.work, s.get("timeout", 600))
    gather = gather_cost(path, s["overrides"], s["repeats"], tuple(s["gather_shape"]))
    d, b = cost["runs"]["deterministic"], cost["runs"]["default"]
    return {
        "result": {"run": cost, "gather": gather},
        "headline": [
            f"train.deterministic: {d['median_step_s']:.3f} s/step vs {b['median_step_s']:.3f} s/step without: "
            f"x{cost['time_ratio']}; reproducible twice in a row: with {d['reproducible']}, without {b['reproducible']}",
            f"row gather (index_select) / advanced indexing, forward + backward: "
            f"x{gather['ratio_deterministic_over_before']}",
        ],
    }


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


PARTS = {
    "env": part_env,
    "hf-profile": part_hf_profile,
    "rollout": part_rollout,
    "kernel": part_kernel,
    "quickstart": part_quickstart,
    "step": part_step,
    "grpo-vs-trl": part_grpo_vs_trl,
    "plan": part_plan,
    "deterministic": part_deterministic,
}
