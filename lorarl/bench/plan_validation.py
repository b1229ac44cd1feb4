"""Validate the memory planner (lorarl.plan) against measured peaks: one GRPO step and one PPO step per model (and,
with ``--algos``, a reward-model step and an SFT step on rows of exactly ``--prompt-len + --max-new-tokens`` ids, and
an RLOO step planned as the planner plans an RLOO recipe, ``lorarl.plan.recipes.rloo_as_grpo``).

For each model of ``--models`` (default: qwen2.5-0.5b, qwen2.5-1.5b, llama-3.1-8b, qwen2.5-7b, mistral-7b) a fresh
worker process builds a **random-init** model with the published shape (``lorarl.plan.KNOWN_CONFIGS``; nothing is
downloaded), in bf16 on the GPU, replaces every decoder projection by a bitsandbytes NF4 ``Linear4bit`` (double
quantization, bf16 compute: what ``lorarl.model.load_base`` loads) and wraps it in lorarl's ``SharedBase``. Then it
builds the **real algorithm** on it from a recipe (``lorarl.algos.make_algorithm``: a recipe whose model is the
random-init model's folder, whose prompts are random token ids, ``lorarl.bench.synthetic``) and runs its real
``step`` -- the code ``lorarl train`` runs, nothing written again here:

* GRPO: generation of ``group_size x prompts`` completions; reference log-probs (``kl_coef > 0``); rewards (a
  hashed reward with a spread, so every row trains); one optimizer step over micro-batches (PPO-clip + k3 KL,
  entropy, backward, AdamW).
* PPO: generation of ``prompts`` completions; old / reference log-probs, reward scores (a frozen reward adapter +
  head with random weights) and values (critic adapter + head); one policy and one critic optimizer step over
  micro-batches (one epoch, one minibatch).

GRPO training packs each micro-batch's completions behind their shared prompt (gradient checkpointing is on), as
the planner assumes (``packed_training``); ``--engine fast`` decodes with the fast engine, whose static KV cache
(and, on CUDA, graph pool) the planner counts through every phase (:mod:`lorarl.plan.engine`).

Each algorithm gets a freshly built model (each sets up its own roles on a bare base, as a run does). The step
marks its phases (``lorarl.phases``); ``lorarl.bench.memory.PhasePeaks`` reads ``torch.cuda.max_memory_allocated``
at every phase boundary (reset there), and each phase's peak is compared with ``lorarl.plan.estimate_memory`` for
the same settings. The AdamW states are created before the measured step (a step on zero gradients), so one step
shows the steady state; ``--steps`` runs more (the last is measured). Prints a table and writes
``$OUT/validate_plan.json`` (or ``--out``).

Run on a CUDA machine (the five default models: 8 min on one H100 with ``--jobs 1``, about half that with the
default ``--jobs 2``; bitsandbytes and peft must import - carry them on PYTHONPATH if the image lacks them)::

    PYTHONUNBUFFERED=1 python scripts/validate_plan_gpu.py            # writes $OUT/validate_plan.json
    python -m lorarl.bench.plan_validation --engine fast --models llama-3.1-8b   # the same, from the package

CPU smoke test of the same code path (a tiny model, unquantized fp32; CPU peaks come from the profiler's
allocation events)::

    python scripts/validate_plan_gpu.py --device cpu --models tiny --quantization none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lorarl.bench.plan_report import compare, format_table, max_abs_error
from lorarl.errors import LorarlError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b"]
# the step's phases (lorarl.phases) compared with the planner, in step order; a training phase holds its optimizer
COMPARED = ("generation", "scoring", "training", "critic_training")


def log(msg: str) -> None:
    print(msg, flush=True)


def require_imports(quantization: str) -> None:
    """Fail loudly, naming what is missing."""
    missing = []
    for name in ["torch", "transformers", "peft", "yaml"] + (["bitsandbytes"] if quantization == "nf4" else []):
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - any import failure is fatal here
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise LorarlError(
            "validate_plan_gpu: cannot import " + "; ".join(missing) + ". Install them (the NF4 path needs "
            "bitsandbytes >= 0.45 with CUDA kernels), or carry them in and put them on PYTHONPATH."
        )


# ---- model construction ------------------------------------------------------------------------------------
def shape_dict(name: str) -> dict:
    """The published shape of a known model (``lorarl.plan.KNOWN_CONFIGS``), or the tiny test shape."""
    from lorarl.bench.synthetic import TINY
    from lorarl.plan import KNOWN_CONFIGS

    if name == "tiny":
        return dict(TINY)
    if name not in KNOWN_CONFIGS:
        raise LorarlError(f"unknown model {name!r}; known: tiny, {', '.join(KNOWN_CONFIGS)}")
    return dict(KNOWN_CONFIGS[name])


# ---- the worker: one model, GRPO and / or PPO ---------------------------------------------------------------
def build_shared(args, d: dict, recipe):
    """The random-init model of shape ``d`` in the recipe's dtype on ``args.device``, its projections NF4 when asked
    (``lorarl.bench.synthetic.random_model``), wrapped in a SharedBase with the recipe's model section. Returns
    ``(shared, build seconds, NF4 projections)``."""
    import torch

    from lorarl.bench.synthetic import IdTokenizer, random_model
    from lorarl.model import SharedBase

    t0 = time.perf_counter()
    model, n_quant = random_model(d, torch.device(args.device), getattr(torch, recipe.model.dtype), args.quantization)
    shared = SharedBase(model, IdTokenizer(d["vocab_size"]), recipe.model, base_path=recipe.model.name)
    return shared, time.perf_counter() - t0, n_quant


def validation_recipe(args, algo: str, work: Path, vocab: int):
    """The recipe the real algorithm is built from: the random-init model's folder (its config.json), prompts of
    random ids (:func:`lorarl.bench.synthetic.write_id_prompts`: lengths in [P/2, P], the longest P, exactly one
    step's worth so every step takes them all), GRPO scored by a hashed reward (a spread, so every row trains),
    PPO by a frozen reward adapter with random weights; one epoch over one minibatch for PPO."""
    from lorarl.bench.synthetic import HASHED_REWARD, write_id_prompts, write_id_rows
    from lorarl.config import recipe_from_dict

    n = {"grpo": args.prompts, "rloo": args.prompts, "ppo": args.ppo_prompts}.get(algo, args.supervised_rows)
    lora = {"r": args.lora_r, "alpha": 2.0 * args.lora_r, "target_modules": "all-linear"}
    reward = {"functions": [{"name": HASHED_REWARD}]}
    T = args.prompt_len + args.max_new_tokens
    if algo in ("reward_model", "sft"):  # rows of exactly T ids (the response's last one: the EOS the loader adds)
        kind = "pairs" if algo == "reward_model" else "sft"
        data = write_id_rows(work / f"{algo}-rows.jsonl", n, args.prompt_len, args.max_new_tokens - 1, vocab, kind)
        section = {"batch_size": n, "max_length": T}
        if algo == "reward_model":
            section["max_tokens_per_forward"] = args.max_tokens_per_forward
    else:
        data = write_id_prompts(work / f"{algo}-prompts.jsonl", n, args.prompt_len, vocab)
    if algo in ("grpo", "rloo"):  # RLOO with the KL on: old and reference log-probs both scored
        section = {"group_size": args.group_size, "num_iterations": 1, "kl": {"coef": args.kl_coef}}
    elif algo == "ppo":
        section = {"epochs": 1, "minibatch_size": n, "kl": {"coef": 0.05}, "critic": {"lora": lora}}
        reward = {"source": "reward_model", "adapter": str(work / "reward")}
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    prompt_cap = args.prompt_len if algo in ("grpo", "rloo", "ppo") else max(512, args.prompt_len)
    d = {
        "algo": algo,
        "model": {
            "name": str(work / "model"),
            "quantization": args.quantization,
            "dtype": dtype,
            "gradient_checkpointing": True,
            "logprob_chunk_size": args.chunk,
        },
        "lora": lora,
        # GRPO / PPO: the planner (generation.batch_size / keep_cache auto) reads the prompt length from
        # max_prompt_tokens, so it is the prompts' longest; the fixed-length rows take theirs from max_length
        "data": {"source": str(data), "max_prompt_tokens": prompt_cap, "eval_size": 1},
        "reward": reward,
        "generation": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "engine": args.engine},
        "train": {
            "steps": args.steps,
            "prompts_per_step": n,
            "micro_batch_size": args.micro_batch,
            "learning_rate": 1e-5,
            "seed": 0,
        },
        "eval": {"batch_size": 32},  # rows per no-grad reward-model / critic pass
        algo: section,
    }
    if algo == "reward_model":  # (sections a reward-model recipe does not read)
        del d["reward"], d["generation"]
    return recipe_from_dict(d, where=f"<validate_plan_gpu {algo}>")


def warm_optimizers(optimizers) -> None:
    """Create the AdamW states now (a step on zero gradients, weight decay 0: the weights do not move), so the
    measured step sees the steady state of a long run without a warm-up step."""
    import torch

    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def measure_algo(args, algo: str, d: dict, work: Path) -> tuple[dict, dict]:
    """Build the model, set up the real ``algo`` on it from its recipe, run ``--steps`` of its real ``step`` with
    per-phase peaks, and compare the last with the planner. Returns ``(comparison, facts of the run)``."""
    import torch

    from lorarl.algos import make_algorithm
    from lorarl.bench.memory import PhasePeaks, run_step, tensor_bytes
    from lorarl.bench.synthetic import add_random_reward_adapter
    from lorarl.plan import estimate_memory, model_shape

    recipe = validation_recipe(args, algo, work, d["vocab_size"])
    shared, t_build, n_quant = build_shared(args, d, recipe)
    log(f"[{args.worker}] {algo}: built in {t_build:.1f}s ({n_quant} NF4 projections, {recipe.model.dtype})")
    facts = {"build_s": round(t_build, 1)}
    if shared.device.type == "cuda":
        facts["weights_allocated"] = int(torch.cuda.memory_allocated())
    if algo == "ppo":
        add_random_reward_adapter(shared, work / "reward", recipe.lora)
    trainer = make_algorithm(recipe, shared)
    warm_optimizers(trainer.optimizers.values())
    for step in range(1, args.steps + 1):
        meter = PhasePeaks(shared.device, lambda: tensor_bytes([shared], trainer.optimizers.values()))
        metrics, seconds = run_step(trainer, step, meter)
        log(
            f"[{args.worker}] {algo} step {step}: {seconds:.1f}s, "
            f"completion {metrics.get('completions/mean_length', args.max_new_tokens):.0f} tokens, "
            "peaks " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in meter.peaks.items())
        )
    measured = {
        "phases": {k: meter.peaks[k] for k in COMPARED if k in meter.peaks},
        "all_phases": meter.peaks,
        "step_peak": meter.step_peak,
        "allocated_before": meter.first_allocated,
        "seconds": round(seconds, 2),
        "rows": {
            "grpo": args.prompts * args.group_size,
            "rloo": args.prompts * args.group_size,
            "ppo": args.ppo_prompts,
        }.get(algo, args.supervised_rows * (2 if algo == "reward_model" else 1)),
        "completion_len": metrics.get("completions/mean_length", args.max_new_tokens),
        "P": args.prompt_len,
    }
    extra = {
        k: {**meter.extra.get(k, {}), "seconds": round(meter.seconds.get(k, 0.0), 2)}
        | ({"shared_gpu": args.jobs > 1} if shared.device.type == "cuda" else {})
        for k in measured["phases"]
    }
    est = estimate_memory(model_shape(d | {"name": args.worker}), plan_settings(args, algo, recipe))
    return compare(est, measured, extra), facts


def plan_settings(args, algo: str, recipe):
    """The planner's settings for the measured step (as the validation has always compared them)."""
    from lorarl.plan import PlanSettings

    common = dict(
        quantization=args.quantization,
        dtype_bytes=2 if recipe.model.dtype == "bfloat16" else 4,
        lora_r=args.lora_r,
        critic_lora_r=args.lora_r,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch,
        logprob_chunk_size=args.chunk,
        device=args.device,
        engine=recipe.generation.engine,
        cuda_graphs=recipe.generation.cuda_graphs,
    )
    if algo == "rloo":  # the planner's own view of the recipe (lorarl.plan.recipes.rloo_as_grpo)
        from lorarl.plan.recipes import recipe_settings

        return recipe_settings(recipe, device_type=args.device)
    if algo == "grpo":
        return PlanSettings(
            algo="grpo", group_size=args.group_size, prompts_per_step=args.prompts, kl_coef=args.kl_coef, **common
        )
    if algo in ("reward_model", "sft"):
        return PlanSettings(
            algo=algo,
            group_size=1,
            prompts_per_step=args.supervised_rows,
            max_tokens_per_forward=args.max_tokens_per_forward if algo == "reward_model" else 0,
            **common,
        )
    return PlanSettings(algo="ppo", group_size=1, prompts_per_step=args.ppo_prompts, **common)


def worker(args) -> dict:
    """Every algorithm of ``--algos`` on a freshly built model of shape ``args.worker`` (one build per algorithm:
    each sets up its own roles on a bare base, as a run does)."""
    import gc
    import tempfile

    import torch

    from lorarl.bench.synthetic import shape_config

    t0 = time.perf_counter()
    d = shape_dict(args.worker)
    result: dict = {"model": args.worker, "device": args.device, "runs": {}, "build_s": 0.0}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="lorarl-validate-") as tmp:
        work = Path(tmp)
        shape_config(d).save_pretrained(work / "model")  # the recipe's model folder (config only: shapes)
        for algo in [a.strip() for a in args.algos.split(",") if a.strip()]:
            run, facts = measure_algo(args, algo, d, work)
            result["runs"][algo] = run
            result["build_s"] = round(result["build_s"] + facts.pop("build_s"), 1)
            result.update({k: v for k, v in facts.items() if k not in result})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


# ---- the driver --------------------------------------------------------------------------------------------
def run_all(args) -> dict:
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    results, failures = [], {}
    t0 = time.perf_counter()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    pending = list(names)
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    done: dict[str, dict] = {}
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            name = pending.pop(0)
            cmd = [sys.executable, "-m", "lorarl.bench.plan_validation", "--worker", name] + _forward(args)
            log(f"== {name}: {' '.join(cmd[2:])}")
            err = out_dir / f".{name}.stderr"
            env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            with err.open("w") as err_file:  # the child keeps its own descriptor
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=str(REPO), env=env
                )  # one fresh process per model: clean peaks
            running[name] = (proc, time.perf_counter(), err)
        time.sleep(0.5)
        for name, (proc, t, err) in list(running.items()):
            if proc.poll() is None and time.perf_counter() - t < args.timeout:
                continue
            del running[name]
            if proc.poll() is None:
                proc.kill()
                failures[name] = f"timed out after {args.timeout}s"
            stdout = proc.stdout.read() if proc.stdout else ""
            if proc.stdout:
                proc.stdout.close()
            proc.wait()
            for line in stdout.splitlines():
                if not line.startswith("{"):
                    log("   " + line)
            stderr = err.read_text() if err.exists() else ""
            err.unlink(missing_ok=True)
            if name in failures:
                continue
            if proc.returncode != 0:
                failures[name] = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
                log(stderr[-4000:])
                continue
            done[name] = json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])
            log(f"   {name} done in {time.perf_counter() - t:.0f}s")
            results = [done[n] for n in names if n in done]
            partial = {"results": results, "failures": failures, "settings": vars(args)}
            (out_dir / "validate_plan.json").write_text(json.dumps(partial, indent=1))
    results = [done[n] for n in names if n in done]
    table = format_table(results)
    log(table)
    summary = {
        "results": results,
        "failures": failures,
        "settings": vars(args),
        "table": table,
        "max_abs_error": max_abs_error(results),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out_dir / "validate_plan.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "validate_plan.md").write_text(table + "\n")
    log(f"wrote {out_dir / 'validate_plan.json'}; max |predicted/measured - 1| = {summary['max_abs_error']}")
    if failures:
        log(f"FAILED: {failures}")
    return summary


_FORWARDED = [
    "device",
    "quantization",
    "dtype",
    "group_size",
    "prompts",
    "ppo_prompts",
    "prompt_len",
    "max_new_tokens",
    "micro_batch",
    "chunk",
    "lora_r",
    "kl_coef",
    "steps",
    "algos",
    "jobs",
    "engine",
]


def _forward(args) -> list[str]:
    out = []
    for k in _FORWARDED:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lorarl.bench.plan_validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated: known names or 'tiny'")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantization", default=None, choices=["nf4", "none"], help="default: nf4 on cuda, none on cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=2, help="GRPO prompts per step")
    p.add_argument("--ppo-prompts", type=int, default=8, help="PPO prompts (= rows) per step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256, help="model.logprob_chunk_size")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--kl-coef", type=float, default=0.04, help="GRPO: > 0 runs (and measures) the reference pass")
    p.add_argument("--steps", type=int, default=1, help="steps per algorithm; the last is measured")
    p.add_argument("--algos", default="grpo,ppo", help="comma-separated: grpo, ppo, reward_model, sft, rloo")
    p.add_argument(
        "--supervised-rows", type=int, default=8, help="reward model: pairs per step; SFT: examples per step"
    )
    p.add_argument("--max-tokens-per-forward", type=int, default=1024, help="reward_model.max_tokens_per_forward")
    p.add_argument("--engine", default="hf", choices=["hf", "fast"], help="generation.engine of the measured steps")
    p.add_argument("--timeout", type=int, default=240, help="seconds per model (both algorithms)")
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="models measured at once, each in its own process (peaks are per process); the whole-device "
        "totals are only recorded with --jobs 1",
    )
    p.add_argument("--out", default=None, help="folder for validate_plan.json (default $OUT, else .)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quantization is None:
        args.quantization = "nf4" if args.device == "cuda" else "none"
    return args


def check_device(args) -> None:
    """The imports the run needs, and CUDA when ``--device cuda`` (LorarlError naming what is missing)."""
    require_imports(args.quantization)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LorarlError(
                "validate_plan_gpu: no CUDA device (use --device cpu --models tiny for the CPU smoke test)"
            )


def validate(argv: list[str]) -> dict:
    """Run the validation with command-line options ``argv`` (as ``scripts/validate_plan_gpu.py`` takes them) and
    return its summary (``results``, ``failures``, ``max_abs_error``, ``table``)."""
    args = parse_args(argv)
    check_device(args)
    return run_all(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_device(args)
    except LorarlError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.worker:
        res = worker(args)
        print(json.dumps(res), flush=True)
        return 0
    summary = run_all(args)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
