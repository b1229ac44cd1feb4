"""``lorarl bench gpu --part kernel``: lorarl's NF4 decode matmul (:func:`lorarl.kernels.nf4_matmul.nf4_matmul`) at
candidate tile sizes, per decoder projection of a model shape and batch size, against its default tiles
(:func:`~lorarl.kernels.nf4_matmul.launch_config`, written as unmeasured guesses), bitsandbytes' ``matmul_4bit``
(what the fast engine runs without the kernel) and the weight-streaming bound.

Why a sweep and not ``triton.autotune``: the fast engine captures its decode step as a CUDA graph, and an autotuner
benchmarks on the first call of each new shape, which may fall inside a capture; the defaults are a pure function
of ``(rows, N, K, SMs)`` so the captured step is what was measured. This part measures which tiles those defaults
should be; it changes nothing.

Per projection ``W [N, K]`` (random weights, bitsandbytes' NF4 with double quantization, bf16 input ``[m, K]``):
each configuration's output is first compared with the default's (equal up to the fp32 summation order: split-K
slices sum in another order), then timed: on CUDA the calls cycle through enough copies of the weight to read it
from memory rather than the L2 cache (:func:`copies_for`) and run captured in a CUDA graph, as the decode step
does (launched one by one from Python, a kernel of a few microseconds would time the host), the median per call of
``repeats`` replays (:func:`timed_ms`). ``bound_ms = weight bytes / bandwidth``: the packed weight and its block scales
(:func:`nf4_bytes`), the bandwidth measured in the same run (:func:`lorarl.bench.rollout.measure_bandwidth`). Per
shape and batch the decoder layer's seven projections sum to ``layer_ms`` (default tiles, best tiles, bitsandbytes)
beside the layer's bound. Off CUDA it runs under Triton's interpreter (``TRITON_INTERPRET=1``, tiny shapes: the
smoke mode), where times measure the interpreter, not a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from lorarl.kernels.nf4_matmul import MAX_ROWS, launch_config

BLOCK_N = (32, 64, 128)
BLOCK_K = (128, 256)
SPLIT_K = (1, 2, 4, 8, 16)


# ---- pure helpers -------------------------------------------------------------------------------------------------
def projections(d: dict) -> dict[str, tuple[int, int, int]]:
    """The decoder layer's projections of shape dict ``d`` grouped by ``(N, K)``: ``{"q_proj+o_proj": (N, K,
    count), ...}`` with ``count`` the projections of that shape per layer (q, k, v, o, gate, up, down).

    >>> projections({"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    ...              "num_key_value_heads": 8})
    {'q_proj+o_proj': (4096, 4096, 2), 'k_proj+v_proj': (1024, 4096, 2), 'gate_proj+up_proj': (14336, 4096, 2), 'down_proj': (4096, 14336, 1)}
    """
    h, i = d["hidden_size"], d["intermediate_size"]
    hd = d.get("head_dim") or h // d["num_attention_heads"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    named = [("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))]
    named += [("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))]
    groups: dict[tuple[int, int], list[str]] = {}
    for name, nk in named:
        groups.setdefault(nk, []).append(name)
    return {"+".join(names): (*nk, len(names)) for nk, names in groups.items()}


def candidates(m: int, n: int, k: int, sms: int) -> list[tuple[int, int, int, int]]:
    """The configurations tried for ``x [m, k] @ W[n, k]^T``: the default (:func:`launch_config`) first, then every
    ``BLOCK_N`` x ``BLOCK_K`` x ``SPLIT_K`` of the grids above at the default's ``BLOCK_M`` with whole ``BLOCK_K``
    steps in each slice (``BLOCK_K x SPLIT_K <= k``) and ``BLOCK_N <= max(32, n)``.

    >>> c = candidates(16, 4096, 4096, 132)
    >>> c[0], len(c), (16, 128, 256, 16) in c
    ((16, 64, 256, 4), 30, True)
    """
    default = launch_config(m, n, k, sms)
    out = [default]
    for bn, bk, split in itertools.product(BLOCK_N, BLOCK_K, SPLIT_K):
        cfg = (default[0], bn, bk, split)
        if cfg != default and bk * split <= k and bn <= max(32, n):
            out.append(cfg)
    return out


def nf4_bytes(n: int, k: int, blocksize: int = 64, nested: bool = True) -> int:
    """Bytes a matmul reads of an NF4 weight ``[n, k]``: the packed codes ``n k / 2`` plus one absmax per
    ``blocksize`` weights (1 byte with double quantization, plus an fp32 per 256 of those; else 4 bytes).

    >>> nf4_bytes(4096, 4096)  # 8 MiB of codes + 256 Ki absmax bytes + 1 Ki fp32 second-level scales
    8654848
    """
    blocks = -(-n * k // blocksize)
    scales = blocks + 4 * -(-blocks // 256) if nested else 4 * blocks
    return n * k // 2 + scales


def best_row(timings: list[dict]) -> dict:
    """The fastest of ``timings`` (``[{config, ms}, ...]``, the default first) and how it compares: ``{default,
    best, default_over_best}``."""
    default = timings[0]
    best = min(timings, key=lambda t: t["ms"])
    return {"default": default, "best": best, "default_over_best": round(default["ms"] / best["ms"], 3)}


def layer_sums(rows: list[dict]) -> dict[str, float]:
    """One decoder layer's seven projections (each row's ``count`` times): default, best and bitsandbytes ms, and
    the bound."""
    keys = {"default_ms": lambda r: r["default"]["ms"], "best_ms": lambda r: r["best"]["ms"]}
    keys |= {"bnb_ms": lambda r: r["bnb_ms"], "bound_ms": lambda r: r["bound_ms"]}
    return {k: round(sum(f(r) * r["count"] for r in rows), 4) for k, f in keys.items()}


def copies_for(nbytes: int, l2_bytes: int, cap: int = 32) -> int:
    """Distinct weights a timed sequence cycles through so that it reads them from memory, not from the L2 cache (a
    decode step streams every layer's weights once): enough for 4 x the L2, at most ``cap`` (the smallest
    projections, e.g. a 1.5B model's k / v, then stay partly in L2: their rows say how many copies ran).

    >>> copies_for(8654848, 50 * 2**20)  # Llama-3.1-8B q_proj on an H200's 50 MiB L2
    25
    >>> copies_for(31000000, 50 * 2**20), copies_for(100000, 50 * 2**20), copies_for(10**9, 50 * 2**20)
    (7, 32, 1)
    """
    return max(1, min(cap, -(-4 * l2_bytes // nbytes)))


# ---- measuring ----------------------------------------------------------------------------------------------------
def _eager_ms(calls: list, device, repeats: int) -> float:
    """Median milliseconds per call of ``calls`` run back to back (each round between two synchronisations), after
    one warm-up round (the compile). Off CUDA: the interpreter's time."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for call in calls:
        call()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for call in calls:
            call()
        sync()
        times.append(1000 * (time.perf_counter() - t) / len(calls))
    return round(statistics.median(times), 6)


def _graph_ms(calls: list, repeats: int, per_graph: int = 64) -> float:
    """Median milliseconds per call on CUDA: ``calls`` (one per weight copy) captured over and over (about
    ``per_graph`` calls) in one CUDA graph, replayed ``repeats`` times between CUDA events. The decode step runs
    captured too, so no launch overhead is counted (a kernel of a few microseconds launched from Python would
    measure the host instead)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (the compile) off the capturing stream, as capture requires
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rounds = max(1, per_graph // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return round(statistics.median(times), 6)


def timed_ms(calls: list, device, repeats: int) -> tuple[float, str]:
    """``(ms per call, how)``: captured and replayed on CUDA (``cuda_graph``; ``eager`` where capture fails), back to
    back elsewhere (``interpreter``)."""
    import torch

    if device.type != "cuda":
        return _eager_ms(calls, device, repeats), "interpreter"
    try:
        return _graph_ms(calls, repeats), "cuda_graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return _eager_ms(calls, device, repeats), "eager"


def bench_projection(name: str, n: int, k: int, count: int, batches, device, repeats: int, bandwidth: float):
    """Every batch size's candidates on random NF4 weights ``[n, k]`` (:func:`copies_for` copies of them on CUDA,
    one elsewhere); a row per batch."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    import torch

    from lorarl.kernels.nf4_matmul import NF4Weight, nf4_matmul

    gen = torch.Generator(device="cpu").manual_seed(0)
    copies = 1
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20
        copies = copies_for(nf4_bytes(n, k), l2)
    quantized = []
    for _ in range(copies):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16)
        packed, qs = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
        quantized.append((packed, qs, NF4Weight.from_bnb(packed, qs)))
        del w
    weight = quantized[0][2]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    bound_ms = 1000 * nf4_bytes(n, k) / bandwidth
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        want = nf4_matmul(x, weight).float()
        scale = want.abs().max().item() + 1e-6
        timings, how = [], set()
        for cfg in candidates(m, n, k, sms):
            err = (nf4_matmul(x, weight, config=cfg).float() - want).abs().max().item() / scale
            if err > 2e-2:  # a bf16 output rounded from a reordered fp32 sum differs by a few units of 2^-8
                raise RuntimeError(f"{name} [{n}x{k}] B={m} tiles {cfg}: relative error {err:.3g} vs the default's")
            calls = [functools.partial(nf4_matmul, x, wt, config=cfg) for _, _, wt in quantized]
            ms, mode = timed_ms(calls, device, repeats)
            timings.append({"config": list(cfg), "ms": ms})
            how.add(mode)
        bnb_calls = [functools.partial(bnb.matmul_4bit, x, p.t(), quant_state=q) for p, q, _ in quantized]
        bnb_ms, mode = timed_ms(bnb_calls, device, repeats)
        row = {"proj": name, "n": n, "k": k, "count": count, "batch": m, "bound_ms": round(bound_ms, 6)}
        row |= best_row(timings) | {"bnb_ms": bnb_ms, "timings": timings}
        row |= {
            "copies": copies,
            "timing": sorted(how | {mode}),
            "best_over_bound": round(row["best"]["ms"] / bound_ms, 3),
        }
        rows.append(row)
    return rows


def run(shapes: list[str], batches: list[int], repeats: int, device_type: str, bandwidth_bytes: float | None = None):
    """Every shape's projections x batch sizes (:func:`bench_projection`); rows and per-layer sums per shape and
    batch. Off CUDA the kernel runs under Triton's interpreter (set here)."""
    import torch

    from lorarl.bench.plan_validation import shape_dict
    from lorarl.bench.rollout import measure_bandwidth

    if max(batches) > MAX_ROWS:
        raise ValueError(f"batches go up to {MAX_ROWS} rows (the kernel's limit)")
    device = torch.device(device_type)
    bandwidth = bandwidth_bytes or measure_bandwidth(device)
    rows, layers = [], []
    with interpreter(device_type != "cuda"):
        for shape in shapes:
            shape_rows = []
            for name, (n, k, count) in projections(shape_dict(shape)).items():
                got = bench_projection(name, n, k, count, batches, device, repeats, bandwidth)
                shape_rows += [r | {"model": shape} for r in got]
            rows += shape_rows
            for m in batches:
                layers.append({"model": shape, "batch": m, **layer_sums([r for r in shape_rows if r["batch"] == m])})
    return {"rows": rows, "layers": layers, "bandwidth_bytes_per_s": bandwidth, "device": device_type}


@contextlib.contextmanager
def interpreter(on: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for the body when ``on`` (the variable restored after: the fast engine elsewhere in
    the process must not take the kernel on a CPU)."""
    if not on:
        yield
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def headline(result: dict[str, Any]) -> list[str]:
    """One line per shape and batch (the layer's seven projections) and one per projection whose best tiles beat
    the default's by 10% or more."""
    lines = []
    for layer in result["layers"]:
        b = layer["bound_ms"]
        lines.append(
            f"{layer['model']} B={layer['batch']}: a layer's 7 NF4 projections: default tiles {layer['default_ms']:.4f} "
            f"ms (x{layer['default_ms'] / b:.2f} the bound {b:.4f} ms), best tiles {layer['best_ms']:.4f} ms "
            f"(x{layer['best_ms'] / b:.2f}), bitsandbytes {layer['bnb_ms']:.4f} ms (x{layer['bnb_ms'] / b:.2f})"
        )
    for r in result["rows"]:
        if r["default_over_best"] >= 1.1:
            lines.append(
                f"{r['model']} {r['proj']} [{r['n']}x{r['k']}] B={r['batch']}: best tiles {tuple(r['best']['config'])} "
                f"{r['best']['ms']:.4f} ms vs default {tuple(r['default']['config'])} {r['default']['ms']:.4f} ms "
                f"(x{r['default_over_best']})"
            )
    return lines
