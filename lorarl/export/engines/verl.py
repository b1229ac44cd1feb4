"""The verl hand-off: parquet rows in verl's layout, the launch script ``run_verl.sh`` (Hydra overrides of verl's
``ppo_trainer`` config for ``python -m verl.trainer.main_ppo``; the mapping is :mod:`.verl_mapping`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from lorarl.export.engines.common import (
    LORARL_COLUMNS,
    Derived,
    Engine,
    HandOff,
    KeyMap,
    Mapping,
    columns_json,
    messages,
)
from lorarl.export.engines.launch import Option, Script, micro_option, render, split_checks
from lorarl.export.engines.verl_mapping import verl_mapping

SERIES, CHECKED = "0.9", "0.9.1"
HYDRA_PLAIN = re.compile(r"^[A-Za-z0-9_./:+-]+$")  # a Hydra override value that needs no quotes

# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def verl_rows(rows: list[dict], split: str, data_source: str, gt: str | None, system_prompt: str | None) -> list[dict]:
    """verl's RL dataset rows: chat-message ``prompt``, ``data_source``, ``reward_model.ground_truth`` (the ``gt``
    column as a string) and ``extra_info`` carrying the whole lorarl row as JSON for the reward functions."""
    out = []
    for i, row in enumerate(rows):
        truth = row.get(gt) if gt else None
        out.append(
            {
                "data_source": data_source,
                "prompt": messages(row["prompt"], system_prompt),
                "ability": "lorarl",
                "reward_model": {"style": "rule", "ground_truth": None if truth is None else str(truth)},
                # JSON, so rows of any shape fit one parquet schema
                "extra_info": {"split": split, "index": i, LORARL_COLUMNS: columns_json(row)},
            }
        )
    return out


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def _write_split(h: HandOff, split: str, rows: list[dict], path: Path) -> None:
    write_parquet(verl_rows(rows, split, h.data_source, h.ground_truth, h.recipe.data.system_prompt), path)


# ---------------------------------------------------------------------------------------------------------------
# The launch script
# ---------------------------------------------------------------------------------------------------------------


def hydra_value(v: Any) -> str:
    """A value as a Hydra override writes it (before shell quoting)."""
    if isinstance(v, Derived):
        return f"'{v.shell()}'" if v.path else v.shell()
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    s = str(v)
    if isinstance(v, str) and not HYDRA_PLAIN.match(s):
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


def hydra_word(e: KeyMap) -> str:
    """``key=value`` as one shell word: double-quoted when it holds a shell variable, else quoted as needed."""
    word = f"{e.engine_key}={hydra_value(e.value)}"
    if isinstance(e.value, Derived):
        return '"' + word.replace('"', '\\"') + '"'
    return shlex.quote(word)


def verl_script(h: HandOff, m: Mapping) -> str:
    """``run_verl.sh``: checks the verl release, derives the per-GPU micro-batches from ``--gpus`` and runs
    ``python -m verl.trainer.main_ppo`` with the mapping's overrides."""
    s = Script(
        name="run_verl.sh",
        package="verl",
        series=SERIES,
        checked=CHECKED,
        launcher="verl.trainer.main_ppo",
        about=[
            f"Continue {h.run_label} on verl {SERIES}.x: {h.recipe.algo.upper()}, FSDP + vLLM, the policy LoRA loaded",
            "from adapter/. Start Ray on every node first when --nodes > 1. Key mapping: verl.yaml beside this file.",
        ],
        options=[
            micro_option(h),
            Option("--base", "BASE", shlex.quote(h.base), "the base model (folder or hub name)", "path"),
            Option("--out", "OUT", '"$PWD/verl-run"', "checkpoints, TensorBoard logs and Hydra's outputs", "path"),
        ],
        body=[
            'NAME="$(basename "$HERE")"',
            '[[ "$BASE" != /* || -e "$BASE" ]] || die "base model $BASE not found on this machine: pass --base DIR"',
            *split_checks(h),
            'MICRO=$(divisor_le $((STEP_SAMPLES / TOTAL_GPUS)) "$MICRO")',
            'mkdir -p "$OUT"',
            'export TENSORBOARD_DIR="${TENSORBOARD_DIR:-$OUT/tensorboard}"',
        ],
        arguments=[hydra_word(e) for e in m.entries] + ['"hydra.run.dir=${OUT}/hydra"'],
    )
    return render(s)


def rows_paragraph(h: HandOff) -> str:
    return (
        "Rows follow verl's format: `prompt` (chat messages), `data_source`, `reward_model.ground_truth` "
        f"(the `{h.ground_truth}` column), `extra_info` (split, index and every lorarl column as JSON). "
        "`reward.py:compute_score(data_source, solution_str, ground_truth, extra_info)` returns the recipe's "
        "weighted reward."
    )


# the same Engine record as OPENRLHF's, field by field: one record per hand-off target is the registry's data,
# its values differ where the engines do (data format, launcher, chat-only, reward label, extra files)
VERL = Engine(
    name="verl",
    title="verl",
    package="verl",
    series=SERIES,
    checked=CHECKED,
    data_ext="parquet",
    launcher="verl.trainer.main_ppo",
    chat_only=True,
    write_split=_write_split,
    mapping=verl_mapping,
    script=verl_script,
    rows_paragraph=rows_paragraph,
    reward_label=lambda h: "answer",
    extra_files=lambda src, h, folder: [],
)
