"""Side-by-side benchmarks: ``lorarl bench grpo-vs-trl`` and ``lorarl bench ppo-memory``.

Every engine or variant runs in a fresh process (``python -m lorarl.bench _worker ...``), one after the other,
so each peak is its own. The parent prints a table, then returns a dict that the CLI prints as its last stdout line.

``grpo-vs-trl``: lorarl's GRPO (:func:`lorarl.algos.grpo.train`) and TRL's ``GRPOTrainer`` on the same model, the
same prompts in the same order (the arithmetic task; TRL's dataset is laid out in lorarl's step order and not
shuffled), the same reward function (:func:`lorarl.rewards.numeric_match`, TRL's signature), the same LoRA (r 16,
alpha 32, all linear layers), group size 8 x 2 prompts = 16 completions per step in one micro-batch, 16 new tokens,
temperature 1, no top-p / top-k, beta 0, one iteration per batch, the GRPO loss (per-sequence token mean, group
std scaling), the same learning rate, gradient checkpointing on. On CPU the model runs unquantized in fp32; on CUDA
in bf16 (unquantized for both, so only the engines differ). Reported per engine: median seconds per step (the first,
warm-up, step left out), completion tokens per second, peak memory (peak RSS on CPU; ``torch.cuda.max_memory_allocated``
on CUDA) and the mean reward over the steps; also the median CPU seconds per step (all threads), which another
process's load on a shared machine disturbs far less than wall time. ``time_ratio`` and ``memory_ratio`` are
lorarl / TRL (``cpu_time_ratio`` too). Both engines use the same thread count: every CPU of the process, or
``$LORARL_BENCH_THREADS``. Note that lorarl skips the forward / backward of rows whose advantage is exactly 0 (their
gradient is 0), so a step whose groups all got equal rewards costs lorarl only its rollout; TRL computes them.

``ppo-memory``: the peak memory of one PPO step (rollout, old / reference log-probs, reward-model scores, values,
GAE, one policy and one critic optimizer step over micro-batches) run (a) on lorarl's one shared base with the
policy, critic and reward as adapters and the reference as the base with adapters off, and (b) with four separate
copies of the model: policy (+ its LoRA), reference (frozen), critic (+ its LoRA and a value head) and reward model
(+ a score head, frozen). The step code is the same for both (:func:`ppo_step`); only where the roles live differs.
``memory_ratio`` is shared / separate on the tensors' peak: on CUDA ``torch.cuda.max_memory_allocated``; on CPU
the weights, adapters, heads and optimizer states alive before a step plus the peak of that step's allocation
events (the profiler's, in a second step, so its buffers do not inflate the first step's RSS) - the same quantity.
``rss_step_ratio`` (peak RSS minus the RSS after imports, before any model) and ``peak_rss_ratio`` (raw peak RSS)
are reported too: they also count the C heap's retained free blocks and the mapped safetensors files.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

GRPO_SETTINGS = {
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
PPO_SETTINGS = {"prompts": 8, "max_new_tokens": 16, "micro_batch": 4, "lora_r": 16}


# ---------------------------------------------------------------------------------------------------------------
# Helpers shared by the workers
# ---------------------------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return peak_rss_bytes()


def machine_description() -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "bench_threads": int(os.environ.get("LORARL_BENCH_THREADS") or 0) or None,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def _device_and_dtype() -> tuple[str, str]:
    import torch

    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def _median_excluding_first(times: list[float]) -> float:
    rest = times[1:] if len(times) > 1 else times
    return float(statistics.median(rest)) if rest else float("nan")


def _engine_summary(
    step_times: list[float],
    tokens: list[float],
    rewards: list[float],
    peak: int,
    cpu_times: list[float] | None = None,
    **extra,
) -> dict:
    rest_t = step_times[1:] if len(step_times) > 1 else step_times
    rest_tok = tokens[1:] if len(tokens) > 1 else tokens
    finite = [r for r in rewards if r is not None and r == r]
    rest_cpu = [c for c in (cpu_times or [])[1:] if c is not None]
    return {
        "steps": len(step_times),
        "step_times_s": [round(t, 3) for t in step_times],
        "median_s_per_step": round(_median_excluding_first(step_times), 3),
        # CPU time (all threads) per step: much less sensitive than wall time to other work on a shared machine
        "median_cpu_s_per_step": round(float(statistics.median(rest_cpu)), 3) if rest_cpu else None,
        "cpu_times_s": [None if c is None else round(c, 3) for c in (cpu_times or [])],
        "completion_tokens_per_s": round(sum(rest_tok) / max(sum(rest_t), 1e-9), 2),
        "peak_memory_gb": round(peak / 1e9, 3),
        "mean_reward": round(sum(finite) / len(finite), 4) if finite else None,
        **extra,
    }


# ---------------------------------------------------------------------------------------------------------------
# grpo-vs-trl workers
# ---------------------------------------------------------------------------------------------------------------
def _bench_recipe(model: str, steps: int, device: str, dtype: str) -> Any:
    """The lorarl recipe with the benchmark's settings."""
    from lorarl.config import recipe_from_dict

    s = GRPO_SETTINGS
    return recipe_from_dict(
        {
            "algo": "grpo",
            "model": {"name": model, "quantization": "none", "dtype": dtype, "gradient_checkpointing": True},
            "lora": {"r": s["lora_r"], "alpha": s["lora_alpha"], "dropout": 0.0, "target_modules": "all-linear"},
            "data": {
                "source": "arithmetic",
                "train_size": s["train_size"],
                "seed": s["data_seed"],
                "operations": ["+"],
                "digits": 2,
                "prompt_template": s["prompt_template"],
            },
            "rewards": [{"name": "numeric_match"}],
            "generation": {
                "max_new_tokens": s["max_new_tokens"],
                "temperature": s["temperature"],
                "top_p": 1.0,
                "top_k": 0,
            },
            "train": {
                "steps": steps,
                "prompts_per_step": s["prompts_per_step"],
                "micro_batch_size": s["prompts_per_step"] * s["group_size"],
                "learning_rate": s["learning_rate"],
                "seed": s["seed"],
                "save_every": 0,
            },
            "grpo": {
                "group_size": s["group_size"],
                "kl_coef": 0.0,
                "num_iterations": 1,
                "loss_reduction": "seq_mean_token_mean",
                "std_scaling": "group",
            },
        },
        where="<bench>",
    )


def _worker_grpo_lorarl(model: str, steps: int, out: Path) -> dict:
    import torch

    import lorarl.algos.grpo as grpo
    from lorarl.runs import read_metrics

    marks: list[float] = []  # CPU seconds when each step's metrics are logged (log_every = 1: the end of a step)

    class CPUMarkingLogger(grpo.MetricsLogger):
        def log(self, step, row):
            marks.append(cpu_seconds())
            return super().log(step, row)

    grpo.MetricsLogger = CPUMarkingLogger
    device, dtype = _device_and_dtype()
    recipe = _bench_recipe(model, steps, device, dtype)
    run_dir = out / "lorarl-run"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    grpo.train(recipe, str(run_dir), max_steps=steps)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "step" in r]
    n_rows = GRPO_SETTINGS["prompts_per_step"] * GRPO_SETTINGS["group_size"]
    times = [float(r["step_time"]) for r in rows]
    tokens = [float(r["completion_len"]) * n_rows for r in rows]
    rewards = [r.get("reward_mean") for r in rows]
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else peak_rss_bytes()
    cpu = [None] + [b - a for a, b in zip(marks, marks[1:])]  # step 1 has no start mark (left out anyway)
    return _engine_summary(
        times,
        tokens,
        rewards,
        peak,
        cpu,
        engine="lorarl",
        device=device,
        gen_time_s=[round(float(r.get("gen_time", 0.0)), 3) for r in rows],
        update_time_s=[round(float(r.get("update_time", 0.0)), 3) for r in rows],
    )


def _trl_dataset(steps: int):
    """The arithmetic rows in lorarl's step order (steps 1..N), so both engines see the same prompts per step."""
    from datasets import Dataset

    from lorarl.algos.grpo import batch_indices
    from lorarl.tasks.arithmetic import make_problems

    s = GRPO_SETTINGS
    rows = make_problems(
        "train", s["train_size"], seed=s["data_seed"], operations=["+"], digits=2, template=s["prompt_template"]
    )
    order = [
        i for step in range(1, steps + 1) for i in batch_indices(len(rows), s["prompts_per_step"], s["seed"], step)
    ]
    return Dataset.from_list([{"prompt": rows[i]["prompt"], "answer": rows[i]["answer"]} for i in order])


def _worker_grpo_trl(model: str, steps: int, out: Path) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lorarl.model import load_tokenizer
    from lorarl.model.registry import resolve_model
    from lorarl.rewards import numeric_match

    s = GRPO_SETTINGS
    device, dtype = _device_and_dtype()
    path = resolve_model(model)
    tok = load_tokenizer(path)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    n_rows = s["prompts_per_step"] * s["group_size"]
    cfg = GRPOConfig(
        output_dir=str(out / "trl-run"),
        per_device_train_batch_size=n_rows,
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

    timer = StepTimer()
    lora = LoraConfig(
        r=s["lora_r"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(
        model=lm,
        reward_funcs=[numeric_match],
        args=cfg,
        train_dataset=_trl_dataset(steps),
        processing_class=tok,
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.train()
    tokens = [float(r.get("completions/mean_length", 0.0)) * n_rows for r in timer.logs]
    rewards = [r.get("reward") for r in timer.logs]
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else peak_rss_bytes()
    import trl

    return _engine_summary(
        timer.times, tokens, rewards, peak, timer.cpu, engine="trl", device=device, trl_version=trl.__version__
    )


# ---------------------------------------------------------------------------------------------------------------
# ppo-memory
# ---------------------------------------------------------------------------------------------------------------
def ppo_step(
    roles: dict[str, tuple[Any, str]], prompts: list[list[int]], max_new_tokens: int, micro_batch: int, optimizers: dict
) -> dict:
    """One PPO step as ``lorarl.algos.ppo`` runs it, with each role given as ``(SharedBase, role name)``: the
    rollout with the policy (old log-probs recorded), reference log-probs, reward-model scores at the last token,
    the KL-shaped per-token rewards, the critic's values, GAE, whitened advantages, then one policy optimizer step
    (PPO-clip, entropy computed) and one critic optimizer step (clipped value loss) over micro-batches."""
    import torch

    from lorarl.config import GenerationConfig
    from lorarl.core.advantages import gae, kl_shaped_rewards
    from lorarl.core.losses import ppo_clip_loss, reduce_loss, value_loss
    from lorarl.core.ops import masked_whiten
    from lorarl.rollout import generate_rollout
    from lorarl.update import micro_batches, optimizer_step

    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    pol, pol_role = roles["policy"]
    rollout = generate_rollout(pol, prompts, gen, role=pol_role, record_old=True)
    P = rollout.prompt_ids.shape[1]
    ids, att = rollout.input_ids, rollout.attention_mask
    ref, ref_role = roles["reference"]
    ref_lp = seq_logprobs(ref, ref_role, rollout, gen.temperature)
    rm, rm_role = roles["reward"]
    crit, crit_role = roles["critic"]
    with torch.no_grad():
        with rm.role(rm_role):
            score = rm.scores(ids.to(rm.device), att.to(rm.device), head=rm_role).float().cpu()
        with crit.role(crit_role):
            values = crit.values(ids.to(crit.device), att.to(crit.device), P).float().cpu()
    mask = rollout.completion_mask
    rewards, _ = kl_shaped_rewards(score, rollout.old_logprobs, ref_lp, mask, 0.05)
    advantages, returns = gae(rewards, values, mask, 1.0, 0.95)
    advantages = masked_whiten(advantages, mask)
    N, T = rollout.completion_ids.shape
    tokens = max(float(mask.sum()), 1.0)

    def policy_loss(rows):
        mb = rollout.select(rows)
        m = mask[rows].to(pol.device)
        with pol.role(pol_role, train=True):
            lp, _ = pol.token_logprobs(
                mb.input_ids.to(pol.device),
                mb.attention_mask.to(pol.device),
                mb.prompt_ids.shape[1],
                1.0,
                with_entropy=True,
            )
        per_token, _ = ppo_clip_loss(lp, rollout.old_logprobs[rows].to(pol.device), advantages[rows].to(pol.device), m)
        return reduce_loss(per_token, m, "token_mean", total_sequences=N, total_tokens=tokens, max_len=T), {}

    def critic_loss(rows):
        mb = rollout.select(rows)
        m = mask[rows].to(crit.device)
        with crit.role(crit_role, train=True):
            v = crit.values(mb.input_ids.to(crit.device), mb.attention_mask.to(crit.device), mb.prompt_ids.shape[1])
        per_token, _ = value_loss(v, values[rows].to(crit.device), returns[rows].to(crit.device), m, 0.2)
        return 0.1 * reduce_loss(per_token, m, "token_mean", total_sequences=N, total_tokens=tokens, max_len=T), {}

    order = torch.arange(N)
    p = optimizer_step(
        pol.trainable_parameters(pol_role),
        optimizers["policy"],
        (order[s] for s in micro_batches(N, micro_batch)),
        policy_loss,
        max_grad_norm=1.0,
    )
    c = optimizer_step(
        crit.trainable_parameters(crit_role),
        optimizers["critic"],
        (order[s] for s in micro_batches(N, micro_batch)),
        critic_loss,
        max_grad_norm=1.0,
    )
    return {"policy_loss": p.loss, "critic_loss": c.loss, "rows": N, "completion_len": T}


def seq_logprobs(shared, role: str, rollout, temperature: float, batch_size=None):
    """``lorarl.rollout.sequence_logprobs`` for either of its signatures: ``(shared, role, rollout, temperature,
    batch_size)`` or the earlier ``(shared, role, input_ids, attention_mask, start, temperature, batch_size)``."""
    import inspect

    from lorarl.rollout import sequence_logprobs

    params = list(inspect.signature(sequence_logprobs).parameters)
    if len(params) > 2 and params[2] == "rollout":
        return sequence_logprobs(shared, role, rollout, temperature, batch_size)
    P = rollout.prompt_ids.shape[1]
    return sequence_logprobs(shared, role, rollout.input_ids, rollout.attention_mask, P, temperature, batch_size)


def _ppo_prompts(tok, n: int) -> list[list[int]]:
    from lorarl.data import encode_prompt, prompt_text
    from lorarl.tasks.arithmetic import make_problems

    rows = make_problems("train", n, seed=GRPO_SETTINGS["data_seed"], template=GRPO_SETTINGS["prompt_template"])
    return [encode_prompt(prompt_text(r["prompt"], tok, None), tok, templated=True) for r in rows]


def _worker_ppo(variant: str, model: str, prompts: int, max_new_tokens: int) -> dict:
    import peft  # noqa: F401  - imported before the baseline is read, like everything the step uses
    import torch
    import transformers  # noqa: F401

    import lorarl.rollout  # noqa: F401
    import lorarl.update  # noqa: F401
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase, load_base

    device, dtype = _device_and_dtype()
    torch.manual_seed(0)
    baseline = current_rss_bytes()  # the runtime with torch / transformers / peft imported, no model yet
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cfg = ModelConfig(name=model, quantization="auto", dtype="auto", gradient_checkpointing=True)
    lora = LoraSettings(r=PPO_SETTINGS["lora_r"], alpha=2.0 * PPO_SETTINGS["lora_r"])

    def fresh() -> SharedBase:
        base, tok, path = load_base(cfg)
        return SharedBase(base, tok, cfg, base_path=path)

    if variant == "shared":
        one = fresh()
        one.add_adapter("policy", lora)
        one.add_adapter("critic", lora)
        one.add_adapter("reward", lora, trainable=False)
        roles = {
            "policy": (one, "policy"),
            "reference": (one, "reference"),
            "critic": (one, "critic"),
            "reward": (one, "reward"),
        }
        tok = one.tokenizer
        n_copies = 1
    elif variant == "separate":
        pol, ref, crit, rm = fresh(), fresh(), fresh(), fresh()
        pol.add_adapter("policy", lora)
        crit.add_adapter("critic", lora)
        rm.add_adapter("reward", lora, trainable=False)
        roles = {
            "policy": (pol, "policy"),
            "reference": (ref, "base"),
            "critic": (crit, "critic"),
            "reward": (rm, "reward"),
        }
        tok = pol.tokenizer
        n_copies = 4
    else:
        raise LorarlError(f"unknown ppo-memory variant {variant!r}")
    optimizers = {
        "policy": torch.optim.AdamW(roles["policy"][0].trainable_parameters("policy"), lr=1e-5),
        "critic": torch.optim.AdamW(roles["critic"][0].trainable_parameters("critic"), lr=1e-5),
    }
    loaded = current_rss_bytes()
    prompt_ids = _ppo_prompts(tok, prompts)
    # step 1, as is: peak RSS and time
    t0 = time.perf_counter()
    info = ppo_step(roles, prompt_ids, max_new_tokens, PPO_SETTINGS["micro_batch"], optimizers)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    out = {
        "variant": variant,
        "device": device,
        "model_copies": n_copies,
        "step_s": round(seconds, 2),
        "peak_rss_gb": round(peak / 1e9, 3),
        "runtime_rss_gb": round(baseline / 1e9, 3),
        "after_load_rss_gb": round(loaded / 1e9, 3),
        "step_memory_gb": round((peak - baseline) / 1e9, 3),
        **info,
    }
    if device == "cuda":
        out["tensor_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        return out
    # step 2 under the profiler (its event buffers would inflate step 1's RSS): the weights, adapters, heads and
    # optimizer states alive before the step + the peak of the step's allocation events - the CPU analogue of
    # torch.cuda.max_memory_allocated, free of the C allocator's retained heap and of file mappings
    from torch.profiler import ProfilerActivity, profile

    persistent = tensor_bytes([r[0] for r in roles.values()], optimizers.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ppo_step(roles, prompt_ids, max_new_tokens, PPO_SETTINGS["micro_batch"], optimizers)
    out["model_tensors_gb"] = round(persistent / 1e9, 3)
    out["tensor_peak_gb"] = round((persistent + _peak_allocated(prof)) / 1e9, 3)
    return out


def tensor_bytes(shared_bases: list, optimizers=()) -> int:
    """Bytes of the distinct storages of the models' parameters, buffers and heads, and the optimizers' states."""
    seen: set[int] = set()
    total = 0
    tensors = []
    for sb in {id(x): x for x in shared_bases}.values():
        tensors += list(sb.module.parameters()) + list(sb.module.buffers()) + list(sb.heads.parameters())
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if hasattr(v, "untyped_storage")]
    if tensors:
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _peak_allocated(prof) -> int:
    """Peak of the running sum of a CPU profile's allocation events (bytes above the start)."""
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


# ---------------------------------------------------------------------------------------------------------------
# The parent: fresh processes, a table, the result
# ---------------------------------------------------------------------------------------------------------------
def _run_worker(args: list[str], out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "lorarl.bench", "_worker", *args, "--out", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    print(f"[bench] {' '.join(args)} ...", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise LorarlError(f"bench worker {' '.join(args)} timed out after {timeout:.0f}s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise LorarlError(f"bench worker {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def format_grpo_table(result: dict) -> str:
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
        ratio = f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        out.append(
            f"| {label} | {fmt.format(a) if a is not None else '-'} | {fmt.format(b) if b is not None else '-'} | {ratio} |"
        )
    return "\n".join(out)


def run_bench(
    which: str,
    steps: int = 5,
    model: str = "smollm2-135m",
    out: str | None = None,
    timeout: float = 3600,
    ppo_prompts: int | None = None,
    ppo_max_new_tokens: int | None = None,
) -> dict:
    """Run benchmark ``which`` (``grpo-vs-trl`` or ``ppo-memory``); print a table; return the result dict.

    ``ppo_prompts`` / ``ppo_max_new_tokens`` shrink the PPO step (tests); the defaults are :data:`PPO_SETTINGS`.
    Workers use every CPU this process may run on, or ``$LORARL_BENCH_THREADS`` threads.
    """
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="lorarl-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if steps < 1:
        raise LorarlError("bench: --steps must be >= 1")
    if which == "grpo-vs-trl":
        engines = {}
        for engine in ("lorarl", "trl"):
            d = out_dir / engine
            d.mkdir(parents=True, exist_ok=True)
            engines[engine] = _run_worker([f"grpo-{engine}", "--steps", str(steps), "--model", model], d, timeout)
            (d / "result.json").write_text(json.dumps(engines[engine], indent=1))
        result = {
            "bench": which,
            "model": model,
            "steps": steps,
            "settings": GRPO_SETTINGS,
            "engines": engines,
            "time_ratio": _ratio(engines["lorarl"]["median_s_per_step"], engines["trl"]["median_s_per_step"]),
            "cpu_time_ratio": _ratio(
                engines["lorarl"]["median_cpu_s_per_step"] or float("nan"),
                engines["trl"]["median_cpu_s_per_step"] or float("nan"),
            ),
            "memory_ratio": _ratio(engines["lorarl"]["peak_memory_gb"], engines["trl"]["peak_memory_gb"]),
            "machine": machine_description(),
            "out": str(out_dir),
        }
        print(format_grpo_table(result), flush=True)
        print(f"time ratio (lorarl / TRL) {result['time_ratio']}, memory ratio {result['memory_ratio']}", flush=True)
    elif which == "ppo-memory":
        settings = dict(PPO_SETTINGS)
        settings["prompts"] = ppo_prompts or settings["prompts"]
        settings["max_new_tokens"] = ppo_max_new_tokens or settings["max_new_tokens"]
        extra = ["--prompts", str(settings["prompts"]), "--max-new-tokens", str(settings["max_new_tokens"])]
        variants = {
            v: _run_worker([f"ppo-{v}", "--model", model, *extra], out_dir, timeout) for v in ("shared", "separate")
        }
        result = {
            "bench": which,
            "model": model,
            "settings": settings,
            "variants": variants,
            # tensors (weights + adapters + states + the step's allocations): what torch.cuda.max_memory_allocated
            # counts on a GPU; the RSS ratios below also count the C heap's retention and file mappings
            "memory_ratio": _ratio(variants["shared"]["tensor_peak_gb"], variants["separate"]["tensor_peak_gb"]),
            "peak_rss_ratio": _ratio(variants["shared"]["peak_rss_gb"], variants["separate"]["peak_rss_gb"]),
            "rss_step_ratio": _ratio(variants["shared"]["step_memory_gb"], variants["separate"]["step_memory_gb"]),
            "machine": machine_description(),
            "out": str(out_dir),
        }
        print("| | shared base (lorarl) | four separate models | shared / separate |", flush=True)
        print("|---|---|---|---|")
        for label, key in (
            ("step memory GB (peak RSS above the runtime)", "step_memory_gb"),
            ("tensor peak GB (weights + allocations)", "tensor_peak_gb"),
            ("peak RSS GB", "peak_rss_gb"),
            ("step s", "step_s"),
        ):
            a, b = variants["shared"][key], variants["separate"][key]
            print(f"| {label} | {a:.3f} | {b:.3f} | {_ratio(a, b):.2f} |")
        print(f"memory ratio (shared / separate) {result['memory_ratio']}", flush=True)
    else:
        raise LorarlError(f"unknown benchmark {which!r} (grpo-vs-trl, ppo-memory)")
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _worker_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m lorarl.bench _worker")
    p.add_argument("kind", choices=["grpo-lorarl", "grpo-trl", "ppo-shared", "ppo-separate"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=PPO_SETTINGS["prompts"])
    p.add_argument("--max-new-tokens", type=int, default=PPO_SETTINGS["max_new_tokens"])
    a = p.parse_args(argv)
    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = int(os.environ.get("LORARL_BENCH_THREADS") or threads)
    torch.set_num_threads(max(1, threads))  # the same for every engine
    if a.kind == "grpo-lorarl":
        import lorarl.algos.grpo as grpo

        grpo.set_threads = lambda: torch.get_num_threads()  # keep this thread count (train() would reset it)
    out = Path(a.out)
    if a.kind == "grpo-lorarl":
        res = _worker_grpo_lorarl(a.model, a.steps, out)
    elif a.kind == "grpo-trl":
        res = _worker_grpo_trl(a.model, a.steps, out)
    else:
        res = _worker_ppo(a.kind.split("-", 1)[1], a.model, a.prompts, a.max_new_tokens)
    res["threads"] = torch.get_num_threads()
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(_worker_main(sys.argv[2:]))
    print("usage: lorarl bench grpo-vs-trl|ppo-memory [--steps N] [--model M] [--out DIR]", file=sys.stderr)
    sys.exit(2)
