"""The OpenRLHF hand-off: JSONL prompt rows, the merged policy (``model/``) and the launch script
``run_openrlhf.sh`` (``python -m openrlhf.cli.train_ppo_ray``; the mapping is :mod:`.openrlhf_mapping`)."""

from __future__ import annotations

import json
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
    row_columns,
    rows_for_steps,
)
from lorarl.export.engines.launch import Option, Script, micro_option, render, split_checks
from lorarl.export.engines.openrlhf_mapping import openrlhf_mapping

SERIES, CHECKED = "0.11", "0.11.2"

# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def openrlhf_rows(rows: list[dict], h: HandOff, with_columns: bool) -> list[dict]:
    """OpenRLHF prompt rows: ``prompt`` (chat messages when conversational, else the text), ``datasource`` (how
    OpenRLHF names its evaluation metrics) and the dataset's columns, the ground-truth column as a string;
    ``with_columns`` adds the whole row as JSON (``lorarl_columns``)."""
    gt, system_prompt = h.ground_truth, h.recipe.data.system_prompt
    out = []
    for row in rows:
        prompt = messages(row["prompt"], system_prompt) if h.conversational else row["prompt"]
        item = {"prompt": prompt, "datasource": h.data_source, **row_columns(row)}
        if gt:
            item[gt] = None if row.get(gt) is None else str(row.get(gt))
        if with_columns:  # the --data.label_key column when user rewards may read any column
            item[LORARL_COLUMNS] = columns_json(row)
        out.append(item)
    return out


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _write_split(h: HandOff, split: str, rows: list[dict], path: Path) -> None:
    if split == "train":  # OpenRLHF has no step limit: the file holds exactly train.steps steps of prompts
        t = h.recipe.train
        rows = rows_for_steps(rows, t.steps * t.prompts_per_step, t.seed)
    write_jsonl(openrlhf_rows(rows, h, h.label_key == LORARL_COLUMNS), path)


def _write_model(src: Any, h: HandOff, folder: Path) -> list[str]:
    """``model/``: the policy adapter merged into the full-precision base, bf16 (what OpenRLHF trains)."""
    from lorarl.export.merged import write_merged

    (folder / "model").mkdir()
    return [f"model/: {n}" for n in write_merged(src, folder / "model", "bf16")["notes"]]


# ---------------------------------------------------------------------------------------------------------------
# The launch script
# ---------------------------------------------------------------------------------------------------------------


def _number(v: Any) -> str:
    """A number as argparse takes it: a negative float never in exponent form (``-1e9`` reads as an option)."""
    if isinstance(v, float) and v < 0 and "e" in repr(v):
        return f"{v:.1f}"
    return str(v)


def flag_words(e: KeyMap) -> str:
    """``--flag value`` (or ``--flag v1 v2`` for a list, a bare ``--flag`` for True) as shell words."""
    v = e.value
    if v is True:
        return e.engine_key
    if isinstance(v, Derived):
        return f'{e.engine_key} "{v.shell()}"'
    values = v if isinstance(v, list) else [v]
    return " ".join([e.engine_key] + [shlex.quote(_number(x)) for x in values])


def _model_check() -> list[str]:
    """Bash: take the merged policy, or make it from adapter/ with lorarl when model/ was left out."""
    make = 'lorarl export "$HERE/adapter" --format merged --dtype bf16 --out "$MODEL"'
    return [
        'if [[ ! -f "$MODEL/config.json" ]]; then',
        "    command -v lorarl >/dev/null ||",
        '        die "no merged model at $MODEL: pass --model DIR (a folder made by: lorarl export RUN --format merged)"',
        '    echo "$SCRIPT: no merged model at $MODEL: making it from adapter/ with lorarl export" >&2',
        f"    {make}",
        "fi",
    ]


def openrlhf_script(h: HandOff, m: Mapping) -> str:
    """``run_openrlhf.sh``: checks the OpenRLHF release, takes (or makes) the merged policy, derives the
    micro-batches and vLLM engines from ``--gpus`` / ``--vllm-tp`` and runs ``openrlhf.cli.train_ppo_ray``."""
    s = Script(
        name="run_openrlhf.sh",
        package="openrlhf",
        series=SERIES,
        checked=CHECKED,
        launcher="openrlhf.cli.train_ppo_ray",
        about=[
            f"Continue {h.run_label} on OpenRLHF {SERIES}.x: {h.recipe.algo.upper()} from the merged policy (model/),",
            "all weights trained, every model colocated on the GPUs. Start Ray first (ray start --head; on each node",
            "when --nodes > 1). Key mapping: openrlhf.yaml beside this file.",
        ],
        options=[
            micro_option(h),
            Option("--model", "MODEL", '"$HERE/model"', "the merged policy to start from", "path"),
            Option("--out", "OUT", '"$PWD/openrlhf-run"', "checkpoints, final model, TensorBoard logs", "path"),
        ],
        body=[
            *_model_check(),
            *split_checks(h),
            'TRAIN_MICRO=$(divisor_le $((STEP_SAMPLES / TOTAL_GPUS)) "$MICRO")',
            'ROLLOUT_MICRO=$(divisor_le $((ROLLOUT_SAMPLES / TOTAL_GPUS)) "$MICRO")',
            "VLLM_ENGINES=$((TOTAL_GPUS / VLLM_TP))",
            'mkdir -p "$OUT"',
        ],
        arguments=[flag_words(e) for e in m.entries],
    )
    return render(s)


def rows_paragraph(h: HandOff) -> str:
    return (
        f"Rows hold `prompt`, `datasource` and the dataset's columns; `--data.label_key {h.label_key}` hands "
        "`reward.py:reward_func(queries, prompts, labels)` what it compares with. `model/` is the policy merged into "
        "the base (bf16): OpenRLHF trains all its weights."
    )


# one Engine record per hand-off target (verl's beside it has the same fields with its own values)
OPENRLHF = Engine(
    name="openrlhf",
    title="OpenRLHF",
    package="openrlhf",
    series=SERIES,
    checked=CHECKED,
    data_ext="jsonl",
    launcher="openrlhf.cli.train_ppo_ray",
    chat_only=False,
    write_split=_write_split,
    mapping=openrlhf_mapping,
    script=openrlhf_script,
    rows_paragraph=rows_paragraph,
    reward_label=lambda h: h.label_key,
    extra_files=_write_model,
)
