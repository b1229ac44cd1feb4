"""Side-by-side benchmarks: ``lorarl bench grpo-vs-trl`` and ``lorarl bench ppo-memory``.

Each measures the code that trains, never a copy of it: lorarl's side of ``grpo-vs-trl`` is the real run loop on a
GRPO recipe (:mod:`lorarl.bench.grpo_vs_trl`), and both variants of ``ppo-memory`` build the real PPO algorithm
from one recipe and run its ``step``, once with every role on the one shared base and once with each role on its
own model copy behind the same interface (:mod:`lorarl.bench.ppo_memory`, :mod:`lorarl.bench.placement`). Peaks
are read at the phase boundaries the step itself marks (:mod:`lorarl.bench.memory`).

Every engine or variant runs in a fresh process (``python -m lorarl.bench _worker ...``, :mod:`lorarl.bench.procs`),
one after the other, so each peak is its own. The parent prints a table, then returns a dict that the CLI prints as
its last stdout line; ``result.json`` in the output folder holds the same.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from lorarl.bench import grpo_vs_trl, ppo_memory
from lorarl.bench.procs import machine_description
from lorarl.errors import LorarlError

BENCHES = ("grpo-vs-trl", "ppo-memory", "rollout")
GRPO_SETTINGS = grpo_vs_trl.SETTINGS
PPO_SETTINGS = ppo_memory.SETTINGS


def run_bench(
    which: str,
    steps: int = 5,
    model: str = "smollm2-135m",
    out: str | None = None,
    timeout: float = 3600,
    ppo_prompts: int | None = None,
    ppo_max_new_tokens: int | None = None,
    rollout_options: dict | None = None,
) -> dict:
    """Run benchmark ``which`` (``grpo-vs-trl``, ``ppo-memory`` or ``rollout``); print a table; return the result.

    ``rollout_options``: the rollout bench's shapes / batches / new_tokens / repeats / profile
    (:mod:`lorarl.bench.rollout`).

    ``steps`` are grpo-vs-trl's steps per engine; ``ppo_prompts`` / ``ppo_max_new_tokens`` shrink the PPO step
    (tests; the defaults are :data:`PPO_SETTINGS`). ``timeout`` is per worker process. Workers use every CPU this
    process may run on, or ``$LORARL_BENCH_THREADS`` threads.
    """
    if which not in BENCHES:
        raise LorarlError(f"unknown benchmark {which!r} ({', '.join(BENCHES)})")
    if steps < 1:
        raise LorarlError("bench: --steps must be >= 1")
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="lorarl-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if which == "rollout":
        import argparse

        from lorarl.bench import rollout

        result = rollout.run_cli(argparse.Namespace(model=model, out=str(out_dir), **(rollout_options or {})))
    elif which == "grpo-vs-trl":
        result = grpo_vs_trl.run(steps, model, out_dir, timeout)
    else:
        result = ppo_memory.run(model, out_dir, timeout, ppo_prompts, ppo_max_new_tokens)
    result = {"bench": which, "model": model, **result, "machine": machine_description(), "out": str(out_dir)}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


__all__ = ["BENCHES", "GRPO_SETTINGS", "PPO_SETTINGS", "run_bench"]
