"""Step checkpoints: complete, atomic, resumable.

``DIR/checkpoints/step-NNNNNN/`` holds everything a run needs to continue bit-identically:

- ``<role>/``: each trained adapter in PEFT format (+ ``head.safetensors`` for critic / reward)
- ``trainer_state.pt``: optimizer and scheduler states, RNG states (python, numpy, torch, cuda), read back with
  ``torch.load(weights_only=True)`` (no arbitrary pickles)
- ``state.json``: the loop's own state (step, data position, adaptive-KL value, counters) and ``recipe.yaml``

A checkpoint is written into a temporary folder and renamed into place, so a kill at any moment leaves the previous
checkpoint intact; ``COMPLETE`` is the last file written. Only the newest ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from lorarl.errors import LorarlError
from lorarl.runfiles import refuse_links
from lorarl.runs import CHECKPOINTS, MARKER, latest_checkpoint, list_checkpoints, step_name


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_to_saveable(state: dict) -> dict:
    """RNG states as tensors / lists / ints only, so torch.load(weights_only=True) reads them back."""
    py = state["python"]
    np_state = state["numpy"]
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            *[_plain(x) for x in np_state[2:]],
        ],
        "torch": state["torch"],
    }
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


def _plain(x):
    if isinstance(x, np.generic):
        return x.item()
    return x


def _rng_from_saved(saved: dict) -> dict:
    np_state = saved["numpy"]
    out = {
        "python": saved["python"],
        "numpy": (np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]),
        "torch": saved["torch"],
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out


def _fault_point(step: int, where: str) -> None:
    """Test hook: ``LORARL_FAULT=save:<step>:<where>`` SIGKILLs this process at that point of a checkpoint write,
    so tests can show that a kill at any moment leaves the previous checkpoint intact and resume exact."""
    spec = os.environ.get("LORARL_FAULT")
    if spec and spec == f"save:{step}:{where}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    shared,
    roles: list[str],
    optimizers: dict,
    schedulers: dict,
    state: dict,
    recipe=None,
    keep_last: int = 2,
) -> Path:
    """Write ``DIR/checkpoints/step-NNNNNN`` atomically and prune to the newest ``keep_last``; return its path."""
    from lorarl.config import recipe_to_dict

    root = refuse_links(Path(run_dir) / CHECKPOINTS)  # (a link here would take every checkpoint elsewhere)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{step_name(step)}.tmp-", dir=root))
    try:
        _fault_point(step, "start")
        for role in roles:
            shared.save_adapter(role, tmp / role)
        _fault_point(step, "adapters")
        trainer_state = {
            "optimizers": {k: v.state_dict() for k, v in optimizers.items()},
            "schedulers": {k: v.state_dict() for k, v in schedulers.items() if v is not None},
            "rng": _rng_to_saveable(rng_state()),
        }
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, "roles": roles, **state}, indent=2))
        if recipe is not None:
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
        _fault_point(step, "before_marker")
        with open(tmp / MARKER, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it atomically
            trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=root))
            os.replace(final, trash / "x")
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _fault_point(step, "renamed")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp-*"):  # left by a run killed mid-write
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike, shared, optimizers: dict, schedulers: dict) -> dict:
    """Restore adapters and heads in place, optimizer / scheduler / RNG states; return the loop's ``state``."""
    from safetensors.torch import load_file

    from lorarl.model import HEAD_FILE

    path = Path(path)
    if not (path / MARKER).is_file():
        raise LorarlError(f"{path}: not a complete checkpoint (no {MARKER} file)")
    state = json.loads((path / "state.json").read_text())
    for role in state["roles"]:
        weights = load_file(str(path / role / "adapter_model.safetensors"), device=str(shared.device))
        try:
            shared.load_adapter_weights(role, weights)
        except LorarlError as e:
            raise LorarlError(f"{path / role}: {e}") from None
        if role in shared.heads and (path / role / HEAD_FILE).is_file():
            shared.load_head(role, path / role / HEAD_FILE)
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    for k, opt in optimizers.items():
        opt.load_state_dict(trainer_state["optimizers"][k])
    for k, sch in schedulers.items():
        if sch is not None and k in trainer_state["schedulers"]:
            sch.load_state_dict(trainer_state["schedulers"][k])
    set_rng_state(_rng_from_saved(trainer_state["rng"]))
    return state


def resume_into(run_dir: str | os.PathLike, shared, optimizers: dict, schedulers: dict, state: dict) -> int:
    """Load the newest complete checkpoint of ``run_dir`` (if any) into the model, optimizers and schedulers; copy
    the saved values of ``state``'s keys into ``state`` in place. Returns the step to continue after (0: none)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return 0
    saved = load_checkpoint(ckpt, shared, optimizers, schedulers)
    state.update({k: saved[k] for k in state if k in saved})
    return int(saved["step"])
