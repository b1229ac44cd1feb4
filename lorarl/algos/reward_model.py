"""Reward model: the ``reward`` LoRA adapter plus a fp32 score head on the shared base, trained with the
Bradley-Terry loss on preference pairs (InstructGPT, Ouyang et al. 2022, Eq. 1):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin) + center_coef * (r_chosen + r_rejected)^2

with the optional margin of Llama 2 (Touvron et al. 2023, Eq. 2; ``reward_model.margin`` reads a ``margin``
column) and the reward-centering term of Eisenstein et al. 2023 (``reward_model.center_coef``). The score of a
sequence is the head applied to the hidden state of its last non-pad token (the EOS that ends the response), found
from the attention mask.

Read :func:`train` top to bottom; its steps are numbered:

1. a batch of pairs (a per-epoch shuffle derived from ``(seed, epoch)``, so a resumed run sees the same data);
2. one optimizer step over micro-batches: chosen and rejected sequences of a micro-batch go through the base in one
   forward pass, the Bradley-Terry loss is averaged over the batch's pairs (gradient accumulation is exact);
3. held-out pairwise accuracy every ``reward_model.eval_every`` steps and at the end;
4. metrics, checkpoints; at the end the ``reward/`` adapter (PEFT folder + ``head.safetensors``) and a plot.

The run stops after ``reward_model.epochs`` passes over the pairs or ``train.steps`` optimizer steps, whichever
comes first. :func:`evaluate` prints the held-out pairwise accuracy (``lorarl eval recipes/reward_model.yaml
--checkpoint DIR``).
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

import torch

from lorarl.algos.grpo import batch_indices, peak_memory_gb, resolve_micro_batch, set_threads, start_run
from lorarl.config import Recipe
from lorarl.errors import DataError, LorarlError
from lorarl.losses import bradley_terry_loss
from lorarl.metrics import MetricsLogger, plot_metrics
from lorarl.model import HEAD_FILE, SharedBase
from lorarl.preferences import PreferenceSet, load_preferences, pad_batch
from lorarl.update import count_nonfinite, make_scheduler, micro_batches, optimizer_step

REWARD = "reward"
PLOT_PANELS = (
    ("Bradley-Terry loss", ("loss",)),
    ("pairwise accuracy", ("accuracy", "eval_accuracy")),
    ("score margin r_chosen - r_rejected", ("reward_margin",)),
    ("mean score (centering)", ("reward_mean",)),
)


# ---------------------------------------------------------------------------------------------------------------
# Helpers (the loop itself is `train` below)
# ---------------------------------------------------------------------------------------------------------------


def _base_dir(recipe: Recipe) -> Path | None:
    return Path(recipe.source_path).parent if recipe.source_path else None


def load_pairs(recipe: Recipe, tokenizer, split: str, limit: int | None = None) -> PreferenceSet | None:
    """The recipe's preference pairs of ``split``, tokenized. For ``eval``: ``data.eval_source``, else the test split
    of a datasets folder given as ``data.source``; None when there is no held-out set."""
    data = recipe.data
    if data.source == "arithmetic":
        raise DataError(
            "reward_model needs preference pairs: set data.source to a .jsonl file, a datasets folder or "
            "pkg:prefs_arith_train.jsonl (and data.eval_source to the held-out pairs)"
        )
    source = data.source
    if split == "eval":
        if data.eval_source:
            source = data.eval_source
        elif not Path(source).is_dir():
            return None
    return load_preferences(
        source,
        tokenizer,
        split=split,
        base_dir=_base_dir(recipe),
        system_prompt=data.system_prompt,
        max_length=recipe.reward_model.max_length,
        on_bad_row=data.on_bad_row,
        limit=limit,
    )


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into groups whose padded size ``len(group) * longest`` stays within
    ``max_tokens`` (a group holds at least one sequence; ``max_tokens`` 0: one group, original order)."""
    if max_tokens <= 0:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def score_sequences(shared: SharedBase, seqs: list[list[int]], max_tokens: int) -> torch.Tensor:
    """Scores of ``seqs`` with the active ``reward`` role -> [len(seqs)] fp32, in the order given. Sequences are
    scored in length-sorted groups (:func:`length_groups`), so short ones are not padded to long ones; the scores
    do not depend on the grouping (each is read at its own last token under a causal mask)."""
    pad = shared.tokenizer.pad_token_id
    out = [None] * len(seqs)
    for group in length_groups([len(s) for s in seqs], max_tokens):
        ids, att = pad_batch([seqs[i] for i in group], pad)
        scores = shared.scores(ids.to(shared.device), att.to(shared.device), head=REWARD)
        for k, i in enumerate(group):
            out[i] = scores[k]
    return torch.stack(out)


@torch.no_grad()
def score_pairs(
    shared: SharedBase, pairs: PreferenceSet, batch_size: int = 32, max_tokens: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every pair with the ``reward`` role, dropout off -> ``(r_chosen [n], r_rejected [n])`` fp32 CPU."""
    rc, rr = [], []
    with shared.role(REWARD, train=False):
        for s in range(0, len(pairs), batch_size):
            seqs = pairs.chosen_ids[s : s + batch_size] + pairs.rejected_ids[s : s + batch_size]
            scores = score_sequences(shared, seqs, max_tokens).float().cpu()
            b = len(seqs) // 2
            rc.append(scores[:b])
            rr.append(scores[b:])
    return torch.cat(rc), torch.cat(rr)


def pairwise_metrics(rc: torch.Tensor, rr: torch.Tensor, pairs: PreferenceSet | None = None) -> dict:
    """Pairwise accuracy (``r_chosen > r_rejected``, ties count as wrong), mean BT loss, mean margin; per ``kind``
    column too when the pairs have one."""
    correct = (rc > rr).float()
    out = {
        "pairwise_accuracy": float(correct.mean()),
        "n": int(rc.numel()),
        "loss": float(bradley_terry_loss(rc, rr).mean()),
        "margin_mean": float((rc - rr).mean()),
        "score_mean": float(torch.cat([rc, rr]).mean()),
    }
    if pairs is not None:
        kinds = [p["columns"].get("kind") for p in pairs.pairs[: rc.numel()]]
        if any(k is not None for k in kinds):
            by: dict[str, list[float]] = {}
            for k, c in zip(kinds, correct.tolist()):
                by.setdefault(str(k), []).append(c)
            out["accuracy_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(by.items())}
    return out


def resolve_reward_adapter(path: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> Path:
    """A reward-model run directory (its ``reward/``), a step checkpoint (its ``reward/``) or the adapter folder
    itself -> the adapter folder (holding ``adapter_config.json`` and ``head.safetensors``). A relative path is
    looked up in the current directory, then beside ``base_dir`` (a recipe's folder)."""
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and base_dir is not None and (Path(base_dir) / p).exists():
        p = Path(base_dir) / p
    if not p.exists():
        raise LorarlError(
            f"reward adapter {path}: no such folder (train one with `lorarl train recipes/reward_model.yaml`)"
        )
    candidates = [p, p / REWARD]
    if (p / "checkpoints").is_dir():
        steps = sorted(c for c in (p / "checkpoints").glob("step-*") if (c / "COMPLETE").is_file())
        if steps:
            candidates.append(steps[-1] / REWARD)
    for c in candidates:
        if (c / "adapter_config.json").is_file():
            if not (c / HEAD_FILE).is_file():
                raise LorarlError(f"reward adapter {c}: no {HEAD_FILE} (the score head); is it a reward-model adapter?")
            return c
    raise LorarlError(f"reward adapter {path}: no PEFT adapter in it or in its {REWARD}/ folder")


def bt_loss(
    shared: SharedBase,
    pairs: PreferenceSet,
    batch_pairs: int,
    use_margin: bool,
    center_coef: float,
    max_tokens: int,
    mb: list[int],
):
    """One micro-batch's share of the batch's mean Bradley-Terry loss: chosen and rejected sequences are scored in
    length-sorted forwards of at most ``max_tokens`` padded tokens; ``sum_i loss_i / batch_pairs``. Returns
    ``(loss, {stat: (sum, count)})``."""
    seqs = [pairs.chosen_ids[i] for i in mb] + [pairs.rejected_ids[i] for i in mb]
    with shared.role(REWARD, train=True):
        scores = score_sequences(shared, seqs, max_tokens)  # [2b]
    rc, rr = scores[: len(mb)], scores[len(mb) :]  # [b], [b]
    margin = pairs.margins(mb).to(shared.device) if use_margin else None
    per_pair = bradley_terry_loss(rc, rr, margin, center_coef)  # [b]
    b = float(len(mb))
    with torch.no_grad():
        stats = {
            "accuracy": (float((rc > rr).float().sum()), b),
            "reward_margin": (float((rc - rr).sum()), b),
            "reward_mean": (float((rc + rr).sum()) / 2, b),
            "bt_loss": (float(per_pair.sum()), b),
        }
    return per_pair.sum() / batch_pairs, stats


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def train(recipe: Recipe, out_dir: str | os.PathLike, *, resume: bool = False, max_steps: int | None = None) -> dict:
    """Train the ``reward`` adapter and score head; write the run directory; return a summary.

    ``out_dir`` gets ``recipe.yaml``, ``metrics.jsonl``, ``tb/``, ``checkpoints/step-NNNNNN/`` (every
    ``train.save_every`` steps), and at the end ``reward/`` (PEFT adapter + ``head.safetensors``), ``eval.json``
    (held-out pairwise accuracy) and ``plot.png``.
    """
    t_start = time.perf_counter()
    cfg, tcfg = recipe.reward_model, recipe.train
    run_dir = start_run(recipe, out_dir)

    # -- set-up: one base, the reward adapter + score head, the pairs, the optimizer --------------------------
    shared = SharedBase.load(recipe.model)
    if recipe.model.init_adapter:
        shared.add_adapter(REWARD, init_from=recipe.model.init_adapter, trainable=True, head=True)
    else:
        shared.add_adapter(REWARD, recipe.lora, head=True)
    train_pairs = load_pairs(recipe, shared.tokenizer, "train")
    eval_pairs = load_pairs(recipe, shared.tokenizer, "eval", limit=recipe.eval.n)
    params = shared.trainable_parameters(REWARD)
    optimizer = torch.optim.AdamW(params, lr=tcfg.learning_rate, weight_decay=tcfg.weight_decay)
    n, B = len(train_pairs), cfg.batch_size
    steps_per_epoch = math.ceil(n / B)
    total_steps = min(tcfg.steps, cfg.epochs * steps_per_epoch)
    scheduler = make_scheduler(optimizer, tcfg.lr_scheduler, tcfg.warmup_steps, total_steps)
    last_step = min(total_steps, max_steps) if max_steps else total_steps
    use_margin = cfg.margin and train_pairs.margins([0]) is not None
    mbs = resolve_micro_batch(tcfg.micro_batch_size, B)

    state = {"nonfinite_in_row": 0, "skipped_updates": 0}
    start_step = 0
    if resume:
        from lorarl.checkpoint import resume_into

        start_step = resume_into(run_dir, shared, {REWARD: optimizer}, {REWARD: scheduler}, state)
    logger = MetricsLogger(run_dir, resume_step=start_step if resume else None)

    from tqdm.auto import tqdm

    bar = tqdm(total=last_step, initial=start_step, desc="reward_model", unit="step", dynamic_ncols=True)
    history: list[dict] = []
    eval_result: dict | None = None
    try:
        for step in range(start_step + 1, last_step + 1):
            t0 = time.perf_counter()

            # 1. A batch of pairs: step `step` of a per-epoch shuffle ---------------------------------------
            idx = batch_indices(n, B, tcfg.seed, step)

            # 2. One optimizer step: chosen + rejected in one forward per micro-batch, BT loss / batch pairs ---
            loss_fn = functools.partial(
                bt_loss, shared, train_pairs, len(idx), use_margin, cfg.center_coef, cfg.max_tokens_per_forward
            )
            with shared.role(REWARD, train=True):  # active through backward too (checkpointing recomputes)
                result = optimizer_step(
                    params,
                    optimizer,
                    (idx[s] for s in micro_batches(len(idx), mbs)),
                    loss_fn,
                    max_grad_norm=tcfg.max_grad_norm,
                    scheduler=scheduler,
                )
            count_nonfinite(result, state, step, tcfg.max_nonfinite_in_row)

            # 3. Held-out pairwise accuracy ---------------------------------------------------------------------
            row = {
                "loss": result.loss,
                **result.stats,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "epoch": (step - 1) * B / n,
                "skipped_updates": state["skipped_updates"],
            }
            if eval_pairs is not None and (step == last_step or (cfg.eval_every and step % cfg.eval_every == 0)):
                eval_result = pairwise_metrics(
                    *score_pairs(shared, eval_pairs, recipe.eval.batch_size, cfg.max_tokens_per_forward), eval_pairs
                )
                row["eval_accuracy"] = eval_result["pairwise_accuracy"]
                row["eval_loss"] = eval_result["loss"]

            # 4. Metrics, progress, checkpoint ------------------------------------------------------------------
            row["step_time"] = time.perf_counter() - t0
            row["peak_mem_gb"] = peak_memory_gb(shared.device)
            history.append(row)
            if step % tcfg.log_every == 0 or step == last_step or "eval_accuracy" in row:
                logger.log(step, row)
            bar.set_postfix(loss=f"{result.loss:.3f}", acc=f"{row.get('accuracy', float('nan')):.2f}")
            bar.update(1)
            if tcfg.save_every > 0 and (step % tcfg.save_every == 0 or step == last_step):
                from lorarl.checkpoint import save_checkpoint

                save_checkpoint(
                    run_dir,
                    step,
                    shared,
                    [REWARD],
                    {REWARD: optimizer},
                    {REWARD: scheduler},
                    {**state, "data_position": step * B, "epoch": (step * B) // n},
                    recipe,
                    keep_last=tcfg.keep_last,
                )
    finally:
        bar.close()
        logger.close()

    # -- the result: the reward adapter + head, the held-out accuracy, a plot ---------------------------------
    shared.save_adapter(REWARD, run_dir / REWARD)
    if eval_result is not None:
        import json

        (run_dir / "eval.json").write_text(json.dumps(eval_result, indent=2), encoding="utf-8")
    plot = plot_metrics(run_dir, panels=PLOT_PANELS)
    tail = [r["accuracy"] for r in history[-20:] if isinstance(r.get("accuracy"), float)]
    return {
        "run_dir": str(run_dir),
        "reward": str(run_dir / REWARD),
        "plot": str(plot),
        "steps": last_step,
        "steps_this_run": len(history),
        "train_pairs": n,
        "skipped_pairs": len(train_pairs.skipped),
        "train_accuracy_last20": sum(tail) / len(tail) if tail else None,
        "pairwise_accuracy": eval_result["pairwise_accuracy"] if eval_result else None,
        "n": eval_result["n"] if eval_result else 0,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Held-out pairwise accuracy of a trained reward adapter: ``checkpoint`` is a run directory, a step checkpoint
    or an adapter folder. Returns ``{pairwise_accuracy, n, loss, margin_mean, score_mean, [accuracy_by_kind],
    checkpoint, seconds}``."""
    t0 = time.perf_counter()
    if checkpoint == "base":
        raise LorarlError("the base model has no score head: give a reward-model run directory or adapter folder")
    folder = resolve_reward_adapter(checkpoint)
    set_threads()
    if shared is None:
        shared = SharedBase.load(recipe.model)
    if shared.has_adapter(REWARD):
        shared.peft.delete_adapter(REWARD)
        del shared.heads[REWARD]
    shared.add_adapter(REWARD, init_from=folder, trainable=False, head=True)
    pairs = load_pairs(recipe, shared.tokenizer, "eval", limit=n or recipe.eval.n)
    if pairs is None:
        raise DataError(
            "no held-out preference pairs: set data.eval_source (or use a datasets folder with a test split)"
        )
    out = pairwise_metrics(
        *score_pairs(shared, pairs, recipe.eval.batch_size, recipe.reward_model.max_tokens_per_forward), pairs
    )
    out.update({"checkpoint": str(folder), "seconds": round(time.perf_counter() - t0, 1)})
    return out
