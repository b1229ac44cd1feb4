"""What SFT packing (``sft.packing``) buys: tokens per second of packed against unpacked SFT on the same rows, in
one process.

Two SFT set-ups of the same recipe on the same rows, each on its own copy of the base (same seed, same LoRA): one
unpacked (``sft.batch_size`` examples a step, each row padded to its micro-batch's longest), one packed
(``--pack-batch`` packed rows of ``sft.max_length`` tokens a step, no padding but a row's tail). Both run every step
of ``--epochs`` passes over the rows, their steps interleaved (one of each in turn, so load from other processes
falls on both alike) after one warm-up step each; a step is :meth:`lorarl.algos.sft.SFT.step` (forward, backward,
optimizer), timed around it. Reported per set-up: steps, real tokens (what the rows hold; padding excluded), the
tokens the forwards ran (padding included), seconds, ``tokens_per_s`` = real tokens / seconds; and
``ratio = packed tokens_per_s / unpacked tokens_per_s``.

    python -m lorarl.bench.sft_packing --data examples/trl_quickstarts/imdb_sample --max-length 256 --epochs 2

The last stdout line is the JSON result. docs/pipeline.md ("Packing") holds the figures measured with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def padded_tokens(algo, rows: list[int]) -> int:
    """The tokens the forwards of one step run, padding included: per micro-batch, its rows x its widest row
    (unpacked: the longest prompt + the longest completion, as :func:`lorarl.algos.sft.example_batch` pads)."""
    from lorarl.update import micro_batches

    total = 0
    for s in micro_batches(len(rows), algo.mbs):
        part = rows[s]
        if algo.packs is not None:
            total += len(part) * max(len(algo.packs.ids[r]) for r in part)
        else:
            d = algo.data
            width = max(len(d.prompt_ids[i]) for i in part) + max(len(d.completion_ids[i]) for i in part)
            total += len(part) * width
    return total


def sft_recipe(model: str, data: str, max_length: int, batch: int, epochs: int, micro: int, packing: bool):
    from lorarl.config import recipe_from_dict

    return recipe_from_dict(
        {
            "algo": "sft",
            "model": {"name": model},
            "data": {"source": data},
            "sft": {"batch_size": batch, "max_length": max_length, "epochs": epochs, "packing": packing},
            "train": {"steps": 1_000_000, "micro_batch_size": micro, "learning_rate": 1e-4, "seed": 0},
        }
    )


def run(
    model: str = "smollm2-135m",
    data: str = "examples/trl_quickstarts/imdb_sample",
    max_length: int = 256,
    batch: int = 8,
    pack_batch: int = 2,
    epochs: int = 2,
) -> dict[str, Any]:
    """Both set-ups, interleaved (see the module docstring); the result dict."""
    import torch

    from lorarl.algos.loop import set_threads
    from lorarl.algos.sft import SFT
    from lorarl.model import SharedBase

    set_threads()
    setups = {
        "unpacked": sft_recipe(model, data, max_length, batch, epochs, batch, packing=False),
        "packed": sft_recipe(model, data, max_length, pack_batch, epochs, pack_batch, packing=True),
    }
    algos = {}
    for name, recipe in setups.items():
        torch.manual_seed(0)
        algos[name] = SFT(recipe, SharedBase.load(recipe.model))
    out: dict[str, Any] = {
        name: {"steps": a.total_steps - 1, "tokens": 0, "forward_tokens": 0, "seconds": 0.0}
        for name, a in algos.items()
    }
    for a in algos.values():  # warm-up, not counted
        a.step(a.batch(1))
    todo = {name: list(range(2, a.total_steps + 1)) for name, a in algos.items()}
    while any(todo.values()):
        for name, a in algos.items():
            if not todo[name]:
                continue
            batch_rows = a.batch(todo[name].pop(0))
            t0 = time.perf_counter()
            row = a.step(batch_rows)
            out[name]["seconds"] += time.perf_counter() - t0
            out[name]["tokens"] += int(row["tokens"])
            out[name]["forward_tokens"] += padded_tokens(a, batch_rows.rows)
    for r in out.values():
        r["tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
        r["padding_share"] = 1 - r["tokens"] / max(r["forward_tokens"], 1)
    out["packed"]["rows"] = len(algos["packed"].packs)
    out["examples"] = len(algos["unpacked"].data)
    out["ratio"] = out["packed"]["tokens_per_s"] / out["unpacked"]["tokens_per_s"]
    out["settings"] = {
        "model": model,
        "data": data,
        "max_length": max_length,
        "batch": batch,
        "pack_batch": pack_batch,
        "epochs": epochs,
        "device": str(next(iter(algos.values())).shared.device),
        "threads": torch.get_num_threads(),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorarl.bench.sft_packing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="examples/trl_quickstarts/imdb_sample", help="text rows (data.source)")
    p.add_argument("--max-length", type=int, default=256, help="sft.max_length: the packed rows' length")
    p.add_argument("--batch", type=int, default=8, help="unpacked: examples a step (and a micro-batch)")
    p.add_argument("--pack-batch", type=int, default=2, help="packed: packed rows a step (and a micro-batch)")
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args(argv)
    result = run(a.model, a.data, a.max_length, a.batch, a.pack_batch, a.epochs)
    for name in ("unpacked", "packed"):
        r = result[name]
        print(
            f"{name:9s} {r['steps']:3d} steps  {r['tokens']:6d} tokens ({100 * r['padding_share']:.0f}% padding in "
            f"the forwards)  {r['seconds']:7.1f} s  {r['tokens_per_s']:7.1f} tokens/s",
            file=sys.stderr,
        )
    print(f"packed / unpacked tokens per second: {result['ratio']:.2f}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
