"""Peak memory of a PPO step vs a GRPO step of the same batch shape, on the same model.

    python scripts/ppo_grpo_memory.py                      # embedded default architecture, NF4 on CUDA
    python scripts/ppo_grpo_memory.py --model /path/to/model --prompts 4 --group 4 --max-new-tokens 64

Each algorithm runs in a fresh process that builds the real algorithm from its recipe
(``lorarl.algos.make_algorithm`` on ``SharedBase.load``) and runs ``--steps`` of its real ``step`` -- the code
``lorarl train`` runs -- with per-phase peaks read at the phase boundaries the step marks
(``lorarl.bench.memory.PhasePeaks``). Reported: the largest step peak of each, weights included: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the same quantity, the bytes of the tensors alive before the step
(weights, adapters, heads, optimizer states) plus the peak of the step's allocation events (``torch.profiler``).

Same batch shape: GRPO samples ``group`` completions for each of ``prompts`` prompts; PPO samples one completion for
each of ``prompts * group`` prompts, in one minibatch, with the same micro-batch size and ``max_new_tokens``. The
model is **randomly initialised** from the given model's config (``--random-init``, the default): memory does not
depend on the weight values, and a random model practically never emits EOS, so every completion has exactly
``max_new_tokens`` tokens in both runs. PPO runs all four roles on the one base (policy, reference, critic, and a
reward adapter made here with random weights); GRPO runs the policy and the reference (``kl.coef > 0``).

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
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
    from lorarl.bench.synthetic import add_random_reward_adapter
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=model_dir, quantization=quantization))
    return add_random_reward_adapter(shared, dest / "reward", LoraSettings(r=16))


def worker(recipe_json: str, out_file: Path) -> None:
    """In this fresh process: the real algorithm from the recipe, its ``train.steps`` steps measured; writes the
    largest step peak and each phase's largest peak (bytes) to ``out_file``."""
    from lorarl.algos import make_algorithm
    from lorarl.bench.memory import PhasePeaks, run_step, tensor_bytes
    from lorarl.config import recipe_from_dict
    from lorarl.model import SharedBase

    recipe = recipe_from_dict(json.loads(recipe_json), where="<ppo_grpo_memory>")
    shared = SharedBase.load(recipe.model)
    algo = make_algorithm(recipe, shared)
    step_peak, phases = 0, {}
    for step in range(1, recipe.train.steps + 1):
        meter = PhasePeaks(shared.device, lambda: tensor_bytes([shared], algo.optimizers.values()))
        run_step(algo, step, meter)
        step_peak = max(step_peak, meter.step_peak)
        phases = {k: max(v, phases.get(k, 0)) for k, v in meter.peaks.items()}
    out_file.write_text(json.dumps({"peak_bytes": step_peak, "phase_peaks": phases}))


def run_one(recipe: dict, run_dir: Path) -> dict:
    """One algorithm in a fresh process (its peak is its own)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "peaks.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(recipe), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=str(REPO))
    return json.loads(out.read_text())


def recipes(
    model_dir: str,
    reward_dir: Path,
    prompts: int,
    group: int,
    max_new_tokens: int,
    micro_batch: int,
    steps: int,
    quantization: str,
) -> tuple[dict, dict]:
    """The GRPO and PPO recipes of the same batch shape (see the module docstring)."""
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
        "grpo": {"group_size": group, "num_iterations": 1, "kl": {"coef": 0.04}},
    }
    ppo = {
        **common,
        "algo": "ppo",
        "reward": {"source": "reward_model", "adapter": str(reward_dir)},
        "train": {**common["train"], "prompts_per_step": prompts * group},
        "ppo": {
            "epochs": 1,
            "minibatch_size": prompts * group,
            "kl": {"coef": 0.05},
            "critic": {"init": "fresh", "lora": {"r": 16, "alpha": 32.0}},
        },
    }
    return grpo, ppo


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
    grpo, ppo = recipes(model_dir, reward_dir, prompts, group, max_new_tokens, micro_batch, steps, quantization)
    g, p = run_one(grpo, work / "grpo"), run_one(ppo, work / "ppo")
    cuda = torch.cuda.is_available()
    return {
        "grpo_peak_gb": round(g["peak_bytes"] / 2**30, 4),
        "ppo_peak_gb": round(p["peak_bytes"] / 2**30, 4),
        "ratio": round(p["peak_bytes"] / g["peak_bytes"], 4),
        "grpo_phase_peaks_gb": {k: round(v / 2**30, 4) for k, v in g["phase_peaks"].items()},
        "ppo_phase_peaks_gb": {k: round(v / 2**30, 4) for k, v in p["phase_peaks"].items()},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "measure": "torch.cuda.max_memory_allocated"
        if cuda
        else "tensors alive before the step + the CPU allocator's peak during it",
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
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a recipe as JSON: run it here
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, Path(args.out))
        return 0
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
