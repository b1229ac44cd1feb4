"""Running a pipeline: each stage through the one run loop, a held-out evaluation after each, one summary table.

:func:`run_pipeline` reads top to bottom:

1. the output directory: ``pipeline.yaml`` (the wired stage recipes); a non-empty directory needs ``resume``
   (which continues a pipeline with the same stages) or ``force``;
2. the starting point's held-out evaluation (``evaluation.base``);
3. each stage in order: skipped when finished before (``DIR/NN-name/stage.json``), else trained by
   :func:`lorarl.algos.loop.train` into ``DIR/NN-name/`` (resumed from its newest checkpoint when resuming), then
   its policy evaluated greedily on the held-out prompts with the pipeline's ONE evaluation recipe (the same
   prompts, template and scoring for every row) and the summary table printed;
4. ``DIR/summary.json`` and ``DIR/summary.md`` (the table), written atomically after every stage.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import yaml

from lorarl.config import yaml_load
from lorarl.errors import LorarlError
from lorarl.pipeline.report import Row, eval_row, stage_row, summary_table
from lorarl.pipeline.spec import Pipeline, Stage
from lorarl.runfiles import write_atomic as write_file_atomic

STAGE_DONE = "stage.json"
EVALS = "evals"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, text)


def stage_plan(pipe: Pipeline) -> list[dict]:
    """What ``pipeline.yaml`` records of each stage: name, algo, run directory, wired recipe."""
    return [{"name": s.name, "algo": s.algo, "run_dir": str(s.run_dir), "recipe": s.raw} for s in pipe.stages]


def prepare_out(pipe: Pipeline, out: Path, resume: bool, force: bool) -> None:
    """Step 1: a fresh output directory, or the same pipeline's to resume."""
    saved = out / "pipeline.yaml"
    if out.exists() and any(out.iterdir()):
        if resume:
            if saved.is_file():
                before = [(s["name"], s["algo"]) for s in yaml_load(saved.read_text())["stages"]]
                now = [(s.name, s.algo) for s in pipe.stages]
                if before != now:
                    raise LorarlError(
                        f"{out}: was started with other stages ({before}); resume it with the same pipeline, or "
                        f"pass --force to start over"
                    )
        elif force:
            shutil.rmtree(out)
        else:
            raise LorarlError(
                f"{out}: output directory is not empty; pass --resume to continue it or --force to start over"
            )
    out.mkdir(parents=True, exist_ok=True)
    doc = {"pipeline": str(pipe.path), "evaluation": {"n": pipe.eval_n, "base": pipe.eval_base}}
    write_atomic(saved, yaml.safe_dump({**doc, "stages": stage_plan(pipe)}, sort_keys=False))


def evaluate_adapter(pipe: Pipeline, checkpoint: str, file: Path) -> dict:
    """Held-out greedy evaluation of ``checkpoint`` (``base`` or an adapter folder) with the pipeline's evaluation
    recipe, cached in ``file`` (a resumed pipeline does not evaluate twice; a different ``evaluation.n`` does)."""
    if file.is_file():
        cached = json.loads(file.read_text())
        if cached.get("n") == pipe.eval_n:
            return cached
    from lorarl.evaluate import evaluate

    result = evaluate(pipe.evaluation, checkpoint, n=pipe.eval_n)
    write_atomic(file, json.dumps(result, indent=2))
    return result


def run_stage(stage: Stage, resume: bool) -> dict:
    """Step 3: train one stage into its run directory (or read the summary of a stage finished before)."""
    done = stage.run_dir / STAGE_DONE
    if done.is_file():
        return json.loads(done.read_text())
    from lorarl.algos.loop import train

    t0 = time.perf_counter()
    summary = train(stage.recipe, stage.run_dir, resume=resume and stage.run_dir.exists())
    summary["stage_wall_s"] = round(time.perf_counter() - t0, 1)
    if not summary.get("stopped"):  # stopped on request (SIGTERM): unfinished, `--resume` continues it
        write_atomic(done, json.dumps(summary, indent=2, default=str))
    return summary


def write_summary(out: Path, rows: list[Row], wall_s: float) -> str:
    """Step 4: ``summary.json`` and ``summary.md``; returns the table."""
    table = summary_table(rows)
    write_atomic(out / "summary.md", table + "\n")
    doc = {"rows": [r.as_dict() for r in rows], "pipeline_wall_s": round(wall_s, 1)}
    write_atomic(out / "summary.json", json.dumps(doc, indent=2))
    return table


def run_pipeline(pipe: Pipeline, out_dir: str | Path, *, resume: bool = False, force: bool = False) -> dict:
    """Run ``pipe``'s stages in order into ``out_dir`` (see the module docstring); returns the summary."""
    out = Path(out_dir)
    t_start = time.perf_counter()
    prepare_out(pipe, out, resume, force)
    rows: list[Row] = []
    elapsed = 0.0  # seconds spent on this pipeline's stages and evaluations (a resumed run adds the earlier ones)

    # 2. The starting point --------------------------------------------------------------------------------------
    if pipe.eval_base:
        t0 = time.perf_counter()
        result = evaluate_adapter(pipe, "base", out / EVALS / "00-base.json")
        elapsed += result.get("seconds", time.perf_counter() - t0)
        rows.append(eval_row("base", "-", result, 0.0, elapsed))
        print(write_summary(out, rows, elapsed), file=sys.stderr)

    # 3. The stages, each evaluated ------------------------------------------------------------------------------
    for stage in pipe.stages:
        print(f"pipeline: {stage.label}: {stage.algo} -> {stage.run_dir}", file=sys.stderr)
        summary = run_stage(stage, resume)
        elapsed += summary["stage_wall_s"]
        if summary.get("stopped"):
            print(f"pipeline: {stage.label}: stopped at step {summary['step']}; --resume continues", file=sys.stderr)
            table = write_summary(out, rows, elapsed)
            return {
                "out": str(out),
                "stopped": True,
                "stage": stage.label,
                "run_dir": str(stage.run_dir),
                "rows": [r.as_dict() for r in rows],
                "table": table,
                "pipeline_wall_s": round(elapsed, 1),
            }
        result = None
        if stage.policy is not None:
            result = evaluate_adapter(pipe, str(stage.policy), out / EVALS / f"{stage.run_dir.name}.json")
            elapsed += result.get("seconds", 0.0)
        rows.append(stage_row(stage, summary, result, elapsed))
        print(write_summary(out, rows, elapsed), file=sys.stderr)

    # 4. The summary -------------------------------------------------------------------------------------------------
    table = write_summary(out, rows, elapsed)
    return {
        "out": str(out),
        "rows": [r.as_dict() for r in rows],
        "table": table,
        "pipeline_wall_s": round(elapsed, 1),
        "wall_s_this_run": round(time.perf_counter() - t_start, 1),
    }
