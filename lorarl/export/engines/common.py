"""What the verl and OpenRLHF hand-offs share: the mapping records (a recipe key mapped to an engine key, applied in
the exported files, or not mapped with the reason), the mapping YAML, the facts a hand-off is built from, and the
data-row helpers (chat messages, JSON-safe columns)."""

from __future__ import annotations

import json
import math
import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.config import Recipe

GROUND_TRUTH_CANDIDATES = ("answer", "ground_truth", "solution", "label", "target")
LORARL_COLUMNS = "lorarl_columns"  # a JSON string of the whole lorarl row, for rewards that read any column
NO_CLIP = 1e9  # an engine's "clip range" that never binds: lorarl does not clip there


# ---------------------------------------------------------------------------------------------------------------
# Mapping records
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Derived:
    """A value the launch script computes at run time: the shell expression ``expr`` (``${MICRO}``,
    ``${HERE}/reward.py``) over its options (``--gpus``, ...); ``rule`` says how, for the mapping file; ``path``
    values are quoted as strings where the engine parses its values."""

    expr: str
    rule: str
    path: bool = False

    def shell(self) -> str:
        return self.expr


def here(rel: str) -> Derived:
    """A file of the export folder, wherever the folder is when the launch script runs."""
    return Derived("${HERE}/" + rel, f"this folder's {rel}", path=True)


@dataclass
class KeyMap:
    """One engine setting the launch script passes: its key and value (a :class:`Derived` for values the script
    computes), the lorarl recipe key it comes from, and a note (units converted, meaning)."""

    engine_key: str
    value: Any
    lorarl_key: str = ""
    note: str = ""


@dataclass
class Applied:
    """A recipe setting whose effect is in the exported files (the data rows, reward.py, the merged model)."""

    lorarl_key: str
    value: Any
    where: str


@dataclass
class Unmapped:
    """A recipe setting the hand-off does not carry over (the engine's default applies), with the reason."""

    lorarl_key: str
    value: Any
    note: str


@dataclass
class Mapping:
    """Everything an engine's mapping says about a recipe: passed keys, settings applied in the files, the rest."""

    entries: list[KeyMap] = field(default_factory=list)
    applied: list[Applied] = field(default_factory=list)
    skipped: list[Unmapped] = field(default_factory=list)

    def key(self, engine_key: str, value: Any, lorarl_key: str = "", note: str = "") -> None:
        self.entries.append(KeyMap(engine_key, value, lorarl_key, note))

    def skip(self, lorarl_key: str, value: Any, note: str) -> None:
        self.skipped.append(Unmapped(lorarl_key, value, note))

    def apply(self, lorarl_key: str, value: Any, where: str) -> None:
        self.applied.append(Applied(lorarl_key, value, where))

    def covered(self) -> set[str]:
        """The recipe keys the mapping accounts for (a ``a / b`` lorarl key counts for both)."""
        keys = [e.lorarl_key for e in self.entries] + [a.lorarl_key for a in self.applied]
        keys += [s.lorarl_key for s in self.skipped]
        return {part.strip() for k in keys for part in k.split(" / ") if part.strip()}


def whole_number(x: float) -> int | float:
    """16.0 -> 16 (an int-typed engine key rejects "16.0"); 0.5 stays 0.5; rounding noise (1 / 0.1) is dropped."""
    x = round(float(x), 10)
    return int(x) if x.is_integer() else x


def kl_target_per_token(h: HandOff, engine: str) -> tuple[float, str]:
    """lorarl's adaptive-KL target is per sequence (nats), the engines' per token: ``(target / L, the note)``, L the
    run's mean completion length at the exported step (metrics.jsonl), else ``generation.max_new_tokens``."""
    target = h.recipe.ppo.kl.target
    length = h.completion_len or h.recipe.generation.max_new_tokens
    src = "the run's mean completion length" if h.completion_len else "generation.max_new_tokens"
    return round(
        target / length, 6
    ), f"{engine} measures KL per token: {target} nats per sequence / {length:.4g} tokens ({src})"


def target_modules(tm: Any) -> Any:
    """LoRA target modules as the engines take them: a string (``"all-linear"``) as is, else a list."""
    return tm if isinstance(tm, str) else list(tm)


def recipe_leaves(d: dict, prefix: str = "") -> dict[str, Any]:
    """``recipe_to_dict(recipe)`` flattened to ``{"ppo.kl.coef": 0.05, ...}`` (lists and free-form dicts such as
    ``reward.functions`` or ``data.columns`` are leaves)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("columns", "kwargs"):
            out.update(recipe_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def yaml_scalar(v: Any) -> str:
    """A value as one line of YAML (lists, dicts, booleans and None as JSON, which YAML reads the same)."""
    if isinstance(v, Derived):
        return json.dumps(v.shell())
    return (
        json.dumps(v)
        if isinstance(v, (list, dict, bool)) or v is None
        else yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
    )


def mapping_yaml(engine: str, header: list[str], m: Mapping) -> str:
    """The mapping file: ``settings`` (engine key: value, each commented with the lorarl key it comes from),
    ``applied_in_files`` and ``not_mapped`` (recipe key: value, commented with where / why)."""
    lines = [f"# {line}" if line else "#" for line in header] + [f"engine: {engine}", "settings:"]
    for e in m.entries:
        note = "; ".join(filter(None, [f"<- {e.lorarl_key}" if e.lorarl_key else "", e.note]))
        if isinstance(e.value, Derived):
            note = "; ".join(filter(None, [note, f"computed by the launch script: {e.value.rule}"]))
        lines.append(f"  {json.dumps(e.engine_key)}: {yaml_scalar(e.value)}" + (f"  # {note}" if note else ""))
    lines.append("applied_in_files:  # recipe settings whose effect is in the exported files" if m.applied else "")
    lines[-1] = lines[-1] or "applied_in_files: {}"
    lines += [f"  {json.dumps(a.lorarl_key)}: {yaml_scalar(a.value)}  # {a.where}" for a in m.applied]
    lines.append("not_mapped:  # recipe settings with no equivalent: the engine's default applies" if m.skipped else "")
    lines[-1] = lines[-1] or "not_mapped: {}"
    lines += [f"  {json.dumps(s.lorarl_key)}: {yaml_scalar(s.value)}  # {s.note}" for s in m.skipped]
    return "\n".join(lines) + "\n"


def shell_word(v: Any) -> str:
    """A value as one shell word: booleans as Python spells them (both engines parse it), derived values as a
    double-quoted shell variable, the rest quoted as needed."""
    if isinstance(v, Derived):
        return f'"{v.shell()}"'
    if isinstance(v, bool):
        return "True" if v else "False"
    return shlex.quote(str(v))


# ---------------------------------------------------------------------------------------------------------------
# One hand-off
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class HandOff:
    """The facts the data rows, reward.py, the mapping, the launch script and the card section are built from."""

    recipe: Recipe
    splits: dict[str, list[dict]]  # "train" and, when the recipe has held-out data, "test" (eval.n rows)
    ground_truth: str | None  # the column rule rewards compare with
    label_key: str  # what OpenRLHF hands reward_func as labels: the ground-truth column, or LORARL_COLUMNS
    has_user_rewards: bool
    conversational: bool  # prompts written (and completions scored) as chat messages
    data_source: str  # verl's data_source: lorarl/arithmetic, lorarl/<file stem>
    base: str  # the full-precision base the adapter was trained on (a folder, or a hub name)
    run_label: str  # "the lorarl run runs/grpo (step 40)"
    completion_len: float | None = None  # the mean completion length at the exported step (metrics.jsonl)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Engine:
    """What differs between the engines: names, versions, the data file format, the mapping and the launch body."""

    name: str  # the --format value and the file names: verl.yaml, run_verl.sh
    title: str  # how the card names it
    package: str  # the distribution the launch script checks (pip name)
    series: str  # the supported release series, "0.9": any 0.9.x
    checked: str  # the release the mapping was checked against (its own config code, in the tests)
    data_ext: str
    launcher: str  # python3 -m <launcher>
    chat_only: bool  # the engine applies the chat template itself: plain-text prompts become one user message
    write_split: Callable[[HandOff, str, list[dict], Path], None]
    mapping: Callable[[HandOff], Mapping]
    script: Callable[[HandOff, Mapping], str]  # the launch script's text
    rows_paragraph: Callable[[HandOff], str]  # the card's description of the rows and the reward entry point
    reward_label: Callable[[HandOff], str]  # reward.py's OPENRLHF_LABEL
    extra_files: Callable[[Any, HandOff, Path], list[str]]  # writes engine-specific files (OpenRLHF: the merged
    # model); returns notes


# ---------------------------------------------------------------------------------------------------------------
# Data rows
# ---------------------------------------------------------------------------------------------------------------


def ground_truth_column(rows: list[dict]) -> str | None:
    """The column the rule rewards compare with: ``answer`` (what every built-in reads), else a usual name."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    return next((c for c in GROUND_TRUTH_CANDIDATES if c in keys), None)


def messages(prompt: Any, system_prompt: str | None) -> list[dict]:
    """A row's prompt as chat messages, with ``data.system_prompt`` prepended as lorarl does."""
    if isinstance(prompt, str):
        out = [{"role": "user", "content": prompt}]
    else:
        out = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    if system_prompt and out[0]["role"] != "system":
        out = [{"role": "system", "content": system_prompt}] + out
    return out


def jsonable(v: Any) -> Any:
    """A dataset value as plain JSON (arrays as lists, non-finite floats as None)."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def row_columns(row: dict) -> dict:
    """Every column of a lorarl row but the prompt, JSON-safe."""
    return {k: jsonable(v) for k, v in row.items() if k != "prompt"}


def columns_json(row: dict) -> str:
    """The whole lorarl row (prompt and every column) as one JSON string: rows of any shape fit one schema."""
    return json.dumps({"prompt": jsonable(row["prompt"]), **row_columns(row)}, ensure_ascii=False)


def rows_for_steps(rows: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` rows drawn as passes over ``rows``, each pass in a seeded random order (every row once per pass): the
    prompts a run of ``n / prompts_per_step`` steps uses, for an engine that has no step limit of its own."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        order = list(range(len(rows)))
        rng.shuffle(order)
        out += [rows[i] for i in order[: n - len(out)]]
    return out
