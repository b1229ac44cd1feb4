"""The cost of the deterministic gather (issue 19), measured in one run: the GRPO training forward + backward of
the prefix-shared path on a quickstart-shaped batch (8 prompts x 8 completions of 16 tokens, the embedded model,
LoRA r 16 with non-zero B), with the deterministic gather (``index_select``, what lorarl runs) and with the advanced
indexing it replaced (transformers' ``batch_select_indices``), alternating, same process.

The code lives in :mod:`lorarl.bench.determinism` (``gather_cost``; ``lorarl bench gpu --part deterministic`` runs
it with the cost of ``train.deterministic`` on a GPU)::

    python scripts/determinism_cost.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lorarl.bench.determinism import main  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    sys.exit(main(["gather", "--repeats", str(args.repeats)]))
