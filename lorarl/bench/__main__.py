"""``python -m lorarl.bench _worker KIND ...``: one engine or variant of a benchmark, in this fresh process; its
result is the last stdout line (JSON). The parent (:func:`lorarl.bench.run_bench`) starts these."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no busy-waiting OpenMP threads

WORKERS = ("grpo-lorarl", "grpo-trl", "ppo-reward-adapter", "ppo-shared", "ppo-separate")
USAGE = "usage: lorarl bench grpo-vs-trl|ppo-memory|agent-turns [--steps N] [--model M] [--out DIR]"


def parse_worker_args(argv: list[str]) -> argparse.Namespace:
    from lorarl.bench.ppo_memory import SETTINGS

    p = argparse.ArgumentParser(prog="python -m lorarl.bench _worker")
    p.add_argument("kind", choices=WORKERS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=SETTINGS["prompts"])
    p.add_argument("--max-new-tokens", type=int, default=SETTINGS["max_new_tokens"])
    p.add_argument("--reward-adapter", default=None)
    p.add_argument("--engine", choices=["hf", "fast"], default="hf", help="grpo-lorarl: generation.engine")
    return p.parse_args(argv)


def worker_main(argv: list[str]) -> int:
    """Run one worker with the bench's thread count; print its result as one JSON line."""
    a = parse_worker_args(argv)
    import torch

    from lorarl.bench import grpo_vs_trl, ppo_memory
    from lorarl.bench.procs import bench_threads

    torch.set_num_threads(bench_threads())  # the same for every engine
    out = Path(a.out)
    if a.kind == "grpo-lorarl":
        res = grpo_vs_trl.worker_lorarl(a.model, a.steps, out, a.engine)
    elif a.kind == "grpo-trl":
        res = grpo_vs_trl.worker_trl(a.model, a.steps, out)
    elif a.kind == "ppo-reward-adapter":
        res = ppo_memory.worker_reward_adapter(a.model, out)
    else:
        variant = a.kind.split("-", 1)[1]
        res = ppo_memory.worker(variant, a.model, a.prompts, a.max_new_tokens, a.reward_adapter)
    res["threads"] = torch.get_num_threads()
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(worker_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "agent-turns":  # in this process (lorarl.bench.agent_turns)
        from lorarl.bench.agent_turns import main as agent_turns_main

        sys.exit(agent_turns_main(sys.argv[2:]))
    print(USAGE, file=sys.stderr)
    sys.exit(2)
