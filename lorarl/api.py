"""The Python door: :func:`train`, :func:`evaluate`, :func:`export`, :func:`load_recipe` and :class:`Run`, over the
same recipe loader (:mod:`lorarl.config`) and run loop (:func:`lorarl.algos.loop.train`) as ``lorarl train``.

One implementation, two doors: a run started here writes the run folder the CLI writes (``recipe.yaml``,
``metrics.jsonl``, checkpoints, adapters, ``summary.json``) and goes through the same checks
(:func:`prepare_run_dir`, which ``lorarl train`` calls too). What Python adds is objects a YAML file cannot hold:

* reward functions as callables with TRL's signature ``f(prompts, completions, completion_ids=..., **columns)`` ->
  ``list[float | None]`` (``async def`` too), metrics ``rewards/<__name__>/mean`` as in TRL;
* datasets as ``datasets.Dataset`` / ``DatasetDict`` (its ``train`` split trains, its test / validation split is
  the held-out set) / a list of dicts, in TRL's fields;
* tools as callables (TRL's convention: name, docstring and type hints give the schema) and an environment class.

Each object is registered under ``python:NAME`` (:mod:`lorarl.inmemory`) and that name is written into the recipe
where a path would stand, so ``recipe.yaml`` stays valid YAML naming what was passed. Errors are
:class:`lorarl.errors.LorarlError` with the one line the CLI prints after ``lorarl: error:``.

Example::

    from datasets import Dataset
    from lorarl import train

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    run = train("recipes/grpo_arith.yaml", "runs/len", reward_funcs=[reward_len],
                train_dataset=Dataset.from_list([{"prompt": "Say hi"}] * 64), train={"steps": 5})
    run.metrics[-1]["rewards/reward_len/mean"]
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from lorarl.config import Recipe, recipe_from_dict, recipe_to_dict
from lorarl.errors import LorarlError, quote
from lorarl.inmemory import (
    callable_name,
    check_registered,
    check_same_objects,
    dataset_rows,
    describe,
    register,
)

__all__ = ["Run", "evaluate", "export", "load_recipe", "prepare_run_dir", "train"]


# ---------------------------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------------------------


def as_overrides(sections: dict, prefix: str = "") -> list[str]:
    """Recipe sections given as Python values -> the ``section.key=value`` overrides that set the same keys (values
    written as one-line YAML, which :func:`lorarl.config.parse_override` reads back): a dict sets its keys one by
    one (merged into the recipe's section), anything else (a list, a scalar, ``{}``) replaces the key's value.

    Example: ``as_overrides({"train": {"steps": 5}, "reward": {"functions": [{"name": "python:f"}]}})`` ->
    ``["train.steps=5", "reward.functions=[{name: 'python:f'}]"]``."""
    import yaml

    out = []
    for key, value in sections.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += as_overrides(value, path + ".")
            continue
        try:
            text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
        except yaml.YAMLError:  # an object YAML has no form for (a function, a model, object())
            raise LorarlError(
                f"{path}: a value of type {type(value).__name__} is not a recipe value (numbers, strings, lists and dicts of them; "
                "functions and datasets go in reward_funcs, train_dataset, tools)"
            ) from None
        out.append(f"{path}={text.removesuffix(chr(10)).removesuffix(chr(10) + '...').strip()}")
    return out


def refuse_pipeline_recipe(path: str) -> None:
    """``lorarl train`` on a pipeline recipe (a file or a shipped name): say which command runs it (one line, exit
    code 2)."""
    from lorarl.config import yaml_load
    from lorarl.config.shipped import resolve_recipe

    try:
        data = yaml_load(resolve_recipe(path).read_text(encoding="utf-8"))
    except Exception:  # unreadable: load_recipe reports it
        return
    if isinstance(data, dict) and "stages" in data:
        raise LorarlError(
            f"{path} is a pipeline recipe (it has stages:): run it with `lorarl pipeline {path} --out DIR`"
        )


def _build(recipe: Any, overrides: Iterable[str], sections: dict, objects: dict | None = None) -> Recipe:
    """A recipe (a path, a dict or a Recipe) with ``sections`` and ``objects`` (the ``python:`` names) applied as
    overrides before ``overrides``: a path goes through :func:`lorarl.config.load_recipe` as on the command line."""
    if isinstance(overrides, str) or not isinstance(overrides, Iterable):
        raise LorarlError(f"overrides: expected a list of section.key=value strings, got {quote(overrides)}")
    all_overrides = as_overrides(sections) + as_overrides(objects or {}) + list(overrides)
    if isinstance(recipe, (str, Path)):
        from lorarl.config import load_recipe as load_recipe_file

        refuse_pipeline_recipe(str(recipe))
        return load_recipe_file(recipe, all_overrides)
    if isinstance(recipe, Recipe):
        out = recipe_from_dict(recipe_to_dict(recipe), "<Recipe>", all_overrides)
        out.source_path = recipe.source_path
        return out
    if isinstance(recipe, dict):
        return recipe_from_dict(recipe, "<recipe dict>", all_overrides)
    raise LorarlError(f"recipe: expected a path, a dict or a lorarl.config.Recipe, got {type(recipe).__name__}")


def load_recipe(recipe: Any, overrides: Iterable[str] = (), **sections: Any) -> Recipe:
    """A validated :class:`lorarl.config.Recipe` from a path to a YAML recipe, a dict with the YAML's shape or a
    Recipe; ``sections`` merge into it key by key (``train={"steps": 5}``), then ``overrides`` apply exactly as on the
    command line (``["train.steps=5"]``). A path with no sections gives what ``lorarl train PATH OVERRIDES`` reads.
    Bad input raises :class:`LorarlError` with the CLI's line (the recipe key named)."""
    return _build(recipe, overrides, sections)


# ---------------------------------------------------------------------------------------------------------------
# Python objects -> python: names in the recipe
# ---------------------------------------------------------------------------------------------------------------


def _reward_entries(reward_funcs: Any, reward_weights: Any, objects: dict) -> list[dict]:
    """``reward.functions`` entries for TRL-style ``reward_funcs`` (a callable, a name, or a list of them) and
    ``reward_weights`` (one per function; default 1.0 each, as TRL)."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise LorarlError(
            f"reward_weights: {len(reward_weights)} weights for {len(funcs)} reward_funcs; give one per function"
        )
    entries = []
    for i, fn in enumerate(funcs):
        if isinstance(fn, str):
            name = fn
        else:
            name = register(callable_name(fn, f"reward_funcs[{i}]"), fn)
            objects[name] = fn
        entry = {"name": name}
        if reward_weights is not None:
            entry["weight"] = float(reward_weights[i])
        entries.append(entry)
    return entries


def _tool_names(tools: Any, objects: dict) -> list[str]:
    names = []
    for i, tool in enumerate(tools if isinstance(tools, (list, tuple)) else [tools]):
        if isinstance(tool, str):
            names.append(tool)
            continue
        name = register(callable_name(tool, f"tools[{i}]"), tool)
        objects[name] = tool
        names.append(name)
    return names


def python_sections(
    objects: dict,
    *,
    reward_funcs: Any = None,
    reward_weights: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    tools: Any = None,
    environment_factory: Any = None,
) -> dict:
    """The recipe sections that name the Python objects given (each registered, and added to ``objects`` under its
    ``python:`` name): ``reward.functions``, ``data.source`` / ``data.eval_source``, ``agent.tools`` /
    ``agent.environment``. Nothing given: ``{}``."""
    out: dict = {}
    if reward_funcs is not None:
        out["reward"] = {"functions": _reward_entries(reward_funcs, reward_weights, objects)}
    elif reward_weights is not None:
        raise LorarlError("reward_weights: given without reward_funcs")
    for key, obj, name in (("source", train_dataset, "train_dataset"), ("eval_source", eval_dataset, "eval_dataset")):
        if obj is None:
            continue
        if isinstance(obj, str):  # a path or hub name, as in a recipe
            out.setdefault("data", {})[key] = obj
            continue
        spec = register(name, dataset_rows(obj, name))
        objects[spec] = obj
        out.setdefault("data", {})[key] = spec
    if tools is not None:
        out.setdefault("agent", {})["tools"] = _tool_names(tools, objects)
    if environment_factory is not None:
        if isinstance(environment_factory, str):
            spec = environment_factory
        else:
            spec = register(callable_name(environment_factory, "environment_factory"), environment_factory)
            objects[spec] = environment_factory
        out.setdefault("agent", {})["environment"] = spec
    return out


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def prepare_run_dir(recipe: Recipe, out: str | Path, *, resume: bool = False, force: bool = False) -> Path:
    """What both doors check before a run starts (``lorarl train`` and :func:`train`): every ``python:`` object the
    recipe names is at hand (else one line: such a run resumes only from Python), the agent's tools and environment
    import (before the model loads), no other process trains ``out``, and a non-empty ``out`` is resumed
    (``resume``), emptied (``force``: the chat's votes copy is kept) or refused with one line."""
    check_registered(recipe)
    if recipe.agent is not None:  # a missing tool, function or environment class: one line, before the model loads
        from lorarl.agents import resolve_agent
        from lorarl.agents.setup import check_reward_source

        check_reward_source(recipe.reward, recipe.agent, resolve_agent(recipe.agent, recipe.source_path))
    out = Path(out)
    from lorarl.runfiles import check_run_folder
    from lorarl.runs import check_output_folder
    from lorarl.runstate import PID_FILE, PRE_RUN_FILES, VOTES_FILE, VOTES_TIES_FILE, check_not_live

    check_output_folder(out, "run directory")

    check_not_live(out)  # never --force away (or resume into) a folder another process is training
    # the workbench (lorarl.app.jobs) writes DIR/train.log, DIR/launch.json (and this process's DIR/train.pid)
    # before this process starts: no run yet
    pre_run = (*PRE_RUN_FILES, PID_FILE)  # (a train.pid naming another live process was refused just above)
    if out.exists() and any(p.name not in pre_run for p in out.iterdir()) and not resume:
        if not force:
            raise LorarlError(
                f"{out}: run directory is not empty; pass --resume to continue it or --force to start over"
            )
        for p in out.iterdir():  # (a retrain's copy of the votes is its data: kept)
            if p.name not in (VOTES_FILE, VOTES_TIES_FILE):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    check_run_folder(out)  # a link where the run writes: one line now, not a crash hours later (lorarl.runfiles)
    return out


def train(
    recipe: Any,
    out: str | Path | None = None,
    *,
    overrides: Iterable[str] = (),
    reward_funcs: Any = None,
    reward_weights: list[float] | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    tools: list[Callable] | None = None,
    environment_factory: Any = None,
    resume: bool = False,
    force: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
    **sections: Any,
) -> Run:
    """Train a recipe (a path, a dict or a Recipe; ``sections`` and ``overrides`` as in :func:`load_recipe`) into the
    run folder ``out`` (default ``runs/<algo>-<YYYYmmdd-HHMMSS>``) with the run loop ``lorarl train`` uses; returns
    the :class:`Run`.

    ``reward_funcs`` (callables with TRL's signature, or recipe names such as ``"numeric_match"``) replace
    ``reward.functions``, weighted by ``reward_weights``; ``train_dataset`` / ``eval_dataset`` (a Dataset,
    DatasetDict or list of dicts in TRL's fields, or a path / hub name) replace ``data.source`` /
    ``data.eval_source``; ``tools`` and ``environment_factory`` set ``agent.tools`` / ``agent.environment``.
    ``resume`` continues the newest checkpoint (the same in-memory datasets must be passed again: their fingerprints
    are checked); ``force`` empties a non-empty ``out``; ``max_steps`` stops after that step; ``progress``: a
    tqdm.auto bar (a widget in a notebook)."""
    from lorarl.algos.loop import check_max_steps

    check_max_steps(max_steps)
    from lorarl.algos.loop import check_max_steps

    check_max_steps(max_steps)
    objects: dict = {}
    extra = python_sections(
        objects,
        reward_funcs=reward_funcs,
        reward_weights=reward_weights,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        tools=tools,
        environment_factory=environment_factory,
    )
    rec = _build(recipe, overrides, sections, extra)
    if out is None:
        out = Path("runs") / f"{rec.algo}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = prepare_run_dir(rec, out, resume=resume, force=force)
    if resume:
        check_same_objects(run_dir, objects)
    if objects:  # what each python: name was (a dataset's fingerprint: resume checks it)
        from lorarl.inmemory import OBJECTS_FILE
        from lorarl.runstate import write_json_atomic

        write_json_atomic(run_dir / OBJECTS_FILE, {name: describe(obj) for name, obj in objects.items()})
    from lorarl.algos.loop import train as run_loop

    run_loop(rec, str(run_dir), resume=resume, max_steps=max_steps, progress=progress)
    return Run(run_dir, rec, objects)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation, export, runs
# ---------------------------------------------------------------------------------------------------------------


def evaluate_recipe(recipe: Recipe, checkpoint: str, n: int | None = None) -> dict:
    """What ``lorarl eval`` computes: the algorithm's own ``evaluate_checkpoint`` (reward model, DPO), else the
    greedy held-out evaluation (:func:`lorarl.evaluate.evaluate`)."""
    from lorarl.algos import algorithm_class
    from lorarl.algos.loop import set_threads
    from lorarl.model import pick_device

    check_registered(recipe)
    evaluate_fn = getattr(algorithm_class(recipe.algo), "evaluate_checkpoint", None)
    if evaluate_fn is None:  # every policy-training algorithm: greedy held-out evaluation
        from lorarl.evaluate import evaluate as evaluate_fn
    set_threads(pick_device(recipe.model.device).type)
    return evaluate_fn(recipe, checkpoint, n=n)


def _noted(result: dict) -> dict:
    """An evaluation without an ``answer`` column has no accuracy (None): the Python door's result says so in
    ``note`` (``reward_mean`` is then the held-out figure)."""
    if "accuracy" in result and result["accuracy"] is None:
        result["note"] = "the held-out rows have no 'answer' column (or none could be judged): accuracy is None"
    return result


def evaluate(recipe: Any, checkpoint: str = "base", n: int | None = None, **kw: Any) -> dict:
    """Greedy held-out evaluation of ``checkpoint`` (``"base"``, a run folder or an adapter folder) on a recipe's
    held-out set: what ``lorarl eval RECIPE --checkpoint C --n N`` returns. ``kw``: ``overrides``, the Python objects
    of :func:`train` (``reward_funcs``, ``eval_dataset``, ...) and recipe sections."""
    overrides = kw.pop("overrides", ())
    names = ("reward_funcs", "reward_weights", "train_dataset", "eval_dataset", "tools", "environment_factory")
    objects: dict = {}
    extra = python_sections(objects, **{k: kw.pop(k) for k in names if k in kw})
    return _noted(evaluate_recipe(_build(recipe, overrides, kw, extra), str(checkpoint), n))


def export(run: Any, out: str | Path, format: str = "merged", **kw: Any) -> dict:
    """Export a run (a :class:`Run` or its folder) to ``out``: what ``lorarl export RUN --out OUT --format F`` does
    (``kw``: ``dtype``, ``force``, ``checkpoint``, ``quant``, ``gate``, ``gate_n``, as its options)."""
    if isinstance(run, Run):
        return run.export(out, format, **kw)
    from lorarl.export import export as export_run

    return export_run(run, out, fmt=format, **kw)


class Run:
    """A run folder: what :func:`train` returns and :meth:`open` reads.

    ``path``: the folder; ``recipe``: its resolved recipe; ``metrics``: the rows of ``metrics.jsonl`` (TRL's metric
    names; re-read on each access, so a run another process trains shows its progress); ``summary``: ``summary.json``
    (the dict ``lorarl train`` prints last); ``state``: ``state.json`` (running / stopped / finished / crashed)."""

    def __init__(self, path: str | Path, recipe: Recipe, objects: dict | None = None):
        self.path = Path(path)
        self.recipe = recipe
        self._objects = dict(objects or {})  # python: name -> object, registered again before evaluate / export

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, algo={self.recipe.algo!r}, state={self.state.get('state')!r})"

    @classmethod
    def open(cls, path: str | Path) -> Run:
        """An existing run folder (``recipe.yaml`` in it). A run given Python objects evaluates and exports in a
        process that registered them (the one that trained it, or after :func:`train` with ``resume=True``)."""
        from lorarl.config import load_run_recipe

        path = Path(path)
        if not (path / "recipe.yaml").is_file():
            raise LorarlError(f"{path}: not a run folder (no recipe.yaml)")
        return cls(path, load_run_recipe(path / "recipe.yaml"))

    @property
    def metrics(self) -> list[dict]:
        from lorarl.runs import read_metrics

        return read_metrics(self.path / "metrics.jsonl")

    @property
    def summary(self) -> dict:
        from lorarl.algos.loop import SUMMARY_FILE

        path = self.path / SUMMARY_FILE
        if not path.is_file():
            raise LorarlError(f"{path}: no summary yet (the run has not finished or stopped)")
        return json.loads(path.read_text(encoding="utf-8"))

    @property
    def state(self) -> dict:
        from lorarl.runstate import read_state

        return read_state(self.path)

    def _register(self) -> None:
        for name, obj in self._objects.items():
            register(name, obj)

    def checkpoint_path(self, checkpoint: str = "final") -> str:
        """``"final"`` -> the run folder (its final adapters); ``"base"``; ``"best"``, ``"latest"``, ``step-NNNNNN``
        or a step number -> that checkpoint's folder (:func:`lorarl.runs.named_checkpoint`)."""
        if checkpoint == "final":
            return str(self.path)
        if checkpoint == "base" or Path(checkpoint).is_absolute():
            return str(checkpoint)
        from lorarl.runs import named_checkpoint

        return str(named_checkpoint(self.path, str(checkpoint)))

    def evaluate(self, checkpoint: str = "final", n: int | None = None) -> dict:
        """Greedy held-out evaluation of ``checkpoint`` (see :meth:`checkpoint_path`): what ``lorarl eval
        RUN/recipe.yaml --checkpoint RUN`` returns (written to ``RUN/eval.json`` for the final policy)."""
        self._register()
        return _noted(evaluate_recipe(self.recipe, self.checkpoint_path(checkpoint), n))

    def export(self, out: str | Path, format: str = "merged", **kw: Any) -> dict:
        """What ``lorarl export RUN --out OUT --format FORMAT`` does (``kw`` as :func:`export`)."""
        from lorarl.export import export as export_run

        self._register()
        return export_run(self.path, out, fmt=format, **kw)
