"""Agents: tools, environments (TRL's ``environment_factory`` convention), tool-call formats and the multi-turn
rollout loop (``docs/agents.md``).

* :mod:`~lorarl.agents.builtins` -- the exact calculator and the sandboxed Python tool;
* :mod:`~lorarl.agents.tools` -- tools by name, JSON schemas (transformers' ``get_json_schema``), safe calls;
* :mod:`~lorarl.agents.environment` -- one environment instance per rollout, TRL's ``reset`` / ``get_reward``;
* :mod:`~lorarl.agents.formats` -- parsing and rendering calls per template family (hermes, llama3_json,
  system_prompt);
* :mod:`~lorarl.agents.render` -- prompts and tool messages as ids, the template's prefix-property check;
* :mod:`~lorarl.agents.setup` -- the recipe's ``agent`` section resolved once;
* :mod:`~lorarl.agents.loop` -- the turn loop through a decode engine, returning a :class:`~lorarl.rollout.Rollout`
  whose ``model_mask`` keeps the model's own tokens.
* :mod:`~lorarl.agents.step` -- the rollout function of an RL step / evaluation, single- or multi-turn, chosen once;
* :mod:`~lorarl.agents.traces` -- SFT tool-use traces (TRL's ``tool_calls`` / ``tool`` messages) as rollout ids.
"""

from lorarl.agents.setup import Agent, ResolvedAgent, build_agent, resolve_agent

__all__ = ["Agent", "ResolvedAgent", "build_agent", "resolve_agent"]
