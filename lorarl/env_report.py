"""``lorarl env``: what a bug report needs, in one command.

:func:`collect` gathers, without loading any model:

* versions: python, torch (and the CUDA / cuDNN it was built with), transformers, peft, trl, bitsandbytes,
  datasets, gradio, lorarl (and the git commit when it runs from a checkout);
* devices: whether CUDA is usable, each device's name, compute capability, memory and bf16 support, the driver
  (``nvidia-smi``) and the CUDA runtime;
* bitsandbytes' 4-bit kernels: a tiny NF4 ``Linear4bit`` forward on this device (CUDA if present, else CPU), compared
  with the same input times its dequantized weight (:func:`nf4_check`);
* the embedded model (installed? converted? where), ``$LORARL_CACHE``, CPU threads and the OpenMP settings.

:func:`format_report` renders it for a human; ``lorarl env --json`` adds the dict as the last stdout line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "datasets", "gradio", "accelerate", "safetensors")
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "LORARL_THREADS", "LORARL_BENCH_THREADS")


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit(folder: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout holding ``folder`` (None outside a checkout or without git)."""
    if not (folder / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def lorarl_info() -> dict[str, Any]:
    import lorarl

    pkg = Path(lorarl.__file__).resolve().parent
    return {"version": lorarl.__version__, "path": str(pkg), "git": git_commit(pkg.parent)}


def driver_version() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi`` (None when it is absent or fails)."""
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = p.stdout.strip().splitlines()
    return lines[0].strip() if p.returncode == 0 and lines else None


def device_info() -> dict[str, Any]:
    """CUDA availability, the CUDA runtime torch was built with, the driver, and each device's facts."""
    import torch

    from lorarl.model.precision import native_bf16

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "cuda_available": cuda,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "driver": driver_version() if cuda or torch.version.cuda else None,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "devices": [],
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
    }
    for i in range(info["device_count"]):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gb": round(p.total_memory / 1e9, 2),
                "multiprocessors": p.multi_processor_count,
                # native bf16 only (compute 8.0+): torch.cuda.is_bf16_supported() also says yes where bf16 is emulated
                "bf16": native_bf16((p.major, p.minor)),
            }
        )
    return info


def nf4_check(device: str | None = None) -> dict[str, Any]:
    """bitsandbytes' NF4 kernels on ``device`` (CUDA when present, else CPU): a ``Linear4bit(64, 32)`` (double
    quantization; compute dtype bf16 on CUDA, fp32 on CPU) applied to ``x [4, 64]``, against ``x @ W_deq^T`` with
    ``W_deq = dequantize_4bit(W)``: ``ok`` when the forward is finite and ``max|y - y_ref| <= 0.02 max|y_ref|``;
    also ``quantization_error = max|W_deq - W| / max|W|`` (NF4's own rounding, about 0.1)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out: dict[str, Any] = {"device": dev.type, "version": package_versions(("bitsandbytes",))["bitsandbytes"]}
    if out["version"] is None:
        return {**out, "ok": False, "error": "bitsandbytes is not installed"}
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf

        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        torch.manual_seed(0)
        weight = torch.randn(32, 64)
        layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(
            weight.clone(), requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
        layer = layer.to(dev)
        x = torch.randn(4, 64, device=dev, dtype=dtype)
        with torch.no_grad():
            y = layer(x).float()
            w_deq = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
            ref = x.float() @ w_deq.t()
        err = (y - ref).abs().max().item()
        scale = ref.abs().max().item()
        out.update(
            compute_dtype=str(dtype).removeprefix("torch."),
            max_abs_error=round(err, 6),
            relative_error=round(err / scale, 6) if scale else None,
            quantization_error=round((w_deq.cpu() - weight).abs().max().item() / weight.abs().max().item(), 4),
            ok=bool(torch.isfinite(y).all()) and err <= 0.02 * scale,
            error=None,
        )
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    return out


def embedded_model() -> dict[str, Any]:
    """The embedded default model: installed (its package present), converted (in the cache), where."""
    from lorarl.model.registry import DEFAULT_MODEL, cache_dir, list_models

    rows = [r for r in list_models() if r["name"] == DEFAULT_MODEL]
    row = rows[0] if rows else {"name": DEFAULT_MODEL, "installed": False, "converted": False, "path": None}
    return {
        "name": row["name"],
        "installed": bool(row["installed"]),
        "converted": bool(row["converted"]),
        "path": row["path"],
        "LORARL_CACHE": os.environ.get("LORARL_CACHE"),
        "cache_dir": str(cache_dir()),
    }


def cpu_info() -> dict[str, Any]:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "usable_cpus": cpus,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        # DEFAULT / AVX2 / AVX512: bitsandbytes 0.50's CPU dequantize takes its AVX-512 branch where this says AVX512
        # (lorarl.model.nf4_dequant checks it at load)
        "capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ.get(k) for k in THREAD_VARS},
    }


def collect() -> dict[str, Any]:
    """Everything :mod:`lorarl.env_report` reports, as one JSON-able dict."""
    import torch

    return {
        "lorarl": lorarl_info(),
        "python": {"version": platform.python_version(), "executable": sys.executable, "platform": platform.platform()},
        "packages": package_versions(),
        "torch_build": {"version": torch.__version__, "cuda": torch.version.cuda, "debug": torch.version.debug},
        "devices": device_info(),
        "bitsandbytes_nf4": nf4_check(),
        "embedded_model": embedded_model(),
        "cpu": cpu_info(),
    }


def format_report(env: dict[str, Any]) -> str:
    """The human-readable report of :func:`collect`'s dict."""
    lo, dev, bnb, em, cpu = env["lorarl"], env["devices"], env["bitsandbytes_nf4"], env["embedded_model"], env["cpu"]
    git = lo["git"]
    commit = f" (git {git['commit'][:12]}{', uncommitted changes' if git['dirty'] else ''})" if git else ""
    lines = [
        f"lorarl       {lo['version']}{commit}  {lo['path']}",
        f"python       {env['python']['version']}  {env['python']['executable']}",
        f"platform     {env['python']['platform']}",
    ]
    for name, v in env["packages"].items():
        lines.append(f"{name:<12} {v or 'not installed'}")
    built = env["torch_build"]["cuda"]
    lines.append(f"torch CUDA   built with {built or 'no CUDA (CPU build)'}")
    if dev["cuda_available"]:
        lines.append(f"CUDA         available: {dev['device_count']} device(s), driver {dev['driver'] or 'unknown'}")
        for d in dev["devices"]:
            lines.append(
                f"  cuda:{d['index']}     {d['name']}, capability {d['capability']}, {d['memory_gb']} GB, "
                f"{d['multiprocessors']} SMs, bf16 {'yes' if d['bf16'] else 'no (fp16 only)'}"
            )
    else:
        lines.append("CUDA         not available (training runs on the CPU)")
    if bnb["ok"]:
        state = (
            f"ok on {bnb['device']} ({bnb['compute_dtype']} compute, max error {bnb['max_abs_error']:.2e} vs the "
            f"dequantized weight)"
        )
    else:
        state = f"FAILED on {bnb['device']}: {bnb.get('error') or 'the 4-bit forward disagrees with its weight'}"
    lines.append(f"NF4 kernels  {state}")
    conv = "converted" if em["converted"] else ("installed, not converted yet" if em["installed"] else "not installed")
    lines.append(f"model        {em['name']} (default): {conv}  {em['path'] or ''}".rstrip())
    lines.append(f"cache        {em['cache_dir']} (LORARL_CACHE {em['LORARL_CACHE'] or 'not set'})")
    env_vars = ", ".join(f"{k}={v}" for k, v in cpu["env"].items() if v is not None) or "none set"
    lines.append(
        f"CPU          {cpu['usable_cpus']} usable of {cpu['cpu_count']}, torch threads {cpu['torch_threads']} "
        f"(interop {cpu['torch_interop_threads']}); {env_vars}"
    )
    return "\n".join(lines)


__all__ = ["collect", "format_report", "nf4_check", "package_versions"]
