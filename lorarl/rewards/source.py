"""Where an RL step's scores come from: rule / Python reward functions, the frozen reward adapter on the shared base,
or both (``total = model_weight * RM score + the weighted rule rewards``). GRPO, PPO, evaluation and rejection
sampling score rollouts through :class:`RewardSource`, so a reward model scores the same way everywhere.

The reward adapter (``recipes/reward_model.yaml`` trains it) is loaded frozen, with its fp32 score head, as the
``reward`` role of the one base: no second model in memory. Its score is read at the last token of each response
(the EOS that ended it, found from the attention mask), where the reward model was trained to read it.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from lorarl.errors import LorarlError
from lorarl.model import HEAD_FILE, SharedBase
from lorarl.model.tokens import end_finished_with
from lorarl.phases import phase
from lorarl.rewards.call_args import LOG_METRIC_PREFIX, add_logged, new_trainer_state, pool_sums, set_steps_done
from lorarl.rewards.concurrent import unwrap_partial
from lorarl.rewards.failures import FailureStreaks
from lorarl.rewards.registry import RewardContext
from lorarl.rewards.scorer import RewardScorer, RewardScores
from lorarl.runs import find_adapter, resolve_path

REWARD = "reward"
SOURCES = ("rules", "reward_model", "both")


def resolve_reward_adapter(path: str | os.PathLike, recipe_path: str | os.PathLike | None = None) -> Path:
    """A reward-model run directory, a step checkpoint or the adapter folder itself -> the adapter folder (holding
    ``adapter_config.json`` and the score head ``head.safetensors``), by :mod:`lorarl.runs`' search order."""
    try:
        p = resolve_path(path, recipe_path, "reward adapter")
    except LorarlError:
        raise LorarlError(
            f"reward adapter {path}: no such folder (train one with `lorarl train recipes/reward_model.yaml`)"
        ) from None
    folder = find_adapter(p, REWARD, what="reward adapter")
    if not (folder / HEAD_FILE).is_file():
        raise LorarlError(f"reward adapter {folder}: no {HEAD_FILE} (the score head); is it a reward-model adapter?")
    return folder


def add_reward_role(shared: SharedBase, adapter: str | os.PathLike, recipe_path=None) -> Path:
    """Load the trained reward adapter + score head as the frozen ``reward`` role (once)."""
    folder = resolve_reward_adapter(adapter, recipe_path)
    if not shared.has_adapter(REWARD):
        shared.add_adapter(REWARD, init_from=folder, trainable=False, head=True)
    return folder


@torch.no_grad()
def reward_model_scores(shared: SharedBase, ids: Tensor, att: Tensor, batch_size: int) -> Tensor:
    """The reward role's score of each sequence (dropout off, read at the last non-pad token) -> ``[N]`` fp32 CPU."""
    out = []
    with shared.role(REWARD, train=False):
        for s in range(0, ids.shape[0], batch_size):
            rows_ids, rows_att = ids[s : s + batch_size].to(shared.device), att[s : s + batch_size].to(shared.device)
            out.append(shared.scores(rows_ids, rows_att, head=REWARD).float().cpu())
    return torch.cat(out)


@dataclass
class EnvironmentReward:
    """An environment's ``get_reward()`` over a rollout's ``n`` rows, held to the same failure rules as a reward
    function under its class name ``name`` (TRL's name for it): ``usable`` rows had a finite value, ``failed`` rows
    failed (``get_reward`` or ``reset`` raised, or a value not a finite float32), ``error`` the first failure."""

    name: str
    n: int
    usable: int
    failed: int
    error: str | None


def environment_reward(name: str, values: Tensor, errors: list[str | None]) -> EnvironmentReward:
    """``values`` ``[N]`` (NaN where none) and each row's error (None: none) -> :class:`EnvironmentReward`."""
    failed = [e for e in errors if e]
    return EnvironmentReward(name, len(errors), int((~torch.isnan(values)).sum()), len(failed), (failed or [None])[0])


@dataclass
class SourceScores:
    """Scores of ``N`` responses.

    total: ``[N]`` the score an RL step uses; NaN where the rule functions (when there are any) have no value for
        the row (every one None or failed), with ``both`` too: GRPO and online DPO leave such a row out of its
        group, PPO out of its update, each counting failures against ``reward.max_failure_fraction``.
    reward_model: ``[N]`` the reward adapter's scores, or None.
    rules: the rule rewards (per function, weighted total, failures), or None.
    environment: an environment's ``get_reward()`` (:class:`EnvironmentReward`), or None.
    """

    total: Tensor
    reward_model: Tensor | None
    rules: RewardScores | None
    environment: EnvironmentReward | None = None

    def means(self) -> dict[str, float]:
        """``rewards/<function>/mean``, the functions' own per-batch metrics (``rewards/judge/failed_rows``, ...) and
        ``rm_score`` (what the loops log beside the total)."""
        out = {f"rewards/{k}/mean": v for k, v in (self.rules.means() if self.rules else {}).items()}
        out.update(self.rules.extra if self.rules else {})
        if self.reward_model is not None:
            out["rm_score"] = float(self.reward_model.mean())
        return out

    @property
    def columns(self) -> dict[str, list]:
        """What the reward functions logged with ``log_extra``: ``{column: N values}``."""
        return self.rules.columns if self.rules else {}


class RewardSource:
    """Scores rollouts from ``source`` (``rules`` | ``reward_model`` | ``both``)."""

    def __init__(
        self,
        shared: SharedBase,
        source: str,
        rules: list,
        *,
        adapter: str | None = None,
        model_weight: float = 1.0,
        timeout_s: float | None = None,
        recipe_path: str | None = None,
        batch_size: int = 32,
        key: str = "reward.source",
        adapter_key: str = "reward.adapter",
        max_failed_steps: int = 2,
        trainer_state=None,
        environments: bool = False,
    ):
        if source not in SOURCES:
            raise LorarlError(f"{key} must be one of {', '.join(SOURCES)}, got {source!r}")
        self.shared, self.source, self.batch_size = shared, source, batch_size
        # (no rule function with source rules: an environment's get_reward scores alone, lorarl.agents.step)
        self.uses_rm, self.uses_rules = source in ("reward_model", "both"), source in ("rules", "both") and bool(rules)
        self.model_weight = model_weight if source == "both" else 1.0
        self.adapter: Path | None = None
        if self.uses_rm:
            if not adapter:
                raise LorarlError(
                    f"{key} is {source!r} but {adapter_key} is not set: train a reward model first (`lorarl train "
                    f"recipes/reward_model.yaml --out runs/reward_model`) and point {adapter_key} at its run directory"
                )
            self.adapter = add_reward_role(shared, adapter, recipe_path)
        context = RewardContext(shared=shared, recipe_path=recipe_path)
        self.rules = RewardScorer(rules, timeout_s=timeout_s, context=context) if self.uses_rules else None
        # what the functions get as trainer_state (one object for the run, as TRL's): set per step
        self.trainer_state = trainer_state if trainer_state is not None else new_trainer_state()
        if self.rules is not None:
            self.rules.trainer_state = self.trainer_state
            if not environments:
                refuse_environment_rewards(self.rules)
        self.streaks = FailureStreaks(max_failed_steps)
        self._moved: set[str] = set()  # logged metric names already said to be moved (one notice each)
        self._rows: int | None = None  # the training prompts (trainer_state's epochs)
        self._logged: dict[str, tuple[float, int]] = {}  # log_metric (sum, count) of the step's calls so far

    def score_rollout(
        self,
        prompts,
        rollout,
        step: int | None = None,
        environments: list | None = None,
        environment: EnvironmentReward | None = None,
    ) -> SourceScores:
        """Score a rollout whose rows answer rows ``rollout.prompt_index`` of ``prompts`` (a PromptSet); ``step``:
        the training step it belongs to (sets ``trainer_state``: ``step - 1`` steps done; None, as in an evaluation,
        leaves it as it is); ``environments``: the rollout's environment instances, one per row; ``environment``:
        their ``get_reward()``, carried for :meth:`report_failures` (the caller adds it to the total)."""
        if step is not None:  # a training step's call
            self._rows = len(prompts)
            set_steps_done(self.trainer_state, step - 1, self._rows)
        rm = None
        total = torch.zeros(len(rollout)) if self.uses_rm else torch.full((len(rollout),), float("nan"))
        if self.uses_rm:
            # one EOS rule: a finished response is scored at the end-of-turn id the reward model was trained on,
            # whichever EOS id ended it
            ended = end_finished_with(
                rollout.completion_ids, rollout.completion_mask, rollout.truncated, self.shared.end_of_turn_id
            )
            ids = torch.cat([rollout.prompt_ids, ended], dim=1)
            with phase("scoring"):
                rm = reward_model_scores(self.shared, ids, rollout.attention_mask, self.batch_size)
            total = total + self.model_weight * rm
        rules = None
        if self.uses_rules:
            with phase("rewards"):
                rules = self.rules.score_rollout(prompts, rollout, environments=environments)
            if step is not None:  # log_metric values: averaged over every call of the step (with_logged)
                self._logged = pool_sums(self._logged, rules.logged)
            # NaN where the rule functions have no value for a row (they failed, or returned None), with a reward
            # model too: its score alone is not the recipe's total, so the row is left out as with rules alone
            total = rules.total if rm is None else total + rules.total
        return SourceScores(total=total, reward_model=rm, rules=rules, environment=environment)

    def report_failures(self, scored: SourceScores, step: int, max_fraction: float, treated: str) -> None:
        """A training scoring call of step ``step``: one line per reward function that failed in ``scored`` (``step
        N: reward NAME failed (ERROR); TREATED``, ``treated`` saying what the loop does with its values), the call
        recorded for :meth:`end_step`, then the run's failure budget: raises LorarlError past ``max_fraction``
        (``reward.max_failure_fraction``) of one function's calls or values (:mod:`lorarl.rewards.failures`)."""
        rules, env = scored.rules, scored.environment
        usable = dict(zip(rules.names, rules.usable())) if rules else {}
        failures = dict(rules.failures) if rules else {}
        if env is not None:  # an environment's get_reward(): the same rules, under its class name
            usable[env.name] = env.usable
            if env.failed:
                failures[env.name] = f"{env.failed} of {env.n} values failed ({env.error})"
        for name, err in failures.items():
            tqdm.write(f"step {step}: reward {name} failed ({err}); {treated}")
        self.streaks.record(usable, failures)
        if rules is not None:
            self.rules.check_failure_budget(max_fraction, rules.failures)

    def end_step(self, step: int) -> None:
        """After step ``step``'s scoring, before it trains: raises LorarlError when a function had no usable value in
        ``reward.max_failed_steps`` steps in a row (:class:`~lorarl.rewards.failures.FailureStreaks`). From here
        ``trainer_state`` counts step ``step`` as done (what a held-out evaluation after it sees, as TRL's)."""
        self.streaks.end_step(step)
        set_steps_done(self.trainer_state, step, self._rows)

    def check_finished(self) -> None:
        """At the end of a run: raises LorarlError when a function failed on every step of the run."""
        self.streaks.check_finished()

    def with_logged(self, row: dict) -> dict:
        """``row`` (a step's metrics) with the mean of each metric the functions logged with ``log_metric`` in the
        step's scoring calls (since the last ``with_logged``) under its name, or ``log_metric/<name>`` where lorarl
        logs that name itself (one notice per name)."""
        logged, self._logged = self._logged, {}
        moved = add_logged(row, {k: s / c for k, (s, c) in logged.items() if c}, LOG_METRIC_PREFIX)
        for name in set(moved) - self._moved:
            self._moved.add(name)
            tqdm.write(
                f"log_metric({name!r}): lorarl logs {name} itself; this value is logged as {LOG_METRIC_PREFIX}{name}"
            )
        return row

    @property
    def calls(self) -> int:
        return self.rules.calls if self.rules else 0

    @property
    def failures(self) -> int:
        return self.rules.failures if self.rules else 0

    @property
    def failed_values(self) -> int:
        return sum(self.rules.failed_values) if self.rules else 0

    def state_dict(self) -> dict:
        counts = self.rules.state_dict() if self.rules else {"calls": 0, "failures": 0}
        return {**counts, "streaks": self.streaks.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.rules is not None:
            self.rules.load_state_dict(state)
        self.streaks.load_state_dict(state.get("streaks"))

    def log_to(self, run_dir: str | os.PathLike) -> None:
        """Reward functions that log samples (an LLM judge's prompts and answers) write them under ``run_dir``."""
        for fn in self.rules.fns if self.rules else []:
            fn = unwrap_partial(fn)
            if hasattr(fn, "log_to"):
                fn.log_to(Path(run_dir))


def refuse_environment_rewards(scorer: RewardScorer) -> None:
    """A reward function that needs ``environments`` (no default) in a recipe without an environment: one line, at
    set-up (TRL passes ``environments`` only with ``environment_factory``)."""
    for i, (fn, name) in enumerate(zip(scorer.fns, scorer.names)):
        try:
            param = inspect.signature(fn).parameters.get("environments")
        except (TypeError, ValueError):
            continue
        if param is not None and param.default is inspect.Parameter.empty and param.kind != param.VAR_KEYWORD:
            raise LorarlError(
                f"reward.functions[{i}]: {name} takes environments (the rollout's environment instances, TRL's "
                "environment_factory) but the recipe has no agent.environment"
            )


def reward_source(recipe, shared: SharedBase, batch_size: int | None = None) -> RewardSource:
    """The recipe's ``reward`` section as a :class:`RewardSource` on ``shared`` (``batch_size``: rows per reward-model
    forward; default ``eval.batch_size``), its ``trainer_state`` sized for the run (``train.steps`` steps of
    ``train.prompts_per_step`` prompts)."""
    r, t = recipe.reward, recipe.train
    state = new_trainer_state(t.steps, t.prompts_per_step, t.log_every, t.save_every, recipe.eval.every)
    return RewardSource(
        shared,
        r.source,
        r.functions,
        adapter=r.adapter,
        model_weight=r.model_weight,
        timeout_s=r.timeout_s or None,
        recipe_path=recipe.source_path,
        batch_size=batch_size or recipe.eval.batch_size,
        max_failed_steps=r.max_failed_steps,
        trainer_state=state,
        environments=bool(recipe.agent is not None and recipe.agent.environment),
    )
