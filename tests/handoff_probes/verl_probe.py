"""Run verl's own entry point on launch-script command lines, on CPU, without Ray, vLLM or GPUs.

``python verl_probe.py ARGV_JSONL OUT_JSON``: for each recorded command line (``["verl.trainer.main_ppo", *args]``)
this calls ``verl.trainer.main_ppo.main()`` -- Hydra composes verl's released ``ppo_trainer.yaml`` with the
arguments in struct mode (an unknown key fails), then verl's ``validate_config`` runs (batch divisibility, micro-batch
settings, its config classes for the actor and the critic). ``main`` then calls ``run_ppo``, whose first act is
``ray.is_initialized()``: there this probe takes the composed config, converts the other sections to verl's config
classes (``omega_conf_to_dataclass``: their ``__post_init__`` checks run; the model sections load the base's
tokenizer and config) and stops.

Not run: anything from ``ray.init`` on. Stand-ins, because verl's config modules import them but never call them
here: ``ray`` (whose ``is_initialized`` is the probe; ``@ray.remote`` leaves a class as it is), ``tensordict`` (classes that refuse to be instantiated), and
``verl.workers.rollout.vllm_rollout.utils`` (it imports vLLM; the stand-in holds verl's own
``get_vllm_max_lora_rank``, copied from that file).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import io
import json
import sys
import traceback
import types
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

# the sections verl's trainer and workers convert to its config classes (validate_config did the actor and critic)
SECTIONS = ("algorithm", "actor_rollout_ref.model", "actor_rollout_ref.rollout")


class Reached(BaseException):  # not an Exception: Hydra's error handler must not swallow it
    """``run_ppo`` was reached with a config that passed everything before it."""


def _placeholder(qualname: str) -> type:
    def refuse(self, *a, **k):
        raise RuntimeError(f"{qualname} is a stand-in in the config probe")

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": refuse})


class StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every module of the stand-in packages (``ray``, ``ray._private.runtime_env.constants``, ...) is a StandIn."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install_stand_ins(captured: list) -> None:
    def is_initialized() -> bool:  # run_ppo's first call: take its config and stop
        captured.append(sys._getframe(1).f_locals["config"])
        raise Reached()

    def remote(*args, **kwargs):  # `@ray.remote class TaskRunnerV1` at import: left as the plain class
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda obj: obj)

    sys.meta_path.insert(0, StandInFinder(("ray", "tensordict")))
    import ray

    ray.is_initialized = is_initialized
    ray.remote = remote


def install_lora_rank(verl_root: Path) -> None:
    """``verl.workers.rollout.vllm_rollout.utils`` holding only verl's ``get_vllm_max_lora_rank`` (validate_config
    calls it for a LoRA run with vLLM; the real module imports vLLM at the top)."""
    name = "verl.workers.rollout.vllm_rollout.utils"
    source = (verl_root / "workers/rollout/vllm_rollout/utils.py").read_text()
    fn = next(n for n in ast.parse(source).body if getattr(n, "name", "") == "get_vllm_max_lora_rank")
    module = types.ModuleType(name)
    exec("from typing import Literal, get_args\n" + ast.get_source_segment(source, fn), module.__dict__)
    sys.modules[name] = module


def check_sections(config) -> list[str]:
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    done = []
    for path in SECTIONS:
        section = OmegaConf.select(config, path)
        obj = omega_conf_to_dataclass(section)
        done.append(f"{path}: {type(obj).__module__}.{type(obj).__name__}")
    return done


def run_one(argv: list[str], captured: list) -> dict:
    import verl.trainer.main_ppo as main_ppo
    from omegaconf import OmegaConf

    sys.argv = ["main_ppo.py", *argv[1:]]
    out, err = io.StringIO(), io.StringIO()
    result: dict = {"argv": argv, "reached": False, "error": None}
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main_ppo.main()
        result["error"] = "main() returned without reaching run_ppo"
    except Reached:
        config = captured.pop()
        result["reached"] = True
        try:
            with redirect_stdout(out):
                result["validated"] = check_sections(config)
            result["config"] = OmegaConf.to_container(config, resolve=True)
        except Exception:
            result["error"] = traceback.format_exc(limit=8)
    except SystemExit as e:  # Hydra reports a bad override / a failed check and exits
        result["error"] = f"SystemExit({e.code}): {err.getvalue()[-2000:]}"
    except Exception:
        result["error"] = traceback.format_exc(limit=8)
    result["stdout"] = out.getvalue()[-4000:]
    return result


def main() -> None:
    argv_file, out_file = sys.argv[1], sys.argv[2]
    captured: list = []
    install_stand_ins(captured)
    import verl

    install_lora_rank(Path(verl.__file__).parent)
    results = [run_one(json.loads(line), captured) for line in Path(argv_file).read_text().splitlines() if line]
    Path(out_file).write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
