"""Generator / trainer parity gap (docs/grpo_options.md, health.parity_tolerance by precision) of the quickstart setup (embedded SmolLM2-135M, LoRA r16 with random non-zero
weights, 8 prompts x 8 completions, temperature 1) on CPU, per dtype and decode engine:
(a) mean / max |sampler - trainer| nats per completion token, what health.parity_tolerance bounds;
(b) the same tokens scored by the trainer in fp32 vs in the low precision (the precision's own rounding).

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python scripts/parity_by_dtype.py float32 bfloat16 float16

prints one line per (dtype, engine) and the whole table as JSON at the end (docs/measurements/parity_by_dtype_cpu.json).
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from lorarl.config import load_recipe
from lorarl.data import load_prompts
from lorarl.health import logprob_gap, parity_metrics
from lorarl.model import SharedBase
from lorarl.rollout import generate_rollout
from lorarl.rollout.generate import sequence_logprobs

recipe = load_recipe(Path("recipes/grpo_arithmetic.yaml"))
tmp = Path(tempfile.mkdtemp())
out = {}
fp32 = None
for dtype in sys.argv[1:]:
    recipe.model.dtype = dtype
    sb = SharedBase.load(recipe.model)
    if dtype == "float32":
        sb.add_adapter("policy", recipe.lora)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in sb.adapter_parameters("policy"):
                p.add_(torch.randn_like(p) * 0.01)
        sb.save_adapter("policy", tmp / "policy")
        fp32 = sb
    else:
        sb.add_adapter("policy", init_from=tmp / "policy", trainable=True)
    prompts = load_prompts(recipe.data, sb.tokenizer, "train", recipe_path=recipe.source_path)
    ids = [prompts.token_ids[i] for i in range(8)]
    for engine in ("hf", "fast"):
        recipe.generation.engine = engine
        torch.manual_seed(1)
        t = time.time()
        r = generate_rollout(sb, ids, recipe.generation, group_size=8, role="policy", record_sampler=True)
        m = parity_metrics(sb, r, "policy", recipe.generation.temperature, rows=len(r))
        row = {
            "sampler_vs_trainer_mean": m["sampling/sampling_logp_difference/mean"],
            "sampler_vs_trainer_max": m["sampling/sampling_logp_difference/max"],
            "tokens": m["health/parity_tokens"],
        }
        if dtype != "float32" and fp32 is not None:
            lo = sequence_logprobs(sb, "policy", r, 1.0)
            hi = sequence_logprobs(fp32, "policy", r, 1.0)
            g = logprob_gap(hi, lo, r.completion_mask)
            row.update(trainer_vs_fp32_mean=g["mean_abs"], trainer_vs_fp32_max=g["max_abs"])
        row["s"] = round(time.time() - t, 1)
        out[f"{dtype}/{engine}"] = row
        print(dtype, engine, row, flush=True)
    if dtype != "float32":
        del sb
print(json.dumps(out, indent=1))
