"""Rejection sampling: the model's own verified answers as a new supervised set (DeepSeek-R1's stage 3; STaR /
expert iteration).

Each step samples ``group_size`` completions for each of ``train.prompts_per_step`` training prompts, with the
adapter ``model.init_adapter`` (frozen) or the bare base, through the same rollout machinery as RL (one batched
``generate``, the prompt prefilled once per group); scores them with the recipe's ``reward`` section (the same
verifiers as RL: rule functions, the reward adapter, or both); and keeps, per prompt (:func:`select_kept`):

* completions whose total reward is at least ``min_reward`` (NaN: no reward, never kept),
* that finished with EOS (``drop_truncated``),
* not a duplicate of a kept completion of the same prompt (same text up to surrounding whitespace),
* at most ``max_per_prompt`` of them, highest reward first (best-of-G; 0: every one that passes).

At the end (:meth:`RejectionSampling.finish`) the kept rows are written, atomically, as a TRL prompt-completion
dataset ``RUN/dataset/train.jsonl`` (the prompt row's columns, ``completion``, ``reward``) with
``RUN/dataset/stats.json`` (sampled / kept counts, why completions were dropped, kept fraction per prompt, reward
histograms of the sampled and the kept). Train SFT on it with ``algo: sft`` and ``data.source:
RUN/dataset/train.jsonl`` (a pipeline does that for you: :mod:`lorarl.pipeline`). Nothing is trained here: a
checkpoint holds the kept rows so far, and a resumed run samples exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.algos.base import batch_indices, load_train_prompts, micro_batch_rows, rollout_batch
from lorarl.config import Recipe
from lorarl.errors import DataError
from lorarl.model import SharedBase
from lorarl.rewards.source import reward_source
from lorarl.rollout import generate_rollout

SAMPLER = "policy"  # the adapter sampled with (frozen), when model.init_adapter is set
DATASET_DIR = "dataset"
DATASET_FILE = "train.jsonl"
STATS_FILE = "stats.json"

PLOT_PANELS = (
    ("kept / sampled", ("kept_frac",)),
    ("prompts with a kept completion", ("prompt_pass_frac",)),
    ("reward of the samples (mean, best)", ("reward", "reward_max")),
    ("completion length", ("completions/mean_length",)),
)


@dataclass
class GroupSelection:
    """What :func:`select_kept` did with one prompt's ``G`` completions: the rows kept (best first) and how many
    were dropped for each reason (each dropped row counted once, under the first reason that applies)."""

    kept: list[int]
    below_threshold: int = 0
    truncated: int = 0
    duplicate: int = 0
    over_limit: int = 0


def select_kept(
    rewards: list[float],
    texts: list[str],
    truncated: list[bool],
    min_reward: float,
    max_per_prompt: int = 0,
    drop_truncated: bool = True,
) -> GroupSelection:
    """The completions of ONE prompt to keep: reward ``>= min_reward`` (NaN fails), finished (unless
    ``drop_truncated`` is off), distinct texts (``strip()``-equal ones are duplicates; the better-rewarded, then the
    earlier one stays), sorted by reward (descending, ties in sampling order), at most ``max_per_prompt`` (0: all).

    Example: rewards ``[1, 0, 1, 1]``, texts ``["a", "b", " a", "c"]``, truncated ``[F, F, F, T]``, threshold 1 ->
    kept ``[0]``; dropped: 1 below the threshold, 1 truncated, 1 duplicate.
    """
    out = GroupSelection(kept=[])
    order = sorted(range(len(rewards)), key=lambda i: (-rewards[i] if not math.isnan(rewards[i]) else math.inf, i))
    seen: set[str] = set()
    for i in order:
        r = rewards[i]
        if math.isnan(r) or r < min_reward:
            out.below_threshold += 1
        elif drop_truncated and truncated[i]:
            out.truncated += 1
        elif texts[i].strip() in seen:
            out.duplicate += 1
        elif max_per_prompt and len(out.kept) >= max_per_prompt:
            out.over_limit += 1
        else:
            seen.add(texts[i].strip())
            out.kept.append(i)
    return out


def value_histogram(values: list[float], decimals: int = 2) -> dict[str, int]:
    """Counts of the values rounded to ``decimals`` (NaN as ``"nan"``), keys in ascending order.

    Example: ``[1.0, 0.5, 1.0, nan]`` -> ``{"0.5": 1, "1.0": 2, "nan": 1}``.
    """
    counts: dict[float, int] = {}
    nan = 0
    for v in values:
        if math.isnan(v):
            nan += 1
        else:
            key = round(float(v), decimals) + 0.0  # -0.0 -> 0.0
            counts[key] = counts.get(key, 0) + 1
    out = {str(k): counts[k] for k in sorted(counts)}
    if nan:
        out["nan"] = nan
    return out


@dataclass
class Tally:
    """Running counts of a rejection-sampling run (saved in checkpoints)."""

    sampled: int = 0
    dropped: dict[str, int] = field(
        default_factory=lambda: {"below_threshold": 0, "truncated": 0, "duplicate": 0, "over_limit": 0}
    )
    best_reward: float | None = None
    sampled_rewards: list[float] = field(default_factory=list)
    per_prompt: list[dict] = field(default_factory=list)  # {prompt_index, sampled, kept, kept_frac, best_reward}

    def add_group(self, prompt_index: int, rewards: list[float], sel: GroupSelection) -> None:
        finite = [r for r in rewards if not math.isnan(r)]
        best = max(finite) if finite else None
        if best is not None:
            self.best_reward = best if self.best_reward is None else max(self.best_reward, best)
        self.sampled += len(rewards)
        self.sampled_rewards += rewards
        for k in self.dropped:
            self.dropped[k] += getattr(sel, k)
        self.per_prompt.append(
            {
                "prompt_index": prompt_index,
                "sampled": len(rewards),
                "kept": len(sel.kept),
                "kept_frac": len(sel.kept) / len(rewards),
                "best_reward": best,
            }
        )


def write_dataset(run_dir: Path, rows: list[dict], stats: dict) -> Path:
    """``run_dir/dataset/{train.jsonl, stats.json}``, written into a temporary folder and renamed into place (an
    existing dataset folder is replaced only once the new one is complete). Returns the JSONL path."""
    final = Path(run_dir) / DATASET_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{DATASET_DIR}.tmp-", dir=run_dir))
    try:
        with open(tmp / DATASET_FILE, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2), encoding="utf-8")
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{DATASET_DIR}.old-", dir=run_dir))
            os.replace(final, trash / "x")
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / DATASET_FILE


@dataclass
class SampleBatch:
    """Step ``step``'s prompts: rows ``prompt_index`` of the prompt set."""

    step: int
    prompt_index: list[int]


class RejectionSampling:
    """Sample, verify, keep: set-up, then :meth:`step` per batch of prompts; :meth:`finish` writes the dataset."""

    name = "rejection_sampling"
    plot_panels = PLOT_PANELS

    def __init__(self, recipe: Recipe, shared: SharedBase):
        self.recipe, self.shared = recipe, shared
        cfg, tcfg = recipe.rejection_sampling, recipe.train
        init = recipe.model.init_adapter
        if init:
            shared.add_adapter(SAMPLER, init_from=init, trainable=False)
        self.sampler = SAMPLER if init else "base"
        self.roles: list[str] = []  # trains nothing: a checkpoint holds the kept rows (state_dict)
        # the loop's health monitor watches outputs[0]: the sampler, which never moves (rows say `updates: 0`)
        self.outputs, self.final_eval = [self.sampler], False
        self.optimizers: dict = {}
        self.schedulers: dict = {}
        self.prompts = load_train_prompts(recipe, shared.tokenizer)
        n_rows = tcfg.prompts_per_step * cfg.group_size
        self.source = reward_source(recipe, shared, micro_batch_rows(recipe.eval.batch_size, n_rows))
        self.total_steps = self.last_step = tcfg.steps
        self.kept: list[dict] = []
        self.tally = Tally()
        self.rollout_rows = rollout_batch(recipe, shared.device.type)  # generation.batch_size

    def batch(self, step: int) -> SampleBatch:
        """Step ``step``'s prompts: consecutive slices of a per-epoch shuffle (no prompt twice within an epoch)."""
        tcfg = self.recipe.train
        return SampleBatch(step, batch_indices(len(self.prompts), tcfg.prompts_per_step, tcfg.seed, step))

    def step(self, sample: SampleBatch) -> dict:
        """Sample, score and filter one batch of prompts; returns its metrics."""
        cfg, G = self.recipe.rejection_sampling, self.recipe.rejection_sampling.group_size
        step, batch = sample.step, sample.prompt_index

        # 1. G completions per prompt with the sampler, one batched generate -----------------------------------
        rollout = generate_rollout(
            self.shared,
            [self.prompts.token_ids[i] for i in batch],
            self.recipe.generation,
            group_size=G,
            role=self.sampler,
            prompt_index=batch,
            batch_size=self.rollout_rows,
        )
        # 2. Scores: the recipe's verifiers, as RL scores them ---------------------------------------------------
        scored = self.source.score_rollout(self.prompts, rollout, step=step)
        self.source.report_failures(
            scored, step, self.recipe.reward.max_failure_fraction, "its completions are not kept"
        )
        self.source.end_step(step)
        rewards = [float(r) for r in scored.total]
        truncated = rollout.truncated.tolist()

        # 3. Keep the verified completions of each prompt ---------------------------------------------------------
        kept_now = 0
        for g, p in enumerate(batch):
            rows = range(g * G, (g + 1) * G)
            sel = select_kept(
                [rewards[i] for i in rows],
                [rollout.completions[i] for i in rows],
                [truncated[i] for i in rows],
                cfg.min_reward,
                cfg.max_per_prompt,
                cfg.drop_truncated,
            )
            self.tally.add_group(p, [rewards[i] for i in rows], sel)
            for k in sel.kept:
                self.kept.append(self.kept_row(p, rollout.completions[g * G + k], rewards[g * G + k]))
            kept_now += len(sel.kept)

        # 4. Metrics ---------------------------------------------------------------------------------------------
        finite = [r for r in rewards if not math.isnan(r)]
        groups = self.tally.per_prompt[-len(batch) :]
        row = {
            "kept": kept_now,
            "kept_frac": kept_now / len(rewards),
            "prompt_pass_frac": sum(g["kept"] > 0 for g in groups) / len(batch),
            "kept_total": len(self.kept),
            "sampled_total": self.tally.sampled,
            "reward": sum(finite) / len(finite) if finite else None,
            "reward_max": max(finite) if finite else None,
            **scored.means(),
            "completions/mean_length": float(rollout.lengths.float().mean()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
            "reward_failures": self.source.failures,
            "reward_failed_values": self.source.failed_values,
            "updates": 0,
            "tokens": float(rollout.lengths.sum()),
        }
        return self.source.with_logged(row)

    def kept_row(self, prompt_index: int, completion: str, reward: float) -> dict:
        """A kept sample as a TRL prompt-completion row: the prompt row's columns (``prompt``, ``answer``, ...), the
        completion (an assistant message when the prompt is conversational), its reward."""
        row = dict(self.prompts.rows[prompt_index])
        conversational = not isinstance(row["prompt"], str)
        row["completion"] = [{"role": "assistant", "content": completion}] if conversational else completion
        row["reward"] = reward
        return row

    def evaluate(self) -> dict:
        """Nothing to evaluate during sampling (the sampler does not change); a pipeline evaluates the next SFT."""
        return {}

    def progress(self, row: dict) -> dict:
        return {"kept": f"{row['kept_total']}/{row['sampled_total']}"}

    def state_dict(self) -> dict:
        t = self.tally
        return {
            "kept": self.kept,
            "tally": {
                "sampled": t.sampled,
                "dropped": t.dropped,
                "best_reward": t.best_reward,
                "sampled_rewards": [None if math.isnan(r) else r for r in t.sampled_rewards],
                "per_prompt": t.per_prompt,
            },
            "rewards": self.source.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.kept = state["kept"]
        t = state["tally"]
        rewards = [math.nan if r is None else r for r in t["sampled_rewards"]]
        self.tally = Tally(t["sampled"], t["dropped"], t["best_reward"], rewards, t["per_prompt"])
        self.source.load_state_dict(state["rewards"])

    def stats(self) -> dict:
        """The dataset's statistics (``stats.json``)."""
        cfg, t = self.recipe.rejection_sampling, self.tally
        n_prompts = len(t.per_prompt)
        kept_per_prompt: dict[str, int] = {}
        for g in t.per_prompt:
            kept_per_prompt[str(g["kept"])] = kept_per_prompt.get(str(g["kept"]), 0) + 1
        return {
            "sampler": self.recipe.model.init_adapter or "base",
            "prompts": n_prompts,
            "sampled": t.sampled,
            "kept": len(self.kept),
            "kept_frac": len(self.kept) / max(t.sampled, 1),
            "prompts_with_kept": sum(g["kept"] > 0 for g in t.per_prompt),
            "best_reward": t.best_reward,
            "settings": {
                "group_size": cfg.group_size,
                "min_reward": cfg.min_reward,
                "max_per_prompt": cfg.max_per_prompt,
                "drop_truncated": cfg.drop_truncated,
            },
            "dropped": t.dropped,
            "prompts_by_kept_count": dict(sorted(kept_per_prompt.items(), key=lambda kv: int(kv[0]))),
            "reward_histogram": {
                "sampled": value_histogram(t.sampled_rewards),
                "kept": value_histogram([r["reward"] for r in self.kept]),
            },
            "per_prompt": t.per_prompt,
        }

    def finish(self, run_dir, history: list[dict]) -> dict:
        """Write the kept set and its statistics (atomically); DataError, and nothing written, when nothing was
        kept."""
        cfg, t = self.recipe.rejection_sampling, self.tally
        if not self.kept:
            best = "none (every reward failed)" if t.best_reward is None else f"{t.best_reward:g}"
            raise DataError(
                f"rejection_sampling: nothing passed the verifier (reward >= rejection_sampling.min_reward="
                f"{cfg.min_reward:g}{', finished with EOS' if cfg.drop_truncated else ''}): {t.sampled} completions "
                f"sampled for {len(t.per_prompt)} prompts, best reward seen {best}; lower min_reward, sample more "
                f"(train.steps, rejection_sampling.group_size) or sample from a better adapter (model.init_adapter)"
            )
        stats = self.stats()
        path = write_dataset(Path(run_dir), self.kept, stats)
        return {
            "dataset": str(path),
            **{k: stats[k] for k in ("prompts", "sampled", "kept", "kept_frac", "prompts_with_kept", "best_reward")},
        }
