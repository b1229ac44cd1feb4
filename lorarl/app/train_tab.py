"""The Train tab's callbacks (a mixin of :class:`lorarl.app.handlers.Workbench`): a recipe shown with its fields,
its adapters and its cost; Check and Launch, which check the same things in the same order -- the recipe loader on
every field, the files the run's set-up reads (:mod:`lorarl.app.preflight`), and the run name -- so Check says
"ok" exactly when Launch would start the run.

The adapters a recipe loads (``reward.adapter``, ``model.init_adapter``) are dropdowns: the recipe's own value and
the matching adapters of the runs folder's runs (:meth:`TrainTab.adapter_choices`); nothing on the page is a path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio as gr

from lorarl.app import recipes, watch
from lorarl.app.jobs import check_real_folder, is_unstarted
from lorarl.app.layout import ADAPTER_KEYS, MAX_FIELDS, START_HERE
from lorarl.app.paths import check_run_name
from lorarl.errors import LorarlError

MODEL_KEY = "model.name"
ADAPTER_ROLES = {"reward.adapter": "reward", "model.init_adapter": "policy"}


def _err(e: Exception) -> str:
    return f"**error:** {e}"


def model_choices(catalog, current: str | None) -> list[str]:
    """What the model dropdown offers: the chat's base (the runs' model), the embedded models, and the recipe's own
    ``model.name`` (no free path from the browser)."""
    from lorarl.model.registry import EMBEDDED

    out = [catalog.base_model, *EMBEDDED]
    if current:
        out.append(str(current))
    return list(dict.fromkeys(out))


def adapter_values(recipe_path: Path) -> dict[str, str | None]:
    """``{key: the recipe's value}`` of the adapters it loads (:data:`ADAPTER_KEYS`): ``reward.adapter`` when the
    run loads it (:func:`lorarl.app.preflight.uses_reward_adapter`), ``model.init_adapter`` when set."""
    from lorarl.app.preflight import uses_reward_adapter
    from lorarl.config import load_recipe

    recipe = load_recipe(recipe_path, strict=False)
    out: dict[str, str | None] = {}
    if uses_reward_adapter(recipe):
        out["reward.adapter"] = recipe.reward.adapter
    if recipe.model.init_adapter:
        out["model.init_adapter"] = recipe.model.init_adapter
    return out


def not_ready_line(errors: dict[str, str], head: str = "not ready") -> str:
    """Every refused field and file in one line, each named by its recipe key (the line under the buttons)."""
    return f"**{head}:** " + " · ".join(f"`{k}`: {v}" if k else v for k, v in errors.items())


class TrainTab:
    """The Train tab's callbacks; needs ``self.catalog``, ``self.runs_dir``, ``self.memory``, ``self._recipe``,
    ``self._launch`` and ``self.run_choices`` of the Workbench."""

    def recipe_choices(self) -> list[tuple[str, str]]:
        """The recipes, the quickstart first and marked as the place to start (:data:`START_HERE`)."""
        out = [(c.label, str(c.path)) for c in recipes.list_recipes(self.recipe_dirs, self.runs_dir)]
        shipped = self.recipe_dirs[0].resolve() if self.recipe_dirs else None  # (recipe_folders: the shipped first)
        start = [c for c in out if Path(c[1]).name == START_HERE[0] and Path(c[1]).resolve().parent == shipped]
        rest = [c for c in out if c not in start]
        return [(f"{START_HERE[1]}: {c[0]}", c[1]) for c in start] + rest

    def start_recipe(self) -> str | None:
        """The recipe the Train tab opens on: the quickstart (else none)."""
        choices = self.recipe_choices()
        return choices[0][1] if choices and choices[0][0].startswith(START_HERE[1]) else None

    def on_recipes(self, current: str | None):
        choices = self.recipe_choices()
        return gr.Dropdown(choices=choices, value=current if current in {c[1] for c in choices} else None)

    def adapter_choices(self, key: str, current: str | None) -> list[tuple[str, str]]:
        """What the ``key`` dropdown offers: the recipe's value (marked when it is missing) and every run in the
        runs folder whose final adapter of that role is there (a reward adapter with its score head)."""
        from lorarl.model import HEAD_FILE
        from lorarl.runs import is_adapter

        role = ADAPTER_ROLES[key]
        out = []
        if current:
            out.append((f"{current} (the recipe's)", str(current)))
        for run in watch.list_runs(self.runs_dir):
            folder = run.path / role
            if is_adapter(folder) and (role != "reward" or (folder / HEAD_FILE).is_file()):
                value = str(run.path) if role == "reward" else str(folder)
                out.append((f"run {run.name}: its {role} adapter", value))
        first: dict[str, tuple[str, str]] = {}
        for label, value in out:
            first.setdefault(value, (label, value))
        return list(first.values())

    def on_recipe(self, path: str):
        """Show a recipe: its header, the model and adapter dropdowns, one slot per common field, its cost."""
        skip = [gr.skip()] * (4 + 2 * len(ADAPTER_KEYS) + 2 * MAX_FIELDS)
        try:
            recipe = self._recipe(path)
            fields, values = recipes.fields_for(recipe), recipes.field_values(recipe)
            header = recipes.recipe_header(recipe)
            code = recipes.code_entries(recipe)
            adapters = adapter_values(recipe)
        except LorarlError as e:
            return [*skip, _err(e), ""]
        others = [f for f in fields if f.key != MODEL_KEY][:MAX_FIELDS]
        model = values.get(MODEL_KEY)
        slots = [
            gr.Textbox(label=f"{f.label}  ({f.key})", value=str(values[f.key]), visible=True)
            if i < len(others)
            else gr.Textbox(visible=False, value="")
            for i, f in enumerate(others + [None] * (MAX_FIELDS - len(others)))
        ]
        md = "```text\n" + header + "\n```" if header else "_(no comment header)_"
        if code:  # a recipe from a run folder may come from anywhere: what it runs is shown before a launch
            md = "**runs code when launched:** " + "; ".join(f"`{c}`" for c in code) + "\n\n" + md
        model_dd = gr.Dropdown(choices=model_choices(self.catalog, model), value=model, visible=MODEL_KEY in values)
        adapter_dds = [
            gr.Dropdown(choices=self.adapter_choices(k, adapters.get(k)), value=adapters.get(k), visible=k in adapters)
            for k in ADAPTER_KEYS
        ]
        return [
            md,
            model_dd,
            "",
            [f.key for f in others],
            *adapter_dds,
            *[""] * len(ADAPTER_KEYS),
            *slots,
            *[""] * MAX_FIELDS,
            self.cost(recipe),
            "",
        ]

    def _values(self, recipe: Path, model: str | None, keys: list[str], slot_values) -> dict[str, Any]:
        values = {k: v for k, v in zip(keys, slot_values)}
        if model is not None and MODEL_KEY in recipes.field_values(recipe):
            if model not in model_choices(self.catalog, recipes.field_values(recipe)[MODEL_KEY]):
                raise LorarlError(f"model.name {model!r} is not one of the models offered")
            values[MODEL_KEY] = model
        return values

    def _adapter_overrides(self, recipe: Path, picked: list[str | None]) -> list[str]:
        """``key=value`` for each adapter dropdown that differs from the recipe; a value it does not offer refused."""
        current, out = adapter_values(recipe), []
        for key, value in zip(ADAPTER_KEYS, picked):
            if key not in current or value in (None, "", current[key]):
                continue
            if value not in {v for _, v in self.adapter_choices(key, current[key])}:
                raise LorarlError(f"{key} {value!r} is not one of the adapters offered")
            out.append(f"{key}={json.dumps(value)}")
        return out

    def _checked(self, path: str, model, adapters: list, keys: list[str], slot_values):
        """``(recipe, overrides, errors, field outputs)``: the loader on every field, then the files the run's set-up
        reads (:func:`lorarl.app.preflight.preflight`); ``errors`` {recipe key or "": line}, ``overrides`` None
        when there are any. Field outputs: the model's, each adapter's and each slot's error line."""
        from lorarl.app.preflight import preflight

        recipe = self._recipe(path)
        overrides, errors = recipes.validate(recipe, self._values(recipe, model, keys, slot_values))
        if not errors:
            overrides = overrides + self._adapter_overrides(recipe, adapters)
            try:
                errors = preflight(recipe, overrides)[0]
            except LorarlError as e:
                errors = {"": str(e)}
        outputs = [errors.get(MODEL_KEY, ""), *[errors.get(k, "") for k in ADAPTER_KEYS]]
        outputs += [errors.get(k, "") for k in keys] + [""] * (MAX_FIELDS - len(keys))
        return recipe, (None if errors else overrides), errors, outputs

    def cost(self, recipe: Path, overrides: list[str] | None = None) -> str:
        """The cost block (:func:`lorarl.app.recipes.cost_block`); on CUDA the planner's budget is the room a
        launch would get beside the chat (:func:`lorarl.app.memory.room_for_run`), the figure it is checked
        against."""
        return recipes.cost_block(recipe, overrides, budget_gb=self.memory.room_gb())

    def _name_refusal(self, name: str) -> str | None:
        """Why Launch would refuse run name ``name`` (as :meth:`lorarl.app.jobs.JobRunner.launch` checks it), or
        None."""
        try:
            check_run_name(name)
            check_real_folder(self.runs_dir / name, name)
        except LorarlError as e:
            return str(e)
        if not is_unstarted(self.runs_dir / name):
            return f"run {name} already exists in {self.runs_dir}; pick another name or resume it in Watch"
        return None

    def on_check(self, path, model, reward_adapter, init_adapter, keys, run_name, *slot_values):
        """What Launch would do, without launching: the fields, the files, the run name; "ok" when it would start."""
        try:
            recipe, overrides, errors, outputs = self._checked(
                path, model, [reward_adapter, init_adapter], keys, slot_values
            )
        except LorarlError as e:
            return [gr.skip()] * (1 + len(ADAPTER_KEYS) + MAX_FIELDS) + [gr.skip(), _err(e)]
        if errors:
            return [*outputs, self.cost(recipe), not_ready_line(errors)]
        name = (run_name or "").strip()
        why = self._name_refusal(name) if name else None
        if why:
            status = f"**not ready:** {why}"
        elif not name:
            status = "**ok:** the fields and the files the run reads pass; give a run name to launch"
        else:
            status = f"**ok:** ready to launch `{name}` (`lorarl train {recipe.name} --out {self.runs_dir / name}`)"
        return [*outputs, self.cost(recipe, overrides), status]

    def on_launch(self, path, model, reward_adapter, init_adapter, keys, run_name, *slot_values):
        """Check as :meth:`on_check` does, check the memory rule, launch; then show the run in Watch."""
        skip_watch = [gr.skip(), gr.skip()]
        try:
            recipe, overrides, errors, outputs = self._checked(
                path, model, [reward_adapter, init_adapter], keys, slot_values
            )
        except LorarlError as e:
            return [gr.skip()] * (1 + len(ADAPTER_KEYS) + MAX_FIELDS) + [gr.skip(), _err(e), *skip_watch]
        if errors:
            return [*outputs, self.cost(recipe), not_ready_line(errors, "not launched"), *skip_watch]
        name = (run_name or "").strip()
        try:
            why = self._name_refusal(name)
            if why:
                raise LorarlError(why)
            run_dir, note = self._launch(recipe, name, overrides)
        except LorarlError as e:
            return [*outputs, self.cost(recipe, overrides), f"**not launched:** {e}", *skip_watch]
        shown = " ".join(overrides) or "(none)"
        status = f"launched `{Path(run_dir).name}`: `lorarl train {recipe.name} --out {run_dir}` overrides: `{shown}`"
        status += f" ({note})" if note else ""
        cost = self.cost(recipe, overrides)
        return [*outputs, cost, status, gr.Tabs(selected="watch"), gr.Dropdown(self.run_choices(), value=run_dir.name)]
