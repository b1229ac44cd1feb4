"""GRPO on one shared base: the policy is a LoRA adapter, the reference is the base with adapters disabled (or a
frozen ``reference`` adapter), the old policy is the log-probs recorded at rollout.

Read :func:`train` top to bottom; its steps are numbered:

1. a batch of prompts (derived from ``(seed, step)``, so a resumed run sees the same data);
2. a rollout: ``group_size`` completions per prompt in one batched ``generate``, masks from generation, old
   log-probs (only when ``num_iterations > 1``) and reference log-probs (only when ``kl_coef > 0``);
3. rewards: the recipe's reward functions, each failure isolated and counted;
4. group-relative advantages (DeepSeekMath; std scaling group | batch | none = Dr. GRPO);
5. the loss: PPO-clip per token with ``eps_low`` / ``eps_high`` (DAPO clip-higher), plus ``kl_coef`` * k3 to the
   reference (or DeepSeek-V3.2's importance-weighted k3), minus ``entropy_coef`` * entropy, reduced once
   (GRPO / DAPO / Dr. GRPO);
6. ``num_iterations`` optimizer steps on the rollout, each over micro-batches with gradient accumulation;
7. iterative GRPO: the reference adapter is refreshed to the policy every ``ref_refresh_every`` steps;
8. metrics, checkpoints; at the end the policy adapter in PEFT format and a plot.

References: Shao et al. 2024 (DeepSeekMath, GRPO, Eqs. 3-4 and iterative GRPO, Alg. 1); Yu et al. 2025 (DAPO);
Liu et al. 2025 (Dr. GRPO); DeepSeek-AI 2025 (DeepSeek-V3.2, unbiased KL estimate).
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import yaml

from lorarl.advantages import group_advantages
from lorarl.config import GRPOConfig, Recipe, recipe_to_dict
from lorarl.data import load_prompts
from lorarl.losses import kl_k3, kl_k3_importance_weighted, ppo_clip_loss, reduce_loss
from lorarl.metrics import MetricsLogger, plot_metrics
from lorarl.model import REFERENCE, SharedBase
from lorarl.rewards import RewardScorer, is_correct
from lorarl.rollout import Rollout, completion_logprobs, generate_rollout
from lorarl.update import count_nonfinite, make_scheduler, micro_batches, optimizer_step_halving

POLICY = "policy"


# ---------------------------------------------------------------------------------------------------------------
# Small helpers (the loop itself is `train` below)
# ---------------------------------------------------------------------------------------------------------------


def set_threads() -> int:
    """On CPU use every core this process may run on (the default can be lower in containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def start_run(recipe: Recipe, out_dir: str | os.PathLike) -> Path:
    """Make the run directory, use every core, seed python and torch from ``train.seed``, write ``recipe.yaml``."""
    run_dir = Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_threads()
    torch.manual_seed(recipe.train.seed)
    random.seed(recipe.train.seed)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False), encoding="utf-8")
    return run_dir


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of step ``step``: sampling is reproducible per step, so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def batch_indices(n_rows: int, per_step: int, seed: int, step: int) -> list[int]:
    """Prompt rows of step ``step`` (1-based): consecutive slices of a per-epoch shuffle seeded by (seed, epoch)."""
    out = []
    pos = (step - 1) * per_step
    while len(out) < per_step:
        epoch, offset = divmod(pos, n_rows)
        order = list(range(n_rows))
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
        take = min(per_step - len(out), n_rows - offset)
        out.extend(order[offset : offset + take])
        pos += take
    return out


def resolve_micro_batch(value: int | str, n: int, planned: int | None = None) -> int:
    """Rows per forward/backward: an int as is; ``auto``: the memory planner's pick (``planned``, from
    :func:`lorarl.plan.resolve_micro_batch`, GRPO and PPO) or else 16, never more than the ``n`` rows to split."""
    if value == "auto":
        return max(1, min(n, planned or 16))
    return int(value)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:  # pragma: no cover - not POSIX
        return float("nan")


def setup_roles(shared: SharedBase, recipe: Recipe) -> bool:
    """Add the policy adapter, and a frozen ``reference`` adapter when the reference is not the bare base.

    The reference is the bare base (adapters disabled) unless RL starts from a trained adapter
    (``model.init_adapter``: the reference is that adapter, frozen) or iterative GRPO refreshes it
    (``grpo.ref_refresh_every``: the reference starts as a copy of the policy). It is only built when
    ``kl_coef > 0`` (otherwise nothing reads it). Returns whether a reference adapter was added.
    """
    cfg = recipe.grpo
    init = recipe.model.init_adapter
    if init:
        shared.add_adapter(POLICY, init_from=init, trainable=True)
    else:
        shared.add_adapter(POLICY, recipe.lora)
    if cfg.kl_coef <= 0:
        if cfg.ref_refresh_every > 0:
            print("grpo.ref_refresh_every has no effect with grpo.kl_coef = 0 (no reference is used)", file=sys.stderr)
        return False
    if init:
        shared.add_adapter(REFERENCE, init_from=init, trainable=False)
        return True
    if cfg.ref_refresh_every > 0:
        shared.add_adapter(REFERENCE, recipe.lora, trainable=False)
        shared.copy_adapter(POLICY, REFERENCE)
        return True
    return False


def grpo_loss(
    rows: torch.Tensor,
    *,
    shared: SharedBase,
    rollout: Rollout,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: GRPOConfig,
    temperature: float,
    total_sequences: int,
    total_tokens: int,
    max_len: int,
    use_reference: bool,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Step 5: a micro-batch's share of the GRPO loss (Shao et al. 2024, Eq. 3, as a loss to minimise):

    ``l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + kl_coef * KL_t - entropy_coef * H_t``,
    ``rho_t = pi_theta / pi_old``, ``KL_t`` the k3 estimate (or k3 weighted by ``pi_theta / pi_old``), reduced by
    ``cfg.loss_reduction`` with the WHOLE batch's ``total_*`` so the micro-batch losses sum to the batch loss.

    ``rows``: the micro-batch, ``B`` row indices into ``rollout`` (``N`` rows); ``advantages`` ``[N]``;
    ``loss_mask`` ``[N, T]``. Without recorded
    ``old_logprobs`` (``num_iterations == 1``) the old policy IS the current one: its detached log-probs are used
    (ratio 1, the gradient is the policy gradient). Returns ``(loss, {stat: (sum, count)})``.
    """
    mb = rollout.select(rows)
    mask = loss_mask[rows].to(shared.device)  # [B, T]
    with shared.role(POLICY, train=True):
        logprobs, ent = completion_logprobs(shared, mb, temperature, with_entropy=True)  # [B, T] each
    old = mb.old_logprobs.to(shared.device) if mb.old_logprobs is not None else logprobs.detach()  # [B, T]
    adv = advantages[rows].to(shared.device)  # [B]
    per_token, pstats = ppo_clip_loss(logprobs, old, adv, mask, cfg.clip_eps_low, cfg.clip_eps_high)  # [B, T]
    n_tok = float(mask.sum())
    stats = {k: (float(v) * n_tok, n_tok) for k, v in pstats.items()}
    stats["entropy"] = (float(ent.detach()[mask].sum()), n_tok)
    if use_reference:
        ref = mb.ref_logprobs.to(shared.device)  # [B, T]
        if cfg.kl_estimator == "k3_unbiased":
            kl = kl_k3_importance_weighted(logprobs, ref, old)  # [B, T] DeepSeek-V3.2
        else:
            kl = kl_k3(logprobs, ref)  # [B, T]
        per_token = per_token + cfg.kl_coef * kl
        stats["kl"] = (float(kl.detach()[mask].sum()), n_tok)
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    loss = reduce_loss(
        per_token, mask, cfg.loss_reduction, total_sequences=total_sequences, total_tokens=total_tokens, max_len=max_len
    )
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def train(recipe: Recipe, out_dir: str | os.PathLike, *, resume: bool = False, max_steps: int | None = None) -> dict:
    """Train the policy adapter with GRPO; write the run directory ``out_dir``; return a summary.

    ``out_dir`` gets ``recipe.yaml``, ``metrics.jsonl``, ``tb/``, ``checkpoints/step-NNNNNN/`` (every
    ``train.save_every`` steps), and at the end ``policy/`` (PEFT adapter) and ``plot.png``. ``resume`` continues
    from the newest checkpoint; ``max_steps`` stops after that step (the LR schedule still spans ``train.steps``).
    """
    t_start = time.perf_counter()
    cfg, gen, tcfg = recipe.grpo, recipe.generation, recipe.train
    G = cfg.group_size
    run_dir = start_run(recipe, out_dir)

    # -- set-up: one base, the roles, the data, the reward functions, the optimizer ---------------------------
    shared = SharedBase.load(recipe.model)
    has_ref_adapter = setup_roles(shared, recipe)
    planned_mbs = None
    if tcfg.micro_batch_size == "auto":  # the memory planner picks what fits this device
        from lorarl.plan import resolve_micro_batch as plan_micro_batch

        planned_mbs = plan_micro_batch(recipe, device_type=shared.device.type)
    reference = REFERENCE if cfg.kl_coef > 0 else None  # None: the reference never runs
    prompts = load_prompts(recipe.data, shared.tokenizer, "train")
    for i, why in prompts.skipped[:5]:
        print(f"data: skipped row {i}: {why}", file=sys.stderr)
    if prompts.skipped:
        print(
            f"data: skipped {len(prompts.skipped)} bad rows of {prompts.source} (data.on_bad_row: skip)",
            file=sys.stderr,
        )
    scorer = RewardScorer(recipe.rewards, timeout_s=tcfg.reward_timeout_s or None)
    params = shared.trainable_parameters(POLICY)
    optimizer = torch.optim.AdamW(params, lr=tcfg.learning_rate, weight_decay=tcfg.weight_decay)
    scheduler = make_scheduler(optimizer, tcfg.lr_scheduler, tcfg.warmup_steps, tcfg.steps * cfg.num_iterations)
    roles_to_save = [POLICY] + ([REFERENCE] if has_ref_adapter else [])
    last_step = min(tcfg.steps, max_steps) if max_steps else tcfg.steps

    state = {"reward_calls": 0, "reward_failures": 0, "nonfinite_in_row": 0, "skipped_updates": 0}
    start_step = 0
    if resume:
        from lorarl.checkpoint import resume_into

        start_step = resume_into(run_dir, shared, {POLICY: optimizer}, {POLICY: scheduler}, state)
        scorer.calls, scorer.failures = state["reward_calls"], state["reward_failures"]
    logger = MetricsLogger(run_dir, resume_step=start_step if resume else None)

    from tqdm.auto import tqdm

    bar = tqdm(total=last_step, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True)
    history: list[dict] = []
    try:
        for step in range(start_step + 1, last_step + 1):
            t0, cpu0 = time.perf_counter(), time.process_time()
            torch.manual_seed(step_seed(tcfg.seed, step))

            # 1. A batch of prompts -------------------------------------------------------------------------
            idx = batch_indices(len(prompts), tcfg.prompts_per_step, tcfg.seed, step)

            # 2. Rollout: G completions per prompt, one generate call; old / reference log-probs when needed --
            rollout = generate_rollout(
                shared,
                [prompts.token_ids[i] for i in idx],
                gen,
                group_size=G,
                role=POLICY,
                record_old=cfg.num_iterations > 1,
                reference=reference,
                prompt_index=idx,
            )
            N = len(rollout)
            t_gen = time.perf_counter()

            # 3. Rewards: each function once on the batch; failures isolated (NaN) and counted -----------------
            scores = scorer.score_rollout(prompts, rollout)
            for name, err in scores.failures.items():
                tqdm.write(f"step {step}: reward {name} failed ({err}); its values are left out")
            scorer.check_failure_budget(tcfg.max_reward_failure_fraction, scores.failures)

            # 4. Group-relative advantages [N] (NaN rewards left out of their group's statistics) --------------
            adv = group_advantages(scores.total, G, cfg.std_scaling, unbiased_std=cfg.unbiased_std)
            advantages = adv.advantages  # [N]

            # 5. The loss on a micro-batch, as its share of the full-batch loss -------------------------------
            loss_mask = rollout.completion_mask.clone()  # [N, T]
            if cfg.mask_truncated:
                loss_mask &= ~rollout.truncated[:, None]  # DAPO overlong filtering: no loss on truncated rows
            total_tokens = int(loss_mask.sum())
            # Rows whose loss is 0 with a 0 gradient need no forward pass: zero advantage and no KL / entropy
            # term. They still count in the normaliser (total_sequences, total_tokens), so the update is exact.
            needs_all_rows = cfg.kl_coef > 0 or cfg.entropy_coef > 0
            active = loss_mask.any(dim=1) & (needs_all_rows | (advantages != 0))
            rows = active.nonzero().squeeze(1)  # [n_active]

            loss_fn = functools.partial(
                grpo_loss,
                shared=shared,
                rollout=rollout,
                advantages=advantages,
                loss_mask=loss_mask,
                cfg=cfg,
                temperature=gen.temperature,
                total_sequences=N,
                total_tokens=max(total_tokens, 1),
                max_len=gen.max_new_tokens,
                use_reference=reference is not None,
            )

            # 6. num_iterations optimizer steps, each over micro-batches with gradient accumulation -----------
            t_upd0 = time.perf_counter()
            mbs = resolve_micro_batch(tcfg.micro_batch_size, max(len(rows), 1), planned_mbs)
            update_stats: dict[str, float] = {}
            # backward runs inside the policy role in train mode: activation checkpointing recomputes the forward
            # there, and must see the same mode (dropout) as the forward did
            with shared.role(POLICY, train=True):
                for _ in range(cfg.num_iterations):
                    if len(rows) == 0:  # nothing to learn from this batch (e.g. every group zero-std)
                        scheduler.step()
                        continue
                    # a CUDA out-of-memory in a micro-batch halves the micro-batch and redoes the step
                    result, mbs = optimizer_step_halving(
                        params,
                        optimizer,
                        lambda size, rows=rows: (rows[s] for s in micro_batches(len(rows), size)),
                        min(mbs, state.get("micro_batch_cap", mbs)),
                        loss_fn,
                        max_grad_norm=tcfg.max_grad_norm,
                        scheduler=scheduler,
                        on_halve=lambda a, b, step=step: tqdm.write(
                            f"step {step}: out of memory at micro-batch {a}, retrying with {b}"
                        ),
                    )
                    state["micro_batch_cap"] = mbs
                    count_nonfinite(result, state, step, tcfg.max_nonfinite_in_row)
                    update_stats = dict(result.stats, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr)
            t_end = time.perf_counter()

            # 7. Iterative GRPO: refresh the reference adapter to the current policy ---------------------------
            if has_ref_adapter and cfg.ref_refresh_every > 0 and step % cfg.ref_refresh_every == 0:
                shared.copy_adapter(POLICY, REFERENCE)

            # 8. Metrics, progress, checkpoint -----------------------------------------------------------------
            answers = prompts.columns(rollout.prompt_index).get("answer")
            lengths = rollout.lengths.float()
            step_time = t_end - t0
            row = {
                "reward_mean": float(torch.nanmean(scores.total))
                if (~torch.isnan(scores.total)).any()
                else float("nan"),
                "reward_std": float(adv.group_std.mean()),
                **{f"reward/{k}": v for k, v in scores.means().items()},
                "accuracy": (sum(is_correct(c, a) for c, a in zip(rollout.completions, answers)) / N)
                if answers
                else None,
                "zero_std_frac": float(adv.zero_std.float().mean()),
                "completion_len": float(lengths.mean()),
                "truncated_frac": float(rollout.truncated.float().mean()),
                "kl": update_stats.get("kl"),
                "clip_frac_low": update_stats.get("clip_frac_low"),
                "clip_frac_high": update_stats.get("clip_frac_high"),
                "approx_kl": update_stats.get("approx_kl"),
                "entropy": update_stats.get("entropy"),
                "loss": update_stats.get("loss"),
                "grad_norm": update_stats.get("grad_norm"),
                "lr": update_stats.get("lr", scheduler.get_last_lr()[0]),
                "trained_rows": int(len(rows)),
                "reward_failures": scorer.failures,
                "skipped_updates": state["skipped_updates"],
                "step_time": step_time,
                "step_cpu_s": time.process_time() - cpu0,  # CPU seconds of this process (all threads)
                "gen_time": t_gen - t0,
                "update_time": t_end - t_upd0,
                "tokens_per_s": float(lengths.sum()) / max(step_time, 1e-9),
                "peak_mem_gb": peak_memory_gb(shared.device),
            }
            history.append(row)
            if step % tcfg.log_every == 0 or step == last_step:
                logger.log(step, row)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}",
                acc=f"{row['accuracy']:.2f}" if row["accuracy"] is not None else "-",
                len=f"{row['completion_len']:.0f}",
            )
            bar.update(1)

            state["reward_calls"], state["reward_failures"] = scorer.calls, scorer.failures
            if tcfg.save_every > 0 and (step % tcfg.save_every == 0 or step == last_step):
                from lorarl.checkpoint import save_checkpoint

                save_checkpoint(
                    run_dir,
                    step,
                    shared,
                    roles_to_save,
                    {POLICY: optimizer},
                    {POLICY: scheduler},
                    dict(state),
                    recipe,
                    keep_last=tcfg.keep_last,
                )
    finally:
        bar.close()
        logger.close()

    # -- the result: the policy adapter, a plot, a summary ----------------------------------------------------
    shared.save_adapter(POLICY, run_dir / POLICY)
    plot = plot_metrics(run_dir)
    tail = history[-10:]

    def tail_mean(key: str) -> float | None:
        vals = [r[key] for r in tail if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    return {
        "run_dir": str(run_dir),
        "policy": str(run_dir / POLICY),
        "plot": str(plot),
        "steps": last_step,
        "steps_this_run": len(history),
        "reward_mean_last10": tail_mean("reward_mean"),
        "accuracy_last10": tail_mean("accuracy"),
        "skipped_updates": state["skipped_updates"],
        "reward_failures": scorer.failures,
        "data_rows": len(prompts),
        "data_skipped_rows": len(prompts.skipped),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
