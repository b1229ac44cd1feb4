"""PPO's per-micro-batch losses: the policy's PPO-clip (+ entropy bonus, + InstructGPT's pretraining term) and the
critic's clipped value loss, each a micro-batch's share of its minibatch loss, as :func:`lorarl.update.optimizer_step`
expects; and the pretraining-text set they read."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lorarl.core.losses import ppo_clip_loss, reduce_loss, tis_weights, value_loss
from lorarl.core.ops import masked_mean
from lorarl.data import read_jsonl
from lorarl.errors import DataError
from lorarl.model import SharedBase
from lorarl.model.tokens import pad_right
from lorarl.rollout import Rollout
from lorarl.runs import resolve_path

POLICY, CRITIC = "policy", "critic"


def load_ptx_texts(source: str, tokenizer, recipe_path: str | None, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of the ``text`` column of a .jsonl file (the InstructGPT pretraining-loss set), truncated."""
    path = resolve_path(source, recipe_path, "ppo.ptx.source")
    if not path.is_file():
        raise DataError(f"ppo.ptx.source {source}: not a file")
    out = []
    for i, row in enumerate(read_jsonl(path)):
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: row {i}: column 'text' is missing or empty")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            out.append(ids)
    if not out:
        raise DataError(f"{path}: no usable rows in ppo.ptx.source")
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
    sampler_logprobs: ``[N, T]`` what the sampler drew each token with, when the loss corrects a sampler / trainer
        mismatch (``ppo.tis``), else None.
    """

    rollout: Rollout
    mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    values: Tensor
    returns: Tensor
    sampler_logprobs: Tensor | None = None


# A micro-batch item: ("rl", rows of the batch, (minibatch sequences, minibatch tokens)) or ("ptx", text rows, None).
Item = tuple


def ptx_loss(shared: SharedBase, ptx: list[list[int]], rows: list[int]) -> Tensor:
    """InstructGPT's pretraining term (Ouyang et al. 2022, Eq. 2, the gamma term): the policy's mean negative
    log-likelihood of the text tokens of ``rows`` (at temperature 1)."""
    ids, att = pad_right([ptx[i] for i in rows], shared.pad_id)
    ids, att = ids.to(shared.device), att.to(shared.device)
    with shared.role(POLICY, train=True):
        lp, _ = shared.token_logprobs(ids, att, 1, 1.0)  # [b, L - 1]
    return -masked_mean(lp, att[:, 1:].bool())


def policy_loss(shared: SharedBase, cfg, temperature: float, batch: PPOBatch, ptx, item: Item):
    """One micro-batch's share of the policy minibatch loss (a token mean over the minibatch):

    ``sum_t [-w_t min(ratio_t A_t, clip(ratio_t, 1 +- eps) A_t) - c_H H_t] / minibatch tokens``, or for a ``ptx``
    item ``ptx_coef * NLL``; ``w_t = min(exp(old_t - sampler_t), ppo.tis.cap)`` when the batch carries the sampler's
    log-probs (truncated importance sampling, :func:`~lorarl.core.losses.tis_weights`), else 1. Returns ``(loss, {stat: (sum, count)})`` as :func:`lorarl.update.optimizer_step` expects.
    """
    kind, rows, denom = item
    if kind == "ptx":
        nll = ptx_loss(shared, ptx, rows)
        return cfg.ptx.coef * nll, {"ptx_loss": (float(nll.detach()), 1.0)}
    mb = batch.rollout.select(rows)
    m = batch.mask[rows].to(shared.device)  # [b, T]
    with shared.role(POLICY, train=True):
        logprobs, ent = shared.token_logprobs(
            mb.input_ids.to(shared.device),
            mb.attention_mask.to(shared.device),
            mb.prompt_ids.shape[1],
            temperature,
            with_entropy=True,
            entropy_grad=cfg.entropy_coef > 0,  # logged; a gradient only for the bonus
        )  # [b, T]
    per_token, pstats = ppo_clip_loss(
        logprobs,
        batch.old_logprobs[rows].to(shared.device),
        batch.advantages[rows].to(shared.device),
        m,
        cfg.clip_eps,
        cfg.clip_eps,
    )  # [b, T]
    if batch.sampler_logprobs is not None:
        old = batch.old_logprobs[rows].to(shared.device)
        per_token = per_token * tis_weights(old, batch.sampler_logprobs[rows].to(shared.device), m, cfg.tis.cap)
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * ent
    T = m.shape[1]
    loss = reduce_loss(
        per_token, m, "token_mean", total_rows=denom[0], total_sequences=denom[0], total_tokens=denom[1], max_len=T
    )
    n_tok = float(m.sum())
    stats = {k: (float(v) * n_tok, n_tok) for k, v in pstats.items()}
    stats["clip_frac"] = (float(pstats["clip_frac_low"] + pstats["clip_frac_high"]) * n_tok, n_tok)
    stats["entropy"] = (float(ent.detach()[m].sum()), n_tok)
    stats["policy_loss"] = (float(per_token.detach()[m].sum()), n_tok)
    return loss, stats


def critic_loss(shared: SharedBase, cfg, batch: PPOBatch, item: Item):
    """One micro-batch's share of the critic minibatch loss: ``c_V * sum_t l(V_t, V_old_t, R_t) / minibatch tokens``
    with ``l`` the clipped 0.5 * squared error (or Huber) of :func:`lorarl.core.losses.value_loss`."""
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
        cfg.critic.value_clip,
        cfg.critic.loss,
        cfg.critic.huber_delta,
    )  # [b, T]
    T = m.shape[1]
    loss = cfg.critic.vf_coef * reduce_loss(
        per_token, m, "token_mean", total_rows=denom[0], total_sequences=denom[0], total_tokens=denom[1], max_len=T
    )
    n_tok = float(m.sum())
    return loss, {
        "value_loss": (float(per_token.detach()[m].sum()), n_tok),
        "value_clip_frac": (float(vstats["clip_frac"]) * n_tok, n_tok),
    }
