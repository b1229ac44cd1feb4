"""Per-step metrics: a JSON line per step in ``DIR/metrics.jsonl``, TensorBoard scalars in ``DIR/tb/``, and a PNG
plot of the run at the end.

"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lorarl.runs import read_metrics

PLOT_PANELS = (  # (title, metric keys, what an empty panel means)
    ("reward", ("reward_mean",), "not logged"),
    ("accuracy", ("accuracy",), "not logged (the data has no `answer` column)"),
    ("KL to reference", ("kl",), "not logged: the reference only runs when kl_coef > 0"),
    ("completion length (tokens)", ("completion_len",), "not logged"),
)


def _clean(value: Any) -> Any:
    """JSON-safe: floats that are NaN/inf become None; tensors become numbers."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes one JSON object per step to ``run_dir/metrics.jsonl`` and each numeric value to TensorBoard.

    ``resume_step`` (resuming a run): lines of later steps are dropped from metrics.jsonl and TensorBoard purges
    events after that step, so a resumed run's logs read as one run.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                kwargs = {"purge_step": resume_step + 1} if resume_step is not None else {}
                self.writer = SummaryWriter(str(self.run_dir / "tb"), **kwargs)
            except ImportError:  # tensorboard missing: JSONL still has everything
                self.writer = None

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Record ``values`` for ``step``; returns the JSON-safe row that was written."""
        row = {"step": int(step)}
        row.update({k: _clean(v) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(k, v, step)
        return row

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None

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
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
