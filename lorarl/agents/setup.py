"""The recipe's ``agent`` section resolved once at set-up: tools, the environment class, the format, the renderer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorarl.agents.environment import load_environment, tool_method_names
from lorarl.agents.formats import ToolFormat, make_format
from lorarl.agents.render import ChatRenderer
from lorarl.agents.tools import Tool, load_tools, tool_schema
from lorarl.config.agent import AgentConfig
from lorarl.errors import LorarlError


@dataclass
class ResolvedAgent:
    """What ``agent.tools`` / ``agent.environment`` name, imported and checked (no model needed)."""

    tools: list[Tool]
    environment: type | None
    env_schemas: list[dict]


def resolve_agent(cfg: AgentConfig, recipe_path: str | Path | None = None) -> ResolvedAgent:
    """Import every tool and the environment class; a missing one is one :class:`LorarlError` line naming it.
    ``lorarl train`` calls this right after reading the recipe, before the model loads."""
    tools = load_tools(cfg.tools, recipe_path)
    env_cls, env_schemas = None, []
    if cfg.environment:
        env_cls = load_environment(cfg.environment, recipe_path)
        probe = env_cls()
        env_schemas = [tool_schema(getattr(probe, n), f"agent.environment: {n}") for n in tool_method_names(env_cls)]
        clash = {t.name for t in tools} & {s["function"]["name"] for s in env_schemas}
        if clash:
            raise LorarlError(
                f"agent: tool {sorted(clash)[0]!r} is both in agent.tools and a method of the environment"
            )
    return ResolvedAgent(tools, env_cls, env_schemas)


def check_reward_source(reward, agent_cfg: AgentConfig, resolved: ResolvedAgent) -> None:
    """A recipe whose only reward is the environment's (``reward.functions: []``, TRL's ``reward_funcs`` left out):
    the environment must define ``get_reward``; else one :class:`LorarlError` line."""
    if reward.source == "rules" and not reward.functions:
        if resolved.environment is None or not callable(getattr(resolved.environment, "get_reward", None)):
            raise LorarlError(
                f"reward.functions is empty and agent.environment {agent_cfg.environment!r} has no get_reward "
                "method: name a reward function, or let the environment score the rollout with get_reward()"
            )


@dataclass
class Agent:
    """Everything a multi-turn rollout needs besides the model: the settings, the tools and environment, the
    format and the renderer (whose template passed the prefix check)."""

    cfg: AgentConfig
    resolved: ResolvedAgent
    fmt: ToolFormat
    renderer: ChatRenderer
    system_prompt: str | None = None

    @property
    def schemas(self) -> list[dict]:
        """The JSON schemas of every tool a rollout may call (standalone tools, then the environment's)."""
        return [t.schema for t in self.resolved.tools] + self.resolved.env_schemas


def build_agent(
    cfg: AgentConfig, tokenizer, eos_ids: list[int], recipe_path=None, system_prompt: str | None = None
) -> Agent:
    """Resolve ``cfg``, pick the format (``agent.format``, ``auto`` from the chat template) and check the template's
    prefix property (refused with one line when broken)."""
    resolved = resolve_agent(cfg, recipe_path)
    fmt = make_format(cfg.format, getattr(tokenizer, "chat_template", None))
    agent = Agent(cfg, resolved, fmt, ChatRenderer(tokenizer, fmt, [], eos_ids), system_prompt)
    agent.renderer.schemas = agent.schemas
    agent.renderer.check_prefix_property()
    return agent
