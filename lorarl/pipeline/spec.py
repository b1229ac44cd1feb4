"""Pipeline recipes: stages in order, each a full recipe, wired to the stages before it.

A pipeline recipe (``lorarl pipeline RECIPE --out DIR``) is a YAML mapping::

    defaults:          # sections every stage starts from (only those its algorithm reads are taken)
      recipe: grpo_sub.yaml          # optional: a recipe's sections (file beside this one, or shipped name)
      model: {name: smollm2-135m}
      data: {source: arithmetic, arithmetic: {operations: ["-"]}}
    evaluation:        # held-out greedy evaluation after every stage, ONE recipe for every row
      n: 200           # held-out prompts (default: the evaluation recipe's eval.n)
      base: true       # a first row for the starting point (adapters off, or the first stage's init adapter)
      recipe: null     # a recipe file to evaluate with; default: the last stage that trains a policy
      overrides: []    # section.key=value applied to the evaluation recipe
    stages:
      - name: cold_start           # [a-z0-9_-]+, unique; the stage's run directory is DIR/01-cold_start
        algo: sft                  # inline sections on top of `defaults` ...
        train: {steps: 60}
      - name: rl
        recipe: grpo_sub.yaml      # ... or a recipe (relative file or shipped name), inline sections on top
        overrides: [train.steps=20]

**Wiring** (a stage's own setting -- in its recipe file, inline, or an override -- always wins):

* ``model.init_adapter``: every stage starts from the adapter of the nearest earlier stage that trains a policy
  (``sft``, ``grpo``, ``ppo``, ``dpo``); an RL or DPO stage's reference is then that adapter, frozen; a
  rejection-sampling stage samples with it. ``model.init_adapter: null`` in a stage starts it from the bare base.
* an ``sft`` stage right after a ``rejection_sampling`` stage trains on its kept set (``data.source``).
* ``stage:NAME`` as ``model.init_adapter``, ``reward.adapter`` or ``data.source`` names an earlier stage's policy
  adapter, reward adapter or kept dataset.

Every stage recipe is built and validated, and every adapter a stage names is checked, before anything runs.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.config import Recipe, apply_overrides, recipe_from_dict, yaml_load
from lorarl.config.algorithms import ALGO_SECTIONS, USES
from lorarl.config.shipped import resolve_recipe, shipped_recipe
from lorarl.errors import LorarlError, RecipeError

POLICY_ALGOS = ("sft", "grpo", "ppo", "dpo", "online_dpo", "rloo", "distill", "kto")
STAGE_KEYS = ("name", "recipe", "overrides")
TOP_KEYS = ("defaults", "evaluation", "stages")
EVAL_KEYS = ("n", "base", "recipe", "overrides")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
REF = "stage:"
UNSET = object()


@dataclass
class Stage:
    """One stage: its name, index (1-based), run directory, and its recipe (wired, validated)."""

    index: int
    name: str
    recipe: Recipe
    run_dir: Path
    raw: dict  # the recipe as a mapping, after wiring (what the stage's recipe.yaml says)

    @property
    def algo(self) -> str:
        return self.recipe.algo

    @property
    def label(self) -> str:
        return f"stage {self.index} ({self.name})"

    @property
    def policy(self) -> Path | None:
        """The policy adapter this stage leaves (None for a stage that trains none)."""
        return self.run_dir / "policy" if self.algo in POLICY_ALGOS else None


@dataclass
class Pipeline:
    """A loaded pipeline: its stages, the evaluation recipe, and where it came from."""

    path: Path
    stages: list[Stage]
    evaluation: Recipe
    eval_n: int
    eval_base: bool
    raw: dict = field(default_factory=dict)


def deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``, mappings merged key by key (``top``'s values win; lists are replaced, not joined)."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def get_path(data: dict, dotted: str, default: Any = UNSET) -> Any:
    """``data["model"]["init_adapter"]`` for ``"model.init_adapter"``; ``default`` when any part is missing."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def read_yaml(path: Path, what: str) -> dict:
    """A YAML mapping from ``path``; RecipeError naming ``what`` and the file otherwise."""
    if not path.is_file():
        raise RecipeError(f"{what}: recipe file {path} not found")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: unreadable YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: must be a YAML mapping")
    return data


def recipe_beside(file: Any, where: Path) -> Path:
    """A recipe a pipeline names (``defaults.recipe``, a stage's ``recipe``, ``evaluation.recipe``): the file at that
    path relative to the pipeline file, else the shipped recipe of that name
    (:func:`lorarl.config.shipped.shipped_recipe`); the missing path beside the pipeline when neither (read_yaml
    names it)."""
    beside = (where.parent / str(file)).resolve()
    found = None if beside.is_file() else shipped_recipe(str(file))
    return beside if found is None else found.resolve()


def read_defaults(value: Any, where: Path) -> dict:
    """The ``defaults`` mapping, with the sections of the recipe file it names (``recipe:``) under its own."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: defaults must be a mapping of recipe sections")
    value = dict(value)
    file = value.pop("recipe", None)
    if file is None:
        return value
    return deep_merge(read_yaml(recipe_beside(file, where), f"{where}: defaults.recipe"), value)


def defaults_for(defaults: dict, algo: str) -> dict:
    """The ``defaults`` sections a stage of ``algo`` reads (its shared sections and its own algorithm section)."""
    keep = set(USES.get(algo, ())) | {algo}
    return {k: v for k, v in defaults.items() if k in keep}


def split_overrides(overrides: list[str], stage_names: list[str]) -> dict[str, list[str]]:
    """Command-line overrides ``NAME.section.key=value`` grouped by NAME (a stage, ``defaults`` or ``evaluation``)."""
    out: dict[str, list[str]] = {}
    for text in overrides:
        head, _, rest = text.partition(".")
        if head not in stage_names and head not in ("defaults", "evaluation") or not rest:
            raise RecipeError(
                f"override {text!r} must start with a stage name ({', '.join(stage_names)}), defaults. or evaluation."
            )
        out.setdefault(head, []).append(rest)
    return out


def stage_mapping(entry: dict, i: int, where: Path, defaults: dict, overrides: list[str]) -> tuple[dict, dict, Path]:
    """Stage ``i``'s recipe mapping before wiring: ``defaults`` (its algorithm's sections), its recipe file, its
    inline sections, its overrides. Returns ``(mapping, the stage's own settings without defaults, source path)``."""
    source = where
    own: dict = {}
    if entry.get("recipe") is not None:
        source = recipe_beside(entry["recipe"], where)
        own = read_yaml(source, f"{where}: stages[{i}].recipe")
    inline = {k: v for k, v in entry.items() if k not in STAGE_KEYS}
    own = deep_merge(own, inline)
    stage_overrides = entry.get("overrides") or []
    if not isinstance(stage_overrides, list):
        raise RecipeError(f"{where}: stages[{i}].overrides must be a list of section.key=value")
    own, _ = apply_overrides(own, [str(o) for o in stage_overrides] + overrides)
    algo = own.get("algo", "grpo")
    if algo not in ALGO_SECTIONS:
        raise RecipeError(f"{where}: stages[{i}].algo must be one of {', '.join(ALGO_SECTIONS)}, got {algo!r}")
    own["algo"] = algo
    return deep_merge(defaults_for(defaults, algo), own), own, source


def resolve_ref(value: Any, kind: str, done: dict[str, Stage], label: str, key: str) -> Any:
    """``stage:NAME`` -> the path of an earlier stage's ``kind`` output (``policy``, ``reward``, ``dataset``);
    other values unchanged."""
    if not isinstance(value, str) or not value.startswith(REF):
        return value
    name = value[len(REF) :]
    if name not in done:
        raise RecipeError(
            f"{label}: {key} {value}: no earlier stage named {name!r} (have: {', '.join(done) or 'none'})"
        )
    stage = done[name]
    wanted = {"policy": POLICY_ALGOS, "reward": ("reward_model",), "dataset": ("rejection_sampling",)}[kind]
    if stage.algo not in wanted:
        raise RecipeError(f"{label}: {key} {value}: stage {name} ({stage.algo}) leaves no {kind} to use")
    from lorarl.algos.rejection_sampling import DATASET_DIR, DATASET_FILE

    return str(
        stage.run_dir / {"policy": "policy", "reward": "reward", "dataset": f"{DATASET_DIR}/{DATASET_FILE}"}[kind]
    )


def wire(mapping: dict, own: dict, previous: list[Stage], label: str) -> dict:
    """Apply the wiring rules of the module docstring to one stage's mapping."""
    done = {s.name: s for s in previous}
    out = copy.deepcopy(mapping)
    init = get_path(own, "model.init_adapter")
    if init is UNSET:
        policies = [s for s in previous if s.policy is not None]
        if policies:
            set_path(out, "model.init_adapter", str(policies[-1].policy))
    source = get_path(own, "data.source")
    if source is UNSET and out["algo"] == "sft" and previous and previous[-1].algo == "rejection_sampling":
        set_path(out, "data.source", resolve_ref(REF + previous[-1].name, "dataset", done, label, "data.source"))
    for key, kind in (("model.init_adapter", "policy"), ("reward.adapter", "reward"), ("data.source", "dataset")):
        value = get_path(out, key)
        if value is not UNSET:
            set_path(out, key, resolve_ref(value, kind, done, label, key))
    return out


def build_stages(raw: dict, where: Path, out_dir: Path, overrides: dict[str, list[str]]) -> list[Stage]:
    """Every stage's wired, validated recipe (nothing runs yet)."""
    entries = raw.get("stages")
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"{where}: stages must be a non-empty list")
    defaults = read_defaults(raw.get("defaults"), where)
    defaults, _ = apply_overrides(defaults, overrides.get("defaults", []))
    stages: list[Stage] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not NAME_RE.match(entry["name"]):
            raise RecipeError(
                f"{where}: stages[{i}] needs a name of lowercase letters, digits, _ and - (got {entry!r})"
            )
        name = entry["name"]
        if any(s.name == name for s in stages):
            raise RecipeError(f"{where}: stages[{i}]: the name {name!r} is used twice")
        label = f"{where}: stage {i + 1} ({name})"
        mapping, own, source = stage_mapping(entry, i, where, defaults, overrides.get(name, []))
        wired = wire(mapping, own, stages, label)
        recipe = recipe_from_dict(wired, label)
        recipe.source_path = str(source)
        stages.append(Stage(i + 1, name, recipe, out_dir / f"{i + 1:02d}-{name}", wired))
    return stages


def evaluation_recipe(raw: dict, where: Path, stages: list[Stage], overrides: list[str]) -> tuple[Recipe, int, bool]:
    """The one recipe every row is evaluated with, the number of held-out prompts, and whether the base gets a row."""
    ev = raw.get("evaluation") or {}
    if not isinstance(ev, dict):
        raise RecipeError(f"{where}: evaluation must be a mapping")
    ev, _ = apply_overrides(ev, [o for o in overrides if o.split("=", 1)[0] in EVAL_KEYS])
    unknown = [k for k in ev if k not in EVAL_KEYS]
    if unknown:
        raise RecipeError(f"{where}: unknown key evaluation.{unknown[0]} (have: {', '.join(EVAL_KEYS)})")
    if ev.get("recipe"):
        path = recipe_beside(ev["recipe"], where)
        mapping = read_yaml(path, f"{where}: evaluation.recipe")
        label = str(path)
    else:
        policies = [s for s in stages if s.policy is not None]
        if not policies:
            raise RecipeError(f"{where}: no stage trains a policy; set evaluation.recipe to evaluate with")
        mapping, label = copy.deepcopy(policies[-1].raw), f"{where}: evaluation (stage {policies[-1].name}'s recipe)"
    extra = [str(o) for o in ev.get("overrides") or []] + [o for o in overrides if o.split("=", 1)[0] not in EVAL_KEYS]
    recipe = recipe_from_dict(mapping, label, extra, strict=False)
    if recipe.algo in ("dpo", "kto") and not getattr(recipe, recipe.algo).task_source:
        raise RecipeError(
            f"{label}: a {recipe.algo.upper()} recipe evaluates on held-out prompts only with "
            f"{recipe.algo}.task_source; set it, or evaluation.recipe"
        )
    # the base row is the pipeline's starting point: adapters off, or the first stage's own init adapter
    recipe.model.init_adapter = stages[0].recipe.model.init_adapter
    n = ev.get("n", recipe.eval.n)
    if not isinstance(n, int) or n < 1:
        raise RecipeError(f"{where}: evaluation.n must be an integer >= 1, got {n!r}")
    return recipe, n, bool(ev.get("base", True))


def check_adapters(stages: list[Stage]) -> None:
    """Every adapter a stage names that no earlier stage makes must exist now: one clear line otherwise."""
    from lorarl.rewards.source import resolve_reward_adapter

    made = {str(p) for s in stages for p in (s.run_dir / "policy", s.run_dir / "reward")}
    for s in stages:
        init = s.recipe.model.init_adapter
        if init and init not in made and not (Path(init) / "adapter_config.json").is_file():
            raise LorarlError(f"{s.label}: model.init_adapter {init}: no such adapter folder (no adapter_config.json)")
        adapter = s.recipe.reward.adapter
        uses_rm = s.recipe.reward.source in ("reward_model", "both") and s.algo != "reward_model"
        if uses_rm and adapter and adapter not in made:
            try:
                resolve_reward_adapter(adapter, s.recipe.source_path)
            except LorarlError as e:
                raise LorarlError(f"{s.label}: reward.adapter: {e}") from None


def load_pipeline(path: str | Path, out_dir: str | Path, overrides: list[str] | None = None) -> Pipeline:
    """Read, wire and validate a pipeline recipe for a run in ``out_dir`` (see the module docstring)."""
    where = resolve_recipe(path).resolve()
    raw = read_yaml(where, "pipeline")
    if "stages" not in raw:
        raise RecipeError(f"{where}: a pipeline recipe needs `stages:` (a single recipe trains with `lorarl train`)")
    unknown = [k for k in raw if k not in TOP_KEYS]
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]} (a pipeline recipe has: {', '.join(TOP_KEYS)})")
    names = [e.get("name") for e in raw["stages"] if isinstance(e, dict)] if isinstance(raw["stages"], list) else []
    grouped = split_overrides(list(overrides or []), [n for n in names if isinstance(n, str)])
    stages = build_stages(raw, where, Path(out_dir), grouped)
    evaluation, n, base = evaluation_recipe(raw, where, stages, grouped.get("evaluation", []))
    check_adapters(stages)
    return Pipeline(where, stages, evaluation, n, base, raw)
