"""Per-step metrics: a JSON line per step in ``DIR/metrics.jsonl``, the experiment trackers of ``train.report_to``,
and a PNG plot of the run at the end.

| ``train.report_to`` | writes | offline / account |
|---|---|---|
| ``tensorboard`` (default) | ``DIR/tb/`` event files | local files |
| ``trackio`` | the trackio store (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``), project ``train.project``, run named after ``DIR``; ``trackio show`` opens the dashboard | local-first, no account |
| ``wandb`` | ``DIR/wandb/``; online when ``WANDB_API_KEY`` is set or ``WANDB_MODE=online``, else offline (``wandb sync DIR/wandb/offline-run-*`` uploads later) | offline needs no account |

Each tracker is the library itself, imported only when chosen; one that is not installed is named in one line
(:func:`check_trackers`). Metric names and their TRL counterparts: ``docs/metrics.md``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from lorarl.errors import RecipeError
from lorarl.runfiles import open_nofollow, refuse_links, write_atomic
from lorarl.runs import read_metrics

TRACKERS = ("tensorboard", "trackio", "wandb")  # train.report_to values; each is also the package to install
IDS_FILE = "trackers.json"  # a run's tracker run ids, so a resumed run continues the same tracker runs

PLOT_PANELS = (  # (title, metric keys, what an empty panel means)
    ("reward", ("reward",), "not logged"),
    ("accuracy", ("accuracy",), "not logged (the data has no `answer` column)"),
    ("KL to reference", ("kl",), "not logged: the reference only runs when kl_coef > 0"),
    ("completion length (tokens)", ("completions/mean_length",), "not logged"),
)


def _clean(value: Any) -> Any:
    """JSON-safe: floats that are NaN/inf become None; tensors become numbers."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def check_trackers(names: list[str]) -> None:
    """Raise RecipeError naming ``train.report_to`` when a tracker is unknown or its package is not installed."""
    for name in names:
        if name not in TRACKERS:
            raise RecipeError(f"train.report_to: unknown tracker {name!r} (use {', '.join(TRACKERS)})")
        if importlib.util.find_spec(name) is None:
            raise RecipeError(
                f"train.report_to: {name} is not installed (pip install {name}, or pip install 'lorarl[trackers]')"
            )


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics row (bools, None and text left out), without ``step``."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    """TensorBoard event files in ``run_dir/tb`` (a resumed run purges events after its step)."""

    def __init__(self, run_dir: Path, resume_step: int | None, **_: Any):
        from torch.utils.tensorboard import SummaryWriter

        kwargs = {"purge_step": resume_step + 1} if resume_step is not None else {}
        self.writer = SummaryWriter(str(refuse_links(run_dir / "tb")), **kwargs)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class _LibraryRun:
    """A tracker library's run object: ``run.log(values, step=)`` and ``run.finish()`` (trackio and wandb alike)."""

    run: Any

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio(_LibraryRun):
    """A trackio run in project ``project`` (trackio's local store; no account, no network)."""

    def __init__(self, run_dir: Path, resume_step: int | None, project: str, ids: dict, config: dict | None):
        import trackio

        ids.setdefault("trackio", run_dir.name)
        self.run = trackio.init(
            project=project,
            name=ids["trackio"],
            config=config,
            resume="allow" if resume_step is not None else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )


class _Wandb(_LibraryRun):
    """A Weights & Biases run with its files in ``run_dir/wandb``: ``WANDB_MODE`` when set, else online with a
    ``WANDB_API_KEY`` and offline without one (no account needed; ``wandb sync`` uploads it later)."""

    def __init__(self, run_dir: Path, resume_step: int | None, project: str, ids: dict, config: dict | None):
        import wandb

        if resume_step is None or "wandb" not in ids:
            ids["wandb"] = f"{_safe_id(run_dir.name)}-{time.strftime('%Y%m%d%H%M%S')}"
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            print(
                f"wandb: no WANDB_API_KEY, logging offline to {run_dir / 'wandb'} (set WANDB_MODE=online if you "
                "logged in with `wandb login`)",
                file=sys.stderr,
            )
        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            id=ids["wandb"],
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=mode,
        )


def _safe_id(text: str) -> str:
    """A wandb run id from a name: letters, digits, ``-`` and ``_`` only."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text)[:48] or "run"


_BACKENDS = {"tensorboard": _TensorBoard, "trackio": _Trackio, "wandb": _Wandb}


class MetricsLogger:
    """Writes one JSON object per step to ``run_dir/metrics.jsonl`` and the numeric values to each tracker of
    ``report_to`` (``tensorboard``, ``trackio``, ``wandb``; see the module docstring).

    ``resume_step`` (resuming a run): lines of later steps are dropped from metrics.jsonl, TensorBoard purges
    events after that step, and trackio / wandb continue the run they started (ids in ``run_dir/trackers.json``), so
    a resumed run's logs read as one run. ``project`` and ``config`` (the resolved recipe) go to trackio / wandb.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        resume_step: int | None = None,
        *,
        report_to: list[str] | None = None,
        project: str = "lorarl",
        config: dict | None = None,
    ):
        report_to = list(report_to) if report_to is not None else (["tensorboard"] if tensorboard else [])
        check_trackers(report_to)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open_nofollow(self.path, "a")
        ids_path = self.run_dir / IDS_FILE
        ids = json.loads(ids_path.read_text()) if resume_step is not None and ids_path.is_file() else {}
        self.trackers: dict[str, Any] = {}
        try:
            for name in report_to:
                self.trackers[name] = _BACKENDS[name](
                    self.run_dir, resume_step, project=project, ids=ids, config=config
                )
        except BaseException:
            self.close()
            raise
        if ids:
            write_atomic(ids_path, json.dumps(ids))

    @classmethod
    def for_recipe(cls, run_dir: str | Path, recipe, resume_step: int | None = None) -> MetricsLogger:
        """The logger of a training run: ``train.report_to`` and ``train.project``, the resolved recipe as config."""
        from lorarl.config import recipe_to_dict

        t = recipe.train
        return cls(
            run_dir, resume_step=resume_step, report_to=t.report_to, project=t.project, config=recipe_to_dict(recipe)
        )

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Record ``values`` for ``step``; returns the JSON-safe row that was written."""
        row = {"step": int(step)}
        row.update({k: _clean(v) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = _scalars(row)
        for tracker in self.trackers.values():
            tracker.log(int(step), scalars)
        return row

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        trackers, self.trackers = self.trackers, {}
        for tracker in trackers.values():
            tracker.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_metrics(run_dir: str | Path, out: str | Path | None = None, panels: tuple[tuple, ...] | None = None) -> Path:
    """A PNG with reward, accuracy, KL and completion length against the step (matplotlib, Agg backend).

    ``panels`` replaces the four default panels: ``((title, (metric, ...)[, text if empty]), ...)``, up to four.
    Panels whose metric never appears say so instead of staying blank. Returns the PNG path
    (default ``run_dir/plot.png``).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out else run_dir / "plot.png"
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, keys, *note) in zip(axes.flat, panels or PLOT_PANELS):
        empty = note[0] if note else "not logged"
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=key, linewidth=1.2)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray", wrap=True)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out, png.getvalue())
    return out
