"""The fidelity gate of a run with an ``agent`` section: each model runs what the run trained -- the run's prompt
format (its system prompt and the tools' schemas, rendered by :class:`lorarl.agents.render.ChatRenderer`), its tools
and its turn loop (:func:`lorarl.agents.loop.agent_rollout`, greedy) -- not the bare prompt.

Both sides go through the same loop with the same tools; only the model that decodes each turn differs: a gate
runtime (:mod:`.runtimes`: the training model, a merged / adapter export in transformers, a GGUF in llama.cpp) is
the loop's engine through :class:`RuntimeEngine`, which decodes each turn with the runtime's own ``greedy``. What
the gate then compares per prompt: the whole trajectory after the rendered prompt (every turn and tool message; its
text with special tokens dropped, and its ids), the final answer's accuracy (the text ``lorarl eval`` scores: the
last turn), and the log-probs of the training model's trajectory teacher-forced in both models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from lorarl.config import Recipe


class RuntimeEngine:
    """A gate runtime as the turn loop's decode engine (:class:`lorarl.rollout.engines.Engine`): greedy only, one
    completion per prompt and group row, each up to its first EOS (the loop cuts there too), right padded with
    ``pad_id``."""

    name = "gate runtime"

    def __init__(self, runtime: Any, pad_id: int):
        self.runtime, self.pad_id = runtime, pad_id

    def sample(
        self, shared, prompts, group_size, generation, *, greedy=False, max_new_tokens=None, record_logprobs=False, **_
    ):
        from lorarl.rollout.engines import Sampled

        if not greedy or record_logprobs:
            raise ValueError("the gate decodes greedily and records no sampler log-probs")
        rows = [p for p in prompts for _ in range(group_size)]
        out = self.runtime.greedy(rows, max_new_tokens or generation.max_new_tokens)
        ids = torch.full((len(out), max(max(map(len, out), default=1), 1)), self.pad_id, dtype=torch.long)
        for i, c in enumerate(out):
            ids[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
        return Sampled(ids)


@dataclass
class LoopBase:
    """What the turn loop reads of a :class:`~lorarl.model.SharedBase` when a gate runtime decodes: the training
    tokenizer and its EOS / pad ids; ``role`` changes nothing (the runtime holds its one model)."""

    tokenizer: Any
    eos_ids: list[int]
    pad_id: int

    def role(self, name: str, train: bool = False):
        return contextlib.nullcontext()


@dataclass
class AgentTurns:
    """The greedy turn loop of ``recipe.agent`` on dataset ``rows``, run by any gate runtime (:meth:`run`)."""

    recipe: Recipe
    rows: list[dict]
    base: LoopBase
    max_new_tokens: int

    def __post_init__(self) -> None:
        from lorarl.agents.setup import build_agent

        a = self.recipe
        self.agent = build_agent(
            a.agent, self.base.tokenizer, self.base.eos_ids, a.source_path, system_prompt=a.data.system_prompt
        )

    @property
    def max_total_tokens(self) -> int:
        """A trajectory's budget (model and tool tokens): the context a runtime needs beyond the prompt."""
        return self.agent.cfg.max_total_tokens

    def run(self, runtime: Any) -> tuple[list[list[int]], list[list[int]], list[str], dict[str, float]]:
        """``(prompt ids, trajectory ids, final answers, agent metrics)`` of the loop with ``runtime`` decoding."""
        from lorarl.agents.loop import agent_rollout

        out = agent_rollout(
            self.base,
            self.agent,
            self.rows,
            self.recipe.generation,
            greedy=True,
            engine=RuntimeEngine(runtime, self.base.pad_id),
            max_new_tokens=self.max_new_tokens,
        )
        r = out.rollout
        prompts = [p[m].tolist() for p, m in zip(r.prompt_ids, r.prompt_mask)]
        trajectories = [c[m].tolist() for c, m in zip(r.completion_ids, r.completion_mask)]
        return prompts, trajectories, list(r.completions), out.stats.metrics()
