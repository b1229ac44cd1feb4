"""Run OpenRLHF's own command line on launch-script command lines, on CPU, without Ray, vLLM, DeepSpeed or GPUs.

``python openrlhf_probe.py ARGV_JSONL OUT_JSON``: for each recorded command line
(``["openrlhf.cli.train_ppo_ray", *args]``) this runs the module as ``__main__`` (``runpy``): OpenRLHF's argparse
parser parses the arguments (an unknown flag or a bad value exits), ``hierarchize`` nests them, and every check of
its ``__main__`` block runs (estimator vs samples per prompt, eval dataset vs reward, micro-batches vs actor GPUs,
...). Its last line calls ``train(args)``, whose first act is ``ray.is_initialized()``: there this probe records
``args`` and stops.

Not run: anything from ``ray.init`` on. Stand-ins, because the module imports them at the top but the parser never
calls them: ``ray`` (whose ``is_initialized`` is the probe) and OpenRLHF's Ray actor modules
(``openrlhf.trainer.ray``, ``.launcher``, ``.ppo_actor``, ``.ppo_critic``: they import vLLM and DeepSpeed).
"""

from __future__ import annotations

import io
import json
import runpy
import sys
import traceback
import types
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

RUNTIME_MODULES = (
    "ray",
    "ray.util",
    "ray.util.placement_group",
    "openrlhf.trainer.ray",
    "openrlhf.trainer.ray.launcher",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.ppo_critic",
)


class Reached(BaseException):
    """``train(args)`` was reached with arguments that passed every check before it."""


def plain(x):
    """``args`` (nested SimpleNamespace) as JSON-able dicts and lists."""
    if isinstance(x, types.SimpleNamespace):
        return {k: plain(v) for k, v in vars(x).items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x if isinstance(x, (str, int, float, bool)) or x is None else repr(x)


def install_stand_ins(captured: list) -> None:
    def refuse(*a, **k):
        raise RuntimeError("a Ray runtime object was used by the parser probe")

    for name in RUNTIME_MODULES:
        module = types.ModuleType(name)
        for attr in ("create_vllm_engines", "RayActorGroup", "ReferenceModelActor", "RewardModelActor"):
            setattr(module, attr, refuse)
        for attr in ("PolicyModelActor", "CriticModelActor", "placement_group"):
            setattr(module, attr, refuse)
        sys.modules[name] = module

    def is_initialized() -> bool:  # train()'s first call: record its args and stop
        captured.append(plain(sys._getframe(1).f_locals["args"]))
        raise Reached()

    sys.modules["ray"].is_initialized = is_initialized


def run_one(argv: list[str], captured: list) -> dict:
    sys.argv = ["train_ppo_ray.py", *argv[1:]]
    out, err = io.StringIO(), io.StringIO()
    result: dict = {"argv": argv, "reached": False, "error": None}
    try:
        with redirect_stdout(out), redirect_stderr(err):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=False)
        result["error"] = "the module returned without calling train()"
    except Reached:
        result["reached"] = True
        result["args"] = captured.pop()
    except SystemExit as e:  # argparse: unknown flag, bad value
        result["error"] = f"SystemExit({e.code}): {err.getvalue()[-1500:]}"
    except BaseException:  # an assert of the __main__ block
        result["error"] = traceback.format_exc(limit=6)
    result["stdout"] = out.getvalue()[-3000:]
    return result


def main() -> None:
    argv_file, out_file = sys.argv[1], sys.argv[2]
    captured: list = []
    install_stand_ins(captured)
    results = [run_one(json.loads(line), captured) for line in Path(argv_file).read_text().splitlines() if line]
    Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
