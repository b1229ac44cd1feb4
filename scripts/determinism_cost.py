"""The cost of the deterministic gather (issue 19), measured in one run: the GRPO training forward + backward of
the prefix-shared path on a quickstart-shaped batch (8 prompts x 8 completions of 16 tokens, the embedded model,
LoRA r 16 with non-zero B), with the deterministic gather (``index_select``, what lorarl runs) and with the advanced
indexing it replaced (transformers' ``batch_select_indices`` and ``hidden[inverse]``), alternating, same process.

    python scripts/determinism_cost.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from lorarl.config import load_recipe  # noqa: E402
from lorarl.model import SharedBase  # noqa: E402
from lorarl.model import logprobs as lp_mod  # noqa: E402


class Batch(SimpleNamespace):
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    recipe = load_recipe(os.path.join(os.path.dirname(__file__), "..", "recipes", "grpo_arithmetic.yaml"))
    shared = SharedBase.load(recipe.model)
    torch.manual_seed(0)
    shared.add_adapter("policy", recipe.lora)
    params = shared.trainable_parameters("policy")
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    U, G, P, T = 8, 8, 40, 16
    batch = Batch(
        prompt_ids=torch.randint(0, 49000, (U, P), generator=g).repeat_interleave(G, 0),
        prompt_mask=torch.ones(U * G, P, dtype=torch.bool),
        completion_ids=torch.randint(0, 49000, (U * G, T), generator=g),
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
        t = time.perf_counter()
        with shared.role("policy", train=True):
            lp, _ = lp_mod.completion_logprobs(shared, batch, 1.0)
            (-(lp * adv).mean()).backward()
        return time.perf_counter() - t

    once(deterministic), once(advanced)  # warm-up
    times = {"index_select (deterministic)": [], "advanced indexing (before)": []}
    for _ in range(args.repeats):
        times["index_select (deterministic)"].append(once(deterministic))
        times["advanced indexing (before)"].append(once(advanced))
    lp_mod.select_cache_rows = deterministic
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "median_s": med,
                "min_s": {k: min(v) for k, v in times.items()},
                "ratio_deterministic_over_before": med["index_select (deterministic)"]
                / med["advanced indexing (before)"],
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
