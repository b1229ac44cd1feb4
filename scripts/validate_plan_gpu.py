#!/usr/bin/env python
"""Validate the memory planner (lorarl.plan) against measured peaks: one GRPO step and one PPO step per model.

For each model of ``--models`` (default: qwen2.5-0.5b, qwen2.5-1.5b, llama-3.1-8b, qwen2.5-7b, mistral-7b) a fresh
worker process builds a **random-init** model with the published shape (``lorarl.plan.KNOWN_CONFIGS``; nothing is
downloaded), in bf16 on the GPU, replaces every decoder projection by a bitsandbytes NF4 ``Linear4bit`` (double
quantization, bf16 compute: what ``lorarl.model.load_base`` loads), wraps it in lorarl's ``SharedBase`` and runs
the loops' own building blocks (``lorarl.rollout.generate_rollout``, ``lorarl.update.optimizer_step``,
``lorarl.core.losses``) exactly as ``lorarl/algos/grpo.py`` (and ``ppo.py``) call them:

* GRPO: generation of ``group_size x prompts`` completions; reference log-probs (``kl_coef > 0``); one optimizer
  step over micro-batches (PPO-clip + k3 KL, entropy computed, backward, AdamW).
* PPO: generation of ``prompts`` completions; old / reference log-probs, values (critic adapter + head) and reward
  scores (frozen reward adapter + head); one optimizer step over micro-batches of the policy loss and one of the
  critic's value loss.

Each phase's ``torch.cuda.max_memory_allocated`` (peak stats reset at the phase start) is compared with
``lorarl.plan.estimate_memory`` for the same settings. The AdamW states are created before the measured step (a
step on zero gradients), so one step shows the steady state; ``--steps`` runs more (the last is measured). Prints a table and writes ``$OUT/validate_plan.json`` (or ``--out``).

Run on a CUDA machine (the five default models: 8 min on one H100 with ``--jobs 1``, about half that with the
default ``--jobs 2``; bitsandbytes and peft must import - carry them on PYTHONPATH if the image lacks them)::

    PYTHONUNBUFFERED=1 python scripts/validate_plan_gpu.py            # writes $OUT/validate_plan.json

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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b"]
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
    "attention_bias": False,
}
PHASE_COMPARE = {"training": ("training", "optimizer"), "critic_training": ("critic_training", "optimizer")}


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
        sys.exit(
            "validate_plan_gpu: cannot import " + "; ".join(missing) + ". Install them (the NF4 path needs "
            "bitsandbytes >= 0.45 with CUDA kernels), or carry them in and put them on PYTHONPATH."
        )


# ---- model construction ------------------------------------------------------------------------------------
def shape_dict(name: str) -> dict:
    from lorarl.plan import KNOWN_CONFIGS

    if name == "tiny":
        return dict(TINY)
    if name not in KNOWN_CONFIGS:
        sys.exit(f"unknown model {name!r}; known: tiny, {', '.join(KNOWN_CONFIGS)}")
    return dict(KNOWN_CONFIGS[name])


def build_config(d: dict):
    from transformers import AutoConfig

    kw = {
        k: d[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "tie_word_embeddings",
            "max_position_embeddings",
        )
    }
    if d["model_type"] == "llama":
        kw["attention_bias"] = bool(d.get("attention_bias", False))
    cfg = AutoConfig.for_model(d["model_type"], pad_token_id=0, eos_token_id=1, bos_token_id=2, **kw)
    cfg.use_cache = True
    return cfg


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_nf4(model, compute_dtype) -> int:
    """Replace every decoder projection by a bitsandbytes NF4 Linear4bit (double quantization), in place, one at
    a time on the weights' device. ``lm_head`` and embeddings stay in the compute dtype (as transformers does)."""
    import bitsandbytes as bnb
    import torch

    n = 0
    targets = [(name, mod) for name, mod in model.named_modules() if name.split(".")[-1] in LINEAR_NAMES]
    for name, lin in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        new = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=new
        ).to(lin.weight.device)
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[1], new)
        del lin
        n += 1
    model.is_loaded_in_4bit = True  # peft dispatches its bnb LoRA layers on this flag
    return n


class StubTokenizer:
    """What SharedBase and the rollout read from a tokenizer (ids only; texts are not needed here)."""

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return ["" for _ in sequences]


# ---- measurement -------------------------------------------------------------------------------------------
class Meter:
    """Peak allocated bytes of a phase: torch.cuda.max_memory_allocated on CUDA; on CPU the running sum of the
    profiler's allocation events (what the CPU allocator handed out), which approximates the same quantity."""

    def __init__(self, device, shared_gpu: bool = False):
        self.device = device
        self.shared_gpu = shared_gpu  # other workers use the GPU: device-level usage is not ours alone
        self.extra: list[dict] = []  # per measured phase on CUDA: time, reserved bytes, device-level usage

    def measure(self, fn):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.extra.append(
                {
                    "shared_gpu": self.shared_gpu,
                    "seconds": round(time.perf_counter() - t, 2),
                    "max_reserved": int(torch.cuda.max_memory_reserved()),
                    "reserved_now": int(torch.cuda.memory_reserved()),
                    "device_used_now": int(total - free),
                }
            )
            return out, int(torch.cuda.max_memory_allocated()), int(before)
        from torch.profiler import ProfilerActivity, profile

        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        self.extra.append({"seconds": round(time.perf_counter() - t, 2)})
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        cur = peak = 0
        for e in events:
            cur += e.nbytes()
            peak = max(peak, cur)
        return out, peak, 0  # relative to the phase start


def cpu_persistent_bytes(shared, optimizers) -> int:
    """Bytes of live parameters, buffers and optimizer states (the CPU meter only sees allocations inside a phase)."""
    seen, total = set(), 0
    tensors = list(shared.module.parameters()) + list(shared.module.buffers()) + list(shared.heads.parameters())
    for opt in optimizers:
        for st in opt.state.values():
            tensors += [v for v in st.values() if hasattr(v, "untyped_storage")]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    # bitsandbytes quant states (absmax etc.) are not parameters
    for m in shared.module.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            for t in (qs.absmax, qs.code, getattr(getattr(qs, "state2", None), "absmax", None)):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


# ---- the worker: one model, GRPO or PPO ------------------------------------------------------------------
def init_adam_states(opt, params) -> None:
    """Create the AdamW states now (a step on zero gradients, weight decay 0: the weights do not move), so the
    measured step sees the steady state of a long run without a warm-up step."""
    import torch

    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(args) -> dict:
    import torch

    from lorarl.core.advantages import group_advantages
    from lorarl.bench import seq_logprobs
    from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
    from lorarl.core.losses import kl_k3, ppo_clip_loss, reduce_loss, value_loss
    from lorarl.model import SharedBase
    from lorarl.plan import PlanSettings, estimate_memory, model_shape
    from lorarl.rollout import completion_logprobs, generate_rollout
    from lorarl.update import micro_batches, optimizer_step

    t0 = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dtype:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    d = shape_dict(args.worker)
    cfg = build_config(d)
    torch.manual_seed(0)
    with torch.device(device):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    n_quant = quantize_nf4(model, dtype) if args.quantization == "nf4" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t_build = time.perf_counter() - t0
    log(f"[{args.worker}] built in {t_build:.1f}s ({n_quant} NF4 projections, {dtype})")

    mcfg = ModelConfig(
        name=args.worker,
        quantization=args.quantization,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        gradient_checkpointing=True,
        logprob_chunk_size=args.chunk,
    )
    shared = SharedBase(model, StubTokenizer(d["vocab_size"]), mcfg, base_path=args.worker)
    lora = LoraSettings(r=args.lora_r, alpha=2.0 * args.lora_r, target_modules="all-linear")
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    meter = Meter(device, shared_gpu=args.jobs > 1)
    gen_rng = torch.Generator().manual_seed(1)
    V = d["vocab_size"]

    def prompts(n: int) -> list[list[int]]:
        """Random token ids, lengths in [P/2, P] (the longest is P): left padding as real prompts have."""
        lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (n,), generator=gen_rng).tolist()
        lens[0] = args.prompt_len
        return [torch.randint(3, V, (k,), generator=gen_rng).tolist() for k in lens]

    shape = model_shape(d | {"name": args.worker})
    common = dict(
        quantization=args.quantization,
        dtype_bytes=2 if dtype == torch.bfloat16 else 4,
        lora_r=args.lora_r,
        critic_lora_r=args.lora_r,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch,
        logprob_chunk_size=args.chunk,
        device=device.type,
    )
    result: dict = {"model": args.worker, "build_s": round(t_build, 1), "device": str(device), "runs": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["weights_allocated"] = int(torch.cuda.memory_allocated())

    # ---------------- GRPO ----------------
    if "grpo" in args.algos:
        G, n_prompts, kl_coef = args.group_size, args.prompts, args.kl_coef
        shared.add_adapter("policy", lora)
        params = shared.trainable_parameters("policy")
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
        init_adam_states(opt, params)
        measured_steps = []
        for step in range(args.steps):
            t_step = time.perf_counter()
            phases, before = {}, {}
            rollout, phases["generation"], before["generation"] = meter.measure(
                lambda: generate_rollout(shared, prompts(n_prompts), gen, group_size=G, role="policy")
            )
            P = rollout.prompt_ids.shape[1]
            if kl_coef > 0:  # as grpo.py: reference log-probs of all rows in one no-grad pass (rollout batch_size)
                rollout.ref_logprobs, phases["scoring"], before["scoring"] = meter.measure(
                    lambda r=rollout, P=P: seq_logprobs(shared, "reference", r, gen.temperature, None)
                )
            N, T = rollout.completion_ids.shape
            rewards = torch.randn(N)
            adv = group_advantages(rewards, G, "group").advantages
            loss_mask = rollout.completion_mask.clone()
            total_tokens = int(loss_mask.sum())
            rows = torch.arange(N)

            def grpo_loss(mb_rows, rollout=rollout, adv=adv, loss_mask=loss_mask, N=N, total_tokens=total_tokens):
                mb = rollout.select(mb_rows)
                mask = loss_mask[mb_rows].to(device)
                with shared.role("policy", train=True):  # as grpo.py: completions packed behind shared prompts
                    lp, ent = completion_logprobs(shared, mb, gen.temperature, with_entropy=True)
                old = lp.detach()
                per_token, _ = ppo_clip_loss(lp, old, adv[mb_rows].to(device), mask, 0.2, 0.2)
                if mb.ref_logprobs is not None:
                    per_token = per_token + kl_coef * kl_k3(lp, mb.ref_logprobs.to(device))
                loss = reduce_loss(
                    per_token,
                    mask,
                    "seq_mean_token_mean",
                    total_sequences=N,
                    total_tokens=max(total_tokens, 1),
                    max_len=gen.max_new_tokens,
                )
                return loss, {"entropy": (float(ent.detach()[mask].sum()), float(mask.sum()))}

            res, phases["training"], before["training"] = meter.measure(
                lambda rows=rows, grpo_loss=grpo_loss: optimizer_step(
                    params,
                    opt,
                    (rows[s] for s in micro_batches(len(rows), args.micro_batch)),
                    grpo_loss,
                    max_grad_norm=1.0,
                )
            )
            dt = time.perf_counter() - t_step
            log(
                f"[{args.worker}] grpo step {step + 1}: {dt:.1f}s, rows {N}, completion {T} tokens, prompt {P}, "
                f"loss {res.loss:.4f}, peaks " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in phases.items())
            )
            measured_steps.append(
                {"phases": phases, "allocated_before": before, "seconds": round(dt, 2), "rows": N, "T": T, "P": P}
            )
        if device.type == "cpu":
            base = cpu_persistent_bytes(shared, [opt])
            measured_steps[-1]["phases"] = {k: v + base for k, v in measured_steps[-1]["phases"].items()}
        est = estimate_memory(
            shape, PlanSettings(algo="grpo", group_size=G, prompts_per_step=n_prompts, kl_coef=kl_coef, **common)
        )
        result["runs"]["grpo"] = compare(est, measured_steps[-1], meter.extra)
        meter.extra = []
        del opt, params, rollout, res
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------- PPO ----------------
    if "ppo" in args.algos:
        n_prompts = args.ppo_prompts
        if not shared.has_adapter("policy"):
            shared.add_adapter("policy", lora)  # else: GRPO's policy adapter is reused (its weights do not matter)
        shared.add_adapter("critic", lora)
        shared.add_adapter("reward", lora, trainable=False)
        p_params = shared.trainable_parameters("policy")
        c_params = shared.trainable_parameters("critic")
        p_opt = torch.optim.AdamW(p_params, lr=1e-5, weight_decay=0.0)
        c_opt = torch.optim.AdamW(c_params, lr=1e-5, weight_decay=0.0)
        init_adam_states(p_opt, p_params)
        init_adam_states(c_opt, c_params)
        measured_steps = []
        for step in range(args.steps):
            t_step = time.perf_counter()
            phases, before = {}, {}
            rollout, phases["generation"], before["generation"] = meter.measure(
                lambda n=n_prompts: generate_rollout(shared, prompts(n), gen, group_size=1, role="policy")
            )
            P = rollout.prompt_ids.shape[1]
            ids, att = rollout.input_ids, rollout.attention_mask
            sb = 32

            def score(rollout=rollout, ids=ids, att=att, P=P, sb=sb):
                # as ppo.py: old and reference log-probs of all rows at once (the rollout's batch_size), then
                # reward scores and values in batches of eval.batch_size rows (32)
                rollout.old_logprobs = seq_logprobs(shared, "policy", rollout, gen.temperature, None)
                rollout.ref_logprobs = seq_logprobs(shared, "reference", rollout, gen.temperature, None)
                vals, scores = [], []
                with torch.no_grad():
                    for s in range(0, ids.shape[0], sb):
                        i, a = ids[s : s + sb].to(device), att[s : s + sb].to(device)
                        with shared.role("critic"):
                            vals.append(shared.values(i, a, P).float().cpu())
                        with shared.role("reward"):
                            scores.append(shared.scores(i, a).float().cpu())
                return torch.cat(vals), torch.cat(scores)

            (values, scores), phases["scoring"], before["scoring"] = meter.measure(score)
            N, T = rollout.completion_ids.shape
            mask = rollout.completion_mask
            returns = values + scores[:, None]  # shapes only: GAE is pure CPU math, not a memory term
            advantages = torch.randn(N, T)
            total_tokens = int(mask.sum())
            rows = torch.arange(N)

            def policy_loss(mb_rows, rollout=rollout, advantages=advantages, mask=mask, N=N, tt=total_tokens, T=T):
                mb = rollout.select(mb_rows)
                Pm = mb.prompt_ids.shape[1]
                i, a = mb.input_ids.to(device), mb.attention_mask.to(device)
                m = mask[mb_rows].to(device)
                with shared.role("policy", train=True):
                    lp, _ = shared.token_logprobs(i, a, Pm, gen.temperature, with_entropy=True)
                per_token, _ = ppo_clip_loss(
                    lp, mb.old_logprobs.to(device), advantages[mb_rows].to(device), m, 0.2, 0.2
                )
                return reduce_loss(
                    per_token, m, "token_mean", total_sequences=N, total_tokens=max(tt, 1), max_len=T
                ), {}

            def critic_loss(
                mb_rows, rollout=rollout, values=values, returns=returns, mask=mask, N=N, tt=total_tokens, T=T
            ):
                mb = rollout.select(mb_rows)
                Pm = mb.prompt_ids.shape[1]
                i, a = mb.input_ids.to(device), mb.attention_mask.to(device)
                m = mask[mb_rows].to(device)
                with shared.role("critic", train=True):
                    v = shared.values(i, a, Pm)
                per_token = value_loss(v, values[mb_rows].to(device), returns[mb_rows].to(device), m, 0.2)
                if isinstance(per_token, tuple):
                    per_token = per_token[0]
                return reduce_loss(
                    per_token, m, "token_mean", total_sequences=N, total_tokens=max(tt, 1), max_len=T
                ), {}

            _, phases["training"], before["training"] = meter.measure(
                lambda rows=rows, policy_loss=policy_loss: optimizer_step(
                    p_params,
                    p_opt,
                    (rows[s] for s in micro_batches(len(rows), args.micro_batch)),
                    policy_loss,
                    max_grad_norm=1.0,
                )
            )
            _, phases["critic_training"], before["critic_training"] = meter.measure(
                lambda rows=rows, critic_loss=critic_loss: optimizer_step(
                    c_params,
                    c_opt,
                    (rows[s] for s in micro_batches(len(rows), args.micro_batch)),
                    critic_loss,
                    max_grad_norm=1.0,
                )
            )
            dt = time.perf_counter() - t_step
            log(
                f"[{args.worker}] ppo step {step + 1}: {dt:.1f}s, rows {N}, completion {T}, prompt {P}, peaks "
                + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in phases.items())
            )
            measured_steps.append(
                {"phases": phases, "allocated_before": before, "seconds": round(dt, 2), "rows": N, "T": T, "P": P}
            )
        if device.type == "cpu":
            base = cpu_persistent_bytes(shared, [p_opt, c_opt])
            measured_steps[-1]["phases"] = {k: v + base for k, v in measured_steps[-1]["phases"].items()}
        est = estimate_memory(
            shape,
            PlanSettings(algo="ppo", group_size=1, prompts_per_step=n_prompts, **common),
        )
        result["runs"]["ppo"] = compare(est, measured_steps[-1], meter.extra)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def compare(est: dict, measured: dict, extra: list[dict] | None = None) -> dict:
    """Predicted vs measured per phase (ratio = predicted / measured). A training phase includes its optimizer
    step, so it is compared with the larger of the two predictions."""
    rows = {}
    for i, (phase, peak) in enumerate(measured["phases"].items()):
        keys = PHASE_COMPARE.get(phase, (phase,))
        preds = [est["phases"][k] for k in keys if k in est["phases"]]
        pred = max(preds) if preds else None
        rows[phase] = {
            "predicted": pred,
            "measured": peak,
            "ratio": round(pred / peak, 4) if pred and peak else None,
            "moment": est["moments"].get(phase),
        }
        if extra and i < len(extra):
            rows[phase].update(extra[i])
    used = [r["device_used_now"] for r in rows.values() if "device_used_now" in r and not r.get("shared_gpu")]
    device = {}
    if used:  # whole-device use (context + everything the allocator holds) vs the planner's budget figure
        device = {
            "predicted_total": est["peak_total_bytes"],
            "measured_device_used": max(used),
            "ratio": round(est["peak_total_bytes"] / max(used), 4),
        }
    return {"phases": rows, "device": device, "estimate": est, "measured": measured}


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
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name] + _forward(args)
            log(f"== {name}: {' '.join(cmd[2:])}")
            err = out_dir / f".{name}.stderr"
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, cwd=str(REPO)
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


def max_abs_error(results: list[dict]) -> float | None:
    errs = [
        abs(r["ratio"] - 1)
        for res in results
        for run in res["runs"].values()
        for r in run["phases"].values()
        if r["ratio"] is not None
    ]
    return round(max(errs), 4) if errs else None


def format_table(results: list[dict]) -> str:
    lines = [
        "| model | algo | phase (peak moment) | predicted GiB | measured GiB | predicted / measured | phase s |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for algo, run in res["runs"].items():
            for phase, r in run["phases"].items():
                pred = f"{r['predicted'] / 2**30:.2f}" if r["predicted"] else "-"
                meas = f"{r['measured'] / 2**30:.2f}"
                ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
                secs = f"{r['seconds']:.1f}" if "seconds" in r else "-"
                lines.append(
                    f"| {res['model']} | {algo} | {phase} ({r.get('moment')}) | {pred} | {meas} | {ratio} | {secs} |"
                )
            dev = run.get("device") or {}
            if dev:
                lines.append(
                    f"| {res['model']} | {algo} | device total (context + allocator) | "
                    f"{dev['predicted_total'] / 2**30:.2f} | {dev['measured_device_used'] / 2**30:.2f} | "
                    f"{dev['ratio']:.3f} | - |"
                )
    return "\n".join(lines)


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
]


def _forward(args) -> list[str]:
    out = []
    for k in _FORWARDED:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--algos", default="grpo,ppo")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    require_imports(args.quantization)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("validate_plan_gpu: no CUDA device (use --device cpu --models tiny for the CPU smoke test)")
    if args.worker:
        res = worker(args)
        print(json.dumps(res), flush=True)
        return 0
    summary = run_all(args)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
