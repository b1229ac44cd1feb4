"""What a launch would fail on after the recipe loader has passed it, checked before any process starts (the Train
tab's Check and Launch, and Resume): the files a run reads in its set-up, resolved as the run resolves them.

* the reward adapter (``reward.adapter`` when ``reward.source`` is ``reward_model`` or ``both``, or PPO's
  ``ppo.critic.init: reward``): :func:`lorarl.rewards.source.resolve_reward_adapter`, the run's own resolution
  (the working folder, then beside the recipe), so the page says what the run would say;
* the starting adapter (``model.init_adapter``): a PEFT folder (``adapter_config.json``) from the working folder,
  as :meth:`lorarl.model.SharedBase.add_adapter` reads it;
* the data: ``data.source`` and ``data.eval_source`` when they name files (``pkg:NAME``, or a path from the
  working folder, then beside the recipe); a hub name is not fetched here (said in the result's notes);
* the columns: for algorithms that score their own samples with rule rewards, the first training row must hold
  each column a built-in reward reads (:func:`lorarl.rewards.builtins.builtin_columns`: ``answer`` for
  ``numeric_match``), read as the run reads its rows (:func:`lorarl.data.prompts.read_rows`).

:func:`preflight` returns ``{recipe key: its one line}``; empty when nothing is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorarl.errors import LorarlError

SAMPLING_ALGOS = ("grpo", "rloo", "ppo", "online_dpo", "rejection_sampling")  # rule rewards score their own samples


def uses_reward_adapter(recipe) -> bool:
    """The run loads ``reward.adapter``: a reward-model source, or PPO's critic warm-started from it."""
    critic = getattr(getattr(recipe, "ppo", None), "critic", None)
    return recipe.reward.source in ("reward_model", "both") or getattr(critic, "init", None) == "reward"


def _data_files(recipe) -> list[tuple[str, str]]:
    """``(key, source)`` of the data sources that name files (not generated, not a Python object, not a hub name
    that is no local path)."""
    from lorarl.data.sources import is_hub_name
    from lorarl.inmemory import is_python_name

    out = []
    for key, source in (("data.source", recipe.data.source), ("data.eval_source", recipe.data.eval_source)):
        if not source or source == "arithmetic" or is_python_name(str(source)):
            continue
        if is_hub_name(str(source)) and not Path(str(source)).expanduser().exists():
            continue
        out.append((key, str(source)))
    return out


def _columns(recipe) -> dict[str, str]:
    """``{"reward.functions": line}`` when a built-in rule reward reads a column the first training row lacks."""
    from lorarl.data.prompts import read_rows
    from lorarl.rewards.builtins import builtin_columns

    if recipe.algo not in SAMPLING_ALGOS or recipe.reward.source == "reward_model":
        return {}
    local = recipe.data.source == "arithmetic" or ("data.source", str(recipe.data.source)) in _data_files(recipe)
    if not local:  # a hub dataset or a Python object: read when the run starts
        return {}
    needs = {spec.name: builtin_columns(spec.name) for spec in recipe.reward.functions}
    if not any(needs.values()):
        return {}
    rows, where = read_rows(recipe.data, "train", size=4, recipe_path=recipe.source_path)
    if not rows:
        return {}
    missing = [(name, col) for name, cols in needs.items() for col in cols if col not in rows[0]]
    if not missing:
        return {}
    what = "; ".join(f"reward {name} reads the column {col!r}" for name, col in missing)
    have = ", ".join(sorted(rows[0])) or "none"
    return {"reward.functions": f"{what}, which the data has not ({where}: columns {have}); map one with data.columns"}


def preflight(recipe_path: str | os.PathLike, overrides: list[str] | None = None) -> tuple[dict[str, str], list[str]]:
    """``(errors, notes)``: for each recipe key a launch would fail on, its one line (see the module docstring);
    ``notes``: what was not checked (a hub dataset). The recipe must load (the loader's own errors come first)."""
    from lorarl.config import load_recipe
    from lorarl.rewards.source import resolve_reward_adapter
    from lorarl.runs import resolve_path

    recipe = load_recipe(recipe_path, list(overrides or []))
    errors: dict[str, str] = {}
    notes: list[str] = []
    if uses_reward_adapter(recipe):
        try:
            resolve_reward_adapter(recipe.reward.adapter, recipe.source_path)
        except LorarlError as e:
            errors["reward.adapter"] = str(e)
    init = recipe.model.init_adapter
    if init and not (Path(init).expanduser() / "adapter_config.json").is_file():
        errors["model.init_adapter"] = f"model.init_adapter {init}: not a PEFT adapter folder (no adapter_config.json)"
    for key, source in _data_files(recipe):
        try:
            resolve_path(source, recipe.source_path, key)
        except LorarlError as e:
            errors[key] = str(e)
    for key in ("data.source", "data.eval_source"):
        source = getattr(recipe.data, key.split(".")[1])
        if source and (key, str(source)) not in _data_files(recipe) and source != "arithmetic":
            notes.append(f"{key} {source} is read when the run starts (not checked here)")
    if "data.source" not in errors:
        try:
            errors.update(_columns(recipe))
        except LorarlError as e:  # a file the loader cannot read: its own line
            errors["data.source"] = str(e)
    return errors, notes
