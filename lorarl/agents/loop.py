"""The turn loop: every row of a step advances turn by turn in one batch through a decode engine, and comes back
as one :class:`~lorarl.rollout.Rollout` whose completion is the whole trajectory after the prompt.

Per step (``N = prompts x group_size`` trajectories, each with its own environment instance when there is one):

1. each trajectory's prompt: the row's messages (+ ``data.system_prompt``, + what the environment's ``reset``
   returned), rendered with the tools' schemas to ids (:class:`~lorarl.agents.render.ChatRenderer`);
2. turn 1: one engine call for all rows (``group_size`` samples per prompt: the engine prefills each prompt once
   and copies its keys / values to its ``G`` rows when the rows of a group share their prompt);
3. after each turn, per row: the sampled ids up to the first end-of-turn token are appended to the trajectory
   (model tokens: loss mask True); a turn that ended with tool calls gets their results rendered as the template's
   tool message ids and appended (loss mask False) -- the conversation is never re-tokenized; rows that finished
   (an answer without a call, ``agent.max_turns`` reached, a budget spent) wait;
4. turn ``k + 1``: one engine call for the rows still going, each continuing from its own ``prompt + trajectory``
   ids. With ``agent.reuse_kv`` (the default) the engine keeps every row's keys / values between the calls of the
   rollout and prefills only the ids appended since (the end-of-turn token and the tool message): each row's
   prompt, the group's shared prefix included, and its earlier turns go through the model once
   (:mod:`lorarl.rollout.prefix_kv`; both engines; not for sliding-window layers or length-dependent rotary
   scaling, :func:`~lorarl.rollout.prefix_kv.reuse_refusal`). Without it every turn prefills the whole context.

The whole loop runs inside one ``shared.role(role)``: every turn of a step is sampled by the same adapter, in eval
mode (no dropout), as the trainer will score it. Budgets: at most ``agent.max_tokens_per_turn`` sampled per turn
and ``agent.max_total_tokens`` in the trajectory (model and tool tokens); a trajectory that hits one, or that ends
on a call at ``max_turns``, is *truncated*.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorarl.agents.environment import EnvironmentSession
from lorarl.agents.setup import Agent
from lorarl.agents.tools import PendingCall, ToolResult, call_tools
from lorarl.config import GenerationConfig
from lorarl.model import SharedBase
from lorarl.model.tokens import pad_left
from lorarl.phases import phase
from lorarl.rollout.engines import Engine
from lorarl.rollout.generate import sequence_logprobs
from lorarl.rollout.prefix_kv import reuse_refusal
from lorarl.rollout.registry import make_engine
from lorarl.rollout.types import Rollout


@dataclass
class Trajectory:
    """One row's state: ``ids`` after the shared prompt, ``model`` (True where the model sampled the id),
    ``sampler`` (the log-prob each sampled id was drawn with, 0 elsewhere), and what happened."""

    context: list[int]  # the prompt ids the trajectory continues (the group's shared prefix + this row's rest)
    ids: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    sampler: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    last_text: str = ""


@dataclass
class AgentStats:
    """Counts of one rollout (sums over its trajectories)."""

    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    tool_tokens: int = 0
    truncated: int = 0
    reset_errors: int = 0
    prefilled_tokens: int = 0  # prompt / context tokens the engine ran through the model (all turns)
    reused_tokens: int = 0  # context tokens of turns 2+ taken from kept keys / values instead

    def metrics(self) -> dict[str, float]:
        """Per-step metrics (TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` where TRL has them)."""
        n = max(self.trajectories, 1)
        return {
            "agent/turns_mean": self.turns / n,
            "tools/call_frequency": self.tool_calls / n,
            "tools/failure_frequency": (self.tool_errors + self.malformed_calls) / max(self.tool_calls, 1),
            "agent/tool_calls": self.tool_calls,
            "agent/tool_errors": self.tool_errors,
            "agent/malformed_calls": self.malformed_calls,
            "agent/tool_tokens": self.tool_tokens,
            "agent/truncated_ratio": self.truncated / n,
            "agent/env_reset_errors": self.reset_errors,
            "agent/prefill_tokens": self.prefilled_tokens,
            "agent/kv_reused_tokens": self.reused_tokens,
        }


@dataclass
class AgentRollout:
    """The rollout, its counts, and the environment's reward per row (``[N]``, NaN where it gave none).
    ``sessions``: each row's environment session (None without an environment), still open when the rollout was
    asked to keep them (``keep_environments``): :meth:`release` closes them."""

    rollout: Rollout
    stats: AgentStats
    env_rewards: Tensor
    messages: list[list[dict]] = field(default_factory=list)
    sessions: list[EnvironmentSession | None] = field(default_factory=list)
    env_errors: list[str | None] = field(default_factory=list)  # why a row has no environment reward

    @property
    def environments(self) -> list | None:
        """The rows' environment instances in row order (TRL's ``environments``), or None without an environment."""
        if not any(s is not None for s in self.sessions):
            return None
        return [s.instance if s is not None else None for s in self.sessions]

    def release(self) -> None:
        """Close every row's environment (``close()`` when it has one); idempotent."""
        for s in self.sessions:
            if s is not None:
                s.release()


def _messages(row: dict, system_prompt: str | None) -> list[dict]:
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def _with_note(messages: list[dict], note: str) -> list[dict]:
    """``note`` appended to the last user message (where TRL puts ``reset``'s observation)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return messages[:i] + [{**messages[i], "content": messages[i]["content"] + note}] + messages[i + 1 :]
    return messages + [{"role": "user", "content": note}]


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _first_eos(ids: list[int], eos: set[int]) -> int | None:
    for i, t in enumerate(ids):
        if t in eos:
            return i
    return None


@dataclass
class TurnCalls:
    """What one row's turn asks of the tools: its calls in order, and why each malformed call failed to parse."""

    calls: list[PendingCall]
    malformed: list[str]


def _end_turn(
    agent: Agent, tr: Trajectory, sampled: list[int], lps: list[float], tools, eos, tok, per_turn: int
) -> TurnCalls | None:
    """Step 3 for one row, first half: append the turn's ids; return its tool calls (None when the trajectory
    ended: an answer without calls, a cut turn, ``max_turns`` reached)."""
    cfg = agent.cfg
    budget = min(per_turn, cfg.max_total_tokens - len(tr.ids))
    end = _first_eos(sampled, eos)
    ended = end is not None and end < budget
    keep = sampled[: end + 1] if ended else sampled[:budget]
    tr.ids += keep
    tr.model += [True] * len(keep)
    tr.sampler += lps[: len(keep)]
    tr.turns += 1
    text = tok.decode([t for t in keep if t not in eos], skip_special_tokens=False)
    tr.last_text = tok.decode(keep, skip_special_tokens=True)
    if not ended:
        tr.done = tr.truncated = True
        return None
    parsed = agent.fmt.parse(text)
    if not parsed.calls and not parsed.malformed:
        tr.done = True
        return None
    if tr.turns >= cfg.max_turns:  # calls left unanswered: the trajectory did not finish
        tr.done = tr.truncated = True
        return None
    return TurnCalls([PendingCall(tools, c.name, c.arguments) for c in parsed.calls], list(parsed.malformed))


def _append_results(agent: Agent, tr: Trajectory, turn: TurnCalls, results: list[ToolResult], stats) -> None:
    """Step 3, second half: the turn's tool results (then an error message per malformed call) rendered as the
    template's tool message ids and appended as context (or the trajectory ends when they do not fit)."""
    messages = []
    for res in results:
        stats.tool_calls += 1
        stats.tool_errors += res.error is not None
        messages.append((res.name, res.text))
    for why in turn.malformed:
        stats.tool_calls += 1
        stats.malformed_calls += 1
        messages.append(("error", '{"error": "malformed tool call: ' + why.replace('"', "'")[:300] + '"}'))
    suffix = agent.renderer.tool_suffix_ids(messages)
    if len(tr.ids) + len(suffix) >= agent.cfg.max_total_tokens:  # no room for the results and another turn
        tr.done = tr.truncated = True
        return
    tr.ids += suffix
    tr.model += [False] * len(suffix)
    tr.sampler += [0.0] * len(suffix)
    stats.tool_tokens += len(suffix)


def _start(agent: Agent, rows: list[dict], group_size: int):
    """Step 1: sessions, prompts (the group's common prefix as the rollout prompt, each row's rest as context)."""
    sessions, contexts, prefixes, tool_maps, messages = [], [], [], [], []
    for row in rows:
        group = []
        for _ in range(group_size):
            session = EnvironmentSession(agent.resolved.environment, row) if agent.resolved.environment else None
            msgs = _messages(row, agent.system_prompt)
            if session is not None and session.reset_error:
                msgs = _with_note(msgs, f"\n\n(environment error: {session.reset_error})")
            elif session is not None and session.observation:
                msgs = _with_note(msgs, session.observation)
            tools = {t.name: t for t in agent.resolved.tools + (session.tools if session else [])}
            group.append(agent.renderer.prompt_ids(msgs))
            sessions.append(session)
            tool_maps.append(tools)
            messages.append(msgs)
        p = _common_prefix(group)
        for ids in group:
            prefixes.append(ids[:p])
            contexts.append(ids)
    return sessions, contexts, prefixes, tool_maps, messages


@torch.no_grad()
def agent_rollout(
    shared: SharedBase,
    agent: Agent,
    rows: list[dict],
    generation: GenerationConfig,
    *,
    group_size: int = 1,
    role: str = "policy",
    greedy: bool = False,
    record_old: bool = False,
    reference: str | None = None,
    prompt_index: list[int] | None = None,
    record_sampler: bool = False,
    engine: Engine | None = None,
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    keep_environments: bool = False,
) -> AgentRollout:
    """Multi-turn trajectories for ``rows`` (dataset rows with a ``prompt``), ``group_size`` per row, sampled with
    ``role``; old / reference log-probs as :func:`lorarl.rollout.generate_rollout` records them (over the whole
    trajectory; the loss mask, ``Rollout.model_mask``, keeps the model's tokens). Tokens per turn:
    ``agent.max_tokens_per_turn``, else ``max_new_tokens`` (evaluation's), else ``generation.max_new_tokens``.
    ``keep_environments``: leave the rows' environment instances open for the reward functions (TRL's
    ``environments``); the caller then calls :meth:`AgentRollout.release`. Otherwise they are released here."""
    tok, eos = shared.tokenizer, set(shared.eos_ids)
    engine = engine or make_engine(generation.engine_for(shared.device.type))
    index = prompt_index if prompt_index is not None else list(range(len(rows)))
    sessions, contexts, prefixes, tool_maps, messages = _start(agent, rows, group_size)
    trajs = [Trajectory(context=c) for c in contexts]
    for tr, pre in zip(trajs, prefixes):  # the part of the prompt a row does not share with its group is context
        rest = tr.context[len(pre) :]
        tr.ids, tr.model, tr.sampler = list(rest), [False] * len(rest), [0.0] * len(rest)
    stats = AgentStats(trajectories=len(trajs), reset_errors=sum(bool(s and s.reset_error) for s in sessions))
    per_turn = agent.cfg.max_tokens_per_turn or max_new_tokens or generation.max_new_tokens
    reuse = agent.cfg.reuse_kv and hasattr(engine, "reusing_kv") and reuse_refusal(shared.decoder().config) is None
    with (
        phase("generation"),
        shared.role(role, train=False),
        engine.reusing_kv() if reuse else contextlib.nullcontext() as kv,
    ):
        first = True
        while True:
            live = [i for i, tr in enumerate(trajs) if not tr.done]
            if not live:
                break
            room = max(agent.cfg.max_total_tokens - len(trajs[i].ids) for i in live)
            kwargs = dict(greedy=greedy, max_new_tokens=max(1, min(per_turn, room)), record_logprobs=record_sampler)
            shared_prompts = (
                first and group_size > 1 and all(not any(trajs[i].model) and not trajs[i].ids for i in live)
            )
            if shared_prompts:  # turn 1, every row of a group has the same prompt: prefill each prompt once
                sampled = engine.sample(shared, prefixes[::group_size], group_size, generation, **kwargs)
            else:
                sampled = engine.sample(shared, [prefixes[i] + trajs[i].ids for i in live], 1, generation, **kwargs)
            first = False
            turns: dict[int, TurnCalls] = {}
            for j, i in enumerate(live):
                ids = sampled.completion_ids[j].tolist()
                lps = sampled.sampler_logprobs[j].tolist() if sampled.sampler_logprobs is not None else [0.0] * len(ids)
                turn = _end_turn(agent, trajs[i], ids, lps, tool_maps[i], eos, tok, per_turn)
                if turn is not None:
                    turns[i] = turn
            calling = list(turns)  # the rows' calls run concurrently, each row's in order (agent.tool_workers)
            cfg = agent.cfg
            results = call_tools(
                [turns[i].calls for i in calling], cfg.tool_timeout_s, cfg.max_tool_output_chars, cfg.tool_workers
            )
            for i, res in zip(calling, results):
                _append_results(agent, trajs[i], turns[i], res, stats)
        if kv is not None:
            stats.prefilled_tokens, stats.reused_tokens = kv.prefilled_tokens, kv.reused_tokens
    stats.turns = sum(tr.turns for tr in trajs)
    stats.truncated = sum(tr.truncated for tr in trajs)
    env_rewards = torch.tensor([s.reward() if s is not None else float("nan") for s in sessions])
    rollout = _as_rollout(shared, trajs, prefixes, index, group_size, record_sampler)
    out = AgentRollout(rollout, stats, env_rewards, messages, sessions)
    out.env_errors = [s.reward_error if s is not None else None for s in sessions]
    if not keep_environments:
        out.release()
    with phase("scoring"):
        if record_old:
            rollout.old_logprobs = sequence_logprobs(shared, role, rollout, generation.temperature, batch_size)
        if reference:
            rollout.ref_logprobs = sequence_logprobs(shared, reference, rollout, generation.temperature, batch_size)
    return out


def _as_rollout(shared, trajs: list[Trajectory], prefixes, index, group_size: int, record_sampler: bool) -> Rollout:
    """Trajectories -> a Rollout: prompts left padded, trajectories right padded, ``completion_mask`` on every
    trajectory token (attended), ``model_mask`` on the sampled ones."""
    prompt_ids, prompt_mask = pad_left(prefixes, shared.pad_id)
    N, T = len(trajs), max(max(len(tr.ids) for tr in trajs), 1)
    ids = torch.full((N, T), shared.pad_id, dtype=torch.long)
    mask = torch.zeros(N, T, dtype=torch.bool)
    model = torch.zeros(N, T, dtype=torch.bool)
    sampler = torch.zeros(N, T)
    for r, tr in enumerate(trajs):
        n = len(tr.ids)
        ids[r, :n] = torch.as_tensor(tr.ids, dtype=torch.long)
        mask[r, :n] = True
        model[r, :n] = torch.as_tensor(tr.model, dtype=torch.bool)
        sampler[r, :n] = torch.as_tensor(tr.sampler)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor([tr.truncated for tr in trajs]),
        completions=[tr.last_text for tr in trajs],
        prompt_index=[i for i in index for _ in range(group_size)],
        group_size=group_size,
        sampler_logprobs=sampler.masked_fill(~model, 0.0) if record_sampler else None,
        model_mask=model,
    )
