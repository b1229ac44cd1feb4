"""Vote -> retrain: the chat's votes file (``RUNS/preferences.jsonl``, :mod:`lorarl.chat.votes`) becomes the data of
a DPO run (``recipes/dpo.yaml``, the policy starting from the chosen checkpoint), of a KTO run
(``recipes/kto_arithmetic.yaml``, the same start; its rows are every pairwise vote unpaired into a 👍 and a 👎 row, and
the single-answer 👍 / 👎 votes of ``RUNS/preferences_unpaired.jsonl``: usable from two rows, one vote of each kind
or one pairwise vote, where DPO needs pairs) or of a reward-model run
(``recipes/reward_model.yaml``), launched by the job runner like any other run. The reward adapter is its own role:
a reward-model run starts a fresh reward adapter and score head on the base the chosen checkpoint was trained on
(the checkpoints offered are policies, which are no reward adapter to continue from); only DPO starts from the
checkpoint's policy.

The shipped recipe is used as it is, with overrides only: ``data.source`` = a copy of the votes file taken at launch
(``RUN/votes.jsonl``, ties beside it; for KTO the single-answer votes appended to it: a vote cast later changes
neither a resume nor the run); ``data.eval_source:
null`` (the votes have no held-out split, so no held-out pairs are scored; DPO's task evaluation, when its recipe has
one, still runs at the end); ``model.init_adapter`` = the checkpoint's policy adapter (DPO) and ``model.name`` = the
base that checkpoint was trained on (else the chat's base); the batch cut to the number of usable pairs, and
``train.steps = ceil(pairs x epochs / batch)`` so the run takes the recipe's epochs over the votes and stops.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from lorarl.app.jobs import is_unstarted
from lorarl.app.paths import check_run_name, is_inside, shipped_recipes_dir
from lorarl.chat.votes import PREFERENCES_FILE, ties_path, unpaired_path
from lorarl.config import load_recipe, yaml_load
from lorarl.errors import LorarlError
from lorarl.runfiles import write_atomic
from lorarl.runs import CHECKPOINTS, STEP_RE, is_adapter
from lorarl.runstate import VOTES_FILE, VOTES_TIES_FILE

Kind = Literal["dpo", "reward_model", "kto"]
KINDS = ("dpo", "reward_model", "kto")
RECIPES = {"dpo": "dpo", "reward_model": "reward_model", "kto": "kto_arithmetic"}  # kind -> its shipped recipe
POLICY_KINDS = ("dpo", "kto")  # the policy starts from the chosen checkpoint
BASE = "base"


@dataclass(frozen=True)
class VotesSummary:
    """The votes file: rows, usable pairs (a chosen and a rejected answer that differ, not a tie), ties (in the file
    and in the ties file beside it), other rows left out."""

    path: Path
    rows: int
    usable: int
    ties: int
    unusable: int
    up: int = 0  # single-answer votes (TRL unpaired rows, in the file or beside it): 👍
    down: int = 0  # 👎

    @property
    def kto_rows(self) -> int:
        """The rows a KTO retrain trains on: each usable pair unpaired into two, and every single-answer vote."""
        return 2 * self.usable + self.up + self.down

    @property
    def text(self) -> str:
        if not self.rows and not self.ties and not (self.up or self.down or self.unusable):
            return (
                f"no votes yet ({self.path} does not exist or is empty): vote on two panes' answers, or 👍 / 👎 one "
                "answer, in the Chat tab"
            )
        extra = f", {self.unusable} unusable row(s) left out" if self.unusable else ""
        line = f"{self.usable} usable preference pair(s) in {self.path} ({self.ties} tie(s) left out{extra})"
        if self.up or self.down:
            line += f"; {self.up + self.down} single-answer vote(s) ({self.up} 👍, {self.down} 👎: KTO only)"
        return line


def _answer(value) -> str | None:
    """The response text of a TRL ``chosen`` / ``rejected`` value (a string or a message list), else None."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        content = value[-1].get("content")
        return content.strip() or None if isinstance(content, str) else None
    return None


def _read_jsonl(path: Path) -> list:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)
    return rows


def votes_summary(runs_dir: str | os.PathLike, votes_path: str | os.PathLike | None = None) -> VotesSummary:
    """Count the votes in ``RUNS/preferences.jsonl`` (or ``votes_path``): what a retrain would train on."""
    path = Path(votes_path) if votes_path else Path(runs_dir) / PREFERENCES_FILE
    rows = _read_jsonl(path)
    ties = len(_read_jsonl(ties_path(path)))
    usable = unusable = 0
    rated = {True: 0, False: 0}
    for row in [*rows, *_read_jsonl(unpaired_path(path))]:
        if isinstance(row, dict) and row.get("tie") is True:
            ties += 1
            continue
        if isinstance(row, dict) and "completion" in row:  # a single-answer vote (TRL's unpaired row)
            label = row.get("label")
            if isinstance(label, bool) and _answer(row["completion"]) is not None:
                rated[label] += 1
            else:
                unusable += 1
            continue
        a = _answer(row.get("chosen")) if isinstance(row, dict) else None
        b = _answer(row.get("rejected")) if isinstance(row, dict) else None
        if a is None or b is None or a == b:
            unusable += 1
        else:
            usable += 1
    return VotesSummary(path, len(rows), usable, ties, unusable, rated[True], rated[False])


def summary_line(summary: VotesSummary) -> str:
    """:attr:`VotesSummary.text`."""
    return summary.text


def checkpoint_adapter(runs_dir: Path, checkpoint: str | os.PathLike | None) -> Path | None:
    """The policy adapter folder of a chat catalog id: ``base`` / None -> None; ``RUN/policy`` (a run's final
    adapter); ``RUN/step-NNNNNN`` (a step checkpoint). It must resolve inside ``runs_dir``."""
    if checkpoint is None or str(checkpoint) in ("", BASE):
        return None
    text = str(checkpoint)
    parts = Path(text).parts
    if len(parts) != 2 or ".." in parts or Path(text).is_absolute():
        raise LorarlError(f"checkpoint {text!r}: give base, RUN/policy or RUN/step-NNNNNN (the chat's checkpoint ids)")
    run, what = parts
    folder = runs_dir / run / "policy" if what == "policy" else runs_dir / run / CHECKPOINTS / what / "policy"
    if what != "policy" and not STEP_RE.match(what):
        raise LorarlError(f"checkpoint {text!r}: give base, RUN/policy or RUN/step-NNNNNN")
    if not is_adapter(folder):
        raise LorarlError(f"checkpoint {text}: no policy adapter at {folder}")
    if not is_inside(folder, runs_dir):
        raise LorarlError(f"checkpoint {text}: resolves outside {runs_dir}; refused")
    return folder


def _run_model(adapter: Path) -> str | None:
    """``model.name`` of the run an adapter belongs to (its recipe.yaml, searched upwards to the run folder)."""
    for folder in (adapter.parent, adapter.parent.parent.parent):
        try:
            data = yaml_load((folder / "recipe.yaml").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        name = (data or {}).get("model", {}).get("name") if isinstance(data, dict) else None
        if name:
            return str(name)
    return None


def _recipe_file(kind: str, recipe_dirs: list[Path] | None) -> Path:
    dirs = [Path(d) for d in recipe_dirs] if recipe_dirs is not None else [shipped_recipes_dir()]
    name = f"{RECIPES[kind]}.yaml"
    for d in dirs:
        if (d / name).is_file():
            return d / name
    raise LorarlError(f"no {name} in the recipe folders ({', '.join(str(d) for d in dirs)})")


def retrain_overrides(
    kind: Kind,
    votes_path: str | os.PathLike,
    start_checkpoint: str | os.PathLike | None,
    *,
    runs_dir: str | os.PathLike,
    recipe_dirs: list[Path] | None = None,
    base_model: str | None = None,
) -> tuple[Path, list[str]]:
    """``(recipe, overrides)`` of a DPO or reward-model run on the votes (see the module docstring).
    ``start_checkpoint``: a chat catalog id (``base``, ``RUN/policy``, ``RUN/step-NNNNNN``); DPO starts its policy
    from it, a reward model trains a fresh reward adapter on the same base (nothing of the policy carries over). ``base_model``: the chat's base, used when the checkpoint is
    ``base``. Refused (one line): an unknown kind, no usable pair, a checkpoint outside the runs folder."""
    if kind not in KINDS:
        raise LorarlError(f"retrain kind must be one of {', '.join(KINDS)}, got {kind!r}")
    runs_dir = Path(runs_dir)
    votes = Path(votes_path).resolve()
    summary = votes_summary(runs_dir, votes)
    usable = summary.kto_rows if kind == "kto" else summary.usable
    if kind == "kto" and usable < 2:
        raise LorarlError(
            f"nothing to train on: KTO needs 2 rows or more (a 👍 and a 👎 under answers, or one pairwise vote): "
            f"{summary.text}"
        )
    if usable == 0:
        raise LorarlError(f"nothing to train on: {summary.text}")
    recipe_path = _recipe_file(kind, recipe_dirs)
    recipe = load_recipe(recipe_path)
    section = getattr(recipe, kind)
    batch = min(section.batch_size, usable)
    steps = max(1, math.ceil(usable * section.epochs / batch))
    overrides = [
        f"data.source={json.dumps(str(votes))}",
        "data.eval_source=null",
        f"{kind}.batch_size={batch}",
        f"train.steps={steps}",
        f"train.warmup_steps={min(recipe.train.warmup_steps, steps - 1)}",
    ]
    mb = recipe.train.micro_batch_size
    if isinstance(mb, int) and mb > batch:
        overrides.append(f"train.micro_batch_size={batch}")
    if kind == "reward_model":
        overrides.append("eval.every=0")  # no held-out pairs to score
    adapter = checkpoint_adapter(runs_dir, start_checkpoint)
    model = _run_model(adapter) if adapter is not None else base_model
    if model:
        overrides.append(f"model.name={json.dumps(model)}")
    if adapter is not None and kind in POLICY_KINDS:
        overrides.append(f"model.init_adapter={json.dumps(str(adapter.resolve()))}")
    return recipe_path, overrides


def launch_retrain(
    runner,
    kind: Kind,
    start_checkpoint: str | None,
    *,
    base_model: str | None = None,
    run_name: str | None = None,
    extra_overrides: list[str] | tuple[str, ...] = (),
    launch=None,
) -> Path:
    """Launch the retrain on ``RUNS/preferences.jsonl`` with ``runner`` (:class:`lorarl.app.jobs.JobRunner`, its
    recipe folders); the run is named ``KIND-votes-YYYYMMDD-HHMMSS`` unless ``run_name`` is given. ``launch(recipe,
    name, overrides)`` starts it (default ``runner.launch``; the workbench passes its memory-guarded launch)."""
    name = run_name or f"{kind.replace('_', '-')}-votes-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    check_run_name(name)
    run_dir = Path(runner.runs_dir) / name
    if not is_unstarted(run_dir):
        raise LorarlError(f"run {name} already exists in {runner.runs_dir}; pick another name or resume it")
    args = dict(runs_dir=runner.runs_dir, recipe_dirs=runner.recipe_dirs, base_model=base_model)
    votes = Path(runner.runs_dir) / PREFERENCES_FILE
    retrain_overrides(kind, votes, start_checkpoint, **args)  # its refusals before anything is written
    created = not run_dir.exists()
    try:
        snapshot = snapshot_votes(votes, run_dir, unpaired=kind == "kto")
        recipe, overrides = retrain_overrides(kind, snapshot, start_checkpoint, **args)
        return (launch or runner.launch)(recipe, name, overrides + list(extra_overrides))
    except BaseException:
        if created and all(p.name in (VOTES_FILE, VOTES_TIES_FILE) for p in run_dir.iterdir()):
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused launch leaves no folder behind
        raise


def snapshot_votes(votes: Path, run_dir: Path, unpaired: bool = False) -> Path:
    """Copy the votes file (and its ties file) into ``RUN/votes.jsonl`` (``RUN/votes_ties.jsonl``), each written
    atomically, and return the copy: the run trains on the votes as they were at launch, so a vote cast later
    changes neither a resume (bit-identical) nor what the run's recipe says it trained on. ``unpaired`` (KTO): the
    single-answer votes beside the votes file are appended to the copy, one file holding every row."""
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = unpaired_path(votes) if unpaired else None
    for src, name in ((votes, VOTES_FILE), (ties_path(votes), VOTES_TIES_FILE)):
        dst = run_dir / name
        parts = [p for p in (src, extra if name == VOTES_FILE else None) if p is not None and p.is_file()]
        if not parts:
            dst.unlink(missing_ok=True)
            continue
        data = [part.read_bytes() for part in parts]
        write_atomic(dst, b"".join(d if not d or d.endswith(b"\n") else d + b"\n" for d in data))
    return run_dir / VOTES_FILE
