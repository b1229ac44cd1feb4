"""What merging into a full-precision base changes compared with the NF4 model a run trained with.

:func:`measure_nf4_gap` loads both models, lets both decode greedily from the same prompts and compares their logits
on the same token sequences. Command line (prints the result as one JSON line)::

    python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] [--merged-dtype fp32] [--checkpoint NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.export.merged import DTYPES, torch_dtype, write_merged
from lorarl.export.source import POLICY, locate
from lorarl.model.sampling import generate_kwargs, use_clean_generation_config
from lorarl.model.tokens import completion_mask, pad_left, position_ids


def _prompt_rows(prompts: list | None, recipe: Recipe, n: int) -> list[dict]:
    """``prompts`` as rows with ``prompt``; None: the first ``n`` held-out rows (training rows without a held-out
    split)."""
    if prompts is None:
        from lorarl.data import read_rows

        try:
            rows = read_rows(recipe.data, "eval", size=n)[0]
        except LorarlError:
            rows = read_rows(recipe.data, "train", size=n)[0]
        return rows[:n]
    return [dict(p) if isinstance(p, dict) else {"prompt": p} for p in prompts]


def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits.float()


def _completions(generated: torch.Tensor, prompt_width: int, eos_ids: list[int]) -> list[list[int]]:
    """Each row's generated ids up to and including its first EOS."""
    ids = generated[:, prompt_width:]
    mask, _ = completion_mask(ids, eos_ids)
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


@dataclass
class _Tally:
    """Running sums over the compared positions, and both models' greedy completions."""

    max_abs: float = 0.0
    abs_sum: float = 0.0
    count: int = 0
    top1_same: int = 0
    tokens: int = 0
    completions: dict[str, list[list[int]]] = field(default_factory=lambda: {"nf4": [], "merged": []})

    def add_logits(self, a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> None:
        diff = (a - b).abs()[real]  # [tokens, V]
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.abs_sum += float(diff.sum())
        self.count += diff.numel()
        self.top1_same += int((a.argmax(-1) == b.argmax(-1))[real].sum())
        self.tokens += int(real.sum())


@torch.no_grad()
def _compare_batch(
    shared: Any, merged: Any, prompt_ids: list[list[int]], gen: dict, device: torch.device, tally: _Tally
) -> None:
    """Greedy completions of both models for one batch of prompts, then both models' logits on each prompt plus
    the NF4 model's completion."""
    pad, eos = shared.pad_id, shared.eos_ids
    ids, mask = pad_left(prompt_ids, pad)
    ids, mask = ids.to(device), mask.long().to(device)
    with shared.role(POLICY):
        out_nf4 = shared.generate(ids, mask, **gen)
    out_merged = merged.generate(input_ids=ids, attention_mask=mask, use_cache=True, **gen)
    c_nf4 = _completions(out_nf4, ids.shape[1], eos)
    tally.completions["nf4"] += c_nf4
    tally.completions["merged"] += _completions(out_merged, ids.shape[1], eos)
    fids, fmask = pad_left([p + c for p, c in zip(prompt_ids, c_nf4)], pad)
    fids, fmask = fids.to(device), fmask.long().to(device)
    with shared.role(POLICY):
        a = _logits(shared.module, fids, fmask)
    b = _logits(merged, fids, fmask)
    tally.add_logits(a, b, fmask.bool())


def _result(tally: _Tally, rows: list[dict], texts: list[str], tok: Any, settings: dict) -> dict:
    """The figures :func:`measure_nf4_gap` returns, ``settings`` (device, dtypes, max_new_tokens) among them."""
    from lorarl.rewards import extract_answer, is_correct

    n_rows = len(rows)
    done = tally.completions
    decoded = {k: [tok.decode(c, skip_special_tokens=True) for c in v] for k, v in done.items()}
    result = {
        "prompts": n_rows,
        "tokens_compared": tally.tokens,
        **settings,
        "logits_max_abs_diff": tally.max_abs,
        "logits_mean_abs_diff": tally.abs_sum / max(tally.count, 1),
        "top1_agreement": tally.top1_same / max(tally.tokens, 1),
        "greedy_agreement": sum(a == b for a, b in zip(done["nf4"], done["merged"])) / n_rows,
        "answer_agreement": sum(
            extract_answer(a) == extract_answer(b) for a, b in zip(decoded["nf4"], decoded["merged"])
        )
        / n_rows,
        "examples": [
            {"prompt": texts[i], "nf4": decoded["nf4"][i], "merged": decoded["merged"][i]}
            for i in range(min(3, n_rows))
        ],
    }
    answers = [r.get("answer") for r in rows]
    if any(a is not None for a in answers):
        scored = [(c_n, c_m, a) for c_n, c_m, a in zip(decoded["nf4"], decoded["merged"], answers) if a is not None]
        acc_nf4 = sum(is_correct(c, a) for c, _, a in scored) / len(scored)
        acc_merged = sum(is_correct(c, a) for _, c, a in scored) / len(scored)
        result.update({"accuracy_nf4": acc_nf4, "accuracy_merged": acc_merged, "accuracy_gap": acc_merged - acc_nf4})
    return result


def _load_merged(merged_dir: str | os.PathLike, dtype: str, device: torch.device, shared: Any) -> Any:
    """The merged export on the training model's device, sampling from a clean generation config with the training
    model's EOS ids and pad (the folder's own generation config adds no processors)."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch_dtype(dtype)).to(device).eval()
    use_clean_generation_config(merged, shared.eos_ids, shared.pad_id)
    return merged


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
    """The gap between the model a run trained (NF4 base + policy LoRA, as :class:`SharedBase` loads it) and its
    merged full-precision export, on sample prompts.

    ``prompts``: strings, chat-message lists or rows with ``prompt`` (and ``answer`` for accuracy); None takes ``n``
    rows of the recipe's held-out split. ``merged_dir``: an existing merged export (None: merged now into a temp
    folder, in fp32). Both models generate greedily from each prompt; the logits of both are compared on the same
    token sequences (each prompt plus the NF4 model's completion, pad positions left out).

    Returns ``logits_max_abs_diff`` / ``logits_mean_abs_diff`` (over all real positions and the vocabulary),
    ``top1_agreement`` (same argmax token), ``greedy_agreement`` (identical greedy completions), and with answers
    ``accuracy_nf4`` / ``accuracy_merged`` / ``accuracy_gap`` / ``answer_agreement`` (same extracted final answer).
    """
    from lorarl.data import encode_prompt, prompt_text
    from lorarl.model import SharedBase, pick_device
    from lorarl.model.loading import resolve_dtype

    src = locate(run_dir, checkpoint)
    recipe = src.recipe or Recipe()
    device = torch.device(device) if device is not None else pick_device()
    max_new_tokens = max_new_tokens or recipe.generation.max_new_tokens
    rows = _prompt_rows(prompts, recipe, n)
    if not rows:
        raise LorarlError("measure_nf4_gap: no prompts")

    mcfg = dataclasses.replace(recipe.model, name=src.base_path, quantization="nf4", gradient_checkpointing=False)
    shared = SharedBase.load(mcfg, device)
    shared.add_adapter(POLICY, init_from=src.adapter_dir, trainable=False)
    tok = shared.tokenizer
    tmp = None
    try:
        if merged_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="lorarl-merged-"))
            write_merged(src, tmp, "fp32")
            merged_dir = tmp
        merged = _load_merged(merged_dir, merged_dtype, device, shared)
        texts = [prompt_text(r["prompt"], tok, recipe.data.system_prompt, i) for i, r in enumerate(rows)]
        prompt_ids = [encode_prompt(t, tok, templated=not isinstance(r["prompt"], str)) for t, r in zip(texts, rows)]
        gen = generate_kwargs(greedy=True, max_new_tokens=max_new_tokens, eos_ids=shared.eos_ids, pad_id=shared.pad_id)
        tally = _Tally()
        for s in range(0, len(rows), batch_size):
            _compare_batch(shared, merged, prompt_ids[s : s + batch_size], gen, device, tally)
        settings = {
            "device": str(device),
            "nf4_compute_dtype": str(resolve_dtype(mcfg, device)).replace("torch.", ""),
            "merged_dtype": merged_dtype,
            "max_new_tokens": max_new_tokens,
        }
        return _result(tally, rows, texts, tok, settings)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        del shared
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export.gap RUN_DIR [--n 64] [--merged DIR] ...``: print measure_nf4_gap's JSON."""
    p = argparse.ArgumentParser(prog="python -m lorarl.export.gap", description=main.__doc__)
    p.add_argument("run")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--merged", default=None, help="an existing merged export (default: merge now, fp32)")
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
