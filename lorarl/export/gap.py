"""What merging into a full-precision base changes compared with the NF4 model a run trained with.

:func:`measure_nf4_gap` loads both models side by side (the run's policy adapter on an NF4 base, as it trained,
:class:`.runtimes.TrainingRuntime`; and the merged full-precision export in transformers), lets each decode greedily
from the same prompts (the run's held-out prompts, as the fidelity gate :mod:`.gate` picks them) and compares:

- ``accuracy_nf4`` / ``accuracy_merged`` / ``accuracy_gap``: the task's verifier on each model's completions;
- ``logits_max_abs_diff`` / ``logits_mean_abs_diff`` / ``top1_agreement``: both models' full logits on the same
  token sequences (each prompt plus the NF4 model's greedy completion, every real position, pad left out), see
  :func:`logit_gap`; ``tokens_compared`` positions;
- ``greedy_agreement``: the fraction of prompts whose two greedy completions decode to the identical text (the
  gate's definition; ``token_agreement``: identical ids).

:func:`gap_table` renders these as the "NF4 training model vs merged full-precision export" table of
docs/exporting.md. Command line (prints the table; ``--json FILE`` also writes every figure)::

    python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] [--merged-dtype fp32] [--checkpoint NAME] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.export.merged import DTYPES, write_merged
from lorarl.export.source import locate

EXAMPLES = 3  # prompts whose two completions are kept in the result


@dataclass
class LogitGap:
    """Running sums of :func:`logit_gap` over batches."""

    max_abs: float = 0.0
    abs_sum: float = 0.0
    entries: int = 0
    top1_same: int = 0
    tokens: int = 0

    def add(self, a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> None:
        """Add one batch: logits ``a``, ``b`` ``[B, T, V]`` of the same ids, ``real`` ``[B, T]`` (False: pad)."""
        diff = (a.float() - b.float()).abs()[real]  # [tokens, V]
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
        self.abs_sum += float(diff.sum())
        self.entries += diff.numel()
        self.top1_same += int((a.argmax(-1) == b.argmax(-1))[real].sum())
        self.tokens += int(real.sum())

    def figures(self) -> dict:
        return {
            "tokens_compared": self.tokens,
            "logits_max_abs_diff": self.max_abs,
            "logits_mean_abs_diff": self.abs_sum / max(self.entries, 1),
            "top1_agreement": self.top1_same / self.tokens if self.tokens else 1.0,
        }


def logit_gap(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> dict:
    """Over the real positions ``(b, t)`` (``real`` ``[B, T]``) of two models' logits ``a``, ``b`` ``[B, T, V]``:

    - ``logits_max_abs_diff = max_{b,t,v} |a[b,t,v] - b[b,t,v]|``
    - ``logits_mean_abs_diff = mean_{b,t,v} |a[b,t,v] - b[b,t,v]|`` (over positions and the whole vocabulary)
    - ``top1_agreement = mean_{b,t} [argmax_v a[b,t] == argmax_v b[b,t]]``; ``tokens_compared`` = the positions.
    """
    tally = LogitGap()
    tally.add(a, b, real)
    return tally.figures()


def _logit_gap_on(nf4: Any, merged: Any, prompts: list, completions: list, batch_size: int) -> dict:
    """:func:`logit_gap` of the two runtimes on each prompt plus its completion, in batches, left-padded."""
    from lorarl.model.tokens import pad_left

    tally = LogitGap()
    for s in range(0, len(prompts), batch_size):
        seqs = [p + c for p, c in zip(prompts[s : s + batch_size], completions[s : s + batch_size])]
        ids, mask = pad_left(seqs, nf4.pad_id)
        mask = mask.long()
        a = nf4.logits(ids, mask).cpu()
        b = merged.logits(ids, mask).cpu()
        tally.add(a, b, mask.bool())
    return tally.figures()


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
    quantization: str = "nf4",
) -> dict:
    """The figures of the module docstring for the run's policy on a ``quantization`` base (``nf4``; ``none``: the
    recipe's precision) against a merged export (``merged_dir``; None: merged now in ``merged_dtype`` into a
    temporary folder), on ``prompts`` (strings, chat-message lists or rows with ``prompt`` and ``answer``) or the
    first ``n`` held-out prompts. Both models are loaded at once."""
    from lorarl.export.gate import _accuracy, _tally, gate_prompts
    from lorarl.export.runtimes import TrainingRuntime, export_runtime

    src = locate(run_dir, checkpoint)
    recipe = src.recipe or Recipe()
    tmp = nf4 = merged = None
    try:
        if merged_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="lorarl-merged-"))
            write_merged(src, tmp, merged_dtype)
            merged_dir = tmp
        nf4 = TrainingRuntime(src, recipe, device, quantization, batch_size)
        merged = export_runtime(
            "merged", Path(merged_dir), nf4.eos_ids, nf4.pad_id, device=device, batch_size=batch_size
        )
        tok = nf4.tokenizer
        rows, where = gate_prompts(src, recipe, tok, len(prompts) if prompts is not None else n, prompts)
        k = min(n if prompts is None else len(prompts), len(rows))
        if k < 1:
            raise LorarlError("python -m lorarl.export.gap: no prompts to compare on (--n must be >= 1)")
        ids = rows.token_ids[:k]
        max_new = max_new_tokens or recipe.eval.max_new_tokens or recipe.generation.max_new_tokens
        out = {"nf4": nf4.greedy(ids, max_new), "merged": merged.greedy(ids, max_new)}
        texts = {key: [tok.decode(c, skip_special_tokens=True) for c in v] for key, v in out.items()}
        acc = _accuracy(recipe, rows, {"trained": texts["nf4"], "export": texts["merged"]})
        return {
            "training_model": nf4.name,
            "export_runtime": merged.name,
            "device": str(nf4.shared.device),
            "merged_dtype": _short_dtype(next(merged.model.parameters()).dtype),
            "prompts": k,
            "prompt_source": where,
            "max_new_tokens": max_new,
            "accuracy_nf4": acc["accuracy_trained"],
            "accuracy_merged": acc["accuracy_export"],
            "accuracy_gap": acc["accuracy_delta"],
            **_logit_gap_on(nf4, merged, ids, out["nf4"], batch_size),
            **_tally(texts["nf4"], texts["merged"], out["nf4"], out["merged"]),
            "examples": [
                {"prompt": rows.texts[i], "nf4": texts["nf4"][i], "merged": texts["merged"][i]}
                for i in range(min(EXAMPLES, k))
            ],
        }
    finally:
        for rt in (nf4, merged):
            if rt is not None:
                rt.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _short_dtype(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``fp32`` (``bf16``, ``fp16``; other dtypes by their torch name)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def _pct(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{100 * v:.{digits}f}%"


def gap_table(result: dict) -> str:
    """The docs' table (docs/exporting.md) of a :func:`measure_nf4_gap` result (markdown, one line per row)."""
    trained = "NF4 base + LoRA (what trained)" if "nf4 base" in result["training_model"] else result["training_model"]
    merged = f"merged {result['merged_dtype']} export"
    return "\n".join(
        [
            f"| | {trained} | {merged} |",
            "|---|---|---|",
            f"| held-out accuracy | {_pct(result['accuracy_nf4'])} | {_pct(result['accuracy_merged'])} |",
            f"| logits on the same {result['tokens_compared']:,} tokens | max abs diff "
            f"{result['logits_max_abs_diff']:.3g}, mean {result['logits_mean_abs_diff']:.3g}, same top-1 token "
            f"{_pct(result['top1_agreement'], 0)} | |",
            f"| identical greedy completions | {_pct(result['greedy_agreement'])} | |",
        ]
    )


def _write_json(result: dict, path: Path) -> None:
    """``result`` as JSON at ``path``, atomically (a temporary file beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] ...``: print the NF4-vs-merged table."""
    p = argparse.ArgumentParser(prog="python -m lorarl.export.gap", description=main.__doc__)
    p.add_argument("run")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--merged", default=None, help="an existing merged export (default: merge now)")
    p.add_argument("--merged-dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write every figure (and example completions) to this file")
    args = p.parse_args(argv)
    try:
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
    except LorarlError as e:
        print(f"lorarl: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{result['training_model']} vs {result['export_runtime']}, greedy, {result['prompts']} prompts "
        f"({result['prompt_source']}), at most {result['max_new_tokens']} new tokens:\n"
    )
    print(gap_table(result), flush=True)
    if args.json:
        _write_json(result, Path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
