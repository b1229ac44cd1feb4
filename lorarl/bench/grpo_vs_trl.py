"""``lorarl bench grpo-vs-trl``: lorarl's GRPO against TRL's ``GRPOTrainer`` on the same work.

lorarl's side is the real run loop (:func:`lorarl.algos.loop.train`) with a GRPO recipe: the same set-up and
``GRPO.step`` that ``lorarl train`` runs, nothing written again for the benchmark. Its per-step figures come from
the run's ``metrics.jsonl`` (``step_time``, ``step_cpu_s``, ``time/<phase>``). TRL's side is TRL 1.16's
``GRPOTrainer`` with a callback that times each step.

The same model, the same prompts in the same order (the arithmetic task; TRL's dataset is laid out in lorarl's
step order and not shuffled), the same reward function (:func:`lorarl.rewards.numeric_match`, TRL's signature),
the same LoRA (r 16, alpha 32, all linear layers), group size 8 x 2 prompts = 16 completions per step in one
micro-batch, 16 new tokens, temperature 1, no top-p / top-k, beta 0, one iteration per batch, the GRPO loss
(per-sequence token mean, group std scaling), the same learning rate, gradient checkpointing on. On CPU the model
runs unquantized in fp32; on CUDA in bf16 (unquantized for both, so only the engines differ).

Reported per engine: median seconds per step (the first, warm-up, step left out), completion tokens per second,
peak memory (peak RSS on CPU; ``torch.cuda.max_memory_allocated`` on CUDA) and the mean reward over the steps; also
the median CPU seconds per step (all threads), which another process's load on a shared machine disturbs far less
than wall time. ``time_ratio`` and ``memory_ratio`` are lorarl / TRL (``cpu_time_ratio`` too). Both engines use the
same thread count: every CPU of the process, or ``$LORARL_BENCH_THREADS``. Note that lorarl skips the forward /
backward of rows whose advantage is exactly 0 (their gradient is 0), so a step whose groups all got equal rewards
costs lorarl only its rollout; TRL computes them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lorarl.bench.procs import (
    cpu_seconds,
    device_and_dtype,
    median_after_warm_up,
    peak_rss_bytes,
    ratios,
    run_worker,
)

SETTINGS = {
    "lora_r": 16,
    "lora_alpha": 32.0,
    "prompts_per_step": 2,
    "group_size": 8,
    "max_new_tokens": 16,
    "temperature": 1.0,
    "learning_rate": 1e-5,
    "seed": 0,
    "data_seed": 1234,
    "train_size": 2000,
    "prompt_template": "What is {a} {op} {b}? Reply with only the number.",
}
ROWS = SETTINGS["prompts_per_step"] * SETTINGS["group_size"]  # completions per step


def bench_recipe(model: str, steps: int, dtype: str, engine: str = "hf") -> Any:
    """lorarl's GRPO recipe with the benchmark's settings (one micro-batch of all the step's rows), decoding with
    ``engine`` (``generation.engine``: hf or fast)."""
    from lorarl.config import recipe_from_dict

    s = SETTINGS
    return recipe_from_dict(
        {
            "algo": "grpo",
            "model": {"name": model, "quantization": "none", "dtype": dtype, "gradient_checkpointing": True},
            "lora": {"r": s["lora_r"], "alpha": s["lora_alpha"], "dropout": 0.0, "target_modules": "all-linear"},
            "data": {
                "source": "arithmetic",
                "train_size": s["train_size"],
                "seed": s["data_seed"],
                "arithmetic": {"operations": ["+"], "digits": 2, "prompt_template": s["prompt_template"]},
            },
            "reward": {"functions": [{"name": "numeric_match"}]},
            "generation": {"max_new_tokens": s["max_new_tokens"], "temperature": s["temperature"], "engine": engine},
            "train": {
                "steps": steps,
                "prompts_per_step": s["prompts_per_step"],
                "micro_batch_size": ROWS,
                "learning_rate": s["learning_rate"],
                "seed": s["seed"],
                "save_every": 0,
            },
            "grpo": {
                "group_size": s["group_size"],
                "kl": {"coef": 0.0},
                "num_iterations": 1,
                "loss_reduction": "seq_mean_token_mean",
                "std_scaling": "group",
            },
        },
        where="<bench grpo-vs-trl>",
    )


def engine_summary(
    step_times: list[float],
    tokens: list[float],
    rewards: list[float | None],
    peak: int,
    cpu_times: list[float | None] | None = None,
    **extra: Any,
) -> dict:
    """One engine's figures from its per-step lists (the first step is the warm-up: left out of the medians and
    the token rate; every step counts for the mean reward)."""
    rest_t = step_times[1:] if len(step_times) > 1 else step_times
    rest_tok = tokens[1:] if len(tokens) > 1 else tokens
    finite = [r for r in rewards if r is not None and r == r]
    cpu = median_after_warm_up(cpu_times or [])
    return {
        "steps": len(step_times),
        "step_times_s": [round(t, 3) for t in step_times],
        "median_s_per_step": round(median_after_warm_up(step_times) or float("nan"), 3),
        # CPU time (all threads) per step: much less sensitive than wall time to other work on a shared machine
        "median_cpu_s_per_step": round(cpu, 3) if cpu is not None else None,
        "cpu_times_s": [None if c is None else round(c, 3) for c in (cpu_times or [])],
        "completion_tokens_per_s": round(sum(rest_tok) / max(sum(rest_t), 1e-9), 2),
        "peak_memory_gb": round(peak / 1e9, 3),
        "mean_reward": round(sum(finite) / len(finite), 4) if finite else None,
        **extra,
    }


def peak_memory_bytes(device: str) -> int:
    """The engine's peak: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else peak_rss_bytes()


# ---------------------------------------------------------------------------------------------------------------
# lorarl: the real run loop
# ---------------------------------------------------------------------------------------------------------------
def worker_lorarl(model: str, steps: int, out: Path, engine: str = "hf") -> dict:
    """Run ``steps`` steps of the bench recipe (decode engine ``engine``) through :func:`lorarl.algos.loop.train`;
    summarise its metrics."""
    import torch

    from lorarl.algos import loop
    from lorarl.runs import read_metrics

    # the bench gives every engine the same thread count; the loop takes it from LORARL_THREADS
    os.environ["LORARL_THREADS"] = str(torch.get_num_threads())
    device, dtype = device_and_dtype()
    run_dir = out / "lorarl-run"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loop.train(bench_recipe(model, steps, dtype, engine), run_dir, max_steps=steps)
    rows = [r for r in read_metrics(run_dir) if "step" in r]
    return engine_summary(
        [float(r["step_time"]) for r in rows],
        [float(r["completions/mean_length"]) * ROWS for r in rows],
        [r.get("reward") for r in rows],
        peak_memory_bytes(device),
        [r.get("step_cpu_s") for r in rows],
        engine="lorarl",
        decode_engine=engine,
        device=device,
        gen_time_s=[round(float(r.get("time/generation", 0.0)), 3) for r in rows],
        update_time_s=[round(float(r.get("time/training", 0.0)), 3) for r in rows],
    )


# ---------------------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer on the same rows, in lorarl's order
# ---------------------------------------------------------------------------------------------------------------
def trl_dataset(steps: int):
    """The arithmetic rows in lorarl's step order (steps 1..N), so both engines see the same prompts per step."""
    from datasets import Dataset

    from lorarl.algos.base import batch_indices
    from lorarl.tasks.arithmetic import make_problems

    s = SETTINGS
    rows = make_problems(
        "train", s["train_size"], seed=s["data_seed"], operations=["+"], digits=2, template=s["prompt_template"]
    )
    order = [
        i for step in range(1, steps + 1) for i in batch_indices(len(rows), s["prompts_per_step"], s["seed"], step)
    ]
    return Dataset.from_list([{"prompt": rows[i]["prompt"], "answer": rows[i]["answer"]} for i in order])


def trl_config(steps: int, out: Path, device: str, dtype: str, **overrides: Any):
    """TRL's ``GRPOConfig`` with the benchmark's settings (the module docstring lists them); ``overrides`` replace
    fields (``lorarl bench gpu --part step`` sets its sizes, micro-batches and continuous batching there)."""
    from trl import GRPOConfig

    s = SETTINGS
    fields = dict(
        output_dir=str(out / "trl-run"),
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=1,
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        max_steps=steps,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        gradient_checkpointing=True,
        use_cpu=device == "cpu",
        bf16=dtype == "bfloat16",
        fp16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        seed=s["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return GRPOConfig(**{**fields, **overrides})


def step_timer():
    """A TRL callback recording each step's wall and CPU seconds and the logged rows."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = self.c0 = 0.0
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.c0 = time.perf_counter(), cpu_seconds()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)
            self.cpu.append(cpu_seconds() - self.c0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    return StepTimer()


def worker_trl(model: str, steps: int, out: Path) -> dict:
    """Run TRL's ``GRPOTrainer`` for ``steps`` steps on the same rows, reward and LoRA; summarise its timings."""
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from lorarl.model import load_tokenizer
    from lorarl.model.registry import resolve_model
    from lorarl.rewards import numeric_match

    s = SETTINGS
    device, dtype = device_and_dtype()
    path = resolve_model(model)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    lora = LoraConfig(
        r=s["lora_r"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    timer = step_timer()
    trainer = trl.GRPOTrainer(
        model=lm,
        reward_funcs=[numeric_match],
        args=trl_config(steps, out, device, dtype),
        train_dataset=trl_dataset(steps),
        processing_class=load_tokenizer(path),
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.train()
    return engine_summary(
        timer.times,
        [float(r.get("completions/mean_length", 0.0)) * ROWS for r in timer.logs],
        [r.get("reward") for r in timer.logs],
        peak_memory_bytes(device),
        timer.cpu,
        engine="trl",
        device=device,
        trl_version=trl.__version__,
    )


# ---------------------------------------------------------------------------------------------------------------
# The parent: one fresh process per engine, a table, the result
# ---------------------------------------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    """The markdown table of both engines' figures and their ratio."""
    e = result["engines"]
    rows = [
        ("median s / step (after warm-up)", "median_s_per_step", "{:.2f}"),
        ("median CPU s / step (all threads)", "median_cpu_s_per_step", "{:.2f}"),
        ("completion tokens / s", "completion_tokens_per_s", "{:.1f}"),
        ("peak memory GB", "peak_memory_gb", "{:.2f}"),
        (f"mean reward over {result['steps']} steps", "mean_reward", "{:.3f}"),
    ]
    out = ["| | lorarl | TRL | lorarl / TRL |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        a, b = e["lorarl"].get(key), e["trl"].get(key)
        r = f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        out.append(f"| {label} | {'-' if a is None else fmt.format(a)} | {'-' if b is None else fmt.format(b)} | {r} |")
    return "\n".join(out)


def run(steps: int, model: str, out_dir: Path, timeout: float, decode_engine: str = "hf") -> dict:
    """Both engines, each in its own process (lorarl decoding with ``decode_engine``); print the table; return the
    bench's part of the result."""
    engines = {}
    for engine in ("lorarl", "trl"):
        d = out_dir / engine
        d.mkdir(parents=True, exist_ok=True)
        args = [f"grpo-{engine}", "--steps", str(steps), "--model", model, "--engine", decode_engine]
        engines[engine] = run_worker(args, d, timeout)
        (d / "result.json").write_text(json.dumps(engines[engine], indent=1))
    lo, tr = engines["lorarl"], engines["trl"]
    result = {
        "steps": steps,
        "settings": {**SETTINGS, "lorarl_decode_engine": decode_engine},
        "engines": engines,
        **ratios(
            lo,
            tr,
            time_ratio="median_s_per_step",
            cpu_time_ratio="median_cpu_s_per_step",
            memory_ratio="peak_memory_gb",
        ),
    }
    print(format_table(result), flush=True)
    print(f"time ratio (lorarl / TRL) {result['time_ratio']}, memory ratio {result['memory_ratio']}", flush=True)
    return result
