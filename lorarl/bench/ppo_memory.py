"""``lorarl bench ppo-memory``: the memory of one PPO step on lorarl's one shared base vs on four separate models.

Both variants build the real PPO algorithm from the same recipe (:func:`lorarl.algos.make_algorithm`: its roles,
reward source, optimizers) and run its real ``step`` -- rollout with old log-probs, reference log-probs,
reward-model scores, KL-shaped rewards, the critic's values, GAE, whitened advantages, then one policy and one
critic optimizer step over micro-batches (one epoch, one minibatch of all the step's prompts). Only where the
roles live differs:

(a) ``shared``: one :class:`~lorarl.model.SharedBase` with the policy, critic and reward as adapters and the
    reference as the base with adapters off;
(b) ``separate``: four copies of the model (:class:`lorarl.bench.placement.SeparateModels`): policy (+ its LoRA),
    reference (frozen, bare), critic (+ its LoRA and a value head) and reward model (+ its LoRA and a score head,
    frozen), behind the same interface the step uses.

The reward adapter (random weights: memory does not depend on them) is written once by its own worker, and both
variants load it as ``reward.adapter``. ``memory_ratio`` is shared / separate on the tensors' peak: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the weights, adapters, heads and optimizer states alive before a step
plus the peak of that step's allocation events (the profiler's, in a second step, so its buffers do not inflate the
first step's RSS) -- the same quantity (:mod:`lorarl.bench.memory`). ``rss_step_ratio`` (peak RSS minus the RSS
after imports, before any model) and ``peak_rss_ratio`` (raw peak RSS) are reported too: they also count the C
heap's retained free blocks and the mapped safetensors files. Each variant also reports its per-phase peaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorarl.bench.procs import (
    current_rss_bytes,
    device_and_dtype,
    peak_rss_bytes,
    ratio,
    ratios,
    run_worker,
)
from lorarl.errors import LorarlError

SETTINGS = {"prompts": 8, "max_new_tokens": 16, "micro_batch": 4, "lora_r": 16}
ROLES = ["policy", "reference", "critic", "reward"]
DATA_SEED = 1234
TEMPLATE = "What is {a} {op} {b}? Reply with only the number."


def ppo_recipe(model: str, prompts: int, max_new_tokens: int, reward_adapter: str) -> Any:
    """The PPO recipe both variants run: one epoch over one minibatch of ``prompts`` responses, micro-batches of
    ``SETTINGS["micro_batch"]``, KL to the reference on, the reward model as the reward source."""
    from lorarl.config import recipe_from_dict

    lora = {"r": SETTINGS["lora_r"], "alpha": 2.0 * SETTINGS["lora_r"]}
    return recipe_from_dict(
        {
            "algo": "ppo",
            "model": {"name": model, "quantization": "auto", "dtype": "auto", "gradient_checkpointing": True},
            "lora": lora,
            "data": {
                "source": "arithmetic",
                "train_size": 256,
                "seed": DATA_SEED,
                "arithmetic": {"prompt_template": TEMPLATE},
            },
            "reward": {"source": "reward_model", "adapter": reward_adapter},
            "generation": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
            "train": {
                "steps": 2,
                "prompts_per_step": prompts,
                "micro_batch_size": SETTINGS["micro_batch"],
                "learning_rate": 1e-5,
                "seed": 0,
            },
            "ppo": {"epochs": 1, "minibatch_size": prompts, "kl": {"coef": 0.05}, "critic": {"lora": lora}},
        },
        where="<bench ppo-memory>",
    )


def worker_reward_adapter(model: str, out: Path) -> dict:
    """Write the reward adapter (random weights) that both variants load."""
    from lorarl.bench.synthetic import add_random_reward_adapter
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=model, quantization="auto", dtype="auto"))
    lora = LoraSettings(r=SETTINGS["lora_r"], alpha=2.0 * SETTINGS["lora_r"])
    return {"adapter": str(add_random_reward_adapter(shared, out / "reward-adapter", lora))}


def worker(variant: str, model: str, prompts: int, max_new_tokens: int, reward_adapter: str) -> dict:
    """Set up PPO on the ``variant``'s placement and measure its step (see the module docstring)."""
    import peft  # noqa: F401  - imported before the baseline is read, like everything the step uses
    import torch
    import transformers  # noqa: F401

    import lorarl.algos.ppo  # noqa: F401
    from lorarl.algos import make_algorithm
    from lorarl.bench.memory import PhasePeaks, run_step, tensor_bytes
    from lorarl.bench.placement import SeparateModels
    from lorarl.model import SharedBase

    device, _ = device_and_dtype()
    torch.manual_seed(0)
    baseline = current_rss_bytes()  # the runtime with torch / transformers / peft imported, no model yet
    recipe = ppo_recipe(model, prompts, max_new_tokens, reward_adapter)
    if variant == "shared":
        shared: Any = SharedBase.load(recipe.model)
        bases = [shared]
    elif variant == "separate":
        shared = SeparateModels.load(recipe.model, ROLES)
        bases = shared.bases
    else:
        raise LorarlError(f"unknown ppo-memory variant {variant!r}")
    algo = make_algorithm(recipe, shared)
    loaded = current_rss_bytes()

    def persistent() -> int:
        return tensor_bytes(bases, algo.optimizers.values())

    # step 1: wall time and peak RSS (on CUDA also the tensor peak: the meter adds no allocations there)
    meter = PhasePeaks(device, persistent)
    metrics, seconds = run_step(algo, 1, meter if device == "cuda" else None)
    peak = peak_rss_bytes()
    if device != "cuda":  # step 2 under the profiler, whose event buffers would have inflated step 1's RSS
        run_step(algo, 2, meter)
    return {
        "variant": variant,
        "device": device,
        "model_copies": len(bases),
        "step_s": round(seconds, 2),
        "peak_rss_gb": round(peak / 1e9, 3),
        "runtime_rss_gb": round(baseline / 1e9, 3),
        "after_load_rss_gb": round(loaded / 1e9, 3),
        "step_memory_gb": round((peak - baseline) / 1e9, 3),
        "model_tensors_gb": round(persistent() / 1e9, 3),
        "tensor_peak_gb": round(meter.step_peak / 1e9, 3),
        "phase_peaks_gb": {k: round(v / 1e9, 3) for k, v in meter.peaks.items()},
        "rows": prompts,
        **{
            k: metrics.get(k)
            for k in ("completions/mean_length", "reward", "objective/kl", "loss/policy_avg", "loss/value_avg")
        },
    }


def run(model: str, out_dir: Path, timeout: float, prompts: int | None = None, max_new_tokens: int | None = None):
    """The reward adapter, then both variants, each in its own process; print the table; return the bench's part
    of the result."""
    settings = dict(SETTINGS, prompts=prompts or SETTINGS["prompts"])
    settings["max_new_tokens"] = max_new_tokens or SETTINGS["max_new_tokens"]
    adapter = run_worker(["ppo-reward-adapter", "--model", model], out_dir, timeout)["adapter"]
    args = [
        "--model",
        model,
        "--prompts",
        str(settings["prompts"]),
        "--max-new-tokens",
        str(settings["max_new_tokens"]),
    ]
    args += ["--reward-adapter", adapter]
    variants = {v: run_worker([f"ppo-{v}", *args], out_dir, timeout) for v in ("shared", "separate")}
    sh, sep = variants["shared"], variants["separate"]
    result = {
        "settings": settings,
        "variants": variants,
        # tensors (weights + adapters + states + the step's allocations): what torch.cuda.max_memory_allocated
        # counts on a GPU; the RSS ratios below also count the C heap's retention and file mappings
        **ratios(sh, sep, memory_ratio="tensor_peak_gb", peak_rss_ratio="peak_rss_gb", rss_step_ratio="step_memory_gb"),
    }
    print(format_table(variants), flush=True)
    print(f"memory ratio (shared / separate) {result['memory_ratio']}", flush=True)
    return result


def format_table(variants: dict[str, dict]) -> str:
    """The markdown table of both variants' figures and their ratio."""
    out = ["| | shared base (lorarl) | four separate models | shared / separate |", "|---|---|---|---|"]
    for label, key in (
        ("step memory GB (peak RSS above the runtime)", "step_memory_gb"),
        ("tensor peak GB (weights + allocations)", "tensor_peak_gb"),
        ("peak RSS GB", "peak_rss_gb"),
        ("step s", "step_s"),
    ):
        a, b = variants["shared"][key], variants["separate"][key]
        out.append(f"| {label} | {a:.3f} | {b:.3f} | {ratio(a, b):.2f} |")
    return "\n".join(out)
