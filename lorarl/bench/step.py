"""``lorarl bench gpu --part step``: a whole GRPO step and a whole PPO step of lorarl against TRL 1.16's
``GRPOTrainer``, on the same random-init model, rows, lengths, LoRA and memory budget, each engine in its own
process.

lorarl's side is the real algorithm on the one base (:func:`lorarl.algos.make_algorithm` from a recipe, its real
``step``, as :mod:`lorarl.bench.plan_validation` builds it: a random-init model of a published shape, NF4 projections
through bitsandbytes, prompts of random ids, a hashed reward with a spread so every row trains); GRPO with
``prompts x group`` rows (policy; no KL, as TRL's ``beta = 0``), PPO with the same number of rows as prompts x 1
(all four roles: policy, reference, reward adapter, critic). TRL's side is ``GRPOTrainer`` on the same model built
the same way (flagged ``is_loaded_in_4bit`` so TRL takes its QLoRA path: bf16 LoRA weights), the same prompts (a
word-level tokenizer over the same ids), the same reward function, LoRA (r 16, alpha 32, all linear layers), micro
batch, gradient checkpointing and learning rate, with ``use_transformers_continuous_batching`` off (``generate``)
and on (its fastest generation without vLLM). TRL 1.16 has no PPO trainer: the PPO row's peer is TRL's GRPO step
on the same number of rows and tokens (which does less work: no value model, no reward model).

Lengths are forced by the model: a random-init model's next-token distribution is near uniform, so EOS (one id of
``V``) ends a row with probability about ``1 / V`` per token; the measured mean completion length is recorded on
both sides. On CUDA each worker is held to ``budget_gb`` with ``torch.cuda.set_per_process_memory_fraction``
(:func:`memory_fraction`); an engine that runs out of memory there is recorded with its error, not retried larger.

Per engine and step (the first step a warm-up; the last one is reported): ``generation_s``, ``scoring_s``
(everything between generation and the first backward: rewards, old / reference log-probs, values),
``training_s`` (the rest of the step: forward / backward / optimizer, the critic's too), ``step_s``, completion
``tokens_per_s`` and ``peak_gb`` (``torch.cuda.max_memory_allocated`` over the process on CUDA, peak RSS on CPU).
``time_ratio`` / ``memory_ratio`` = lorarl / TRL's fastest variant of the same run (:func:`row_ratios`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

GB = 10**9
STEP_FULL = {  # the step part (lorarl.bench.step): 8 prompts x 8, 128-token prompts, NF4, held to 24 GB
    "models": ["qwen2.5-1.5b", "llama-3.1-8b"],
    "new_tokens": [256, 1024],
    "quantization": "nf4",
    "prompts": 8,
    "group_size": 8,
    "prompt_len": 128,
    "lora_r": 16,
    "steps": 2,  # the first a warm-up (lorarl's graph capture, TRL's first generation); the second is reported
    "micro_batch": 8,
    "budget_gb": 24,
    "engine": "fast",
    "trl_variants": ["trl", "trl-cb"],
    "timeout": 900,
    "one_process": False,
}
STEP_QUICK = STEP_FULL | {"models": ["qwen2.5-1.5b"], "new_tokens": [256]}  # --quick: the 1.5B shape, 256 tokens
TRL_VARIANTS = {"trl": False, "trl-cb": True}  # name -> use_transformers_continuous_batching
UNSLOTH = (
    "Unsloth is not a column: its newest release on PyPI (2026.10.9, checked 2026-11-28 with `pip download unsloth "
    "--no-deps`) requires trl<=1.15.0 and transformers<=5.17.0 (this run: trl 1.16, transformers 5.24), xformers "
    "and unsloth_zoo, and needs a GPU at import; beside this stack it cannot install, and a side environment would "
    "compare other TRL / transformers versions"
)


# ---- pure helpers -------------------------------------------------------------------------------------------------
def memory_fraction(budget_bytes: float, total_bytes: float) -> float | None:
    """The per-process fraction that holds a process to ``budget_bytes`` of a card of ``total_bytes``:
    ``budget / total``, or None where the card is not bigger than the budget (nothing to hold)."""
    if total_bytes <= budget_bytes:
        return None
    return budget_bytes / total_bytes


def apply_budget(device_type: str, budget_gb: float) -> float | None:
    """On CUDA, ``torch.cuda.set_per_process_memory_fraction(memory_fraction(...))``; returns the fraction set
    (None on any other device, or a card no bigger than the budget)."""
    import torch

    if device_type != "cuda":
        return None
    frac = memory_fraction(budget_gb * GB, torch.cuda.get_device_properties(0).total_memory)
    if frac is not None:
        torch.cuda.set_per_process_memory_fraction(frac, 0)
    return frac


def phase_split(step_s: float, generation_s: float, scoring_s: float) -> dict[str, float]:
    """``{generation_s, scoring_s, training_s = step_s - generation_s - scoring_s, step_s}`` (rounded to ms)."""
    return {
        "generation_s": round(generation_s, 3),
        "scoring_s": round(scoring_s, 3),
        "training_s": round(step_s - generation_s - scoring_s, 3),
        "step_s": round(step_s, 3),
    }


def scoring_seconds(phases: dict[str, float]) -> float:
    """lorarl's scoring time: its ``scoring`` phase (old / reference log-probs, reward-model scores, values) plus
    its ``rewards`` phase (the reward functions), which do not nest."""
    return phases.get("scoring", 0.0) + phases.get("rewards", 0.0)


def tokens_per_s(rows: int, mean_completion_len: float, step_s: float) -> float:
    """Completion tokens of the step per second: ``rows x mean length / step_s``."""
    return round(rows * mean_completion_len / step_s, 2) if step_s > 0 else float("nan")


def reset_peak(device: str) -> None:
    """Start a new peak: ``torch.cuda.reset_peak_memory_stats`` on CUDA; on Linux CPUs the kernel's resident peak
    (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``)."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # (no reset: the process's peak so far counts)


def peak_bytes(device: str) -> int:
    """The peak since :func:`reset_peak`: ``torch.cuda.max_memory_allocated`` on CUDA, ``VmHWM`` on a CPU (peak
    RSS where ``/proc`` is not readable)."""
    import torch

    from lorarl.bench.procs import peak_rss_bytes

    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return peak_rss_bytes()


def cb_memory_percent(
    budget_bytes: float, allocated_bytes: float, device_free_bytes: float, share: float = 0.5
) -> float:
    """transformers' continuous batching sizes its paged cache as ``max_memory_percent x`` the device's free memory
    (``mem_get_info``, blind to the per-process fraction); TRL's default ``max_memory_percent`` is ``share = 0.5``.
    The percent that gives the cache ``share`` of what the budget leaves after the weights, as on a card of that
    size: ``share x (budget - allocated) / device_free``, at most ``share``."""
    return max(0.0, min(share, share * (budget_bytes - allocated_bytes) / device_free_bytes))


def row_ratios(lorarl: dict, peers: dict[str, dict]) -> dict[str, Any]:
    """lorarl / TRL for one row: ``time_ratio = step_s / peer step_s`` and ``memory_ratio = peak_gb / peer
    peak_gb`` against the fastest peer that ran (``peer``), and the same ratios against each peer
    (``ratios_by_peer``). Peers with an ``error`` are left out; with none left the ratios are None."""
    ran = {k: v for k, v in peers.items() if "error" not in v}
    by_peer = {
        k: {
            "time_ratio": round(lorarl["step_s"] / v["step_s"], 4),
            "memory_ratio": round(lorarl["peak_gb"] / v["peak_gb"], 4),
        }
        for k, v in ran.items()
        if "error" not in lorarl
    }
    if not by_peer:
        return {"peer": None, "time_ratio": None, "memory_ratio": None, "ratios_by_peer": {}}
    best = min(by_peer, key=lambda k: ran[k]["step_s"])
    return {"peer": best, **by_peer[best], "ratios_by_peer": by_peer}


def plan_row(recipe, budget_gb: float) -> dict[str, Any]:
    """The planner's view of a lorarl row on a CUDA card held to ``budget_gb``: the sizes the run resolves to
    (``train.micro_batch_size``, ``generation.batch_size``, ``generation.keep_cache``;
    :func:`lorarl.plan.recipes.run_sizes`) and the step's predicted peak with them, allocated (what ``peak_gb``
    measures on CUDA: the GPU run validates it) and with the CUDA context and allocator slack (what must fit the
    budget), and the latter with the whole rollout in one batch."""
    from lorarl.errors import LorarlError
    from lorarl.plan import estimate_memory
    from lorarl.plan.recipes import cuda_plan, run_sizes

    planned = cuda_plan(recipe, budget_gb)
    if planned is None:
        raise LorarlError(f"bench step: the planner cannot read the shape of {recipe.model.name}")
    shape, s, budget = planned
    micro, gen = run_sizes(recipe, shape, s, budget)
    est = estimate_memory(shape, s, micro_batch_size=micro, generation_batch_size=gen)
    one = estimate_memory(shape, s, micro_batch_size=micro, generation_batch_size=None)
    return {
        "micro_batch": micro,
        "generation_batch": gen,
        "keep_cache": s.keep_cache,
        "peak_gb": round(est["peak_bytes"] / GB, 3),
        "peak_total_gb": round(est["peak_total_bytes"] / GB, 3),
        "peak_phase": est["peak_phase"],
        "one_batch_total_gb": round(one["peak_total_bytes"] / GB, 3),
    }


def plan_rows(settings: dict, work: Path) -> list[dict[str, Any]]:
    """:func:`plan_row` for every lorarl row of ``settings`` (the step part's models x lengths x GRPO / PPO),
    from the recipes the workers build (a model folder holding only ``config.json``; nothing is loaded)."""
    out = []
    for model in settings["models"]:
        for new_tokens in settings["new_tokens"]:
            for algo in ("grpo", "ppo"):
                spec = worker_spec(settings, "cuda", model, new_tokens, f"lorarl-{algo}")
                recipe = lorarl_recipe(spec, work / f"{model}-{new_tokens}-{algo}")[2]
                out.append(
                    {"model": model, "algo": algo, "new_tokens": new_tokens, **plan_row(recipe, spec["budget_gb"])}
                )
    return out


# ---- the workers (one process each) -------------------------------------------------------------------------------
def lorarl_args(spec: dict, work: Path) -> argparse.Namespace:
    """The :mod:`lorarl.bench.plan_validation` settings of the step (its recipe builder reads them)."""
    rows = spec["prompts"] * spec["group_size"]
    same = ("prompts", "group_size", "lora_r", "prompt_len", "device", "quantization", "engine", "steps")
    return argparse.Namespace(
        **{k: spec[k] for k in same},
        micro_batch=spec["micro_batch"],
        ppo_prompts=rows,
        supervised_rows=rows,
        kl_coef=0.0,
        max_new_tokens=spec["new_tokens"],
        max_tokens_per_forward=0,
        dtype=None,
        chunk=256,
        worker=spec["model"],
    )


def lorarl_recipe(spec: dict, out: Path):
    """``(args, shape dict, recipe)`` of a lorarl engine's spec: the random-init model's ``config.json`` written to
    ``out/model`` and the :mod:`lorarl.bench.plan_validation` recipe over it (what the worker trains and
    :func:`plan_rows` plans)."""
    from lorarl.bench.plan_validation import shape_dict, validation_recipe
    from lorarl.bench.synthetic import shape_config

    args = lorarl_args(spec, out)
    d = shape_dict(spec["model"])
    shape_config(d).save_pretrained(out / "model")
    return args, d, validation_recipe(args, spec["algo"], out, d["vocab_size"])


def worker_lorarl(spec: dict, out: Path) -> dict:
    """``spec["algo"]`` (grpo / ppo) for ``spec["steps"]`` steps of the real algorithm; the last step's figures."""
    from lorarl.algos import make_algorithm
    from lorarl.algos.loop import keep_decode_cache
    from lorarl.bench.memory import run_step
    from lorarl.bench.plan_validation import build_shared
    from lorarl.bench.synthetic import add_random_reward_adapter
    from lorarl.phases import recording

    fraction = apply_budget(spec["device"], spec["budget_gb"])
    args, d, recipe = lorarl_recipe(spec, out)
    plan = plan_row(recipe, spec["budget_gb"])  # (the sizes below resolve as it says on CUDA)
    reset_peak(spec["device"])
    shared, build_s, n_quant = build_shared(args, d, recipe)
    if spec["algo"] == "ppo":
        add_random_reward_adapter(shared, out / "reward", recipe.lora)
    trainer = make_algorithm(recipe, shared)
    keep_decode_cache(recipe, shared)  # generation.keep_cache: auto, resolved as lorarl train does
    for step in range(1, spec["steps"] + 1):
        log = phase_log(spec["device"])
        with recording(log):
            (metrics, _), seconds = synced(spec["device"], run_step, trainer, step)
    length = float(metrics.get("completions/mean_length", spec["new_tokens"]))
    rows = spec["prompts"] * spec["group_size"]
    return {
        "engine": f"lorarl-{spec['algo']}",
        **phase_split(seconds, log.seconds.get("generation", 0.0), scoring_seconds(log.seconds)),
        "mean_completion_len": round(length, 2),
        "tokens_per_s": tokens_per_s(rows, length, seconds),
        "peak_gb": round(peak_bytes(spec["device"]) / GB, 3),
        "phase_seconds": {k: round(v, 3) for k, v in log.seconds.items()},
        "build_s": round(build_s, 1),
        "nf4_projections": n_quant,
        "memory_fraction": fraction,
        "plan": plan,
    }


def id_tokenizer(vocab: int):
    """A transformers fast tokenizer over the ids ``0 .. vocab-1`` written as space-separated numbers (what
    :class:`lorarl.bench.synthetic.IdTokenizer` reads), pad 0, EOS 1, BOS 2: TRL tokenizes the same prompts to the
    same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="0", eos_token="1", bos_token="2", unk_token="0", padding_side="left"
    )


def synced(device: str, fn, *a, **k) -> tuple[Any, float]:
    """``(fn(*a, **k), wall seconds)``, the device synchronised before and after (CUDA)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(*a, **k)
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def phase_log(device: str):
    """A :class:`lorarl.phases.PhaseLog` whose phases start on an idle device (CUDA: synchronised on entry, so the
    work queued before a phase is not counted in it)."""
    import torch

    from lorarl.phases import PhaseLog

    if device != "cuda":
        return PhaseLog()
    return PhaseLog(on_enter=lambda name: torch.cuda.synchronize())


def timed(fn, log: list[float], device: str):
    """``fn`` wrapped to append its wall seconds (:func:`synced`) to ``log``."""

    def wrapper(*a, **k):
        out, seconds = synced(device, fn, *a, **k)
        log.append(seconds)
        return out

    return wrapper


def worker_trl(spec: dict, out: Path) -> dict:
    """TRL's ``GRPOTrainer`` on the same model, rows and LoRA for ``spec["steps"]`` optimizer steps
    (continuous batching per ``spec["continuous_batching"]``); the last step's figures."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    from lorarl.bench.grpo_vs_trl import step_timer, trl_config
    from lorarl.bench.plan_validation import shape_dict
    from lorarl.bench.synthetic import hashed_reward, random_model, write_id_prompts

    fraction = apply_budget(spec["device"], spec["budget_gb"])
    d = shape_dict(spec["model"])
    dtype = "bfloat16" if spec["device"] == "cuda" else "float32"
    rows, micro = spec["prompts"] * spec["group_size"], spec["micro_batch"]
    prompts = write_id_prompts(out / "prompts.jsonl", spec["prompts"], spec["prompt_len"], d["vocab_size"])
    data = [json.loads(line) for line in prompts.read_text().splitlines()] * spec["steps"]
    reset_peak(spec["device"])
    model, n_quant = random_model(d, torch.device(spec["device"]), getattr(torch, dtype), spec["quantization"])
    model.is_loaded_in_4bit = spec["quantization"] == "nf4"  # as from_pretrained(BitsAndBytesConfig) marks it
    model.train()
    cb_config = dict(spec.get("cb_config") or {})
    if spec["device"] == "cuda" and spec["continuous_batching"]:
        free = torch.cuda.mem_get_info()[0]
        cb_config.setdefault(
            "max_memory_percent", cb_memory_percent(spec["budget_gb"] * GB, torch.cuda.memory_allocated(), free)
        )
    config = trl_config(
        spec["steps"],
        out,
        spec["device"],
        dtype,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        num_generations=spec["group_size"],
        max_completion_length=spec["new_tokens"],
        beta=0.0,
        use_transformers_continuous_batching=spec["continuous_batching"],
        transformers_continuous_batching_config=cb_config or None,
    )
    lora = LoraConfig(r=spec["lora_r"], lora_alpha=2.0 * spec["lora_r"], lora_dropout=0.0, target_modules="all-linear")
    timer = step_timer()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[hashed_reward],
        args=config,
        train_dataset=Dataset.from_list(data),
        processing_class=id_tokenizer(d["vocab_size"]),
        peft_config=lora,
        callbacks=[timer],
    )
    gen_log: list[float] = []
    score_log: list[float] = []
    trainer._generate = timed(trainer._generate, gen_log, spec["device"])
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, score_log, spec["device"])
    trainer.train()
    step_s = timer.times[-1]
    length = float(timer.logs[-1].get("completions/mean_length", spec["new_tokens"]))
    return {
        "engine": "trl-cb" if spec["continuous_batching"] else "trl",
        **phase_split(step_s, gen_log[-1], score_log[-1] - gen_log[-1]),
        "mean_completion_len": round(length, 2),
        "tokens_per_s": tokens_per_s(rows, length, step_s),
        "peak_gb": round(peak_bytes(spec["device"]) / GB, 3),
        "nf4_projections": n_quant,
        "memory_fraction": fraction,
        "trl_version": trl.__version__,
        "continuous_batching": spec["continuous_batching"],
    }


# ---- the parent ---------------------------------------------------------------------------------------------------
def worker_spec(settings: dict, device: str, model: str, new_tokens: int, engine: str) -> dict:
    """What one engine runs (an element of the worker's JSON argument)."""
    keys = ("quantization", "prompts", "group_size", "prompt_len", "lora_r", "steps", "micro_batch", "budget_gb")
    spec = {k: settings[k] for k in keys} | {"device": device, "model": model, "new_tokens": new_tokens}
    spec["cb_config"] = settings.get("cb_config")
    spec["name"] = engine
    if engine in TRL_VARIANTS:
        return spec | {"kind": "trl", "continuous_batching": TRL_VARIANTS[engine]}
    return spec | {"kind": "lorarl", "algo": engine.split("-", 1)[1], "engine": settings["engine"]}


def run_specs(specs: list[dict], work: Path, timeout: float) -> dict[str, dict]:
    """Engines in one fresh process, one after the other; ``{name: figures or {"error": ...}}`` (an engine that
    fails, e.g. out of memory under the budget, is recorded and the others run)."""
    from lorarl.bench.procs import run_worker
    from lorarl.errors import LorarlError

    work.mkdir(parents=True, exist_ok=True)
    try:
        return run_worker([json.dumps(specs)], work, timeout, module="lorarl.bench.step")
    except LorarlError as e:
        return {s["name"]: {"error": str(e)[-1500:]} for s in specs}


def run(settings: dict, device: str, work: Path) -> dict:
    """Every model x length: lorarl's GRPO and PPO steps and TRL's variants (each engine in its own process, or all
    in one with ``one_process``: the smoke mode); rows with ratios; the Unsloth line."""
    engines = ["lorarl-grpo", "lorarl-ppo", *settings["trl_variants"]]
    rows, runs = [], []
    for model in settings["models"]:
        for new_tokens in settings["new_tokens"]:
            specs = [worker_spec(settings, device, model, new_tokens, e) for e in engines]
            groups = [specs] if settings.get("one_process") else [[s] for s in specs]
            res: dict[str, dict] = {}
            for group in groups:
                res |= run_specs(group, work / f"{model}-{new_tokens}", settings["timeout"])
            for name in engines:
                print(f"[bench step] {model} {new_tokens} {name}: {res[name]}", flush=True)
            peers = {k: res[k] for k in settings["trl_variants"]}
            runs.append({"model": model, "new_tokens": new_tokens, "engines": res})
            for algo in ("grpo", "ppo"):
                lo = res[f"lorarl-{algo}"]
                rows.append(
                    {
                        "model": f"{model}:{settings['quantization']}",
                        "algo": algo,
                        "new_tokens": new_tokens,
                        "rows": settings["prompts"] * settings["group_size"],
                        **row_ratios(lo, peers),
                        "lorarl": lo,
                        "trl": peers,
                    }
                )
    return {"rows": rows, "runs": runs, "unsloth": UNSLOTH, "budget_gb": settings["budget_gb"]}


def headline(result: dict) -> list[str]:
    """One line per row (step seconds, peak GB and the ratios against TRL's fastest variant), and the Unsloth line."""
    lines = []
    for r in result["rows"]:
        lo = r["lorarl"]
        if "error" in lo:
            lines.append(f"{r['model']} {r['algo']} {r['new_tokens']} new tokens: lorarl FAILED ({lo['error'][-200:]})")
            continue
        peer = r["trl"].get(r["peer"] or "", {})
        vs = (
            f"TRL {r['peer']} {peer['step_s']} s, {peer['peak_gb']} GB: time ratio {r['time_ratio']} (target <= 0.3), "
            f"memory ratio {r['memory_ratio']} (target <= 0.7)"
            if r["peer"]
            else "TRL did not run: " + "; ".join(f"{k}: {v.get('error', '')[-160:]}" for k, v in r["trl"].items())
        )
        plan = lo.get("plan") or {}
        planned = (
            f" (planned {plan['peak_gb']} GB; generation batch {plan['generation_batch']}, keep_cache "
            f"{str(plan['keep_cache']).lower()})"
            if plan
            else ""
        )
        lines.append(
            f"{r['model']} {r['algo'].upper()} {r['rows']} rows x {r['new_tokens']} new tokens: lorarl "
            f"{lo['step_s']} s (generation {lo['generation_s']}, scoring {lo['scoring_s']}, training "
            f"{lo['training_s']}), {lo['peak_gb']} GB{planned} vs {vs}"
        )
    lines.append(result["unsloth"])
    return lines


def main(argv: list[str]) -> int:
    """``python -m lorarl.bench.step plan [--quick]``: the planner's view of every lorarl row (:func:`plan_rows`,
    no model loaded, any machine); ``python -m lorarl.bench.step _worker SPEC_JSON --out DIR``: one worker, its
    result as the last JSON line."""
    p = argparse.ArgumentParser(prog="python -m lorarl.bench.step")
    p.add_argument("kind", choices=["plan", "_worker"])
    p.add_argument("spec", nargs="?")
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="plan: the step part's --quick rows")
    a = p.parse_args(argv)
    if a.kind == "plan":
        import tempfile

        settings = STEP_QUICK if a.quick else STEP_FULL
        with tempfile.TemporaryDirectory() as work:
            for row in plan_rows(settings, Path(work)):
                print(json.dumps(row), flush=True)
        return 0
    if a.spec is None or a.out is None:
        p.error("_worker needs SPEC and --out")
    import torch

    from lorarl.bench.procs import bench_threads

    torch.set_num_threads(bench_threads())  # the same for every engine
    spec, out = json.loads(a.spec), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for one in spec if isinstance(spec, list) else [spec]:  # (the smoke mode runs every engine in one process)
        name = one["name"]
        run = worker_trl if one["kind"] == "trl" else worker_lorarl
        try:
            results[name] = run(one, out / name)
        except Exception as e:  # noqa: BLE001 - one engine's failure (out of memory) is recorded; the next runs
            results[name] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        free_device(one["device"])
    print(json.dumps(results), flush=True)
    return 0


def free_device(device: str) -> None:
    """Drop what the last engine left (garbage, the CUDA cache) before the next one is measured."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
