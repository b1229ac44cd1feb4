"""``lorarl bench rollout``: decode speed of the fast engine against transformers' ``generate`` (the hf engine), on
the same model in the same process, with the weight-streaming bound of the device.

Engines: ``hf``; ``fast`` with ``generation.nf4_kernel: off`` (the NF4 base through bitsandbytes' ``matmul_4bit``,
the LoRA path in the adapter's dtype: the engine measured before the kernel existed); ``fast_kernel``, the fast engine
with ``nf4_kernel: auto`` (the default: :mod:`lorarl.kernels`), run where the kernel can run (CUDA and an NF4 model;
otherwise the output says why it was not run, and the row's ``fast_kernel_skipped`` holds the reason). For the
Llama-3.1-8B and Qwen2.5-1.5B shapes each row carries issue 32's target (:data:`BOUND_TARGETS`: ``fast_kernel`` at
most 3x / 4x / 6x the bound at batch 1 / 16 / 64) and whether it was met.

For each model and batch size ``B`` (1, 16, 64: ``B / G`` prompts x ``G = min(8, B)`` completions, as a GRPO step
lays them out; prompts of random token ids, ``P/2`` to ``P`` long, left padded; LoRA r 16 on all linear layers with
non-zero ``B`` so the adapter is computed; sampling at temperature 1 as rollouts do), each engine decodes once to
warm up (and, for the fast engine on CUDA, capture its step), then ``--repeats`` times ``C`` tokens and ``C = 1``
token, alternating engines. With ``t(C)`` the median wall time of a ``C``-token call and ``s`` the steps it ran:

* ``ms_per_step = (t(C) - t(1)) / (s - 1)``: one decode step, the prefill left out (``best_ms_per_step``: the
  same from the fastest repeats; ``speedup`` = hf / fast of the medians, ``speedup_best`` of the best);
* ``tokens_per_s = B s / t(C)``: rows x steps per second of the whole call, prefill included;
* ``bound_ms = weight bytes read per step / bandwidth`` (:func:`weight_bytes_per_step`; bandwidth measured here by
  copying a large tensor, :func:`measure_bandwidth`), and ``ms_per_step / bound_ms``;
* on CPU also ``cpu_ms_per_step`` from process CPU time (another process's load disturbs it far less than wall time);
  on CUDA the generation peak (``torch.cuda.max_memory_allocated`` above the weights).

Models: on CUDA, random-init NF4 models with the published shapes of Llama-3.1-8B, Qwen2.5-7B and Qwen2.5-1.5B
(:func:`random_shared`: built in bf16, every decoder projection swapped for a bitsandbytes ``Linear4bit``, nothing
downloaded; the builder of :mod:`lorarl.bench.synthetic`); on CPU the embedded model in fp32. ``--shapes tiny --quantization none`` runs the GPU rows' code path on
a CPU. ``--profile`` adds the top operators of a few decode steps of each engine (torch.profiler, CPU and CUDA
self time). Prints a table; the last stdout line is the result as JSON.

    python -m lorarl.bench.rollout                      # CUDA: the three NF4 shapes; CPU: the embedded model
    python -m lorarl.bench.rollout --device cpu --shapes tiny --quantization none --batches 1,2 --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lorarl.bench.rollout_report import batch_row, format_row, per_step

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

GPU_SHAPES = ("llama-3.1-8b", "qwen2.5-7b", "qwen2.5-1.5b")
# issue 32's decode targets, NF4 + LoRA r 16 on an H100: the fast_kernel step at most this many times the bound
BOUND_TARGETS = {shape: {1: 3.0, 16: 4.0, 64: 6.0} for shape in ("llama-3.1-8b", "qwen2.5-1.5b")}


# ---- the models ---------------------------------------------------------------------------------------------------
def random_shared(shape: str, device, quantization: str):
    """A :class:`~lorarl.model.SharedBase` on a random-init model of a known shape (``tiny`` or a name from
    :data:`lorarl.plan.KNOWN_CONFIGS`), built like the planner's GPU validation builds them
    (:func:`lorarl.bench.synthetic.random_model`): bf16 on CUDA (fp32 on CPU), NF4 projections if asked."""
    import torch

    from lorarl.bench.synthetic import TINY, IdTokenizer, random_model
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase
    from lorarl.plan import KNOWN_CONFIGS

    d = dict(TINY if shape == "tiny" else KNOWN_CONFIGS[shape])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = random_model(d, device, dtype, quantization)
    mcfg = ModelConfig(
        name=shape,
        quantization=quantization,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        gradient_checkpointing=False,
    )
    return SharedBase(model, IdTokenizer(d["vocab_size"]), mcfg, base_path=shape)


def embedded_shared(name: str, device):
    """The embedded model (or any model name lorarl loads) in full precision."""
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    return SharedBase.load(ModelConfig(name=name, quantization="none", dtype="float32"), device)


def add_policy(shared, r: int = 16, seed: int = 0) -> None:
    """A ``policy`` adapter (r ``r``, all linear layers) with non-zero weights, so decoding computes it."""
    import torch

    from lorarl.config import LoraSettings

    shared.add_adapter("policy", LoraSettings(r=r, alpha=2.0 * r), trainable=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.01)


# ---- the bound ----------------------------------------------------------------------------------------------------
def weight_bytes_per_step(shared) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer of the model (NF4 codes, their absmax and
    code tables, norms, biases, ``lm_head``, the LoRA adapters) except the input embedding table, of which a step
    reads only ``B`` rows (it is counted once when ``lm_head`` shares it)."""
    module = shared.module
    embed = shared.decoder().get_input_embeddings().weight
    head = shared.output_head().weight
    seen: set[int] = set()
    total = 0
    tensors = list(module.parameters()) + list(module.buffers())
    for m in module.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            tensors += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code] if qs.nested else [])
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or (t is embed and head.data_ptr() != embed.data_ptr()):
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def measure_bandwidth(device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Device memory bandwidth in bytes/s: the best of ``repeats`` copies of an ``nbytes`` buffer (1 GiB on CUDA,
    256 MiB on CPU), each moving ``2 nbytes`` (read + write)."""
    import torch

    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- timing -------------------------------------------------------------------------------------------------------
def random_prompts(n: int, prompt_len: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of random ids in ``[3, vocab)``, lengths in ``[P/2, P]`` (the first exactly ``P``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (n,), generator=gen).tolist()
    lengths[0] = prompt_len
    return [torch.randint(3, vocab, (k,), generator=gen).tolist() for k in lengths]


def timed_call(engine, shared, prompts, group: int, new_tokens: int) -> dict[str, float]:
    """One rollout call with the policy: wall and process CPU seconds, the steps it ran, the generation peak and
    what stays allocated after it (CUDA; the fast engine keeps its static cache and graph pool)."""
    import torch

    from lorarl.bench.procs import cpu_seconds
    from lorarl.config import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, temperature=1.0)
    if shared.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if shared.device.type == "cuda" else 0
    torch.manual_seed(0)
    sync(shared.device)
    t, c = time.perf_counter(), cpu_seconds()
    with shared.role("policy"):
        out = engine.sample(shared, prompts, group, gen)
    sync(shared.device)
    wall, cpu = time.perf_counter() - t, cpu_seconds() - c
    steps = getattr(engine, "steps_run", 0) or out.completion_ids.shape[1]
    cuda = shared.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    kept = torch.cuda.memory_allocated() - base if cuda else 0
    return {"wall": wall, "cpu": cpu, "steps": steps, "peak": peak, "kept": kept}


def bench_batch(shared, engines: dict, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """Both engines at one batch size, alternating: warm-up, then ``repeats`` x (``C`` tokens, 1 token)."""
    group = min(8, batch)
    prompts = random_prompts(max(1, batch // group), prompt_len, len(shared.tokenizer))
    runs: dict[str, dict[str, list]] = {name: {"full": [], "one": []} for name in engines}
    warm = {name: timed_call(e, shared, prompts, group, new_tokens) for name, e in engines.items()}  # (and capture)
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name]["full"].append(timed_call(engine, shared, prompts, group, new_tokens))
            runs[name]["one"].append(timed_call(engine, shared, prompts, group, 1))
    out = {}
    for name, r in runs.items():
        full, one = r["full"], r["one"]
        steps = statistics.median(x["steps"] for x in full)
        out[name] = {
            "ms_per_step": round(per_step(full, one, "wall"), 3),
            "cpu_ms_per_step": round(per_step(full, one, "cpu"), 3),
            "best_ms_per_step": round(per_step(full, one, "wall", min), 3),
            "best_cpu_ms_per_step": round(per_step(full, one, "cpu", min), 3),
            "tokens_per_s": round(batch * steps / statistics.median(x["wall"] for x in full), 2),
            "steps": steps,
            "peak_generation_bytes": max(x["peak"] for x in full),
            "kept_bytes": warm[name]["kept"],
            "wall_s": [round(x["wall"], 4) for x in full],
        }
        if name.startswith("fast"):
            out[name].update(graph_report(shared, engines[name]))
            out[name]["nf4_kernel"] = engines[name].kernel_reason is None
    return out


def graph_report(shared, engine) -> dict[str, Any]:
    """Whether the fast engine replayed a captured step (``cuda_graphs``), the capture failures its state pool kept
    (``graph_failures``: shape -> reason), ``eager_fallback`` (on CUDA: graphs wanted but the step ran eagerly) and
    ``unsupported_reason`` (the model made the engine fall back to HF ``generate``; None when it did not)."""
    from lorarl.rollout.fast import unsupported_reason
    from lorarl.rollout.fast.graphs import pool_for

    used = bool(engine.used_graphs)
    return {
        "cuda_graphs": used,
        "graph_failures": dict(pool_for(shared).failures) if shared.device.type == "cuda" else {},
        "eager_fallback": shared.device.type == "cuda" and not used,
        "unsupported_reason": unsupported_reason(shared),
    }


def profile_steps(shared, engine, batch: int, prompt_len: int, top: int = 15) -> dict[str, Any]:
    """Where a decode step goes: the top operators of a 9-token call (by self device time on CUDA, self CPU time
    otherwise) and the host-side ``aten`` operator calls per decode step, ``(calls(9 tokens) - calls(1)) / 8`` -
    on a GPU each is host work (dispatch, a kernel launch for most) unless the step is replayed from a graph.
    Per decode step, by the same difference: ``wall_ms_per_step`` (under the profiler), ``host_ms_per_step`` (the
    operators' self CPU time) and ``device_ms_per_step`` (their self device time; 0 on CPU); ``device_busy`` =
    device / wall: well below 1, the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if shared.device.type == "cuda" else [])
    group = min(8, batch)
    prompts = random_prompts(max(1, batch // group), prompt_len, len(shared.tokenizer))
    timed_call(engine, shared, prompts, group, 9)

    def profiled(tokens: int):
        with profile(activities=acts) as prof:
            call = timed_call(engine, shared, prompts, group, tokens)
        return prof.key_averages(), call

    (nine, call9), (one, call1) = profiled(9), profiled(1)
    aten_calls = [sum(e.count for e in events if e.key.startswith("aten::")) for events in (nine, one)]
    key = "self_device_time_total" if shared.device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(nine, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    steps = max(call9["steps"] - call1["steps"], 1)

    def per_step_ms(attr: str) -> float:
        totals = [sum(getattr(e, attr, 0) for e in events) for events in (nine, one)]
        return round((totals[0] - totals[1]) / 1000 / steps, 3)

    wall = round(1000 * (call9["wall"] - call1["wall"]) / steps, 3)
    device = per_step_ms("self_device_time_total")
    return {
        "wall_ms_per_step": wall,
        "host_ms_per_step": per_step_ms("self_cpu_time_total"),
        "device_ms_per_step": device,
        "device_busy": round(device / wall, 3) if wall > 0 else None,
        "aten_ops_per_step": round((aten_calls[0] - aten_calls[1]) / steps, 1),
        "top_9_tokens": [
            {
                "op": e.key,
                "calls": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3),
                "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1000, 3),
            }
            for e in rows
        ],
    }


# ---- the benchmark ------------------------------------------------------------------------------------------------
def planned_kept_bytes(shape_name: str, rows: int, prompt_len: int, new_tokens: int, quantization: str) -> int:
    """What the planner says the fast engine keeps on CUDA with graphs: static KV cache + graph pool (bf16)."""
    from lorarl.plan import model_shape
    from lorarl.plan.terms import (
        GRAPH_BUCKET,
        decode_step_bytes,
        dequantized_weight_bytes,
        static_cache_columns,
        static_kv_cache_bytes,
    )

    shape = model_shape(shape_name)
    cols = static_cache_columns(prompt_len, new_tokens, GRAPH_BUCKET)
    deq = dequantized_weight_bytes(shape, quantization, 2)
    return static_kv_cache_bytes(shape, rows, cols, 2) + decode_step_bytes(shape, rows, 2, deq)


def bench_model(
    shared, label: str, batches, prompt_len, new_tokens, repeats, bandwidth, profile, shape_name=None
) -> list[dict]:
    """Every batch size on one model: both engines, the bound, the ratios (and the profile, if asked); for a known
    shape on CUDA also the planner's static cache + graph pool next to what the fast engine kept."""
    from lorarl.kernels.lora_decode import kernel_reason
    from lorarl.rollout.engines import HFEngine
    from lorarl.rollout.fast import FastEngine, release

    add_policy(shared)
    weights = weight_bytes_per_step(shared)
    bound_ms = 1000 * weights / bandwidth
    skip = kernel_reason(shared.module, shared.device, "auto")
    if skip:
        print(f"[bench rollout] {label}: engine fast_kernel not run: {skip}", flush=True)
    target = BOUND_TARGETS.get((shape_name or "").split(":")[0], {})
    rows = []
    for b in batches:
        release(shared)  # each batch size measures what its own state keeps
        engines = {"hf": HFEngine(), "fast": FastEngine(nf4_kernel="off")}
        if not skip:
            engines["fast_kernel"] = FastEngine(nf4_kernel="auto")
        res = bench_batch(shared, engines, b, prompt_len, new_tokens, repeats)
        row = batch_row(label, b, res, weights, bound_ms, skip, target.get(b))
        if shape_name and shared.device.type == "cuda":
            q = shared.cfg.quantization
            row["fast"]["planned_kept_bytes"] = planned_kept_bytes(shape_name, b, prompt_len, new_tokens, q)
        if profile:
            row["profile"] = {name: profile_steps(shared, e, b, prompt_len) for name, e in engines.items()}
        rows.append(row)
        print(format_row(row), flush=True)
    release(shared)
    return rows


def run(
    device: str | None = None,
    model: str | None = None,
    shapes: list[str] | None = None,
    quantization: str | None = None,
    batches: tuple[int, ...] = (1, 16, 64),
    prompt_len: int = 64,
    new_tokens: int = 64,
    repeats: int = 3,
    profile: bool = False,
    out: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark; print a table; return the result (also written to ``out/result.json`` when given).

    Defaults: on CUDA the random-init NF4 :data:`GPU_SHAPES`; on CPU ``model`` (the embedded default) in fp32."""
    import torch

    from lorarl.bench.procs import bench_threads, machine_description

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(bench_threads())
    quantization = quantization or ("nf4" if dev.type == "cuda" else "none")
    if shapes is None and model is None:
        shapes, model = (list(GPU_SHAPES), None) if dev.type == "cuda" else ([], "smollm2-135m")
    bandwidth = measure_bandwidth(dev)
    print(f"[bench rollout] {dev.type}, bandwidth {bandwidth / 1e9:.1f} GB/s, batches {list(batches)}", flush=True)
    rows: list[dict] = []
    targets = ([("model", model)] if model else []) + [("shape", s) for s in shapes or []]
    for kind, name in targets:
        shared = embedded_shared(name, dev) if kind == "model" else random_shared(name, dev, quantization)
        label = name if kind == "model" else f"{name}:{quantization}"
        known = name if kind == "shape" and name != "tiny" else None
        rows += bench_model(shared, label, batches, prompt_len, new_tokens, repeats, bandwidth, profile, known)
        del shared
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result = {
        "bench": "rollout",
        "machine": machine_description(),
        "versions": package_versions(),
        "settings": {
            "device": dev.type,
            "quantization": quantization,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "lora_r": 16,
            "temperature": 1.0,
            "group": "min(8, batch)",
        },
        "bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "result.json").write_text(json.dumps(result, indent=1))
    return result


def package_versions() -> dict[str, str | None]:
    """Versions of what the numbers depend on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    """``lorarl bench rollout``: :func:`run` from the ``bench`` command's options (``--model``, ``--out`` and this
    module's ``--shapes --batches --new-tokens --prompt-len --repeats --profile --device``; missing ones take their
    defaults). ``--model`` is the CPU model; on CUDA without ``--shapes`` the :data:`GPU_SHAPES` run."""
    import torch

    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = getattr(args, "shapes", None)
    return run(
        device=device,
        model=None if (shapes or device == "cuda") else (getattr(args, "model", None) or "smollm2-135m"),
        shapes=shapes.split(",") if shapes else None,
        quantization=getattr(args, "quantization", None),
        batches=tuple(int(b) for b in str(getattr(args, "batches", None) or "1,16,64").split(",")),
        prompt_len=getattr(args, "prompt_len", None) or 64,
        new_tokens=getattr(args, "new_tokens", None) or 64,
        repeats=getattr(args, "repeats", None) or 3,
        profile=bool(getattr(args, "profile", False)),
        out=getattr(args, "out", None),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lorarl.bench.rollout", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--model", default=None, help="a model lorarl loads (default on CPU: the embedded model)")
    p.add_argument(
        "--shapes", default=None, help=f"random-init shapes, comma separated (default on CUDA: {GPU_SHAPES})"
    )
    p.add_argument("--quantization", choices=["nf4", "none"], default=None)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run_cli(parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
