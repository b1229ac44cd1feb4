"""The cost of ``train.deterministic``, measured in one run (``lorarl bench gpu --part deterministic``).

Two measurements, each against its peer in the same run:

* :func:`run_cost`: the same GRPO run (a recipe + overrides, ``steps`` steps) in two fresh processes, one with
  ``train.deterministic: false`` and one with ``true`` (torch's deterministic algorithms; on CUDA a fixed cuBLAS
  workspace, which must be set before cuBLAS starts: hence a process each). Each process trains the run twice and
  says whether both runs logged the same metrics (``reproducible``): the point of the option. Reported:
  ``time_ratio = median step_time(deterministic) / median step_time(default)`` (the first step left out).
* :func:`gather_cost`: the issue-19 micro-benchmark (formerly ``scripts/determinism_cost.py``): the GRPO training
  forward + backward of the prefix-shared log-prob path on a quickstart-shaped batch (8 prompts x 8 completions of
  16 tokens, LoRA with non-zero B), with the deterministic row gather lorarl runs
  (:func:`lorarl.model.logprobs.select_cache_rows`, ``index_select``) and with the advanced indexing it replaced
  (transformers' ``batch_select_indices``), alternating, same process: ``ratio_deterministic_over_before``.

    python -m lorarl.bench.determinism --recipe recipes/grpo_arithmetic.yaml --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# metrics that two runs of the same (seed, step) must log identically when the run is reproducible
COMPARED_METRICS = ("loss", "reward", "completions/mean_length", "grad_norm", "kl", "entropy")


class _Batch(SimpleNamespace):
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def gather_cost(recipe_path: str, overrides: list[str], repeats: int = 10, shape=(8, 8, 40, 16)) -> dict[str, Any]:
    """Median / best seconds of one forward + backward with each row gather (see the module doc); ``shape`` is
    ``(U prompts, G completions each, P prompt tokens, T completion tokens)``."""
    import torch

    from lorarl.config import load_recipe
    from lorarl.model import SharedBase
    from lorarl.model import logprobs as lp_mod

    recipe = load_recipe(recipe_path, overrides)
    shared = SharedBase.load(recipe.model)
    torch.manual_seed(0)
    shared.add_adapter("policy", recipe.lora)
    params = shared.trainable_parameters("policy")
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
    U, G, P, T = shape
    vocab = min(49000, len(shared.tokenizer))
    g = torch.Generator().manual_seed(0)
    batch = _Batch(
        prompt_ids=torch.randint(0, vocab, (U, P), generator=g).repeat_interleave(G, 0),
        prompt_mask=torch.ones(U * G, P, dtype=torch.bool),
        completion_ids=torch.randint(0, vocab, (U * G, T), generator=g),
        completion_mask=torch.ones(U * G, T, dtype=torch.bool),
        prompt_index=[i // G for i in range(U * G)],
    )
    adv = torch.randn(U * G, T, generator=g)
    deterministic = lp_mod.select_cache_rows

    def advanced(cache, rows):  # what lorarl did before: transformers' batch_select_indices (advanced indexing)
        cache.batch_select_indices(rows)

    def once(select) -> float:
        lp_mod.select_cache_rows = select
        for p in params:
            p.grad = None
        sync(shared.device)
        t = time.perf_counter()
        with shared.role("policy", train=True):
            lp, _ = lp_mod.completion_logprobs(shared, batch, 1.0)
            (-(lp * adv.to(lp.device)).mean()).backward()
        sync(shared.device)
        return time.perf_counter() - t

    names = {"index_select (deterministic)": deterministic, "advanced indexing (before)": advanced}
    times: dict[str, list[float]] = {k: [] for k in names}
    try:
        for select in names.values():  # warm-up
            once(select)
        for _ in range(repeats):
            for name, select in names.items():
                times[name].append(once(select))
    finally:
        lp_mod.select_cache_rows = deterministic
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "ratio_deterministic_over_before": round(
            med["index_select (deterministic)"] / med["advanced indexing (before)"], 4
        ),
        "shape": {"prompts": U, "group": G, "prompt_len": P, "completion_len": T},
        "device": shared.device.type,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(recipe_path: str, overrides: list[str], deterministic: bool, steps: int, out: Path) -> dict[str, Any]:
    """Train the recipe twice in this process (``train.deterministic`` as given, ``steps`` steps each) and return
    both runs' step times and whether they logged the same :data:`COMPARED_METRICS`."""
    from lorarl.algos import loop
    from lorarl.config import load_recipe
    from lorarl.runs import read_metrics

    flag = f"train.deterministic={'true' if deterministic else 'false'}"
    runs = []
    for i in range(2):
        recipe = load_recipe(recipe_path, [*overrides, flag, f"train.steps={steps}"])
        run_dir = out / f"run-{i}"
        loop.train(recipe, run_dir, max_steps=steps)
        runs.append([r for r in read_metrics(run_dir) if "step" in r])
    step_times = [[float(r["step_time"]) for r in rows] for rows in runs]
    compared = [{k: r.get(k) for k in COMPARED_METRICS if k in r} for r in runs[0]]
    again = [{k: r.get(k) for k in COMPARED_METRICS if k in r} for r in runs[1]]
    return {
        "deterministic": deterministic,
        "steps": steps,
        "step_times_s": step_times,
        "median_step_s": statistics.median(t for ts in step_times for t in (ts[1:] or ts)),
        "reproducible": compared == again,
        "compared_metrics": sorted({k for row in compared for k in row}),
        "first_difference": next(
            ({"step": i + 1, "run_0": a, "run_1": b} for i, (a, b) in enumerate(zip(compared, again)) if a != b), None
        ),
    }


def run_cost(recipe_path: str, overrides: list[str], steps: int, out: Path, timeout: float = 600) -> dict[str, Any]:
    """Both settings, each in a fresh process (:func:`worker`); ``time_ratio`` = deterministic / default."""
    import subprocess

    from lorarl.bench.procs import REPO

    results = {}
    for det in (False, True):
        d = out / ("deterministic" if det else "default")
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "lorarl.bench.determinism", "_worker", "--recipe", recipe_path]
        cmd += ["--steps", str(steps), "--out", str(d)] + (["--deterministic"] if det else [])
        cmd += [f"--override={o}" for o in overrides]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the default run must not inherit the deterministic workspace
        print(f"[deterministic] train.deterministic={det} ...", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"train.deterministic={det} worker timed out after {timeout:.0f}s") from None
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"train.deterministic={det} worker failed (exit {proc.returncode}):\n{tail}")
        results["deterministic" if det else "default"] = json.loads(lines[-1])
    a, b = results["deterministic"]["median_step_s"], results["default"]["median_step_s"]
    return {"runs": results, "time_ratio": round(a / b, 4) if b else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from lorarl.config.shipped import shipped_recipes_dir

    p = argparse.ArgumentParser(prog="python -m lorarl.bench.determinism", description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="cost", choices=["cost", "gather", "_worker"])
    p.add_argument("--recipe", default=str(shipped_recipes_dir() / "grpo_arithmetic.yaml"))
    p.add_argument("--override", action="append", default=[], help="section.key=value (repeatable)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=10, help="gather: measurements per variant")
    p.add_argument("--deterministic", action="store_true", help="_worker: train.deterministic true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.mode == "gather":
        res = gather_cost(a.recipe, a.override, a.repeats)
    elif a.mode == "_worker":
        res = worker(a.recipe, a.override, a.deterministic, a.steps, Path(a.out))
    else:
        import tempfile

        out = Path(a.out or tempfile.mkdtemp(prefix="lorarl-determinism-"))
        res = run_cost(a.recipe, a.override, a.steps, out)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
