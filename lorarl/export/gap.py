"""What merging into a full-precision base changes compared with the NF4 model a run trained with: the fidelity gate
(:mod:`.gate`) run on a merged export against the training model loaded with an NF4 base.

:func:`measure_nf4_gap` returns the gate's report (greedy agreement, accuracy of each, |delta log-prob| on the NF4
model's greedy tokens, argmax agreement). Command line (prints it as one JSON line)::

    python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] [--merged-dtype fp32] [--checkpoint NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lorarl.export.gate import run_gate
from lorarl.export.merged import DTYPES, write_merged
from lorarl.export.source import locate


def measure_nf4_gap(
    run_dir: str | os.PathLike,
    prompts: list | None = None,
    *,
    checkpoint: str | None = None,
    merged_dir: str | os.PathLike | None = None,
    n: int = 32,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    device: Any = None,
    merged_dtype: str = "fp32",
) -> dict:
    """The gate report of a merged export (``merged_dir``; None: merged now in ``merged_dtype`` into a temporary
    folder) against the run's policy on an NF4 base, on ``prompts`` (strings, chat-message lists or rows with
    ``prompt`` and ``answer``) or the first ``n`` held-out prompts."""
    src = locate(run_dir, checkpoint)
    tmp = None
    try:
        if merged_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="lorarl-merged-"))
            write_merged(src, tmp, merged_dtype)
            merged_dir = tmp
        return run_gate(
            src,
            "merged",
            merged_dir,
            n=len(prompts) if prompts is not None else n,
            device=device,
            max_new_tokens=max_new_tokens,
            train_quantization="nf4",
            batch_size=batch_size,
            prompts=prompts,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] ...``: print measure_nf4_gap's JSON."""
    p = argparse.ArgumentParser(prog="python -m lorarl.export.gap", description=main.__doc__)
    p.add_argument("run")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--merged", default=None, help="an existing merged export (default: merge now)")
    p.add_argument("--merged-dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    result = measure_nf4_gap(
        args.run,
        checkpoint=args.checkpoint,
        merged_dir=args.merged,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        device=args.device,
        merged_dtype=args.merged_dtype,
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
