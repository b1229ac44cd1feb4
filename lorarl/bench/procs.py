"""Worker processes and what they report about themselves: peak / current RSS, CPU seconds, the machine, the
thread count every engine uses, and the parent's side (start a worker, read its last JSON line).

Every engine or variant of a benchmark runs in a fresh process (``python -m lorarl.bench _worker ...``), one after
the other, so that each peak (RSS, ``torch.cuda.max_memory_allocated``) is its own and no engine inherits another's
allocator state, imports or threads.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from lorarl.errors import LorarlError

REPO = Path(__file__).resolve().parents[2]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def current_rss_bytes() -> int:
    """Resident set size now (``/proc/self/statm``; the peak where that is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return peak_rss_bytes()


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def bench_threads() -> int:
    """Threads of every engine: ``$LORARL_BENCH_THREADS``, else every usable CPU (the same for all engines)."""
    return max(1, int(os.environ.get("LORARL_BENCH_THREADS") or usable_cpus()))


def device_and_dtype() -> tuple[str, str]:
    """``("cuda", "bfloat16")`` on a GPU, ``("cpu", "float32")`` otherwise: unquantized on both, for every engine."""
    import torch

    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on (the load average too: wall times on a busy machine carry its error)."""
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": usable_cpus(),
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


def median_after_warm_up(values: list[float | None]) -> float | None:
    """Median of ``values`` without the first (warm-up) one when there are more; None when nothing is left."""
    rest = [v for v in (values[1:] if len(values) > 1 else values) if v is not None]
    return float(statistics.median(rest)) if rest else None


def ratio(a: float | None, b: float | None) -> float:
    """``a / b`` rounded to 4 places; NaN when either is missing or ``b`` is 0."""
    return round(a / b, 4) if a is not None and b else float("nan")


def ratios(a: dict, b: dict, **keys: str) -> dict[str, float]:
    """``{name: ratio(a[key], b[key])}`` for each ``name=key``: the figures of ``a`` over those of ``b``."""
    return {name: ratio(a[key], b[key]) for name, key in keys.items()}


def run_worker(args: list[str], out: Path, timeout: float, module: str = "lorarl.bench") -> dict:
    """Run ``python -m MODULE _worker ARGS --out OUT`` in a fresh process; return its last JSON stdout line.

    Raises LorarlError with the tail of its output when it fails, prints nothing JSON, or runs past ``timeout``."""
    cmd = [sys.executable, "-m", module, "_worker", *args, "--out", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
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
