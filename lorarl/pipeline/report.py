"""The pipeline's summary table: one row for the starting point and one per stage, held-out metrics and wall times."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

HEADER = (
    "stage",
    "algo",
    "held-out accuracy",
    "reward_mean",
    "completion tokens",
    "stage wall",
    "pipeline wall",
    "notes",
)


@dataclass
class Row:
    """One row of the summary: held-out figures (None where the stage has no policy to evaluate) and times."""

    stage: str
    algo: str
    accuracy: float | None
    reward_mean: float | None
    completion_len: float | None
    stage_wall_s: float
    pipeline_wall_s: float  # training and evaluations so far
    notes: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def minutes(seconds: float) -> str:
    """``754.2`` -> ``"12:34"`` (minutes:seconds, rounded to the second)."""
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def percent(x: float | None) -> str:
    """``0.355`` -> ``"35.5%"``; None or NaN -> ``"-"``."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def number(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def eval_row(stage: str, algo: str, result: dict, stage_wall_s: float, pipeline_wall_s: float, notes: str = "") -> Row:
    """A row from a held-out evaluation result (:func:`lorarl.evaluate.evaluate`)."""
    return Row(
        stage,
        algo,
        result.get("accuracy"),
        result.get("reward_mean"),
        result.get("completion_len"),
        stage_wall_s,
        pipeline_wall_s,
        notes,
    )


def stage_notes(algo: str, summary: dict) -> str:
    """What a stage's own summary adds to its row: kept counts (rejection sampling), the loss (SFT), pairwise
    accuracy (reward model), the training reward (RL)."""
    if algo == "rejection_sampling":
        return (
            f"kept {summary.get('kept')} of {summary.get('sampled')} samples ({percent(summary.get('kept_frac'))}), "
            f"{summary.get('prompts_with_kept')} of {summary.get('prompts')} prompts"
        )
    if algo == "sft":
        return (
            f"{summary.get('steps')} steps on {summary.get('examples')} examples ({number(summary.get('epochs'), 2)} "
            f"epochs), loss {number(summary.get('loss_first10'))} -> {number(summary.get('loss_last10'))}"
        )
    if algo == "dpo":
        return (
            f"{summary.get('steps')} steps on {summary.get('train_pairs')} pairs, held-out implicit-reward accuracy "
            f"{percent(summary.get('preference_accuracy'))}"
        )
    if algo == "kto":
        return (
            f"{summary.get('steps')} steps on {summary.get('train_rows')} rows ({summary.get('desirable_rows')} "
            f"desirable), held-out loss {number(summary.get('eval_loss'))}"
        )
    if algo == "online_dpo":
        return (
            f"{summary.get('steps')} steps, reward of the samples {number(summary.get('reward_first10'))} -> "
            f"{number(summary.get('reward_last10'))}"
        )
    if algo == "distill":
        return (
            f"{summary.get('steps')} steps from the {summary.get('teacher_kind')} teacher, divergence per token "
            f"{number(summary.get('loss_first10'))} -> {number(summary.get('loss_last10'))}"
        )
    if algo == "reward_model":
        return f"held-out pairwise accuracy {percent(summary.get('pairwise_accuracy'))}"
    if algo in ("grpo", "ppo", "rloo"):
        return f"{summary.get('steps')} steps, train reward (last 10) {number(summary.get('reward_last10', summary.get('reward_mean_last10')))}"
    return ""


def stage_row(stage, summary: dict, result: dict | None, pipeline_wall_s: float) -> Row:
    """A stage's row: its held-out evaluation (when it trains a policy) and its summary's notes."""
    notes = stage_notes(stage.algo, summary)
    wall = float(summary.get("stage_wall_s", 0.0))
    if result is None:
        return Row(stage.name, stage.algo, None, None, None, wall, pipeline_wall_s, notes)
    return eval_row(stage.name, stage.algo, result, wall, pipeline_wall_s, notes)


def summary_table(rows: list[Row]) -> str:
    """The rows as a Markdown table (times as minutes:seconds)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = (
            r.stage,
            r.algo,
            percent(r.accuracy),
            number(r.reward_mean),
            number(r.completion_len),
            minutes(r.stage_wall_s),
            minutes(r.pipeline_wall_s),
            r.notes,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
