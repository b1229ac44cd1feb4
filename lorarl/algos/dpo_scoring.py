"""Scoring preference pairs on the shared base for DPO: summed response log-probs under a role, the reference's
log-probs (per batch or for the whole set), and the held-out implicit-reward metrics.

A micro-batch of ``b`` pairs is one :class:`lorarl.model.logprobs.TokenBatch` of ``2b`` rows -- the chosen responses,
then the rejected ones -- whose two rows of a pair share their prompt (``prompt_index``), so the prompt runs through
the model once for both (:func:`lorarl.model.completion_logprobs`: prefix-shared, or packed under activation
checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.algos.reward_model import length_groups
from lorarl.core.preference_scores import PairLogps, ld_token_weights, log_sum_sq_probs, wpo_weights
from lorarl.data.pairs import PairSet
from lorarl.model import SharedBase, completion_logprobs
from lorarl.model.tokens import pad_left, pad_right


@dataclass
class PairTokens:
    """``b`` pairs as ``2b`` rows (chosen rows first, then rejected), a :class:`~lorarl.model.logprobs.TokenBatch`.

    prompt_ids / prompt_mask:         ``[2b, P]`` left padded.
    completion_ids / completion_mask: ``[2b, T]`` right padded; the mask covers each response through its EOS.
    prompt_index:                     ``2b`` labels: the pair's row index, twice.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    prompt_index: list[int]

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


def pair_tokens(pairs: PairSet, rows: list[int], pad_id: int) -> PairTokens:
    """Rows ``rows`` of ``pairs`` as a :class:`PairTokens` (chosen responses, then rejected ones).

    Example: rows ``[4, 7]`` -> prompt_index ``[4, 7, 4, 7]``; row 2 is pair 4's rejected response."""
    prompts = [pairs.prompt_ids[i] for i in rows] * 2
    responses = [pairs.chosen_ids[i] for i in rows] + [pairs.rejected_ids[i] for i in rows]
    return token_rows(prompts, responses, list(rows) * 2, pad_id)


def token_rows(prompts: list[list[int]], responses: list[list[int]], prompt_index: list[int], pad_id: int):
    """Prompts left padded, responses right padded -> :class:`PairTokens` (rows with the same ``prompt_index``
    share their prompt)."""
    p_ids, p_mask = pad_left(prompts, pad_id)
    c_ids, c_mask = pad_right(responses, pad_id)
    return PairTokens(p_ids, p_mask, c_ids, c_mask.bool(), list(prompt_index))


@dataclass(frozen=True)
class Scoring:
    """How a pair's responses are scored (TRL's DPO options): ``ld_alpha`` LD-DPO's weight of the tokens past the
    pair's shorter response (None: plain sums); ``wpo`` whether WPO's weights are computed from the same forward."""

    ld_alpha: float | None = None
    wpo: bool = False


PLAIN = Scoring()


@dataclass
class RowLogps:
    """Per row of a :class:`PairTokens`, fp32 ``[N]``: ``logps`` the summed response log-probs (LD-weighted under
    ``ld_alpha``), ``counts`` ``|y|``, ``full`` the plain sums (``logps`` itself without ``ld_alpha``), ``wpo`` WPO's
    weight of the response (None unless asked)."""

    logps: Tensor
    counts: Tensor
    full: Tensor
    wpo: Tensor | None = None


def response_logps(shared: SharedBase, tokens: PairTokens, max_tokens: int = 0, scoring: Scoring = PLAIN) -> RowLogps:
    """Under the ACTIVE role: the summed log-probs of each row's response tokens (temperature 1; gradients when
    enabled) and its token count, fp32, in the rows' order (:class:`RowLogps`).

    With ``scoring.ld_alpha`` the sum weighs the tokens past the pair's shorter response by alpha (LD-DPO,
    :func:`~lorarl.core.preference_scores.ld_token_weights`; the rows of a pair are ``b`` apart, chosen first); with
    ``scoring.wpo`` each response's WPO weight comes from the same forward (its ``log sum p^2`` per position,
    detached: :func:`~lorarl.core.preference_scores.wpo_weights`).

    The rows run in length-sorted groups of at most ``max_tokens`` padded tokens (0: one forward), so a short
    answer is not padded to a rambling one (:func:`lorarl.algos.reward_model.length_groups`); the values do not
    depend on the grouping (each response is scored under its own causal mask), only the padding work does. Rows
    of one pair that land in the same group share their prompt's forward."""
    p_len = tokens.prompt_mask.sum(dim=1).tolist()
    c_len = tokens.completion_mask.sum(dim=1)  # [N]
    shared_len = None  # [N]: the pair's shorter response (LD-DPO only: other callers' rows need not be pairs)
    if scoring.ld_alpha is not None:
        b = len(tokens) // 2
        shared_len = torch.minimum(c_len[:b], c_len[b:]).repeat(2)
    n = len(tokens)
    out: dict[str, list] = {"logps": [None] * n, "full": [None] * n, "wpo": [None] * n}
    for group in length_groups([p + c for p, c in zip(p_len, c_len.tolist())], max_tokens):
        prompts = [tokens.prompt_ids[j][tokens.prompt_mask[j]].tolist() for j in group]
        responses = [tokens.completion_ids[j][: int(c_len[j])].tolist() for j in group]
        part = token_rows(prompts, responses, [tokens.prompt_index[j] for j in group], shared.pad_id)
        mask = part.completion_mask.to(shared.device)  # [g, T]
        logprobs, stat = completion_logprobs(
            shared, part, temperature=1.0, with_entropy=scoring.wpo, entropy_grad=False, token_stat=log_sum_sq_probs
        )  # [g, T] each (stat: WPO's log sum p^2, or None)
        full = torch.where(mask, logprobs, torch.zeros((), device=logprobs.device)).sum(dim=-1)  # [g]
        summed = full
        if scoring.ld_alpha is not None:
            weights = ld_token_weights(mask, shared_len[group], scoring.ld_alpha, logprobs.dtype)  # [g, T]
            summed = (torch.where(mask, logprobs, torch.zeros((), device=logprobs.device)) * weights).sum(dim=-1)
        wpo = wpo_weights(logprobs, stat, mask) if scoring.wpo else None  # [g]
        for k, j in enumerate(group):
            out["logps"][j], out["full"][j] = summed[k], full[k]
            out["wpo"][j] = None if wpo is None else wpo[k]
    counts = c_len.float().to(shared.device)
    return RowLogps(
        torch.stack(out["logps"]),
        counts,
        torch.stack(out["full"]),
        torch.stack(out["wpo"]) if scoring.wpo else None,
    )


def pair_logps(rows: RowLogps, b: int, scoring: Scoring) -> PairLogps:
    """The ``2b`` scored rows of ``b`` pairs (chosen first) -> a :class:`PairLogps` without reference fields: WPO's
    pair weight ``w(y_w) w(y_l)`` with ``scoring.wpo``, the chosen responses' plain sums with ``ld_alpha``."""
    return PairLogps(
        rows.logps[:b],
        rows.logps[b:],
        rows.counts[:b],
        rows.counts[b:],
        weights=rows.wpo[:b] * rows.wpo[b:] if rows.wpo is not None else None,
        chosen_full=rows.full[:b] if scoring.ld_alpha is not None else None,
    )


@torch.no_grad()
def role_logps(
    shared: SharedBase,
    role: str,
    pairs: PairSet,
    rows: list[int],
    rows_per_forward: int,
    max_tokens: int = 0,
    scoring: Scoring = PLAIN,
) -> PairLogps:
    """Summed response log-probs of ``rows`` under ``role`` (dropout off, no gradients), ``rows_per_forward`` pairs
    at a time (in length-sorted forwards of at most ``max_tokens`` padded tokens), on the CPU -> a
    :class:`PairLogps` without reference fields (``chosen``, ``rejected``, token counts; WPO's weights and the
    plain chosen sums as ``scoring`` asks)."""
    parts: list[PairLogps] = []
    with shared.role(role, train=False):
        for s in range(0, len(rows), rows_per_forward):
            part = rows[s : s + rows_per_forward]
            scored = response_logps(shared, pair_tokens(pairs, part, shared.pad_id), max_tokens, scoring)
            parts.append(pair_logps(scored, len(part), scoring))

    def cat(name: str) -> Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values).cpu()

    return PairLogps(
        *(cat(k) for k in ("chosen", "rejected", "chosen_tokens", "rejected_tokens")),
        weights=cat("weights"),
        chosen_full=cat("chosen_full"),
    )


def implicit_reward_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's DPO reward metrics from the implicit rewards ``[B]``: ``rewards/chosen``, ``rewards/rejected`` (means),
    ``rewards/accuracies`` (fraction with chosen > rejected; a tie counts as wrong), ``rewards/margins`` (mean of
    chosen - rejected).

    Example: chosen ``[1, 0]``, rejected ``[0, 0]`` -> accuracies 0.5, margins 0.5."""
    return {
        f"{prefix}rewards/chosen": float(chosen_rewards.mean()),
        f"{prefix}rewards/rejected": float(rejected_rewards.mean()),
        f"{prefix}rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
        f"{prefix}rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
    }


def accuracy_by_kind(chosen_rewards: Tensor, rejected_rewards: Tensor, pairs: PairSet) -> dict[str, float] | None:
    """Implicit-reward accuracy per value of the pairs' ``kind`` column (None when they have none)."""
    kinds = [p["columns"].get("kind") for p in pairs.pairs[: chosen_rewards.numel()]]
    if all(k is None for k in kinds):
        return None
    by: dict[str, list[float]] = {}
    for k, right in zip(kinds, (chosen_rewards > rejected_rewards).tolist()):
        by.setdefault(str(k), []).append(float(right))
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def pair_metrics(
    shared: SharedBase,
    pairs: PairSet,
    role: str,
    ref: PairLogps | None,
    loss_fn,
    rows_per_forward: int,
    max_tokens: int,
    scoring: Scoring = PLAIN,
) -> dict:
    """Held-out figures of ``role`` as the policy on every pair of ``pairs`` (``ref``: the reference's log-probs of
    the same pairs, None for a reference-free loss): the mean loss, TRL's reward metrics
    (:func:`implicit_reward_metrics`), the mean summed log-probs, the pair count and the accuracy per ``kind``.
    The loss sees every held-out pair at once (``aot`` sorts across all of them)."""
    pol = role_logps(shared, role, pairs, list(range(len(pairs))), rows_per_forward, max_tokens, scoring)
    if ref is not None:
        pol.ref_chosen, pol.ref_rejected = ref.chosen, ref.rejected
    loss, rc, rr = loss_fn(pol)
    out = {"loss": float(loss.mean()), **implicit_reward_metrics(rc, rr), "n_pairs": len(pairs)}
    out["logps/chosen"], out["logps/rejected"] = float(pol.chosen.mean()), float(pol.rejected.mean())
    by_kind = accuracy_by_kind(rc, rr, pairs)
    if by_kind:
        out["accuracy_by_kind"] = by_kind
    return out
