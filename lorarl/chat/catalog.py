"""What can be chatted with: the base, every run's adapters (final + complete steps), merged exports, and scorers.

Ids are ``base``, ``RUN/policy`` (a run's final adapter), ``RUN/step-000010`` (a complete step checkpoint) and
``export:NAME`` (a merged export: a plain transformers folder with ``config.json``). The browser only ever sends
ids; an id resolves to a folder found by :meth:`Catalog.scan`, and that folder must lie inside the runs directory
after ``resolve()`` (symlinks pointing out are refused). Runs trained on another base model are left out and listed
in :attr:`Catalog.skipped`. Where something is inside a run (its adapters, its checkpoints, their steps) follows the
rules of :mod:`lorarl.runs`; which runs and exports to offer is decided here.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from lorarl.chat.consent import CodeConsent, RunCode, run_code
from lorarl.config import RewardConfig, RewardSpec
from lorarl.errors import LorarlError
from lorarl.model.shared import HEAD_FILE
from lorarl.rewards.source import REWARD
from lorarl.runs import ADAPTER_CONFIG, CHECKPOINTS, checkpoint_step, is_adapter, list_checkpoints
from lorarl.runstate import error_line

BASE_ID = "base"
EXPORT_PREFIX = "export:"
RULES_PREFIX = "rules:"
REWARD_MODEL_PREFIX = "rm:"
NO_REWARD = "none"
POLICY = "policy"
# a run's own sub-folders: never merged exports
SKIP_DIRS = {POLICY, CHECKPOINTS, REWARD, "critic", "reference", "logs", "tensorboard"}
EXPORT_MARKER = "config.json"


@dataclass(frozen=True)
class Entry:
    """One choosable checkpoint. ``kind``: ``base`` | ``adapter`` | ``export``; ``folder`` is None for the base;
    ``step`` is set for step checkpoints (it orders them, newest first)."""

    id: str
    kind: str
    label: str
    folder: Path | None = None
    run: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class ScorerEntry:
    """A way to score answers: a run's rule rewards (``rules:RUN``) or its reward adapter (``rm:RUN``)."""

    id: str
    kind: str  # "rules" | "reward_model"
    label: str
    run: str
    specs: tuple[RewardSpec, ...] = ()  # the rule rewards, for kind "rules"
    folder: Path | None = None  # the reward adapter folder, for kind "reward_model"
    system_prompt: str | None = None  # the reward run's data.system_prompt (used when the chat has none)
    recipe_path: Path | None = None  # the run's recipe.yaml, for kind "rules" (relative files are found beside it)


# ---------------------------------------------------------------------------------------------------------------
# Recipes saved in runs
# ---------------------------------------------------------------------------------------------------------------


def read_recipe(run: Path) -> dict | None:
    """A run's ``recipe.yaml`` as plain data, with keys that moved read under their new names
    (:func:`lorarl.config.migrate.migrate`: ``rewards`` -> ``reward.functions``, ...), or None when it is missing or
    unreadable (not YAML, nested past the parser's depth, an alias bomb: :func:`lorarl.config.yaml_load`'s limits).
    Read leniently and without validation: a bad recipe only costs the run its reward scorers."""
    import yaml

    from lorarl.config import yaml_load
    from lorarl.config.migrate import migrate

    f = run / "recipe.yaml"
    if not f.is_file():
        return None
    try:
        data = yaml_load(f.read_text(encoding="utf-8"))  # aliases bounded, like every recipe
    except (OSError, UnicodeDecodeError, yaml.YAMLError, LorarlError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return migrate(data)[0]
    except LorarlError:  # a key set under its old and its new name: read it as it is
        return data


def _section(recipe: dict | None, name: str) -> dict:
    value = (recipe or {}).get(name)
    return value if isinstance(value, dict) else {}


def recipe_model(recipe: dict | None) -> str | None:
    """The base model a recipe trains (``model.name``), or None."""
    name = _section(recipe, "model").get("name")
    return str(name) if name else None


def rule_specs(recipe: dict | None) -> list[RewardSpec]:
    """The rule rewards a run was trained with: its ``reward.functions`` when its ``reward.source`` uses rules
    (reward-model runs have none). Raises LorarlError naming the key when they are not a list of ``{name, weight,
    kwargs}`` with a string name, a numeric weight and a mapping of kwargs (the catalog then leaves them out)."""
    if not recipe or recipe.get("algo", "grpo") == "reward_model":
        return []
    reward = _section(recipe, "reward")
    if reward.get("source", RewardConfig.source) == "reward_model":
        return []
    functions = reward.get("functions") or []
    if not isinstance(functions, list):
        raise LorarlError(f"reward.functions must be a list, got {type(functions).__name__}")
    return [_rule_spec(i, s) for i, s in enumerate(functions) if isinstance(s, dict) and s.get("name")]


def _rule_spec(i: int, s: dict) -> RewardSpec:
    """``reward.functions[i]`` of a saved recipe as a :class:`RewardSpec`, or LorarlError naming the key."""
    key = f"reward.functions[{i}]"
    name, weight, kwargs = s["name"], s.get("weight", 1.0), s.get("kwargs") or {}
    if not isinstance(name, str):
        raise LorarlError(f"{key}.name must be a string, got {type(name).__name__}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise LorarlError(f"{key}.weight must be a number, got {weight!r:.40}")
    if not isinstance(kwargs, dict):
        raise LorarlError(f"{key}.kwargs must be a mapping, got {type(kwargs).__name__}")
    return RewardSpec(name=name, weight=float(weight), kwargs=dict(kwargs))


def normalize_model_name(name: str) -> str:
    """Compare model names across recipes: embedded names -> their converted folder, paths -> resolved paths."""
    from lorarl.model.registry import EMBEDDED, converted_path

    if name in EMBEDDED:
        return str(converted_path(name).resolve())
    p = Path(name).expanduser()
    if p.exists():
        return str(p.resolve())
    return name


def default_base_model(runs_dir: str | os.PathLike) -> str:
    """The base to load when none is given: the embedded default, unless no run under ``runs_dir`` uses it and
    the runs were trained on another model that is available here (the most common such one)."""
    from lorarl.model.registry import DEFAULT_MODEL, EMBEDDED

    root = Path(runs_dir)
    names = [recipe_model(read_recipe(p)) for p in sorted(root.iterdir()) if p.is_dir()] if root.is_dir() else []
    usable = collections.Counter(n for n in names if n and (n in EMBEDDED or Path(n).expanduser().is_dir()))
    by_norm = {normalize_model_name(n) for n in usable}
    if not usable or normalize_model_name(DEFAULT_MODEL) in by_norm:
        return DEFAULT_MODEL
    return usable.most_common(1)[0][0]


def is_export(folder: Path) -> bool:
    """A merged export: a plain transformers model folder (``config.json``), not a PEFT adapter."""
    return (folder / EXPORT_MARKER).is_file() and not is_adapter(folder)


def folder_stamp(folder: Path) -> str:
    """Names, mtimes and sizes of an adapter folder's weight files: changes when a run saves new weights in place."""
    files = sorted(folder.glob("adapter_model.*")) + sorted(folder.glob("*.safetensors"))
    return ";".join(f"{f.name}:{f.stat().st_mtime_ns}:{f.stat().st_size}" for f in files)


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


# ---------------------------------------------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------------------------------------------


class Catalog:
    """Scans ``runs_dir`` for the base, run adapters (final + steps), merged exports and reward scorers.

    Only folders found by the scan can be loaded, and only when they resolve to a path inside ``runs_dir``.
    """

    def __init__(self, runs_dir: str | os.PathLike, base_model: str, base_label: str | None = None):
        self.root = Path(runs_dir).expanduser().resolve()
        self.base_model = base_model
        self.base_label = base_label or f"base · {Path(base_model).name if os.sep in base_model else base_model}"
        self.entries: dict[str, Entry] = {}
        self.scorers: dict[str, ScorerEntry] = {}
        self.skipped: list[str] = []
        self.consent = CodeConsent()  # code named by a run folder runs only once allowed (lorarl.chat.consent)
        self._lock = threading.Lock()
        self.scan()

    # ---- scanning ---------------------------------------------------------------------------------------------
    def inside(self, path: Path) -> bool:
        """True when ``path`` resolves to a place inside the runs directory."""
        try:
            return path.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):
            return False

    def scan(self) -> Catalog:
        """Look at the runs directory again (new runs, new steps, pruned checkpoints); returns ``self``."""
        entries: dict[str, Entry] = {BASE_ID: Entry(BASE_ID, "base", self.base_label)}
        scorers: dict[str, ScorerEntry] = {}
        skipped: list[str] = []
        base_norm = normalize_model_name(self.base_model)
        for run in _visible_dirs(self.root) if self.root.is_dir() else []:
            if not self.inside(run):
                skipped.append(f"{run.name} (outside the runs directory)")
            elif is_export(run):
                self._add_export(entries, run.name, run)
            else:
                found: tuple[dict, dict] = ({}, {})
                try:
                    why = self._scan_run(run, base_norm, *found, skipped)
                except Exception as e:  # noqa: BLE001 - a folder can hold anything: one unreadable run hides no other
                    why = f"not read: {e if isinstance(e, LorarlError) else error_line(e)}"
                else:
                    entries.update(found[0])
                    scorers.update(found[1])
                if why:
                    skipped.append(f"{run.name} ({why})")
        with self._lock:
            self.entries, self.scorers, self.skipped = entries, scorers, skipped
        return self

    def _scan_run(self, run: Path, base_norm: str, entries: dict, scorers: dict, skipped: list[str]) -> str | None:
        """Add one run's adapters, scorers and exports; return why its adapters were left out, if they were (reward
        functions its recipe.yaml does not state right are left out alone, with why in ``skipped``)."""
        name = run.name
        recipe = read_recipe(run)
        if recipe is None and (run / "recipe.yaml").is_file():
            skipped.append(f"{name}'s reward functions and tools (its recipe.yaml could not be read)")
        model = recipe_model(recipe)
        why = None
        if model is not None and normalize_model_name(model) != base_norm:
            why = f"trained on {model}"
        else:
            final = run / POLICY
            if is_adapter(final) and self.inside(final):
                entries[f"{name}/{POLICY}"] = Entry(f"{name}/{POLICY}", "adapter", f"{name} · final", final, name)
            for cp in list_checkpoints(run):
                folder = cp / POLICY
                if is_adapter(folder) and self.inside(folder):
                    step = checkpoint_step(cp)
                    eid = f"{name}/{cp.name}"
                    entries[eid] = Entry(eid, "adapter", f"{name} · step {step}", folder, name, step)
            try:
                self._add_scorers(scorers, name, run, recipe)
            except LorarlError as e:
                skipped.append(f"{name}'s reward functions (recipe.yaml: {e})")
        for sub in _visible_dirs(run):
            if sub.name not in SKIP_DIRS and is_export(sub):
                self._add_export(entries, f"{name}/{sub.name}", sub)
        return why

    def _add_export(self, entries: dict, rel: str, folder: Path) -> None:
        if self.inside(folder):
            eid = EXPORT_PREFIX + rel
            entries[eid] = Entry(eid, "export", f"{rel} · merged export", folder, rel.split("/")[0])

    def _add_scorers(self, scorers: dict, name: str, run: Path, recipe: dict | None) -> None:
        reward = run / REWARD
        if is_adapter(reward) and (reward / HEAD_FILE).is_file() and self.inside(reward):
            sid = REWARD_MODEL_PREFIX + name
            system_prompt = _section(recipe, "data").get("system_prompt")
            label = f"{name} · reward model"
            scorers[sid] = ScorerEntry(sid, "reward_model", label, name, folder=reward, system_prompt=system_prompt)
        specs = rule_specs(recipe)
        if specs:
            sid = RULES_PREFIX + name
            label = " + ".join(f"{s.weight:g}×{s.name}" for s in specs)
            path = run / "recipe.yaml"
            scorers[sid] = ScorerEntry(
                sid, "rules", f"{name} · rules ({label})", name, specs=tuple(specs), recipe_path=path
            )

    # ---- lookups ----------------------------------------------------------------------------------------------
    def choices(self) -> list[tuple[str, str]]:
        """(label, id) pairs for a dropdown: base first, then runs (final, then steps, newest first), then exports."""
        order = {"base": 0, "adapter": 1, "export": 2}

        def key(e: Entry) -> tuple:
            final = 0 if e.kind == "adapter" and e.step is None else 1
            return (order[e.kind], e.run or "", final, -(e.step or 0))

        return [(e.label, e.id) for e in sorted(self.entries.values(), key=key)]

    def scorer_choices(self) -> list[tuple[str, str]]:
        """(label, id) pairs for the reward dropdown: "off" first, then the scorers by id."""
        return [("off", NO_REWARD)] + [(s.label, s.id) for s in sorted(self.scorers.values(), key=lambda s: s.id)]

    def summary(self) -> str:
        """One line: what the scan found, and what it left out."""
        n_ad = sum(1 for e in self.entries.values() if e.kind == "adapter")
        n_ex = sum(1 for e in self.entries.values() if e.kind == "export")
        text = f"`{self.root}`: {n_ad} adapter checkpoint(s), {n_ex} merged export(s), {len(self.scorers)} reward(s)."
        if self.skipped:
            text += " Skipped: " + "; ".join(self.skipped) + "."
        return text

    def get(self, entry_id: str) -> Entry:
        """The entry for ``entry_id`` (rescanning once if unknown); LorarlError for anything else."""
        if not isinstance(entry_id, str) or not entry_id:
            raise LorarlError(f"unknown checkpoint {entry_id!r}")
        entry = self.entries.get(entry_id)
        if entry is None:
            entry = self.scan().entries.get(entry_id)
        if entry is None:
            raise LorarlError(f"unknown checkpoint {entry_id!r} (not found under {self.root}; press Refresh)")
        if entry.folder is not None:
            self.folder(entry)
        return entry

    def folder(self, entry: Entry) -> Path:
        """The entry's folder, resolved, checked again to be inside the runs directory and to still exist."""
        resolved = Path(entry.folder).resolve()
        if not resolved.is_relative_to(self.root):
            raise LorarlError(f"{entry.id}: resolves outside the runs directory {self.root}; refused")
        marker = EXPORT_MARKER if entry.kind == "export" else ADAPTER_CONFIG
        if not (resolved / marker).is_file():
            raise LorarlError(f"{entry.id}: {resolved} no longer exists (pruned checkpoint?); press Refresh")
        return resolved

    def run_recipe(self, run: str | None) -> tuple[dict, Path] | None:
        """``(recipe as plain data, its path)`` of run ``run`` when its ``recipe.yaml`` has an ``agent`` section (the
        run trained with tools), else None. The folder must lie inside the runs directory."""
        if not run:
            return None
        path = self.root / run / "recipe.yaml"
        if not self.inside(path.parent) or not path.is_file():
            return None
        recipe = read_recipe(path.parent)
        return (recipe, path) if _section(recipe, "agent") else None

    def scorer_code(self, scorer: ScorerEntry | None) -> RunCode | None:
        """The code a ``rules:RUN`` scorer would import (its run's ``module:function`` / ``file.py:function``
        rewards), None for built-ins only or a reward model."""
        if scorer is None or scorer.kind != "rules":
            return None
        recipe = {"reward": {"functions": [{"name": s.name} for s in scorer.specs]}}
        return run_code(recipe, scorer.recipe_path, f"run {scorer.run}", ("reward",))

    def tools_code(self, run: str | None) -> RunCode | None:
        """The code a pane of run ``run`` would import to answer with tools (its ``agent.tools`` with ``:``; an
        ``agent.environment`` is not offered in chat), None when it names none."""
        found = self.run_recipe(run)
        if found is None:
            return None
        return run_code(found[0], found[1], f"run {run}", ("tool",))

    def get_scorer(self, scorer_id: str) -> ScorerEntry | None:
        """The scorer for ``scorer_id`` (None for ``none``; rescanning once if unknown); LorarlError otherwise."""
        if not scorer_id or scorer_id == NO_REWARD:
            return None
        s = self.scorers.get(scorer_id) or self.scan().scorers.get(scorer_id)
        if s is None:
            raise LorarlError(f"unknown reward {scorer_id!r} (press Refresh)")
        if s.folder is not None and not Path(s.folder).resolve().is_relative_to(self.root):
            raise LorarlError(f"{scorer_id}: resolves outside the runs directory; refused")
        return s
