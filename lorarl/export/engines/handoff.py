"""``--format verl`` / ``--format openrlhf``: what a run needs to continue on a distributed engine.

The recipe's prompts (each engine's data format), a self-contained ``reward.py``, the trained adapter (verl loads
it; OpenRLHF gets it merged into the base, ``model/``), a YAML file mapping every recipe key (mapped, applied in the
files, or not mapped and why) and a launch script that takes GPU counts and checks the installed engine release.
Paths in the script are relative to its own folder, so the export can be copied to the cluster as a whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.export.engines.common import (
    LORARL_COLUMNS,
    Engine,
    HandOff,
    Mapping,
    ground_truth_column,
    mapping_yaml,
    yaml_scalar,
)
from lorarl.export.engines.openrlhf import OPENRLHF
from lorarl.export.engines.verl import VERL
from lorarl.export.merged import write_adapter
from lorarl.export.rewards_file import reward_module_source, strip_suffixes, user_reward_file
from lorarl.export.source import RunSource

ENGINES: dict[str, Engine] = {e.name: e for e in (VERL, OPENRLHF)}


def split_rows(recipe: Recipe) -> dict[str, list[dict]]:
    """The recipe's training rows and, when it has held-out data, its first ``eval.n`` held-out rows (what
    ``lorarl eval`` scores)."""
    from lorarl.data import read_rows

    out = {"train": read_rows(recipe.data, "train")[0]}
    try:
        out["test"] = read_rows(recipe.data, "eval")[0][: recipe.eval.n]
    except LorarlError:  # no held-out source: train only
        pass
    return out


def _hand_off(src: RunSource, engine: Engine, base: str, notes: list[str]) -> HandOff:
    """The facts of this hand-off: rows, the ground-truth column, the label OpenRLHF passes, the run."""
    from lorarl.rewards import BUILTIN_REWARDS

    recipe = src.recipe
    splits = split_rows(recipe)
    if len(splits["train"]) < recipe.train.prompts_per_step:
        raise LorarlError(
            f"{src.run_dir or src.adapter_dir}: {len(splits['train'])} training rows, fewer than "
            f"train.prompts_per_step {recipe.train.prompts_per_step}: the engines need at least one full batch"
        )
    all_rows = [r for rows in splits.values() for r in rows]
    gt = ground_truth_column(all_rows)
    conversational = any(not isinstance(r.get("prompt"), str) for r in all_rows) or engine.chat_only
    if any(isinstance(r.get("prompt"), str) for r in all_rows) and engine.chat_only:
        notes.append("plain-text prompts were wrapped as one user message (verl applies the chat template)")
    source = recipe.data.source
    has_user = any(s.name not in BUILTIN_REWARDS for s in recipe.reward.functions)
    metrics = src.metrics or {}
    length = metrics.get("completions/mean_length", metrics.get("completion_len"))  # older runs: completion_len
    return HandOff(
        recipe=recipe,
        splits=splits,
        ground_truth=gt,
        label_key=LORARL_COLUMNS if has_user or not gt else gt,
        has_user_rewards=has_user,
        conversational=conversational,
        data_source="lorarl/arithmetic" if source == "arithmetic" else f"lorarl/{Path(source).stem}",
        base=base,
        run_label=f"the lorarl run {src.run_dir or src.adapter_dir}" + (f" (step {src.step})" if src.step else ""),
        completion_len=float(length) if isinstance(length, (int, float)) and length > 0 else None,
        notes=notes,
    )


def _copy_user_rewards(h: HandOff, folder: Path, engine: Engine) -> dict[str, str]:
    """Copy each ``file.py:function`` reward's file into ``user_rewards/``; returns ``{reward name: path relative to
    reward.py}``. Rewards imported by module name (or whose file is missing) get a note."""
    from lorarl.rewards import BUILTIN_REWARDS

    user_files = {}
    for name in (s.name for s in h.recipe.reward.functions if s.name not in BUILTIN_REWARDS):
        f = user_reward_file(name, h.recipe)
        if f is not None:
            (folder / "user_rewards").mkdir(exist_ok=True)
            shutil.copy2(f, folder / "user_rewards" / f.name)
            user_files[name] = f"user_rewards/{f.name}"
        elif name.rpartition(":")[0].endswith(".py"):
            h.notes.append(f"reward {name}: file not found at export; reward.py loads it from that path")
        else:
            h.notes.append(f"reward {name}: reward.py imports its module by name; install it where {engine.name} runs")
    return user_files


def _write_reward_py(src: RunSource, h: HandOff, engine: Engine, folder: Path, user_files: dict[str, str]) -> None:
    from lorarl.model import load_tokenizer

    tok = load_tokenizer(src.base_path, src.trust_remote_code)
    text = reward_module_source(
        h.recipe,
        ground_truth_column=h.ground_truth,
        conversational=h.conversational,
        strip_suffixes=strip_suffixes(tok),
        user_files=user_files,
        openrlhf_label=engine.reward_label(h),
    )
    compile(text, "reward.py", "exec")  # a broken generated file fails here, not on the cluster
    (folder / "reward.py").write_text(text, encoding="utf-8")


def write_handoff(src: RunSource, folder: Path, out: Path, engine_name: str) -> dict:
    """Write the ``engine_name`` hand-off of ``src`` into ``folder`` (renamed to ``out`` afterwards); returns the
    notes, the adapter's base and the model card's section."""
    engine = ENGINES[engine_name]
    if src.recipe is None:
        raise LorarlError(
            f"{src.adapter_dir}: no recipe.yaml in the run; the {engine.name} hand-off needs its data and rewards"
        )
    if src.recipe.algo not in ("grpo", "ppo"):
        raise LorarlError(
            f"{src.run_dir or src.adapter_dir}: a {src.recipe.algo} run; the {engine.name} hand-off continues GRPO "
            "and PPO runs (export it with --format merged or adapter)"
        )
    info = write_adapter(src, folder / "adapter")
    notes = list(info["notes"])
    h = _hand_off(src, engine, info["base"], notes)
    for split, rows in h.splits.items():
        engine.write_split(h, split, rows, folder / "data" / f"{split}.{engine.data_ext}")
    user_files = _copy_user_rewards(h, folder, engine)
    _write_reward_py(src, h, engine, folder, user_files)
    h.notes.extend(engine.extra_files(src, h, folder))
    m = engine.mapping(h)
    script = f"run_{engine.name}.sh"
    header = [
        f"lorarl -> {engine.title} {engine.series}.x (checked against {engine.checked}): continuing {h.run_label}.",
        f"Generated by `lorarl export --format {engine.name}`; launch: bash {script} --gpus N (see --help).",
        "settings: what the launch script passes (values in ${...} are computed by the script from its options);",
        "applied_in_files: recipe settings already applied in the exported files; not_mapped: the engine's default",
        "applies, with the reason. Every recipe setting is in one of the three.",
    ]
    (folder / f"{engine.name}.yaml").write_text(mapping_yaml(engine.name, header, m), encoding="utf-8")
    (folder / script).write_text(engine.script(h, m), encoding="utf-8")
    os.chmod(folder / script, 0o755)
    return {"notes": h.notes, "base": info["base"], "card": handoff_card(engine, h, m, script)}


def handoff_card(engine: Engine, h: HandOff, m: Mapping, script: str) -> list[str]:
    """The model card's "Continue on ..." section: the files, the rows, and the key mapping as tables."""
    counts = ", ".join(f"`data/{k}.{engine.data_ext}` ({len(v)} rows)" for k, v in h.splits.items())
    lines = [f"## Continue on {engine.title}", ""]
    lines.append(
        f"Files: {counts}; `reward.py` (self-contained rule rewards); `adapter/` (the trained policy LoRA); "
        f"`{engine.name}.yaml` (every recipe key: mapped, applied in the files, or not mapped and why); "
        f"`{script}` (the launch command)."
    )
    lines += ["", engine.rows_paragraph(h), ""]
    lines.append(
        f"Launch on a node with {engine.title} {engine.series}.x installed (checked against {engine.checked}): "
        f"`bash {script} --gpus 8` (`--help` lists the options; {engine.package} arguments go after `--`)."
    )
    lines += ["", f"| lorarl key | {engine.name} key | value |", "|---|---|---|"]
    for e in m.entries:
        lines.append(f"| {e.lorarl_key or '-'} | `{e.engine_key}` | `{yaml_scalar(e.value)}` |")
    if m.skipped:
        lines += ["", "Not mapped (the engine's default applies):", ""]
        lines += [f"- `{s.lorarl_key}` = `{yaml_scalar(s.value)}`: {s.note}" for s in m.skipped]
    return lines
