"""What an export reads: the policy adapter, the run it belongs to, its recipe, step and metrics.

Every rule that finds something in a run (which folder is an adapter, a checkpoint or a run directory, the step of a
checkpoint, ``--checkpoint`` names, the newest complete checkpoint, ``metrics.jsonl``) is :mod:`lorarl.runs`'s; this
module only decides what an export takes from them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.config import Recipe, load_run_recipe
from lorarl.errors import LorarlError
from lorarl.runs import (
    ADAPTER_CONFIG,
    CHECKPOINTS,
    checkpoint_of,
    checkpoint_step,
    is_adapter,
    latest_checkpoint,
    named_checkpoint,
    read_metrics,
    run_dir_of,
)

POLICY = "policy"
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors")


@dataclass
class RunSource:
    """What an export reads: the adapter folder, the run it belongs to, its recipe, step and metrics."""

    adapter_dir: Path
    run_dir: Path | None
    checkpoint_dir: Path | None
    step: int | None
    recipe: Recipe | None
    recipe_path: Path | None
    base_path: str
    metrics: dict | None = None
    eval: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def trust_remote_code(self) -> bool:
        """The recipe's ``model.trust_remote_code`` (False without a recipe): every load of the base honours it."""
        return bool(self.recipe and self.recipe.model.trust_remote_code)


def metrics_at(rows: list[dict], step: int | None) -> dict | None:
    """The metrics row of ``step`` (the last row when ``step`` is None; else the last row at or before it)."""
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        return None
    if step is None:
        return rows[-1]
    before = [r for r in rows if r["step"] <= step]
    return before[-1] if before else None


def _adapter_in_run(run: Path, checkpoint: str | None, notes: list[str]) -> tuple[Path, Path | None]:
    """``(adapter, checkpoint folder)`` of a run directory: ``--checkpoint``'s, else the final ``policy/``, else the
    newest complete checkpoint's (a run stopped early; ``notes`` says so)."""
    if checkpoint:
        cp = named_checkpoint(run, checkpoint)
        return cp / POLICY, cp
    if (run / POLICY).is_dir():
        return run / POLICY, None
    cp = latest_checkpoint(run)
    if cp is None:
        raise LorarlError(
            f"{run}: no policy adapter (expected {run / POLICY}/ or a complete checkpoint under {run / CHECKPOINTS}/)"
        )
    notes.append(f"the run has no final adapter; exported its newest checkpoint {cp.name}")
    return cp / POLICY, cp


def _run_of(folder: Path, cp: Path | None) -> Path | None:
    """The run directory ``folder`` belongs to (:func:`lorarl.runs.run_dir_of`), never its checkpoint: a checkpoint
    copied out of its run holds a recipe.yaml, which ``run_dir_of`` takes for the mark of a run directory."""
    run_dir = run_dir_of(folder)
    return None if run_dir is not None and run_dir == cp else run_dir


def _find(run: Path, checkpoint: str | None, notes: list[str]) -> tuple[Path, Path | None, Path | None]:
    """``(adapter, checkpoint folder, run directory)`` for what the user named: an adapter folder, a checkpoint
    folder or a run directory."""
    if is_adapter(run):
        cp = checkpoint_of(run)
        return run, cp, _run_of(run, cp)
    if checkpoint_of(run) == run:  # a checkpoint folder (step-NNNNNN, or one holding COMPLETE)
        if checkpoint:
            raise LorarlError(f"{run}: is a checkpoint already; --checkpoint applies to a run directory")
        return run / POLICY, run, _run_of(run, run)
    adapter, cp = _adapter_in_run(run, checkpoint, notes)
    return adapter, cp, run


def _eval_json(run_dir: Path | None, cp: Path | None, notes: list[str]) -> dict | None:
    """The run's ``eval.json`` (it measures the final adapter, so only for a final-adapter export)."""
    if run_dir is None or cp is not None or not (run_dir / "eval.json").is_file():
        return None
    try:
        return json.loads((run_dir / "eval.json").read_text())
    except json.JSONDecodeError:
        notes.append(f"{run_dir / 'eval.json'} is not valid JSON; left out of the model card")
        return None


def locate(run: str | os.PathLike, checkpoint: str | None = None) -> RunSource:
    """Find the policy adapter, recipe, step and metrics for ``run``.

    ``run`` is a run directory (its final ``policy/`` adapter, or ``checkpoints/<checkpoint>/policy`` when
    ``checkpoint`` is given: ``step-000040``, ``40``, ``latest`` or ``best``), a checkpoint folder inside it, or a PEFT adapter
    folder. A run without a final adapter (stopped early) falls back to its newest complete checkpoint.
    """
    run = Path(run).expanduser()
    if not run.exists():
        raise LorarlError(f"{run}: run directory not found")
    if not run.is_dir():
        raise LorarlError(f"{run}: not a directory (expected a run directory)")
    notes: list[str] = []
    adapter, cp, run_dir = _find(run, checkpoint, notes)
    missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
    if missing:
        raise LorarlError(f"{adapter}: no policy adapter there (missing {', '.join(missing)})")

    # a checkpoint's own recipe first (the run's may have been edited for a resume)
    candidates = [folder / "recipe.yaml" for folder in (cp, run_dir) if folder is not None]
    recipe_path = next((c for c in candidates if c.is_file()), None)
    recipe = load_run_recipe(recipe_path) if recipe_path else None

    step = checkpoint_step(cp) if cp is not None else None
    metrics = metrics_at(read_metrics(run_dir) if run_dir else [], step)
    if step is None and metrics is not None:
        step = metrics.get("step")
    return RunSource(
        adapter_dir=adapter,
        run_dir=run_dir,
        checkpoint_dir=cp,
        step=step,
        recipe=recipe,
        recipe_path=recipe_path,
        base_path=base_path(recipe, adapter),
        metrics=metrics,
        eval=_eval_json(run_dir, cp, notes),
        notes=notes,
    )


def base_path(recipe: Recipe | None, adapter: Path) -> str:
    """What ``from_pretrained`` takes for the base: the recipe's model resolved (the embedded default is converted
    into its cache folder once), else the adapter's ``base_model_name_or_path``."""
    from lorarl.model.registry import resolve_model

    cfg = json.loads((adapter / ADAPTER_CONFIG).read_text())
    base = cfg.get("base_model_name_or_path")
    if recipe is not None:
        try:
            return resolve_model(recipe.model.name)
        except LorarlError:
            # e.g. a relative model.name read from another working directory: the folder the run loaded still works
            if base and (Path(base) / "config.json").is_file():
                return base
            raise
    if not base:
        raise LorarlError(f"{adapter}: no recipe.yaml beside it and no base_model_name_or_path in adapter_config.json")
    return base
