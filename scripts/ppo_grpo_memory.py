"""Peak memory of a PPO step vs a GRPO step of the same batch shape, on the same model.

    python scripts/ppo_grpo_memory.py                      # embedded default architecture, NF4 on CUDA
    python scripts/ppo_grpo_memory.py --model /path/to/model --prompts 4 --group 4 --max-new-tokens 64

Both runs go through the real training loops (``lorarl.algos.grpo.train`` and ``lorarl.algos.ppo.train``) for
``--steps`` steps, each in a fresh process, and report the largest ``peak_mem_gb`` of their metrics
(``torch.cuda.max_memory_allocated``, weights included). On CPU: the peak of the bytes allocated by torch's CPU
allocator during the training loop (adapters, heads, optimizer states, KV cache, activations, logits), from
``torch.profiler``'s memory events, with the base loaded before profiling starts (the weights are not included).

Same batch shape: GRPO samples ``group`` completions for each of ``prompts`` prompts; PPO samples one completion for
each of ``prompts * group`` prompts, in one minibatch, with the same micro-batch size and ``max_new_tokens``. The
model is **randomly initialised** from the given model's config (``--random-init``, the default): memory does not
depend on the weight values, and a random model practically never emits EOS, so every completion has exactly
``max_new_tokens`` tokens in both runs. PPO runs all four roles on the one base (policy, reference, critic, and a
reward adapter made here with random weights); GRPO runs the policy and the reference (``kl_coef > 0``).

The last stdout line is one JSON object: ``{grpo_peak_gb, ppo_peak_gb, ratio, device, quantization, shape...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CHILD = """
import json, sys, torch
from lorarl.config import recipe_from_dict
recipe = recipe_from_dict(json.loads(sys.argv[1]))
mod = __import__(f"lorarl.algos.{recipe.algo}", fromlist=["train"])
if torch.cuda.is_available():
    mod.train(recipe, sys.argv[2])
else:  # CPU: the allocator's own alloc / free events, summed in time order (peak RSS would hide them)
    from torch.profiler import ProfilerActivity, profile
    from lorarl.model import SharedBase
    shared = SharedBase.load(recipe.model)  # loaded before profiling: the peak is the training loop's own
    SharedBase.load = classmethod(lambda cls, cfg, device=None: shared)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mod.train(recipe, sys.argv[2])
    # each op's net (self) allocation, and frees outside any op ("[memory]"), in time order: live bytes
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    with open(sys.argv[2] + "/cpu_peak.json", "w") as f:
        json.dump({"peak_bytes": peak}, f)
"""


def make_random_model(src: str, dest: Path) -> Path:
    """A randomly initialised copy of ``src``'s architecture (config + tokenizer) at ``dest``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorarl.model import load_tokenizer
    from lorarl.model.registry import resolve_model

    path = resolve_model(src)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest, safe_serialization=True)
    load_tokenizer(path).save_pretrained(dest)
    return dest


def make_reward_adapter(model_dir: str, dest: Path, quantization: str) -> Path:
    """A reward adapter + score head with random weights (for the memory measurement only)."""
    import torch

    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=model_dir, quantization=quantization))
    shared.add_adapter("reward", LoraSettings(r=16), head=True)
    with torch.no_grad():
        for p in shared.adapter_parameters("reward"):
            p.add_(torch.randn_like(p) * 0.01)
    shared.save_adapter("reward", dest / "reward")
    return dest


def run_one(recipe: dict, run_dir: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", _CHILD, json.dumps(recipe), str(run_dir)], check=True, env=env, cwd=str(REPO))
    if (run_dir / "cpu_peak.json").is_file():
        return json.loads((run_dir / "cpu_peak.json").read_text())["peak_bytes"] / 2**30
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return max(r["peak_mem_gb"] for r in rows if r.get("peak_mem_gb") is not None)


def measure(
    model: str = "smollm2-135m",
    *,
    prompts: int = 4,
    group: int = 4,
    max_new_tokens: int = 64,
    micro_batch: int = 8,
    steps: int = 2,
    quantization: str = "auto",
    random_init: bool = True,
    work_dir: str | None = None,
) -> dict:
    """Run GRPO and PPO for ``steps`` steps each on the same batch shape; return both peaks and their ratio."""
    import torch

    work = Path(work_dir or tempfile.mkdtemp(prefix="lorarl-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = str(make_random_model(model, work / "model")) if random_init else model
    reward_dir = make_reward_adapter(model_dir, work / "rm", quantization)
    common = {
        "model": {"name": model_dir, "quantization": quantization},
        "lora": {"r": 16, "alpha": 32.0},
        "data": {"source": "arithmetic", "train_size": 64, "eval_size": 8},
        "generation": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        "train": {"steps": steps, "micro_batch_size": micro_batch, "learning_rate": 1e-4},
    }
    grpo = {
        **common,
        "algo": "grpo",
        "train": {**common["train"], "prompts_per_step": prompts},
        "grpo": {"group_size": group, "kl_coef": 0.04, "num_iterations": 1},
    }
    ppo = {
        **common,
        "algo": "ppo",
        "train": {**common["train"], "prompts_per_step": prompts * group},
        "ppo": {
            "reward_adapter": str(reward_dir),
            "epochs": 1,
            "minibatch_size": prompts * group,
            "kl_coef": 0.05,
            "critic_init": "fresh",
            "critic_lora": {"r": 16, "alpha": 32.0},
        },
    }
    grpo_peak = run_one(grpo, work / "grpo")
    ppo_peak = run_one(ppo, work / "ppo")
    cuda = torch.cuda.is_available()
    return {
        "grpo_peak_gb": round(grpo_peak, 4),
        "ppo_peak_gb": round(ppo_peak, 4),
        "ratio": round(ppo_peak / grpo_peak, 4),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "measure": "torch.cuda.max_memory_allocated"
        if cuda
        else "CPU allocator peak during training, base weights excluded",
        "quantization": ("nf4" if cuda else "none") if quantization == "auto" else quantization,
        "model": model,
        "random_init": random_init,
        "sequences": prompts * group,
        "max_new_tokens": max_new_tokens,
        "micro_batch": micro_batch,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4, help="GRPO prompts per step (PPO uses prompts * group)")
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--quantization", choices=["auto", "nf4", "none"], default="auto")
    p.add_argument("--real-weights", action="store_true", help="use the model's weights (lengths then vary)")
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    result = measure(
        args.model,
        prompts=args.prompts,
        group=args.group,
        max_new_tokens=args.max_new_tokens,
        micro_batch=args.micro_batch,
        steps=args.steps,
        quantization=args.quantization,
        random_init=not args.real_weights,
        work_dir=args.work_dir,
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
