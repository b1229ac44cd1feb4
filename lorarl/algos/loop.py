"""One run loop for every algorithm: run directory, seeds, resume, checkpoints, metrics, progress, plot, summary.

:func:`train` reads top to bottom:

1. the run directory (``recipe.yaml``), threads and seeds;
2. the one shared base, and the algorithm's set-up on it (roles, data, optimizers);
3. resume: the newest complete checkpoint, when asked;
4. each step: seed the RNGs from ``(seed, step)``, take the step's batch, run the algorithm's ``step``, add timing
   and memory; every ``eval.every`` steps a held-out evaluation (the best kept in ``DIR/best`` by
   ``train.keep_best``); the health checks (:mod:`lorarl.health`); log (and a few completions:
   ``train.log_completions``); a checkpoint every ``train.save_every``;
5. the algorithm's final adapters, a plot, and a summary (returned; the CLI prints it as the last stdout line).

Run control (:mod:`lorarl.runstate`): ``train.pid`` names the training process while it runs, ``state.json`` says
``running`` / ``stopped`` / ``finished`` / ``crashed`` and the step. SIGTERM (``lorarl.runstate.request_stop``, the
workbench's Stop) ends the run after the current step with a checkpoint of it and state ``stopped``; ``--resume``
continues it bit-identically. A SIGTERM while the step generates ends the generation within a token and abandons
the step: the run stops at the step before it, and ``--resume`` runs the abandoned step again.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
import yaml

from lorarl.algos import make_algorithm
from lorarl.algos.base import Algorithm, step_seed
from lorarl.config import Recipe, recipe_to_dict
from lorarl.errors import LorarlError, quote
from lorarl.health import HealthMonitor
from lorarl.metrics import MetricsLogger, check_trackers, plot_metrics
from lorarl.model import SharedBase, pick_device
from lorarl.model.host_memory import release_freed_tensors
from lorarl.phases import phase, recording
from lorarl.plan.bounds import check_planned_memory
from lorarl.rollout.fast import engine_metrics
from lorarl.runfiles import write_atomic
from lorarl.runs import latest_checkpoint
from lorarl.runstate import (
    CompletionsLog,
    StepAbandoned,
    StopRequest,
    check_not_live,
    clear_pid,
    mark_crashed,
    write_json_atomic,
    write_pid,
    write_state,
)

SUMMARY_FILE = "summary.json"  # the run's summary (the dict train returns), written when it ends or stops


@dataclass
class LoopState:
    """What the loop itself carries across a resume (the algorithm's own state is its ``state_dict``).

    step: the last step done; best_value / best_step: the best ``train.keep_best`` value so far and its step;
    health: the health monitor's state.
    """

    step: int = 0
    best_value: float | None = None
    best_step: int | None = None
    health: dict = field(default_factory=dict)


def eval_due(every: int, step: int, last_step: int, at_end: bool) -> bool:
    """Whether step ``step`` runs a held-out evaluation: every ``every`` steps and at the last step (``every`` 0:
    only at the last step, and only for algorithms that evaluate at the end: ``at_end``)."""
    if every > 0:
        return step % every == 0 or step == last_step
    return at_end and step == last_step


def improved(value, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` (``mode`` max or min; a missing or non-finite value never does)."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def save_best(run_dir: Path, shared: SharedBase, roles: list[str], step: int, metric: str, value: float) -> Path:
    """``run_dir/best/``: the adapters of ``roles`` at ``step`` and ``best.json`` (metric, value, step), replaced
    atomically (temp folder, then rename)."""
    import json
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=".best.tmp-", dir=run_dir))
    try:
        for role in roles:
            shared.save_adapter(role, tmp / role)
        (tmp / "best.json").write_text(json.dumps({"metric": metric, "value": value, "step": step}, indent=2))
        final = run_dir / "best"
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=".best.old-", dir=run_dir))
            os.replace(final, trash / "x")
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir / "best"


def use_deterministic_algorithms() -> None:
    """``train.deterministic``: torch's deterministic algorithms for the rest of the process (an op without a
    deterministic version warns instead of failing). On CUDA cuBLAS also needs a fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set here unless the user set it; it must be set before cuBLAS starts, so
    before the first matmul). CPU runs are bit-identical without this: the one CPU op that was not (the backward of
    the prefix-shared forward's row gather) is replaced at its source (``lorarl.model.logprobs.select_cache_rows``)."""
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def set_threads(device_type: str | None = None) -> int:
    """On CPU (``device_type``: the run's, default CUDA when a GPU is visible) use every core this process may run
    on (the default can be lower in containers), unless the user chose a count: ``LORARL_THREADS`` or
    ``OMP_NUM_THREADS``."""
    chosen = os.environ.get("LORARL_THREADS") or os.environ.get("OMP_NUM_THREADS")
    try:
        n = int(chosen) if chosen else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):  # not a number / not Linux
        n = os.cpu_count() or 1
    if (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) != "cuda":
        torch.set_num_threads(max(1, n))
        release_freed_tensors()  # glibc would keep a step's freed activations resident (lorarl.model.host_memory)
    return torch.get_num_threads()


def start_run(recipe: Recipe, out_dir: str | os.PathLike) -> Path:
    """Make the run directory, use every core, seed python and torch from ``train.seed``, write ``recipe.yaml``."""
    run_dir = Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_threads(pick_device(recipe.model.device).type)
    if recipe.train.deterministic:
        use_deterministic_algorithms()
    torch.manual_seed(recipe.train.seed)
    random.seed(recipe.train.seed)
    write_atomic(run_dir / "recipe.yaml", yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    return run_dir


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: CUDA's max allocated on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:  # pragma: no cover - not POSIX
        return float("nan")


def save(
    run_dir: Path, algo: Algorithm, shared: SharedBase, loop: LoopState, recipe: Recipe, algo_state: dict | None = None
) -> Path:
    """A step checkpoint of everything the next step needs (atomic; see :mod:`lorarl.checkpoint`); ``algo_state``
    stands for ``algo.state_dict()`` (an abandoned step's saves the one taken before that step)."""
    from lorarl.checkpoint import save_checkpoint

    state = {"loop": asdict(loop), "algo": algo.state_dict() if algo_state is None else algo_state}
    return save_checkpoint(
        run_dir,
        loop.step,
        shared,
        algo.roles,
        algo.optimizers,
        algo.schedulers,
        state,
        recipe,
        keep_last=recipe.train.keep_last,
    )


def restore(run_dir: Path, algo: Algorithm, shared: SharedBase) -> LoopState:
    """The newest complete checkpoint of ``run_dir`` loaded into the adapters, optimizers, schedulers, RNGs and the
    algorithm; a fresh :class:`LoopState` when there is none."""
    from lorarl.checkpoint import load_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return LoopState()
    saved = load_checkpoint(ckpt, shared, algo.optimizers, algo.schedulers)
    algo.load_state_dict(saved["algo"])
    return LoopState(**saved["loop"])


def after_step(step: int, row: dict, ctx: dict) -> bool:
    """The loop's own work after a step: held-out evaluation when due (and the best adapters kept), health checks.
    Returns whether the row must be logged now (an evaluation ran)."""
    from tqdm.auto import tqdm

    recipe, algo, loop = ctx["recipe"], ctx["algo"], ctx["loop"]
    evaluated = eval_due(recipe.eval.every, step, ctx["last_step"], getattr(algo, "final_eval", False))
    if evaluated:
        with recording() as phases, phase("evaluation"):
            row.update(algo.evaluate())
        row["time/evaluation"] = phases.seconds["evaluation"]
        metric = recipe.train.keep_best
        if metric and improved(row.get(metric), loop.best_value, recipe.train.keep_best_mode):
            loop.best_value, loop.best_step = float(row[metric]), step
            save_best(ctx["run_dir"], ctx["shared"], algo.outputs, step, metric, loop.best_value)
    for warning in ctx["monitor"].check(step, row, ctx["params"]):
        tqdm.write(f"step {step}: health: {warning}")
    loop.health = ctx["monitor"].state_dict()
    return evaluated


def unsaved_state(algo: Algorithm) -> tuple[dict, dict]:
    """What a checkpoint of the last complete step needs besides the adapters and optimizers, which a step leaves
    alone until its update: the RNG states and a copy of the algorithm's state (taken before a step, for
    :func:`abandon_step`)."""
    import copy

    from lorarl.checkpoint import rng_state

    return rng_state(), copy.deepcopy(algo.state_dict())


def abandon_step(ctx: dict, step: int, saved_step: int, before: tuple[dict, dict] | None) -> None:
    """A stop request ended step ``step``'s generation (:class:`lorarl.runstate.StepAbandoned`): nothing trained on
    its partial rollout, nothing of it is logged or saved. The steps done since the newest checkpoint
    (``saved_step``) are saved as they were when step ``step`` began (``before``: :func:`unsaved_state`), so
    ``--resume`` runs step ``step`` again from the same RNGs and state, bit-identically."""
    from tqdm.auto import tqdm

    from lorarl.checkpoint import set_rng_state

    loop = ctx["loop"]
    if loop.step > saved_step and before is not None:
        rng, algo_state = before
        set_rng_state(rng)
        save(ctx["run_dir"], ctx["algo"], ctx["shared"], loop, ctx["recipe"], algo_state=algo_state)
    kept = f"checkpoint of step {loop.step}" if loop.step else "no step done"
    tqdm.write(f"step {step}: stop requested during generation: step abandoned; {kept}; `--resume` continues")


def run_steps(ctx: dict, stop: StopRequest, start_step: int) -> tuple[list[dict], bool]:
    """Step 4: the steps after ``start_step`` through ``ctx["last_step"]``; each logged (``metrics.jsonl``, a few
    completions in ``completions.jsonl``), checkpointed every ``train.save_every``, and ``state.json`` updated.
    A stop request (SIGTERM) ends the loop after the current step with a checkpoint of it, unless it was the last
    step; one that comes while the step generates ends the generation and abandons the step (:func:`abandon_step`).
    Returns the rows of this run's steps and whether it stopped early."""
    from tqdm.auto import tqdm

    recipe, algo, loop, shared, run_dir = ctx["recipe"], ctx["algo"], ctx["loop"], ctx["shared"], ctx["run_dir"]
    last_step, logger, samples, bar = ctx["last_step"], ctx["logger"], ctx["samples"], ctx["bar"]
    history: list[dict] = []
    saved_step = start_step  # the step of the newest checkpoint (the one resumed from, or none at 0)
    for step in range(start_step + 1, last_step + 1):
        if stop.requested:  # asked during set-up, or after the last step's `stopping` was computed
            if loop.step > saved_step:  # the steps since the newest checkpoint are kept
                save(run_dir, algo, shared, loop, recipe)
                tqdm.write(f"step {loop.step}: stop requested: checkpoint saved; `lorarl train --resume` continues")
            return history, True
        before = unsaved_state(algo) if loop.step > saved_step else None  # saved if this step is abandoned
        t0, cpu0 = time.perf_counter(), time.process_time()
        torch.manual_seed(step_seed(recipe.train.seed, step))
        try:
            with recording() as phases, stop.observed():  # the rollout engines watch the flag while generating
                row = algo.step(algo.batch(step))
        except StepAbandoned:
            abandon_step(ctx, step, saved_step, before)
            return history, True
        step_time = time.perf_counter() - t0
        row.update({f"time/{name}": seconds for name, seconds in phases.seconds.items()})
        row["step_time"] = step_time
        row["step_cpu_s"] = time.process_time() - cpu0  # CPU seconds of this process (all threads)
        if "tokens" in row:
            row["tokens_per_s"] = row.pop("tokens") / max(step_time, 1e-9)
        row["peak_mem_gb"] = peak_memory_gb(shared.device)
        row.update(engine_metrics(shared))  # the fast engine's CUDA-graph captures / failures / eager fallbacks
        loop.step = step
        log_now = after_step(step, row, ctx)
        history.append(row)
        if step % recipe.train.log_every == 0 or step == last_step or log_now:
            logger.log(step, row)
        samples.log(step, getattr(algo, "samples", []))  # GRPO / PPO: train.log_completions rows of this step
        bar.set_postfix(algo.progress(row))
        bar.update(1)
        stopping = stop.requested and step < last_step
        save_every = recipe.train.save_every
        if stopping or (save_every > 0 and (step % save_every == 0 or step == last_step)):
            save(run_dir, algo, shared, loop, recipe)
            saved_step = step
        if stopping:
            tqdm.write(f"step {step}: stop requested: checkpoint saved; `lorarl train --resume` continues")
            return history, True
        write_state(run_dir, "running", step, last_step)
    return history, False


def check_max_steps(max_steps: Any) -> None:
    """``--max-steps`` / ``max_steps``: None (every step of ``train.steps``) or the step to stop after, an int >= 1
    (0 trained every step and -1 wrote an untrained adapter before)."""
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, Integral) or max_steps < 1):
        raise LorarlError(
            f"--max-steps (max_steps) must be an int >= 1, the step to stop after; got {quote(max_steps)}"
        )


def train(
    recipe: Recipe,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
) -> dict:
    """Train ``recipe``'s algorithm; write the run directory ``out_dir``; return a summary.

    ``out_dir`` gets ``recipe.yaml``, ``metrics.jsonl``, ``summary.json`` (the returned summary), ``completions.jsonl``, ``tb/``, ``checkpoints/step-NNNNNN/``
    (every ``train.save_every`` steps), and at the end the trained adapters (``policy/``, ``critic/``, ``reward/``)
    and ``plot.png``. ``resume`` continues from the newest checkpoint; ``max_steps`` stops after that step (the LR
    schedule still spans the whole run). While it runs, ``train.pid`` names this process and ``state.json`` says how
    far it got (:mod:`lorarl.runstate`). ``progress``: the tqdm.auto bar (a widget in a notebook); False hides it.
    SIGTERM stops it after the current step with a checkpoint (state
    ``stopped``, no final adapters; the summary has ``"stopped": true``); an exception leaves state ``crashed``.
    """
    t_start = time.perf_counter()
    check_max_steps(max_steps)
    check_trackers(recipe.train.report_to)  # a tracker that is not installed fails before the model loads
    check_not_live(out_dir)  # another process is training this folder
    check_planned_memory(recipe)  # sizes that multiply past this machine (the planner, no weights read)
    run_dir = start_run(recipe, out_dir)
    write_pid(run_dir)
    try:
        with StopRequest() as stop:
            summary = train_in(recipe, run_dir, resume, max_steps, stop, t_start, progress=progress)
        write_json_atomic(run_dir / SUMMARY_FILE, summary)  # what the CLI prints last; lorarl.Run.summary reads it
        return summary
    except BaseException as e:
        mark_crashed(run_dir, e, default_last_step=max_steps or recipe.train.steps)
        raise
    finally:
        clear_pid(run_dir)


def keep_decode_cache(recipe: Recipe, shared: SharedBase) -> None:
    """Resolve ``generation.keep_cache`` for this run's base (CUDA: ``auto`` asks the planner,
    :func:`lorarl.plan.recipes.resolve_keep_cache`; one line says what it chose and why when it frees)."""
    if shared.device.type != "cuda":
        return
    from lorarl.plan.recipes import resolve_keep_cache
    from lorarl.rollout.fast.graphs import pool_for

    keep = resolve_keep_cache(recipe, "cuda")
    pool_for(shared).keep = keep
    if recipe.generation.keep_cache == "auto" and not keep:
        print(
            "generation.keep_cache auto -> false: the fast engine's static KV cache is freed after each rollout "
            "(held, it would not fit the card or would lower the planned micro-batch; `lorarl plan` shows both)",
            file=sys.stderr,
        )


def train_in(
    recipe: Recipe,
    run_dir: Path,
    resume: bool,
    max_steps: int | None,
    stop: StopRequest,
    t_start: float,
    progress: bool = True,
) -> dict:
    """:func:`train` in the run directory ``run_dir`` made by :func:`start_run`."""
    from tqdm.auto import tqdm

    # 2. The shared base and the algorithm's set-up on it --------------------------------------------------
    shared = SharedBase.load(recipe.model)
    algo = make_algorithm(recipe, shared)
    keep_decode_cache(recipe, shared)
    if hasattr(algo, "source"):  # an LLM judge logs a sample of its prompts and answers to run_dir/judge.jsonl
        algo.source.log_to(run_dir)
    last_step = min(algo.total_steps, max_steps) if max_steps else algo.total_steps
    algo.last_step = last_step  # the step that ends this run (an algorithm may evaluate there)

    # the adapter the health monitor watches, from its starting weights (set-up is seeded: a resumed run's are the
    # same, so health/adapter_delta reads as in an uninterrupted run)
    params = shared.trainable_parameters(algo.outputs[0])
    monitor = HealthMonitor.from_recipe(recipe, params)

    # 3. Resume ---------------------------------------------------------------------------------------------
    loop = restore(run_dir, algo, shared) if resume else LoopState()
    start_step = loop.step
    write_state(run_dir, "running", start_step, last_step)
    if loop.health:
        monitor.load_state_dict(loop.health)
    ctx = dict(recipe=recipe, algo=algo, loop=loop, last_step=last_step, run_dir=run_dir, shared=shared)
    ctx.update(monitor=monitor, params=params)
    ctx["logger"] = MetricsLogger.for_recipe(run_dir, recipe, resume_step=start_step if resume else None)
    ctx["samples"] = CompletionsLog(run_dir, resume_step=start_step if resume else None)
    ctx["bar"] = tqdm(
        total=last_step, initial=start_step, desc=algo.name, unit="step", dynamic_ncols=True, disable=not progress
    )

    # 4. The steps ------------------------------------------------------------------------------------------
    try:
        history, stopped = run_steps(ctx, stop, start_step)
    finally:
        ctx["bar"].close()
        ctx["logger"].close()
        ctx["samples"].close()
    common = {
        "steps": last_step,
        "steps_this_run": len(history),
        **({"best": {"step": loop.best_step, recipe.train.keep_best: loop.best_value}} if loop.best_step else {}),
        "warnings": sorted(monitor.warned),
    }
    if stopped:  # no final adapters: the run is unfinished
        write_state(run_dir, "stopped", loop.step, last_step)
        latest = latest_checkpoint(run_dir)
        return {
            "run_dir": str(run_dir),
            "stopped": True,
            "step": loop.step,
            "checkpoint": str(latest) if latest else None,
            **common,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }

    # 5. Final adapters, plot, summary ------------------------------------------------------------------------
    if hasattr(algo, "source"):  # a reward function that failed on every step of the run: not a success
        algo.source.check_finished()
    summary = algo.finish(run_dir, history)
    plot = plot_metrics(run_dir, panels=algo.plot_panels)
    write_state(run_dir, "finished", loop.step, last_step)
    return {
        "run_dir": str(run_dir),
        **summary,
        "plot": str(plot),
        **common,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
