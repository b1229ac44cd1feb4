"""Where an RL step's scores come from: rule / Python reward functions, the frozen reward adapter on the shared base,
or both (``total = model_weight * RM score + the weighted rule rewards``). GRPO, PPO, evaluation and rejection
sampling score rollouts through :class:`RewardSource`, so a reward model scores the same way everywhere.

The reward adapter (``recipes/reward_model.yaml`` trains it) is loaded frozen, with its fp32 score head, as the
``reward`` role of the one base: no second model in memory. Its score is read at the last token of each response
(the EOS that ended it, found from the attention mask), where the reward model was trained to read it.
"""

from __future__ import annotations

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
from lorarl.rewards.concurrent import unwrap_partial
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
class SourceScores:
    """Scores of ``N`` responses.

    total: ``[N]`` the score an RL step uses; NaN where the rule functions (when there are any) have no value for
        the row (every one None or failed), with ``both`` too: GRPO and online DPO leave such a row out of its
        group, PPO out of its update, each counting failures against ``reward.max_failure_fraction``.
    reward_model: ``[N]`` the reward adapter's scores, or None.
    rules: the rule rewards (per function, weighted total, failures), or None.
    """

    total: Tensor
    reward_model: Tensor | None
    rules: RewardScores | None

    def means(self) -> dict[str, float]:
        """``rewards/<function>/mean``, the functions' own per-batch metrics (``rewards/judge/failed_rows``, ...) and
        ``rm_score`` (what the loops log beside the total)."""
        out = {f"rewards/{k}/mean": v for k, v in (self.rules.means() if self.rules else {}).items()}
        out.update(self.rules.extra if self.rules else {})
        if self.reward_model is not None:
            out["rm_score"] = float(self.reward_model.mean())
        return out


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

    def score_rollout(self, prompts, rollout) -> SourceScores:
        """Score a rollout whose rows answer rows ``rollout.prompt_index`` of ``prompts`` (a PromptSet)."""
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
                rules = self.rules.score_rollout(prompts, rollout)
            # NaN where the rule functions have no value for a row (they failed, or returned None), with a reward
            # model too: its score alone is not the recipe's total, so the row is left out as with rules alone
            total = rules.total if rm is None else total + rules.total
        return SourceScores(total=total, reward_model=rm, rules=rules)

    def report_failures(self, scored: SourceScores, step: int, max_fraction: float, treated: str) -> None:
        """One line per reward function that failed in ``scored`` (``step N: reward NAME failed (ERROR); TREATED``,
        ``treated`` saying what the loop does with its values), then the run's failure budget: raises LorarlError
        past ``max_fraction`` (``reward.max_failure_fraction``) of the calls or of one function's values."""
        if scored.rules is None:
            return
        for name, err in scored.rules.failures.items():
            tqdm.write(f"step {step}: reward {name} failed ({err}); {treated}")
        self.rules.check_failure_budget(max_fraction, scored.rules.failures)

    @property
    def calls(self) -> int:
        return self.rules.calls if self.rules else 0

    @property
    def failures(self) -> int:
        return self.rules.failures if self.rules else 0

    def state_dict(self) -> dict:
        return self.rules.state_dict() if self.rules else {"calls": 0, "failures": 0}

    def load_state_dict(self, state: dict) -> None:
        if self.rules is not None:
            self.rules.load_state_dict(state)

    def log_to(self, run_dir: str | os.PathLike) -> None:
        """Reward functions that log samples (an LLM judge's prompts and answers) write them under ``run_dir``."""
        for fn in self.rules.fns if self.rules else []:
            fn = unwrap_partial(fn)
            if hasattr(fn, "log_to"):
                fn.log_to(Path(run_dir))


def reward_source(recipe, shared: SharedBase, batch_size: int | None = None) -> RewardSource:
    """The recipe's ``reward`` section as a :class:`RewardSource` on ``shared`` (``batch_size``: rows per reward-model
    forward; default ``eval.batch_size``)."""
    r = recipe.reward
    return RewardSource(
        shared,
        r.source,
        r.functions,
        adapter=r.adapter,
        model_weight=r.model_weight,
        timeout_s=r.timeout_s or None,
        recipe_path=recipe.source_path,
        batch_size=batch_size or recipe.eval.batch_size,
    )
