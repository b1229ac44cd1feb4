"""``lorarl bench gpu``: every GPU measurement lorarl has, in one command, into one folder.

    lorarl bench gpu                        # all parts -> docs/measurements/gpu/<device>-<date>/
    lorarl bench gpu --part rollout         # one part (repeatable); the others are left as they are
    lorarl bench gpu --smoke                # tiny shapes on any device (CPU included), in a temporary folder
    lorarl bench gpu --quick --part rollout --part step --part grpo-vs-trl --part quickstart   # ~9 min, one H100

Parts, in order (:mod:`lorarl.bench.gpu_parts`): ``env``, ``hf-profile``, ``rollout``, ``kernel``, ``quickstart``, ``step``,
``grpo-vs-trl``, ``plan``, ``deterministic``. Each writes ``<part>.json`` (its settings, result, headline lines,
seconds, the warnings it raised) and, for raw files, ``<part>.files/``; ``summary.md`` is rewritten after every part
from all the JSON files present. A part whose JSON records success is skipped unless ``--force`` (a failed one runs
again), so an interrupted run resumes; a part that fails records its error and traceback and the next part runs.
Parts run one after the other in this process (each measuring step that needs its own process starts it: the
GRPO-vs-TRL engines, the planner's workers, the two ``train.deterministic`` settings); the CUDA cache is emptied
between parts. Without a GPU the full sizes are refused: ``--smoke`` runs every part's code on tiny shapes.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import re
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lorarl.bench.gpu_parts import PARTS, PartContext, PartError, write_json  # noqa: E402
from lorarl.bench.step import STEP_FULL, STEP_QUICK  # noqa: E402
from lorarl.errors import LorarlError  # noqa: E402

QUICKSTART = "grpo_arithmetic.yaml"
QUICKSTART_GPU = ["model.quantization=none", "model.dtype=bfloat16", "train.report_to=[]"]


def full_settings() -> dict[str, dict]:
    """The GPU sizes of every part (each well under 10 minutes on one H100)."""
    from lorarl.bench.rollout import GPU_SHAPES

    return {
        "env": {},
        "hf-profile": {"shape": "llama-3.1-8b", "quantization": "nf4", "batches": [1, 16], "prompt_len": 64, "top": 15},
        "rollout": {
            "shapes": list(GPU_SHAPES),
            "quantization": "nf4",
            "batches": [1, 16, 64],
            "prompt_len": 64,
            "new_tokens": 32,
            "repeats": 3,
            "target_model": "llama-3.1-8b",
            "target_batch": 16,
        },
        "kernel": {"shapes": ["llama-3.1-8b", "qwen2.5-1.5b"], "batches": [1, 16, 64], "repeats": 20},
        "quickstart": {
            "recipe": QUICKSTART,
            "overrides": QUICKSTART_GPU,
            "steps": None,
            "eval_n": 200,
            "peer_steps": 6,
        },
        "step": STEP_FULL,
        "grpo-vs-trl": {"model": "smollm2-135m", "steps": 6, "engine": "fast"},
        "plan": {
            "argv": ["--models", "qwen2.5-1.5b,llama-3.1-8b", "--engine", "fast", "--jobs", "1", "--timeout", "280"]
            + ["--algos", "grpo,ppo,reward_model,sft"]
        },
        "deterministic": {
            "recipe": QUICKSTART,
            "overrides": [*QUICKSTART_GPU, "generation.engine=fast"],
            "steps": 6,
            "repeats": 10,
            "gather_shape": [8, 8, 40, 16],
        },
    }


def quick_settings() -> dict[str, dict]:
    """``--quick``: the full settings with fewer shapes, steps and repeats (never fewer engines), so that
    ``--quick --part rollout --part step --part grpo-vs-trl --part quickstart`` fits 9 minutes on one H100
    (per-part estimates in docs/benchmarks.md)."""
    full = full_settings()
    roll = full["rollout"] | {"shapes": ["llama-3.1-8b", "qwen2.5-1.5b"], "repeats": 2}
    step = STEP_QUICK
    quick = full["quickstart"] | {"eval_n": 100, "peer_steps": 4}
    return full | {
        "rollout": roll,
        "step": step,
        "grpo-vs-trl": full["grpo-vs-trl"] | {"steps": 4},
        "quickstart": quick,
    }


def smoke_settings(device_type: str, tiny_model: Path) -> dict[str, dict]:
    """Every part's code path on tiny shapes: a random Llama of hidden size 64 (the real tokenizer where a task
    needs text), 1-2 steps, a few tokens."""
    dtype = "bfloat16" if device_type == "cuda" else "float32"
    tiny = [
        f"model.name={tiny_model}",
        "model.quantization=none",
        f"model.dtype={dtype}",
        "train.prompts_per_step=2",
        "grpo.group_size=2",
        "train.micro_batch_size=4",
        "generation.max_new_tokens=4",
        "data.train_size=16",
        "data.eval_size=4",
        "eval.batch_size=4",
        "train.report_to=[]",
    ]
    return {
        "env": {},
        "hf-profile": {
            "shape": "tiny",
            "quantization": "nf4",
            "batches": [2],
            "prompt_len": 8,
            "top": 5,
            "bandwidth_bytes": 2**22,
        },
        "rollout": {
            "shapes": ["tiny"],
            "quantization": "none",
            "batches": [2],
            "prompt_len": 8,
            "new_tokens": 4,
            "repeats": 1,
            "target_model": "tiny",
            "target_batch": 2,
        },
        # under Triton's interpreter off CUDA; a fixed bandwidth (the smoke's times mean nothing)
        "kernel": {"shapes": ["tiny"], "batches": [2], "repeats": 1, "bandwidth_bytes": 2**22},
        "quickstart": {"recipe": QUICKSTART, "overrides": tiny, "steps": 2, "eval_n": 4, "peer_steps": 2},
        "step": STEP_FULL
        | {
            "models": ["tiny"],
            "new_tokens": [4],
            "prompts": 2,
            "group_size": 2,
            "prompt_len": 8,
            "lora_r": 4,
            "micro_batch": 2,
            "one_process": True,  # every engine in one process (the imports once)
            "cb_config": {"num_blocks": 4, "max_batch_tokens": 32},  # (on a CPU it would size its cache by RAM)
        },
        "grpo-vs-trl": {"model": str(tiny_model), "steps": 1, "engine": "fast"},
        "plan": {
            "argv": ["--device", device_type, "--models", "tiny", "--quantization", "none", "--engine", "fast"]
            + ["--algos", "grpo", "--prompts", "1", "--group-size", "2", "--prompt-len", "8", "--max-new-tokens", "4"]
            + ["--micro-batch", "2", "--jobs", "1", "--timeout", "300"]
        },
        "deterministic": {
            "recipe": QUICKSTART,
            "overrides": [*tiny, "generation.engine=fast"],
            "steps": 1,
            "repeats": 1,
            "gather_shape": [2, 2, 8, 4],
        },
    }


def tiny_model_folder(folder: Path) -> Path:
    """A random-init Llama (hidden 64, 2 layers, seed 0) with the embedded model's tokenizer, saved at ``folder``
    (reused when present): the smoke mode's model where a part needs real text (the arithmetic task)."""
    if (folder / "config.json").is_file():
        return folder
    from lorarl.bench.synthetic import tiny_llama_folder

    return tiny_llama_folder(folder)


def device_slug(device) -> str:
    """``nvidia-h100-80gb-hbm3`` from the CUDA device's name; ``cpu-x86_64`` without one."""
    import platform

    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_out(device) -> Path:
    """``docs/measurements/gpu/<device>-<UTC date>`` of the checkout (of the current folder outside one)."""
    from lorarl.bench.procs import REPO

    root = REPO if (REPO / "docs").is_dir() else Path.cwd()
    return root / "docs" / "measurements" / "gpu" / f"{device_slug(device)}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"


def run_part(name: str, ctx: PartContext) -> dict[str, Any]:
    """Run one part; return its record (status ok / failed, seconds, result, headline, warnings, error)."""
    import torch

    print(f"[bench gpu] == {name} ==", flush=True)
    t0 = time.perf_counter()
    record: dict[str, Any] = {"part": name, "smoke": ctx.smoke, "settings": ctx.settings}
    record["started"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = PARTS[name](ctx)
            record.update(status="ok", **out)
        except Exception as e:  # noqa: BLE001 - a failed part is recorded; the next one runs
            record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            if isinstance(e, PartError):
                record.update(e.partial)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["warnings"] = warning_counts(caught)
    for w in record["warnings"]:
        print(f"[bench gpu] warning x{w['count']}: {w['message'][:300]}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for line in record.get("headline", []):
        print(f"[bench gpu] {name}: {line}", flush=True)
    if record["status"] == "failed":
        print(f"[bench gpu] {name} FAILED: {record['error']}", flush=True)
    return record


def warning_counts(caught) -> list[dict[str, Any]]:
    """The warnings a part raised, one entry per distinct (category, message), with how often."""
    counts: dict[tuple[str, str], int] = {}
    for w in caught:
        key = (w.category.__name__, str(w.message))
        counts[key] = counts.get(key, 0) + 1
    return [{"category": c, "message": m, "count": n} for (c, m), n in counts.items()]


def run_gpu_bench(
    out: str | None = None,
    parts: list[str] | None = None,
    force: bool = False,
    smoke: bool = False,
    quick: bool = False,
) -> dict[str, Any]:
    """Run the parts (all, or ``parts``) into ``out`` (``quick``: :func:`quick_settings`); return ``{"out",
    "summary", "parts": {name: status}}``."""
    import torch

    names = parts or list(PARTS)
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        raise LorarlError(f"bench gpu: unknown part {', '.join(unknown)} (parts: {', '.join(PARTS)})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not smoke:
        raise LorarlError("bench gpu: no CUDA device; --smoke runs every part on tiny shapes here")
    folder = (
        Path(out) if out else (Path(tempfile.mkdtemp(prefix="lorarl-bench-gpu-")) if smoke else default_out(device))
    )
    folder.mkdir(parents=True, exist_ok=True)
    if smoke:
        settings = smoke_settings(device.type, tiny_model_folder(folder / "tiny-model"))
    else:
        settings = quick_settings() if quick else full_settings()
    status: dict[str, str] = {}
    for name in names:
        path = folder / f"{name}.json"
        if path.is_file() and not force and json.loads(path.read_text()).get("status") == "ok":
            print(f"[bench gpu] {name}: done before ({path}); --force runs it again", flush=True)
            status[name] = "kept"
            continue
        ctx = PartContext(folder, folder / f"{name}.files", device, settings[name], smoke, force)
        ctx.work.mkdir(parents=True, exist_ok=True)
        record = run_part(name, ctx)
        write_json(path, record)
        status[name] = record["status"]
        write_summary(folder)
    summary = write_summary(folder)
    print(f"[bench gpu] wrote {folder} ({summary.name})", flush=True)
    return {
        "out": str(folder),
        "summary": str(summary),
        "parts": status,
        "failed": [n for n, s in status.items() if s == "failed"],
    }


def write_summary(folder: Path) -> Path:
    """``summary.md``: the device and versions (from ``env.json``, else collected now), then every part's status,
    seconds and headline lines, from the part JSON files in ``folder``."""
    from lorarl.env_report import collect

    env_file = folder / "env.json"
    env = json.loads(env_file.read_text()).get("result") if env_file.is_file() else None
    env = env or collect()
    dev, pk, lo = env["devices"], env["packages"], env["lorarl"]
    gpus = "; ".join(f"{d['name']} (capability {d['capability']}, {d['memory_gb']} GB)" for d in dev["devices"])
    git = (
        f" (git {lo['git']['commit'][:12]}{', uncommitted changes' if lo['git']['dirty'] else ''})" if lo["git"] else ""
    )
    lines = [
        f"# lorarl GPU measurements: {gpus or 'no GPU (CPU)'}",
        "",
        f"- driver {dev['driver']}, CUDA runtime {dev['cuda_runtime']}, python {env['python']['version']}",
        f"- torch {pk['torch']}, transformers {pk['transformers']}, peft {pk['peft']}, trl {pk['trl']}, "
        f"bitsandbytes {pk['bitsandbytes']}; lorarl {lo['version']}{git}",
        f"- command: `lorarl bench gpu --out {folder}` (one part: `--part NAME`); raw results: `<part>.json`",
        "",
        "| part | status | seconds | warnings |",
        "|---|---|---|---|",
    ]
    records = {n: json.loads((folder / f"{n}.json").read_text()) for n in PARTS if (folder / f"{n}.json").is_file()}
    for name, r in records.items():
        smoke = " (smoke)" if r.get("smoke") else ""
        n_warn = sum(w["count"] for w in r.get("warnings", []))
        lines.append(f"| {name}{smoke} | {r['status']} | {r['seconds']} | {n_warn} |")
    for name, r in records.items():
        lines += ["", f"## {name}", ""] + [f"- {h}" for h in r.get("headline", [])]
        if r["status"] == "failed":
            lines.append(f"- **failed**: `{r['error'][:500]}`")
        for w in r.get("warnings", []):
            lines.append(f"- warning x{w['count']} ({w['category']}): {w['message'][:200]}")
    path = folder / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


__all__ = ["full_settings", "quick_settings", "run_gpu_bench", "smoke_settings", "write_summary"]
