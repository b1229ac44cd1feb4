"""The Train tab's recipes: which recipes can be launched, their comment header, the common fields a user changes,
validation by the real recipe loader, and the planner's memory line for this machine.

Recipes come only from the configured recipe folders (``recipes/*.yaml`` that are not pipelines) and from the runs
folder (``RUNS/NAME/recipe.yaml``, the resolved recipe a run saved) -- :mod:`lorarl.app.paths`. A field's value
becomes a ``section.key=value`` override, checked exactly as ``lorarl train RECIPE section.key=value`` checks it
(:func:`lorarl.config.load_recipe`): a wrong value gets the loader's one line, attributed to its field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lorarl.app.paths import checked_recipe
from lorarl.chat.consent import code_items
from lorarl.config import load_recipe, yaml_load
from lorarl.config.algorithms import USES
from lorarl.errors import LorarlError

FieldKind = Literal["text", "int", "float"]
REWARD_WEIGHT = "reward.functions.{}.weight"  # the key of the weight of reward function N (0-based)


@dataclass(frozen=True)
class RecipeChoice:
    """One launchable recipe: ``label`` for a dropdown, ``path`` (str) to pass back to the functions here."""

    label: str
    path: str


@dataclass(frozen=True)
class Field:
    """A common recipe field: the dotted ``key`` (an override's left side), its ``label``, and its ``kind``
    (``text`` values are sent as strings, ``int`` / ``float`` values are parsed as YAML, as the CLI parses them)."""

    key: str
    label: str
    kind: FieldKind


# The fields the Train tab shows, in order. grpo.group_size only for GRPO recipes (rloo.group_size for RLOO's); one
# weight per reward function (REWARD_WEIGHT) where the reward section applies -- fields_for() gives one recipe's list.
COMMON_FIELDS: list[Field] = [
    Field("model.name", "model", "text"),
    Field("train.steps", "steps", "int"),
    Field("train.learning_rate", "learning rate", "float"),
    Field("grpo.group_size", "group size (completions per prompt)", "int"),
    Field("rloo.group_size", "group size (completions per prompt)", "int"),
    Field("distill.teacher", "teacher (model folder, merged export or adapter folder)", "text"),
    Field("distill.beta", "beta (0 forward KL, 1 reverse KL)", "float"),
    Field("generation.max_new_tokens", "max new tokens", "int"),
    Field(REWARD_WEIGHT, "reward weight", "float"),
    Field("eval.every", "evaluate every N steps", "int"),  # label completed per algorithm: eval_every_label
]


# ---------------------------------------------------------------------------------------------------------------
# Listing recipes
# ---------------------------------------------------------------------------------------------------------------


def read_yaml(path: Path) -> Any:
    """The YAML mapping in ``path``, or None when it cannot be read."""
    try:
        return yaml_load(Path(path).read_text(encoding="utf-8"))
    except Exception:  # unreadable: the loader says why when it is picked
        return None


def list_recipes(recipe_dirs: list[Path], runs_dir: Path) -> list[RecipeChoice]:
    """Shipped / user recipes (``*.yaml`` in each recipe folder, pipelines left out: ``lorarl train`` refuses them),
    then every run's saved ``recipe.yaml`` (newest run first)."""
    out: list[RecipeChoice] = []
    for folder in recipe_dirs:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        for p in sorted(folder.glob("*.y*ml")):
            data = read_yaml(p)
            if isinstance(data, dict) and "stages" in data:
                continue
            out.append(RecipeChoice(f"{p.name}  ({folder.name}/)", os.path.abspath(p)))
    runs_dir = Path(runs_dir)
    runs = [p for p in runs_dir.iterdir() if (p / "recipe.yaml").is_file()] if runs_dir.is_dir() else []
    for run in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True):
        out.append(RecipeChoice(f"{run.name}  (run)", os.path.abspath(run / "recipe.yaml")))
    return out


def recipe_header(path: str | os.PathLike) -> str:
    """The recipe's leading comment block (what it trains, memory, measured result, the command), ``# `` removed."""
    lines = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return "\n".join(lines).strip()


def code_entries(path: str | os.PathLike) -> list[str]:
    """What in a recipe runs code of its own when launched: reward functions and tools named ``module:function`` /
    ``file.py:function``, an environment class, ``model.trust_remote_code`` (a model's own Python). The page shows
    them beside the recipe, so a recipe found in a run folder (copied or downloaded) is never launched unseen."""
    return code_items(dataclasses.asdict(load_recipe(path, strict=False)))  # lorarl.chat.consent: one list


# ---------------------------------------------------------------------------------------------------------------
# Fields and validation
# ---------------------------------------------------------------------------------------------------------------


def _raw(path: Path) -> dict:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise LorarlError(f"{path}: a recipe must be a YAML mapping of sections")
    return data


def _reward_functions(recipe) -> list[dict]:
    """The resolved recipe's reward functions as plain mappings (the list a weight override rewrites)."""
    import dataclasses

    return [
        {k: v for k, v in dataclasses.asdict(spec).items() if v not in (None, {}) or k == "kwargs"}
        for spec in recipe.reward.functions
    ]


def fields_for(path: str | os.PathLike) -> list[Field]:
    """:data:`COMMON_FIELDS` for one recipe: sections its algorithm does not read are left out (a reward model has
    no generation or reward section), group size only for GRPO and RLOO, one weight field per reward function."""
    recipe = load_recipe(path, strict=False)
    uses = set(USES[recipe.algo]) | {recipe.algo}
    out = []
    for f in COMMON_FIELDS:
        section = f.key.split(".")[0]
        if section not in uses:
            continue
        if f.key == "eval.every":
            out.append(Field(f.key, eval_every_label(recipe.algo), f.kind))
            continue
        if f.key == REWARD_WEIGHT:
            if recipe.reward.source == "reward_model":
                continue
            for i, spec in enumerate(recipe.reward.functions):
                out.append(Field(REWARD_WEIGHT.format(i), f"weight of reward {spec.name}", "float"))
            continue
        out.append(f)
    return out


def eval_every_label(algo: str) -> str:
    """What ``eval.every`` 0 means for ``algo``, as the run loop does it (:func:`lorarl.algos.loop.eval_due` with the
    algorithm's ``final_eval``): one evaluation at the last step, or none during training."""
    from lorarl.app.results import final_eval_of

    zero = "only at the last step" if final_eval_of(algo) else "no held-out evaluation during training"
    return f"evaluate every N steps (0: {zero})"


def field_values(path: str | os.PathLike) -> dict[str, Any]:
    """The recipe's current value of each of its fields (:func:`fields_for`), defaults filled in."""
    recipe = load_recipe(path, strict=False)
    values = {}
    for f in fields_for(path):
        parts = f.key.split(".")
        if parts[:2] == ["reward", "functions"]:
            values[f.key] = recipe.reward.functions[int(parts[2])].weight
            continue
        node: Any = recipe
        for p in parts:
            node = getattr(node, p)
        values[f.key] = node
    return values


def _widget_value(field: Field, value: Any) -> Any:
    """A number widget's float for an int field (``40.0``) as the int it shows; anything typed stays as typed."""
    if field.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _same(field: Field, value: Any, current: Any) -> bool:
    """The field still holds the recipe's value (numbers compared as the loader would read them: ``3e-4`` and
    ``0.0003`` are the same)."""
    if field.kind != "text" and isinstance(value, str):
        try:
            value = yaml_load(value) if value.strip() else value
        except Exception:  # not YAML: certainly a change (the loader will say why)
            return False
    if field.kind != "text" and type(value) is not type(current) and not isinstance(value, bool):
        return isinstance(value, (int, float)) and isinstance(current, float) and float(value) == current
    return value == current if field.kind != "text" else str(value).strip() == str(current).strip()


def _value_text(field: Field, value: Any) -> str:
    """The override's right side: a text field as a quoted YAML string; a number as typed (YAML decides the type,
    so ``abc`` stays a string and the loader names the key)."""
    if field.kind == "text":
        return json.dumps(str(value))
    return str(value).strip() if isinstance(value, str) else repr(value)


def _weights_override(functions: list[dict], weights: dict[int, Any]) -> str:
    """One ``reward.functions=[...]`` override: the recipe's functions with some weights replaced (the loader's
    overrides do not index lists). A typed weight is parsed as YAML, as the CLI would."""
    new = [dict(f) for f in functions]
    for i, w in weights.items():
        new[i]["weight"] = yaml_load(w) if isinstance(w, str) and w.strip() else w
    return "reward.functions=" + json.dumps(new)


def overrides_for(path: str | os.PathLike, values: dict[str, Any]) -> dict[str, str]:
    """``{field key: override}`` for every field whose value differs from the recipe's (unknown keys refused)."""
    current = field_values(path)
    fields = {f.key: f for f in fields_for(path)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise LorarlError(f"not a field of this recipe: {', '.join(unknown)}")
    functions = _reward_functions(load_recipe(path, strict=False)) if any(".functions." in k for k in values) else []
    out = {}
    for key, value in values.items():
        value = _widget_value(fields[key], value)
        if value is None or _same(fields[key], value, current[key]):
            continue
        if key.startswith("reward.functions."):
            out[key] = _weights_override(functions, {int(key.split(".")[2]): value})
        else:
            out[key] = f"{key}={_value_text(fields[key], value)}"
    return out


def validate(path: str | os.PathLike, values: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``(overrides, errors)``: the ``section.key=value`` overrides of the changed fields, and for each field the
    loader refuses, its one line as ``lorarl train`` prints it (key ``""``: a problem of no single field, e.g. the
    recipe itself). No errors: the overrides launch as they are."""
    try:
        per_field = overrides_for(path, values)
    except LorarlError as e:
        return [], {"": str(e)}
    errors = {}
    for key, override in per_field.items():
        try:
            load_recipe(path, [override])
        except LorarlError as e:
            errors[key] = str(e)
    weights = {int(k.split(".")[2]): values[k] for k in per_field if k.startswith("reward.functions.")}
    overrides = [o for k, o in per_field.items() if not k.startswith("reward.functions.")]
    if weights:
        overrides.append(_weights_override(_reward_functions(load_recipe(path, strict=False)), weights))
    if not errors:
        try:
            load_recipe(path, overrides)
        except LorarlError as e:
            errors[""] = str(e)
    return (overrides, errors) if not errors else ([], errors)


def check_recipe(path: str | os.PathLike, recipe_dirs: list[Path], runs_dir: Path) -> Path:
    """The recipe ``path`` names, inside the configured folders (:func:`lorarl.app.paths.checked_recipe`)."""
    return checked_recipe(path, recipe_dirs, runs_dir)


# ---------------------------------------------------------------------------------------------------------------
# The planner's line
# ---------------------------------------------------------------------------------------------------------------


def host_memory_gb() -> float | None:
    """MemAvailable of ``/proc/meminfo`` in GB (10^9 bytes), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def cost_block(path: str | os.PathLike, overrides: list[str] | None = None, budget_gb: float | None = None) -> str:
    """The Train tab's cost block for the recipe with ``overrides`` on this machine (:mod:`lorarl.app.cost`): memory,
    time and a GPU recipe's warning on a CPU; the planner's line alone when the recipe does not load."""
    import torch

    from lorarl.app.cost import cost_markdown, machine_line, recipe_costs

    planner = plan_line(path, overrides, budget_gb)
    try:
        recipe = load_recipe(path, overrides or [])
    except LorarlError:
        return planner
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_properties(0).name if cuda else None
    return cost_markdown(
        recipe_costs(recipe_header(path)),
        device="cuda" if cuda else "cpu",
        machine=machine_line(name, None if cuda else host_memory_gb()),
        steps=recipe.train.steps,
        planner=planner,
        changed=[o.split("=", 1)[0] for o in overrides or []],
        model=recipe.model.name,
    )


def plan_line(path: str | os.PathLike, overrides: list[str] | None = None, budget_gb: float | None = None) -> str:
    """The planner's peak estimate of one step of this recipe on this machine, in one line: on CUDA against the
    device's total memory (or ``budget_gb``), on a CPU as host memory (fp32, no NF4) beside what is available."""
    from lorarl.plan import estimate_memory, pick_micro_batch, recipe_model_shape, recipe_settings
    from lorarl.plan.recipes import PLANNED_RECIPES
    from lorarl.plan.terms import GB

    try:
        recipe = load_recipe(path, overrides or [])
    except LorarlError as e:
        return f"plan: {e}"
    if recipe.algo not in PLANNED_RECIPES:
        return f"plan: the planner models {', '.join(PLANNED_RECIPES)} steps; no estimate for a {recipe.algo} recipe"
    import torch

    cuda = torch.cuda.is_available()
    try:
        shape = recipe_model_shape(recipe)
    except LorarlError as e:
        return f"plan: {e}"
    budget = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        budget = budget_gb if budget_gb is not None else props.total_memory / GB
    try:
        s = recipe_settings(
            recipe, device_type="cuda" if cuda else "cpu", shape=shape, budget_bytes=budget * GB if budget else None
        )
    except LorarlError as e:  # a distillation teacher whose shape cannot be read (not trained / exported yet)
        return f"plan: {e}"
    mb = recipe.train.micro_batch_size
    if cuda:
        pick = pick_micro_batch(shape, budget, s)
        est = pick["estimate"] if mb == "auto" else estimate_memory(shape, s, micro_batch_size=int(mb))
        total = est["peak_total_bytes"] / GB
        verdict = "fits" if total <= budget else "DOES NOT FIT"
        return (
            f"plan: peak {total:.2f} GB ({est['peak_phase']}, with CUDA context and allocator slack) of "
            f"{budget:.1f} GB on {props.name} -> {verdict}; micro-batch {mb} (picked {pick['micro_batch_size']})"
        )
    est = estimate_memory(shape, s, micro_batch_size=int(mb) if mb != "auto" else 1)
    return (
        f"plan: the planner's tensor peak {est['peak_bytes'] / GB:.2f} GB ({est['peak_phase']}, fp32, {shape.name}); "
        "it models GPU allocations, not a CPU process's RSS, and the recipe has no measured CPU figure"
    )
