"""Greedy evaluation of a policy on the recipe's held-out prompts: one path for every algorithm that trains a policy
(GRPO, PPO, SFT) and for evaluation during training.

``evaluate(recipe, checkpoint, n)`` decodes greedily with the base (``checkpoint="base"``: adapters off, or the
``model.init_adapter`` the run started from) or a trained policy (a run directory -- its ``policy/`` -- or a PEFT
adapter folder, e.g. a step checkpoint's ``policy/``), scores the completions like training scores them (the rule
rewards and/or the reward adapter), and measures accuracy with the task's own verifier. The base is evaluated
under the same prompt format (chat template, system prompt, template) as the policy, so the numbers compare like
with like.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from lorarl import forward_calls_to_api
from lorarl.agents.step import make_step_rollout
from lorarl.config import DataConfig, Recipe
from lorarl.data import load_prompts
from lorarl.errors import LorarlError
from lorarl.model import SharedBase
from lorarl.rewards.call_args import LOG_METRIC_PREFIX, add_logged, pool_sums
from lorarl.rewards.source import RewardSource, reward_source
from lorarl.runfiles import write_atomic
from lorarl.runs import find_adapter
from lorarl.runstate import STATE_FILE, read_json
from lorarl.tasks import accuracy

POLICY = "policy"
EVAL_ROLE = "eval_policy"  # the adapter under evaluation, loaded frozen beside the others
AGENT_EVAL_KEYS = {"agent/turns_mean", "tools/call_frequency", "tools/failure_frequency", "agent/truncated_ratio"}


def checkpoint_adapter(recipe: Recipe, checkpoint: str) -> Path | None:
    """``"base"`` -> the run's starting point (``model.init_adapter``, else None: adapters off); anything else -> the
    policy adapter found there (:func:`lorarl.runs.find_adapter`)."""
    if checkpoint == "base":
        return Path(recipe.model.init_adapter) if recipe.model.init_adapter else None
    return find_adapter(checkpoint, POLICY)


def adapter_steps(adapter: Path | None) -> int:
    """The optimizer steps behind an adapter under evaluation (what reward functions see as
    ``trainer_state.global_step``, as after TRL's training): a step checkpoint's step (``step-000040/...`` -> 40),
    a run's final policy's last step (its ``state.json``), else 0 (the base, a folder of unknown origin)."""
    if adapter is None:
        return 0
    for folder in (adapter, *adapter.parents[:2]):
        if folder.name.startswith("step-") and folder.name[5:].isdigit():
            return int(folder.name[5:])
    try:
        state = read_json(adapter.parent / STATE_FILE) if adapter.name == POLICY else None
    except LorarlError:  # an unreadable state file: the adapter is still evaluated
        state = None
    step = state.get("step") if state else None
    return step if isinstance(step, int) and not isinstance(step, bool) else 0


def load_eval_adapter(shared: SharedBase, adapter: Path | None) -> str:
    """The role that runs ``adapter`` for an evaluation: ``"base"`` for None, else the frozen adapter loaded as
    ``eval_policy`` (replacing an earlier one)."""
    if adapter is None:
        return "base"
    shared.remove_adapter(EVAL_ROLE)
    shared.add_adapter(EVAL_ROLE, init_from=adapter, trainable=False)
    return EVAL_ROLE


TASK_SOURCE_ALGOS = ("dpo", "kto")  # algorithms whose data are not prompts: their held-out prompts are task_source


def prompt_data(recipe: Recipe) -> DataConfig:
    """The data section a greedy evaluation reads its held-out prompts from: the recipe's own, or for DPO and KTO
    (whose ``data`` holds preference pairs / labelled rows) the same section with ``dpo.task_source`` /
    ``kto.task_source`` as its source, read whole as the held-out set (``arithmetic`` generates the task's held-out
    split). Raises LorarlError for such a recipe without a ``task_source``."""
    if recipe.algo not in TASK_SOURCE_ALGOS:
        return recipe.data
    section = getattr(recipe, recipe.algo)
    task = section.task_source if section is not None else None
    if not task:
        raise LorarlError(
            f"a {recipe.algo.upper()} recipe evaluates on held-out prompts only with {recipe.algo}.task_source "
            "(e.g. arithmetic, or a prompt file)"
        )
    mapped = ("chosen", "rejected", "completion", "label")
    columns = {k: v for k, v in recipe.data.columns.items() if k not in mapped}
    return dataclasses.replace(recipe.data, source=task, eval_source=task, columns=columns)


@torch.no_grad()
def evaluate_role(
    shared: SharedBase, recipe: Recipe, role: str, n: int, source: RewardSource | None = None, steps_done: int = 0
) -> dict:
    """Greedy completions of role ``role`` on the first ``n`` held-out prompts, scored and checked ->
    ``{n, accuracy, reward_mean, [rm_score], reward/<name>..., completion_len, truncated_frac, reward_failures,
    example}`` and the means of what the reward functions logged with ``log_metric``. ``source``: the training
    run's (its ``trainer_state``), else a new one whose ``trainer_state`` counts ``steps_done`` steps."""
    ecfg = recipe.eval
    if source is None:
        source = reward_source(recipe, shared)
        source.trainer_state.global_step = steps_done
    # generated held-out sets grow to n (their first rows do not change); files are read whole
    data = prompt_data(recipe)
    prompts = load_prompts(data, shared.tokenizer, "eval", size=max(n, data.eval_size), recipe_path=recipe.source_path)
    k = min(n, len(prompts))
    completions, totals, rms, lengths, truncated, rule_scores = [], [], [], [], [], []
    failures: dict[str, str] = {}
    logged: dict[str, tuple[float, int]] = {}  # what the reward functions logged with log_metric
    rollout_fn = make_step_rollout(recipe, shared, prompts)  # the same tool loop as training when recipe.agent
    agent_counts: dict[str, float] = {}
    for s in range(0, k, ecfg.batch_size):
        idx = list(range(s, min(s + ecfg.batch_size, k)))
        sampled = rollout_fn(idx, role=role, greedy=True, max_new_tokens=ecfg.max_new_tokens)
        r = sampled.rollout
        for key in AGENT_EVAL_KEYS & sampled.metrics.keys():  # per-trajectory rates, weighted by the batch's rows
            agent_counts[key] = agent_counts.get(key, 0.0) + sampled.metrics[key] * len(idx) / k
        scored = sampled.score(source, prompts)  # + the environment's get_reward(), when it has one
        totals.append(scored.total)
        if scored.reward_model is not None:
            rms.append(scored.reward_model)
        if scored.rules is not None:
            rule_scores.append(scored.rules.per_function)
            failures.update(scored.rules.failures)
            logged = pool_sums(logged, scored.rules.logged)
        completions += r.completions
        lengths += r.lengths.tolist()
        truncated += r.truncated.tolist()
    total = torch.cat(totals)
    valid = ~torch.isnan(total)
    out = {
        "n": k,
        "accuracy": accuracy(recipe, completions, prompts.columns(list(range(k)))),
        "reward_mean": float(total[valid].mean()) if valid.any() else None,
    }
    if rms:
        out["rm_score"] = float(torch.cat(rms).mean())
    if rule_scores:
        matrix = torch.cat(rule_scores)  # [k, K]
        for j, name in enumerate(source.rules.names):
            col = matrix[:, j]
            ok = ~torch.isnan(col)
            v = float(col[ok].mean()) if ok.any() else float("nan")
            out[f"reward/{name}"] = v if math.isfinite(v) else None
    out.update(
        completion_len=sum(lengths) / k,
        truncated_frac=sum(truncated) / k,
        reward_failures=failures or None,
        example=completions[0] if completions else None,
    )
    out.update(agent_counts)
    add_logged(out, {k: v / c for k, (v, c) in logged.items() if c}, LOG_METRIC_PREFIX)
    return out


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Greedy decoding on ``n`` held-out prompts (default ``eval.n``) with ``checkpoint`` (``base``, a run directory
    or an adapter folder); returns :func:`evaluate_role`'s figures plus ``checkpoint`` and ``seconds``. The result
    is also written to ``RUN/eval.json`` when ``checkpoint`` is a run's final policy.

    ``shared`` reuses an already loaded base (the adapter under evaluation is loaded beside the others).
    """
    t0 = time.perf_counter()
    n = n or recipe.eval.n
    if n < 1:
        raise LorarlError(f"eval: n must be >= 1, got {n}")
    adapter = checkpoint_adapter(recipe, checkpoint)
    if shared is None:
        shared = SharedBase.load(recipe.model)
    role = load_eval_adapter(shared, adapter)
    out = {"checkpoint": "base" if adapter is None else str(adapter)}
    out.update(evaluate_role(shared, recipe, role, n, steps_done=adapter_steps(adapter)))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if adapter is not None and adapter.name == POLICY and (adapter.parent / "recipe.yaml").is_file():
        write_atomic(adapter.parent / "eval.json", json.dumps(out, indent=2))
    return out


# `from lorarl import evaluate` gives this module once it is imported: calling it calls lorarl.api.evaluate
forward_calls_to_api(__name__, "evaluate")
