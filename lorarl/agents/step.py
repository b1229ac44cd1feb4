"""The rollout an RL step uses, chosen once at set-up: single-turn (:func:`lorarl.rollout.generate_rollout`) or
multi-turn with tools (:func:`lorarl.agents.loop.agent_rollout`) when the recipe has an ``agent`` section. GRPO and
PPO call the chosen function and read the loss mask from the rollout (``Rollout.loss_mask``), so their steps are
the same for both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorarl.rewards.source import EnvironmentReward, environment_reward
from lorarl.rollout import Rollout, generate_rollout


@dataclass
class StepRollout:
    """A step's rollout, the agent's metrics (empty single-turn) and the environment's rewards (``[N]`` or None);
    ``environments``: the rows' environment instances, open until :meth:`score` (None without an environment)."""

    rollout: Rollout
    metrics: dict = field(default_factory=dict)
    env_rewards: Tensor | None = None
    environments: list | None = None
    release: Callable[[], None] = lambda: None
    env_reward: EnvironmentReward | None = None  # the environment's get_reward() held to the reward failure rules

    def score(self, source, prompts, step: int | None = None):
        """The rollout scored by ``source`` (a :class:`~lorarl.rewards.source.RewardSource`) with the environment
        instances handed to the reward functions (TRL's ``environments``), then released; the total includes the
        environment's ``get_reward()`` (:meth:`total_reward`). ``step``: the training step (None: evaluation)."""
        try:
            scored = source.score_rollout(
                prompts, self.rollout, step=step, environments=self.environments, environment=self.env_reward
            )
        finally:
            self.release()
        scored.total = self.total_reward(scored.total)
        return scored

    def total_reward(self, total: Tensor) -> Tensor:
        """``total`` ``[N]`` (the reward functions / reward model) plus the environment's ``get_reward()`` with
        weight 1, as TRL adds it; where one of the two is NaN the other stands alone."""
        if self.env_rewards is None or torch.isnan(self.env_rewards).all():
            return total
        env = self.env_rewards.to(total.dtype)
        both = torch.nan_to_num(total, nan=0.0) + torch.nan_to_num(env, nan=0.0)
        return torch.where(torch.isnan(total) & torch.isnan(env), total, both)


RolloutFn = Callable[..., StepRollout]


def make_step_rollout(recipe, shared, prompts, batch_size: int | None = None) -> RolloutFn:
    """``fn(prompt_index, *, group_size, role, record_old, reference, record_sampler) -> StepRollout`` for the
    recipe: multi-turn when ``recipe.agent`` is set (its tools and template checked now), else single-turn.
    ``batch_size``: rows decoded and scored at once unless a call passes its own (None: all of a call's rows;
    training passes ``generation.batch_size`` resolved, :func:`lorarl.algos.base.rollout_batch`)."""
    gen = recipe.generation
    if recipe.agent is None:

        def single_turn(prompt_index: list[int], **kw) -> StepRollout:
            ids = [prompts.token_ids[i] for i in prompt_index]
            kw.setdefault("batch_size", batch_size)
            return StepRollout(generate_rollout(shared, ids, gen, prompt_index=prompt_index, **kw))

        return single_turn

    from lorarl.agents.loop import agent_rollout
    from lorarl.agents.setup import build_agent, check_reward_source

    agent = build_agent(
        recipe.agent, shared.tokenizer, shared.eos_ids, recipe.source_path, system_prompt=recipe.data.system_prompt
    )
    check_reward_source(recipe.reward, recipe.agent, agent.resolved)

    def multi_turn(prompt_index: list[int], **kw) -> StepRollout:
        rows = [prompts.rows[i] for i in prompt_index]
        kw.setdefault("batch_size", batch_size)
        out = agent_rollout(shared, agent, rows, gen, prompt_index=prompt_index, keep_environments=True, **kw)
        env_cls, metrics = agent.resolved.environment, out.stats.metrics()
        env = out.env_rewards if env_cls is not None else None
        if env is not None and not torch.isnan(env).all():  # TRL logs the environment's reward under its class name
            metrics[f"rewards/{env_cls.__name__}/mean"] = float(env.nanmean())
        has_reward = env is not None and callable(getattr(env_cls, "get_reward", None))
        env_reward = environment_reward(env_cls.__name__, env, out.env_errors) if has_reward else None
        return StepRollout(out.rollout, metrics, env, out.environments, out.release, env_reward)

    multi_turn.agent = agent  # type: ignore[attr-defined]  (tests and eval read the resolved agent)
    return multi_turn
