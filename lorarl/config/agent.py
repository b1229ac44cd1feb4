"""The recipe's ``agent`` section: tools, an environment, and the budgets of a multi-turn rollout
(:mod:`lorarl.agents`). Present only in recipes that train or evaluate with tools; absent, rollouts are single-turn.

Names are checked here for their shape only; :func:`lorarl.agents.resolve_agent` imports every tool and the
environment class before the model loads (``lorarl train`` calls it right after reading the recipe), so a missing
tool, function or class is one line naming it, exit code 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lorarl.config.common import check

ToolFormatName = Literal["auto", "hermes", "llama3_json", "system_prompt"]


@dataclass
class AgentConfig:
    """Multi-turn tool use (``docs/agents.md``)."""

    tools: list[str] = field(default_factory=list)  # built-ins calculator / python, module:fn, path/file.py:fn
    environment: str | None = None  # a TRL environment_factory class: module:Class or path/to/file.py:Class
    format: ToolFormatName = "auto"  # tool-call format; auto: from the chat template (system_prompt when it has none)
    max_turns: int = 4  # model turns per trajectory (tool results are appended between them)
    max_tokens_per_turn: int | None = None  # sampled tokens per model turn; default generation.max_new_tokens
    max_total_tokens: int = 512  # all trajectory tokens after the prompt (model and tool tokens); past it: truncated
    tool_timeout_s: float = 10.0  # wall-clock limit of one tool call; a call past it is an error told to the model
    max_tool_output_chars: int = 2000  # a longer tool result is cut to this many characters (and says so)
    reuse_kv: bool = True  # turns 2+ prefill only the new tokens (the rows' keys / values kept between turns)
    # rows whose tool calls run at once, in threads (each row's calls in order): for thread-safe tools that wait on a
    # process or the network; 1 (default): one call at a time in the main thread, where a time limit stops it
    tool_workers: int = 1

    def validate(self, where: str) -> None:
        check(bool(self.tools) or bool(self.environment), where, "agent", "needs agent.tools or agent.environment")
        for i, spec in enumerate(self.tools):
            check(bool(str(spec).strip()), where, f"agent.tools[{i}]", "must not be empty")
        if self.environment is not None:
            check(":" in self.environment, where, "agent.environment", "must be module:Class or path/to/file.py:Class")
        check(self.max_turns >= 1, where, "agent.max_turns", "must be >= 1")
        check(
            self.max_tokens_per_turn is None or self.max_tokens_per_turn >= 1,
            where,
            "agent.max_tokens_per_turn",
            "must be >= 1",
        )
        check(self.max_total_tokens >= 1, where, "agent.max_total_tokens", "must be >= 1")
        check(self.tool_timeout_s > 0, where, "agent.tool_timeout_s", "must be > 0")
        check(self.max_tool_output_chars >= 16, where, "agent.max_tool_output_chars", "must be >= 16")
        check(self.tool_workers >= 1, where, "agent.tool_workers", "must be >= 1")
