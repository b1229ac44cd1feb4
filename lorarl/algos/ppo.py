"""PPO (InstructGPT-style RLHF) on ONE shared base: every role is a way of running the same base weights.

| role       | how it runs                                                        | trained here          |
|------------|--------------------------------------------------------------------|-----------------------|
| policy     | LoRA adapter ``policy`` (from ``model.init_adapter`` if set)       | yes, its own AdamW    |
| old policy | the policy's log-probs recorded at rollout                         | no                    |
| reference  | adapters disabled, or the frozen ``reference`` adapter (= the      | no                    |
|            | ``model.init_adapter`` the policy started from)                    |                       |
| critic     | LoRA adapter ``critic`` + fp32 value head (optionally warm-started | yes, its own AdamW    |
|            | from the reward adapter)                                           |                       |
| reward     | LoRA adapter ``reward`` + fp32 score head, from                    | no (frozen, loaded    |
|            | ``recipes/reward_model.yaml``                                      | with trainable=False) |

Read :func:`train` top to bottom. Each step has the four phases of the seeds (and of CleanRL's ppo.py):

1. **Rollout** -- a batch of prompts; one batched ``generate`` with the policy (dropout off); masks from generation
   (through the first EOS); old log-probs with the policy and reference log-probs, at the sampling temperature.
2. **Reward** -- the reward adapter's score at the final token (the last non-pad token) and/or rule rewards; optional
   running normalisation and clipping; a fixed score for responses without EOS; then per-token rewards
   ``r_t = -beta (log pi_old(a_t|s_t) - log pi_ref(a_t|s_t)) + score * 1[t = last]`` (Ziegler et al. 2019;
   InstructGPT Eq. 2), with ``beta`` fixed or adaptive (Ziegler et al.'s proportional controller).
3. **Advantages** -- values ``V(s_t)`` from the critic adapter + value head; GAE (Schulman et al. 2016) with
   ``gamma``, ``lam`` and the masks; value targets ``returns = advantages + values``; advantage whitening.
4. **Optimisation** -- ``ppo.epochs`` x shuffled minibatches x micro-batches (gradient accumulation): the policy
   minimises PPO-clip ``- c_H * entropy`` (``+ ptx_coef *`` the InstructGPT pretraining loss on a text set), the
   critic ``c_V *`` the clipped value loss (or Huber); the epochs stop early once the minibatch approx KL passes
   ``ppo.target_approx_kl``.

The policy's and the critic's parameters are disjoint, so minimising the seeds' combined objective
``-L_clip + c_V L_V - c_H H`` is exactly one step of each optimizer on its own part (``c_V`` then only matters for
the critic's gradient clipping: Adam is invariant to the loss scale).
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lorarl.advantages import AdaptiveKLController, FixedKLController, gae, kl_shaped_rewards
from lorarl.algos.grpo import batch_indices, peak_memory_gb, resolve_micro_batch, set_threads, start_run, step_seed
from lorarl.algos.reward_model import REWARD, resolve_reward_adapter
from lorarl.config import Recipe
from lorarl.data import load_prompts, read_jsonl
from lorarl.errors import DataError, LorarlError
from lorarl.losses import ppo_clip_loss, reduce_loss, value_loss
from lorarl.metrics import MetricsLogger, plot_metrics
from lorarl.model import REFERENCE, SharedBase
from lorarl.ops import masked_mean, masked_var, masked_whiten
from lorarl.rewards import RewardScorer, is_correct
from lorarl.rollout import Rollout, generate_rollout
from lorarl.update import count_nonfinite, make_scheduler, micro_batches, optimizer_step_halving

POLICY, CRITIC = "policy", "critic"
PLOT_PANELS = (
    ("reward (score before shaping)", ("reward_mean",)),
    ("KL to reference (per sequence)", ("kl",)),
    ("critic explained variance", ("explained_variance",)),
    ("response length (tokens)", ("completion_len",)),
)


# ---------------------------------------------------------------------------------------------------------------
# Small helpers (the loop itself is `train` below)
# ---------------------------------------------------------------------------------------------------------------


class RunningMoments:
    """Running mean and std of every score seen so far (Chan et al.'s parallel update), for reward normalisation.

    Example: ``m.update(tensor([1., 3.]))`` then ``m.update(tensor([5.]))`` -> ``mean 3``, ``std 2`` (unbiased).
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        b_mean, b_var = float(x.mean()), float(x.var(unbiased=False)) if n > 1 else 0.0
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * max(self.count - 1, 0) + b_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / max(total - 1, 1)
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def normalize(self, x: Tensor, eps: float = 1e-6) -> Tensor:
        return (x - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[returns - values] / Var[returns]`` over the valid tokens: 1 is a perfect critic, 0 no better than a
    constant, < 0 worse. NaN when the returns do not vary.

    Example: values ``[1, 2, 3]``, returns ``[1, 2, 4]`` -> ``1 - (1/3) / (7/3) = 0.857``.
    """
    var_ret = masked_var(returns, mask)
    if float(var_ret) == 0.0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_ret)


@torch.no_grad()
def role_scores(shared: SharedBase, ids: Tensor, att: Tensor, batch_size: int) -> Tensor:
    """The reward role's score of each sequence (dropout off, read at the last non-pad token) -> ``[N]`` fp32 CPU."""
    out = []
    with shared.role(REWARD, train=False):
        for s in range(0, ids.shape[0], batch_size):
            out.append(
                shared.scores(
                    ids[s : s + batch_size].to(shared.device), att[s : s + batch_size].to(shared.device), head=REWARD
                )
                .float()
                .cpu()
            )
    return torch.cat(out)


@torch.no_grad()
def role_values(shared: SharedBase, ids: Tensor, att: Tensor, start: int, batch_size: int) -> Tensor:
    """The critic's ``V(s_t)`` for the states before each completion token (dropout off) -> ``[N, T]`` fp32 CPU."""
    out = []
    with shared.role(CRITIC, train=False):
        for s in range(0, ids.shape[0], batch_size):
            out.append(
                shared.values(
                    ids[s : s + batch_size].to(shared.device), att[s : s + batch_size].to(shared.device), start
                )
                .float()
                .cpu()
            )
    return torch.cat(out)


def setup_roles(shared: SharedBase, recipe: Recipe) -> dict:
    """Add the PPO roles to the one base; return what was added.

    * ``policy``: fresh LoRA, or ``model.init_adapter`` (then ``reference`` is that adapter, frozen);
    * ``reward``: the trained reward adapter + score head, frozen (``trainable=False``), when a step needs it;
    * ``critic``: fresh LoRA (``ppo.critic_lora``) + value head, or a trainable copy of the reward adapter + head.
    """
    cfg = recipe.ppo
    base_dir = Path(recipe.source_path).parent if recipe.source_path else None
    uses_rm = cfg.reward_source in ("reward_model", "both")
    reward_folder = None
    if uses_rm or cfg.critic_init == "reward":
        if not cfg.reward_adapter:
            raise LorarlError(
                "ppo.reward_adapter is not set: train a reward model first (`lorarl train recipes/reward_model.yaml "
                "--out runs/reward_model`) and point ppo.reward_adapter at its run directory"
            )
        reward_folder = resolve_reward_adapter(cfg.reward_adapter, base_dir)
    init = recipe.model.init_adapter
    if init:
        shared.add_adapter(POLICY, init_from=init, trainable=True)
        shared.add_adapter(REFERENCE, init_from=init, trainable=False)
    else:
        shared.add_adapter(POLICY, recipe.lora)
    if uses_rm:
        shared.add_adapter(REWARD, init_from=reward_folder, trainable=False, head=True)
    if cfg.critic_init == "reward":
        shared.add_adapter(CRITIC, init_from=reward_folder, trainable=True, head=True)
    else:
        shared.add_adapter(CRITIC, cfg.critic_lora, head=True)
    return {"reward_folder": reward_folder, "reference_adapter": bool(init), "uses_rm": uses_rm}


def load_ptx_texts(source: str, tokenizer, base_dir: Path | None, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of the ``text`` column of a .jsonl file (the InstructGPT pretraining-loss set), truncated."""
    path = Path(source).expanduser()
    if not path.is_absolute() and not path.exists() and base_dir is not None and (base_dir / path).exists():
        path = base_dir / path
    if not path.is_file():
        raise DataError(f"ppo.ptx_source {source}: no such file")
    out = []
    for i, row in enumerate(read_jsonl(path)):
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: row {i}: column 'text' is missing or empty")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            out.append(ids)
    if not out:
        raise DataError(f"{path}: no usable rows in ppo.ptx_source")
    return out


@dataclass
class PPOBatch:
    """What phases 1-3 of one step produced, on CPU (``N`` responses, ``T`` completion columns).

    rollout: the :class:`~lorarl.rollout.Rollout` (prompt / completion ids and masks).
    mask: ``[N, T]`` bool, True on response tokens through the first EOS.
    old_logprobs: ``[N, T]`` log pi_old(a_t | s_t) recorded at rollout.
    advantages: ``[N, T]`` GAE advantages (whitened if asked).
    values: ``[N, T]`` V_old(s_t), the critic at rollout (the centre of value clipping).
    returns: ``[N, T]`` value targets, advantages + values (before whitening).
    """

    rollout: Rollout
    mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    values: Tensor
    returns: Tensor


# A micro-batch item: ("rl", rows of the batch, (minibatch sequences, minibatch tokens)) or ("ptx", text rows, None).
Item = tuple


def ptx_loss(shared: SharedBase, ptx: list[list[int]], rows: list[int]) -> Tensor:
    """InstructGPT's pretraining term (Ouyang et al. 2022, Eq. 2, the gamma term): the policy's mean negative
    log-likelihood of the text tokens of ``rows`` (at temperature 1)."""
    width = max(len(ptx[i]) for i in rows)
    ids = torch.full((len(rows), width), shared.tokenizer.pad_token_id)
    att = torch.zeros_like(ids)
    for k, i in enumerate(rows):
        ids[k, : len(ptx[i])] = torch.tensor(ptx[i])
        att[k, : len(ptx[i])] = 1
    ids, att = ids.to(shared.device), att.to(shared.device)
    with shared.role(POLICY, train=True):
        lp, _ = shared.token_logprobs(ids, att, 1, 1.0)  # [b, L - 1]
    return -masked_mean(lp, att[:, 1:].bool())


def policy_loss(shared: SharedBase, cfg, temperature: float, batch: PPOBatch, ptx, item: Item):
    """One micro-batch's share of the policy minibatch loss (a token mean over the minibatch):

    ``sum_t [-min(ratio_t A_t, clip(ratio_t, 1 +- eps) A_t) - c_H H_t] / minibatch tokens``, or for a ``ptx`` item
    ``ptx_coef * NLL``. Returns ``(loss, {stat: (sum, count)})`` as :func:`lorarl.update.optimizer_step` expects.
    """
    kind, rows, denom = item
    if kind == "ptx":
        nll = ptx_loss(shared, ptx, rows)
        return cfg.ptx_coef * nll, {"ptx_loss": (float(nll.detach()), 1.0)}
    mb = batch.rollout.select(rows)
    m = batch.mask[rows].to(shared.device)  # [b, T]
    with shared.role(POLICY, train=True):
        logprobs, ent = shared.token_logprobs(
            mb.input_ids.to(shared.device),
            mb.attention_mask.to(shared.device),
            mb.prompt_ids.shape[1],
            temperature,
            with_entropy=True,
        )  # [b, T]
    per_token, pstats = ppo_clip_loss(
        logprobs,
        batch.old_logprobs[rows].to(shared.device),
        batch.advantages[rows].to(shared.device),
        m,
        cfg.clip_eps,
        cfg.clip_eps,
    )  # [b, T]
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    T = m.shape[1]
    loss = reduce_loss(per_token, m, "token_mean", total_sequences=denom[0], total_tokens=denom[1], max_len=T)
    n_tok = float(m.sum())
    stats = {k: (float(v) * n_tok, n_tok) for k, v in pstats.items()}
    stats["clip_frac"] = (float(pstats["clip_frac_low"] + pstats["clip_frac_high"]) * n_tok, n_tok)
    stats["entropy"] = (float(ent.detach()[m].sum()), n_tok)
    stats["policy_loss"] = (float(per_token.detach()[m].sum()), n_tok)
    return loss, stats


def critic_loss(shared: SharedBase, cfg, batch: PPOBatch, item: Item):
    """One micro-batch's share of the critic minibatch loss: ``c_V * sum_t l(V_t, V_old_t, R_t) / minibatch tokens``
    with ``l`` the clipped 0.5 * squared error (or Huber) of :func:`lorarl.losses.value_loss`."""
    _, rows, denom = item
    mb = batch.rollout.select(rows)
    m = batch.mask[rows].to(shared.device)  # [b, T]
    with shared.role(CRITIC, train=True):
        v = shared.values(mb.input_ids.to(shared.device), mb.attention_mask.to(shared.device), mb.prompt_ids.shape[1])
    per_token, vstats = value_loss(
        v,
        batch.values[rows].to(shared.device),
        batch.returns[rows].to(shared.device),
        m,
        cfg.value_clip,
        cfg.value_loss,
        cfg.huber_delta,
    )  # [b, T]
    T = m.shape[1]
    loss = cfg.vf_coef * reduce_loss(
        per_token, m, "token_mean", total_sequences=denom[0], total_tokens=denom[1], max_len=T
    )
    n_tok = float(m.sum())
    return loss, {
        "value_loss": (float(per_token.detach()[m].sum()), n_tok),
        "value_clip_frac": (float(vstats["clip_frac"]) * n_tok, n_tok),
    }


def _finite_mean(values: list) -> float | None:
    vals = [v for v in values if isinstance(v, float) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def train(recipe: Recipe, out_dir: str | os.PathLike, *, resume: bool = False, max_steps: int | None = None) -> dict:
    """Train the policy (and critic) adapters with PPO; write the run directory ``out_dir``; return a summary.

    ``out_dir`` gets ``recipe.yaml``, ``metrics.jsonl``, ``tb/``, ``checkpoints/step-NNNNNN/`` (every
    ``train.save_every`` steps: policy + critic adapters and heads, both optimizers and schedulers, the KL
    coefficient, the reward statistics, the data position, RNG states), and at the end ``policy/``, ``critic/`` and
    ``plot.png``. ``resume`` continues from the newest checkpoint; ``max_steps`` stops after that step.
    """
    t_start = time.perf_counter()
    cfg, gen, tcfg = recipe.ppo, recipe.generation, recipe.train
    run_dir = start_run(recipe, out_dir)
    base_dir = Path(recipe.source_path).parent if recipe.source_path else None

    # -- set-up: ONE base; policy, reference, critic and reward are ways of running it -------------------------
    shared = SharedBase.load(recipe.model)
    roles = setup_roles(shared, recipe)
    uses_rules = cfg.reward_source in ("rules", "both")
    scorer = RewardScorer(recipe.rewards, timeout_s=tcfg.reward_timeout_s or None) if uses_rules else None
    prompts = load_prompts(recipe.data, shared.tokenizer, "train")
    ptx = load_ptx_texts(cfg.ptx_source, shared.tokenizer, base_dir) if cfg.ptx_coef > 0 else None
    need_ref = cfg.kl_coef > 0  # beta = 0 and fixed: the reference never runs
    ref_role = REFERENCE if need_ref else None  # "reference": the frozen init adapter, else adapters disabled

    policy_params = shared.trainable_parameters(POLICY)
    critic_params = shared.trainable_parameters(CRITIC)  # exactly the critic adapter + value head
    policy_opt = torch.optim.AdamW(policy_params, lr=tcfg.learning_rate, weight_decay=tcfg.weight_decay)
    critic_opt = torch.optim.AdamW(
        critic_params, lr=cfg.critic_learning_rate or tcfg.learning_rate, weight_decay=tcfg.weight_decay
    )
    N = tcfg.prompts_per_step
    updates_per_step = cfg.epochs * math.ceil(N / cfg.minibatch_size)
    policy_sched = make_scheduler(policy_opt, tcfg.lr_scheduler, tcfg.warmup_steps, tcfg.steps * updates_per_step)
    critic_sched = make_scheduler(critic_opt, tcfg.lr_scheduler, tcfg.warmup_steps, tcfg.steps * updates_per_step)
    kl_ctl = (
        AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_coef)
    )
    reward_stats = RunningMoments()
    mbs = resolve_micro_batch(tcfg.micro_batch_size, min(N, cfg.minibatch_size))
    fwd_bs = resolve_micro_batch(recipe.eval.batch_size, N)  # rows per no-grad forward (scores, values)
    last_step = min(tcfg.steps, max_steps) if max_steps else tcfg.steps
    optimizers = {POLICY: policy_opt, CRITIC: critic_opt}
    schedulers = {POLICY: policy_sched, CRITIC: critic_sched}

    state = {"nonfinite_in_row": 0, "skipped_updates": 0, "reward_calls": 0, "reward_failures": 0}
    start_step = 0
    if resume:
        from lorarl.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            saved = load_checkpoint(ckpt, shared, optimizers, schedulers)
            start_step = int(saved["step"])
            state.update({k: saved[k] for k in state if k in saved})
            kl_ctl.load_state_dict(saved["kl_ctl"])
            reward_stats.load_state_dict(saved["reward_stats"])
            if scorer is not None:
                scorer.calls, scorer.failures = state["reward_calls"], state["reward_failures"]
    logger = MetricsLogger(run_dir, resume_step=start_step if resume else None)

    from tqdm.auto import tqdm

    bar = tqdm(total=last_step, initial=start_step, desc="ppo", unit="step", dynamic_ncols=True)
    history: list[dict] = []

    def check_nonfinite(result, step: int, who: str) -> None:
        count_nonfinite(result, state, step, tcfg.max_nonfinite_in_row, who)

    try:
        for step in range(start_step + 1, last_step + 1):
            t0 = time.perf_counter()
            torch.manual_seed(step_seed(tcfg.seed, step))

            # ===== Phase 1. Rollout: sample with the policy; old and reference log-probs =======================
            idx = batch_indices(len(prompts), N, tcfg.seed, step)
            rollout = generate_rollout(
                shared,
                [prompts.token_ids[i] for i in idx],
                gen,
                role=POLICY,
                record_old=True,
                reference=ref_role,
                prompt_index=idx,
            )
            P = rollout.prompt_ids.shape[1]
            mask = rollout.completion_mask  # [N, T] bool, through the first EOS
            ids, att = rollout.input_ids, rollout.attention_mask  # [N, P + T]
            old_logprobs = rollout.old_logprobs  # [N, T]
            ref_logprobs = rollout.ref_logprobs if need_ref else old_logprobs  # [N, T]
            t_gen = time.perf_counter()

            # ===== Phase 2. Reward: score at the final token, then the per-token KL penalty ======================
            score = torch.zeros(N)
            rm_score = None
            if roles["uses_rm"]:
                rm_score = role_scores(shared, ids, att, fwd_bs)  # [N]
                score = score + (cfg.reward_model_weight if uses_rules else 1.0) * rm_score
            rule_means: dict[str, float] = {}
            if uses_rules:
                rs = scorer.score_rollout(prompts, rollout)
                for name, err in rs.failures.items():
                    tqdm.write(f"step {step}: reward {name} failed ({err}); counted as 0")
                scorer.check_failure_budget(tcfg.max_reward_failure_fraction, rs.failures)
                score = score + torch.nan_to_num(rs.total, nan=0.0)
                rule_means = rs.means()
            raw_score = score.clone()  # [N] what eval reports as reward_mean
            if cfg.reward_normalize:
                reward_stats.update(score)
                score = reward_stats.normalize(score)
            if cfg.reward_clip is not None:
                score = score.clamp(-cfg.reward_clip, cfg.reward_clip)
            if cfg.no_eos_penalty is not None:
                score = torch.where(rollout.truncated, torch.full_like(score, cfg.no_eos_penalty), score)
            beta = kl_ctl.value
            rewards, kl = kl_shaped_rewards(score, old_logprobs, ref_logprobs, mask, beta)  # [N, T] each

            # ===== Phase 3. Values from the critic; GAE; value targets; whitening ================================
            values = role_values(shared, ids, att, P, fwd_bs)  # [N, T] V(s_t)
            advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)  # [N, T] each
            ev = explained_variance(values, returns, mask)
            if cfg.whiten_advantages:
                advantages = masked_whiten(advantages, mask)

            # ===== Phase 4. K epochs x shuffled minibatches x micro-batches ======================================
            t_upd0 = time.perf_counter()
            batch = PPOBatch(rollout, mask, old_logprobs, advantages, values, returns)
            policy_fn = functools.partial(policy_loss, shared, cfg, gen.temperature, batch, ptx)
            critic_fn = functools.partial(critic_loss, shared, cfg, batch)
            shuffle = torch.Generator().manual_seed(step_seed(tcfg.seed, step) + 1)
            acc: dict[str, list[float]] = {}
            minibatches_done, early_stop = 0, False
            for _epoch in range(cfg.epochs):
                order = torch.randperm(N, generator=shuffle)
                for s in range(0, N, cfg.minibatch_size):
                    mb_rows = order[s : s + cfg.minibatch_size]
                    denom = (len(mb_rows), max(float(mask[mb_rows].sum()), 1.0))  # the minibatch's sequences, tokens
                    ptx_item = None
                    if ptx is not None:
                        first = (minibatches_done * cfg.ptx_batch_size) % len(ptx)
                        ptx_item = ("ptx", [(first + k) % len(ptx) for k in range(cfg.ptx_batch_size)], None)

                    def rl_items(size, mb_rows=mb_rows, denom=denom):
                        return [("rl", mb_rows[sl], denom) for sl in micro_batches(len(mb_rows), size)]

                    # Each whole step (forward AND backward) runs with its role active: gradient checkpointing
                    # recomputes the forward during backward, with whatever adapter is active at that moment.
                    # A CUDA out-of-memory in a micro-batch halves the micro-batch and redoes that optimizer step.
                    with shared.role(POLICY, train=True):
                        pres, mbs = optimizer_step_halving(
                            policy_params,
                            policy_opt,
                            lambda size, rl_items=rl_items, ptx_item=ptx_item: (
                                rl_items(size) + ([ptx_item] if ptx_item else [])
                            ),
                            mbs,
                            policy_fn,
                            max_grad_norm=tcfg.max_grad_norm,
                            scheduler=policy_sched,
                        )
                    check_nonfinite(pres, step, "policy")
                    with shared.role(CRITIC, train=True):
                        cres, mbs = optimizer_step_halving(
                            critic_params,
                            critic_opt,
                            rl_items,
                            mbs,
                            critic_fn,
                            max_grad_norm=tcfg.max_grad_norm,
                            scheduler=critic_sched,
                        )
                    check_nonfinite(cres, step, "critic")
                    minibatches_done += 1
                    for k, v in {
                        **pres.stats,
                        **cres.stats,
                        "policy_grad_norm": pres.grad_norm,
                        "critic_grad_norm": cres.grad_norm,
                    }.items():
                        acc.setdefault(k, []).append(v)
                    if cfg.target_approx_kl is not None and pres.stats.get("approx_kl", 0.0) > cfg.target_approx_kl:
                        early_stop = True
                        break
                if early_stop:
                    break
            seq_kl = float((kl * mask).sum(dim=1).mean())  # mean over sequences of sum_t (log pi_old - log pi_ref)
            kl_ctl.update(seq_kl, n_steps=N)
            t_end = time.perf_counter()

            # ===== Metrics, progress, checkpoint =================================================================
            def mean_of(key: str, acc: dict = acc) -> float | None:
                return _finite_mean(acc.get(key, []))

            answers = prompts.columns(rollout.prompt_index).get("answer")
            lengths = rollout.lengths.float()
            m_f = mask.float()
            row = {
                "reward_mean": float(raw_score.mean()),
                "reward_std": float(raw_score.std()) if N > 1 else 0.0,
                "rm_score": float(rm_score.mean()) if rm_score is not None else None,
                **{f"reward/{k}": v for k, v in rule_means.items()},
                "score_used": float(score.mean()),
                "accuracy": (sum(is_correct(c, a) for c, a in zip(rollout.completions, answers)) / N)
                if answers
                else None,
                "kl": seq_kl if need_ref else None,
                "kl_per_token": float((kl * m_f).sum() / m_f.sum().clamp(min=1)) if need_ref else None,
                "kl_coef": beta,
                "approx_kl": mean_of("approx_kl"),
                "clip_frac": mean_of("clip_frac"),
                "entropy": mean_of("entropy"),
                "policy_loss": mean_of("policy_loss"),
                "ptx_loss": mean_of("ptx_loss"),
                "value_loss": mean_of("value_loss"),
                "value_clip_frac": mean_of("value_clip_frac"),
                "explained_variance": ev,
                "values_mean": float(masked_mean(values, mask)),
                "returns_mean": float(masked_mean(returns, mask)),
                "returns_final": float(returns[:, 0].mean()),
                "completion_len": float(lengths.mean()),
                "truncated_frac": float(rollout.truncated.float().mean()),
                "epochs_done": minibatches_done / max(math.ceil(N / cfg.minibatch_size), 1),
                "early_stop": early_stop,
                "policy_grad_norm": mean_of("policy_grad_norm"),
                "critic_grad_norm": mean_of("critic_grad_norm"),
                "lr": policy_sched.get_last_lr()[0],
                "skipped_updates": state["skipped_updates"],
                "step_time": t_end - t0,
                "gen_time": t_gen - t0,
                "update_time": t_end - t_upd0,
                "tokens_per_s": float(lengths.sum()) / max(t_end - t0, 1e-9),
                "peak_mem_gb": peak_memory_gb(shared.device),
            }
            history.append(row)
            if step % tcfg.log_every == 0 or step == last_step:
                logger.log(step, row)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}",
                ev=f"{ev:.2f}",
                kl=f"{seq_kl:.2f}",
                len=f"{row['completion_len']:.0f}",
            )
            bar.update(1)
            if scorer is not None:
                state["reward_calls"], state["reward_failures"] = scorer.calls, scorer.failures
            if tcfg.save_every > 0 and (step % tcfg.save_every == 0 or step == last_step):
                from lorarl.checkpoint import save_checkpoint

                extra = {
                    "kl_ctl": kl_ctl.state_dict(),
                    "reward_stats": reward_stats.state_dict(),
                    "data_position": step * N,
                }
                save_checkpoint(
                    run_dir,
                    step,
                    shared,
                    [POLICY, CRITIC],
                    optimizers,
                    schedulers,
                    {**state, **extra},
                    recipe,
                    keep_last=tcfg.keep_last,
                )
    finally:
        bar.close()
        logger.close()

    # -- the result: policy and critic adapters, a plot, a summary ----------------------------------------------
    shared.save_adapter(POLICY, run_dir / POLICY)
    shared.save_adapter(CRITIC, run_dir / CRITIC)
    plot = plot_metrics(run_dir, panels=PLOT_PANELS)

    def tail_mean(key: str, k: int = 10) -> float | None:
        vals = [r[key] for r in history[-k:] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    return {
        "run_dir": str(run_dir),
        "policy": str(run_dir / POLICY),
        "critic": str(run_dir / CRITIC),
        "plot": str(plot),
        "steps": last_step,
        "steps_this_run": len(history),
        "reward_mean_first10": (sum(r["reward_mean"] for r in history[:10]) / min(len(history), 10))
        if history
        else None,
        "reward_mean_last10": tail_mean("reward_mean"),
        "explained_variance_last10": tail_mean("explained_variance"),
        "kl_last10": tail_mean("kl"),
        "kl_coef": kl_ctl.value,
        "skipped_updates": state["skipped_updates"],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


# ---------------------------------------------------------------------------------------------------------------
# Evaluation: held-out prompts, greedy, scored by the reward adapter
# ---------------------------------------------------------------------------------------------------------------


def evaluate(recipe: Recipe, checkpoint: str, n: int | None = None, *, shared: SharedBase | None = None) -> dict:
    """Greedy responses to ``n`` held-out prompts (default ``eval.n``) from ``checkpoint`` -- a PPO run directory
    (its ``policy/``), an adapter folder, or ``base`` (the starting point: the base, or ``model.init_adapter``) --
    scored like training scores them (reward adapter at the final token and/or rule rewards, before normalisation).

    Returns ``{reward_mean, rm_score, accuracy (where prompts have answers), n, completion_len, truncated_frac,
    checkpoint, seconds}``.
    """
    from lorarl.evaluate import load_eval_adapter, resolve_checkpoint

    t0 = time.perf_counter()
    cfg, ecfg = recipe.ppo, recipe.eval
    n = n or ecfg.n
    base_dir = Path(recipe.source_path).parent if recipe.source_path else None
    set_threads()
    if shared is None:
        shared = SharedBase.load(recipe.model)
    uses_rm = cfg.reward_source in ("reward_model", "both")
    uses_rules = cfg.reward_source in ("rules", "both")
    if uses_rm and not shared.has_adapter(REWARD):
        if not cfg.reward_adapter:
            raise LorarlError("ppo.reward_adapter is not set: the reward adapter scores the held-out responses")
        shared.add_adapter(
            REWARD, init_from=resolve_reward_adapter(cfg.reward_adapter, base_dir), trainable=False, head=True
        )
    adapter = (
        resolve_checkpoint(checkpoint)
        if checkpoint != "base"
        else (Path(recipe.model.init_adapter) if recipe.model.init_adapter else None)
    )
    role = load_eval_adapter(shared, adapter)
    prompts = load_prompts(recipe.data, shared.tokenizer, "eval", size=max(n, recipe.data.eval_size))
    k = min(n, len(prompts))
    scorer = RewardScorer(recipe.rewards, timeout_s=recipe.train.reward_timeout_s or None) if uses_rules else None
    totals, rm_scores, completions, lengths, truncated = [], [], [], [], []
    for s in range(0, k, ecfg.batch_size):
        idx = list(range(s, min(s + ecfg.batch_size, k)))
        r = generate_rollout(
            shared,
            [prompts.token_ids[i] for i in idx],
            recipe.generation,
            role=role,
            greedy=True,
            max_new_tokens=ecfg.max_new_tokens,
            prompt_index=idx,
        )
        total = torch.zeros(len(idx))
        if uses_rm:
            rm = role_scores(shared, r.input_ids, r.attention_mask, ecfg.batch_size)
            rm_scores.append(rm)
            total = total + (cfg.reward_model_weight if uses_rules else 1.0) * rm
        if uses_rules:
            rs = scorer.score_rollout(prompts, r)
            total = total + torch.nan_to_num(rs.total, nan=0.0)
        totals.append(total)
        completions += r.completions
        lengths += r.lengths.tolist()
        truncated += r.truncated.tolist()
    answers = prompts.columns(list(range(k))).get("answer")
    out = {
        "checkpoint": "base" if adapter is None else str(adapter),
        "n": k,
        "reward_mean": float(torch.cat(totals).mean()),
        "rm_score": float(torch.cat(rm_scores).mean()) if rm_scores else None,
        "accuracy": (sum(is_correct(c, a) for c, a in zip(completions, answers)) / k) if answers else None,
        "completion_len": sum(lengths) / k,
        "truncated_frac": sum(truncated) / k,
        "example": completions[0] if completions else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return out
