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
from lorarl.core.preference_losses import PairLogps
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


def response_logps(shared: SharedBase, tokens: PairTokens, max_tokens: int = 0) -> tuple[Tensor, Tensor]:
    """Under the ACTIVE role: ``(log pi(y|x) [N], |y| [N])``, the summed log-probs of each row's response tokens
    (temperature 1; gradients when enabled) and its token count, both fp32, in the rows' order.

    The rows run in length-sorted groups of at most ``max_tokens`` padded tokens (0: one forward), so a short
    answer is not padded to a rambling one (:func:`lorarl.algos.reward_model.length_groups`); the values do not
    depend on the grouping (each response is scored under its own causal mask), only the padding work does. Rows
    of one pair that land in the same group share their prompt's forward."""
    p_len = tokens.prompt_mask.sum(dim=1).tolist()
    c_len = tokens.completion_mask.sum(dim=1).tolist()
    out: list[Tensor | None] = [None] * len(tokens)
    for group in length_groups([p + c for p, c in zip(p_len, c_len)], max_tokens):
        prompts = [tokens.prompt_ids[j][tokens.prompt_mask[j]].tolist() for j in group]
        responses = [tokens.completion_ids[j][: c_len[j]].tolist() for j in group]
        part = token_rows(prompts, responses, [tokens.prompt_index[j] for j in group], shared.pad_id)
        mask = part.completion_mask.to(shared.device)  # [g, T]
        logprobs, _ = completion_logprobs(shared, part, temperature=1.0)  # [g, T]
        summed = torch.where(mask, logprobs, torch.zeros((), device=logprobs.device)).sum(dim=-1)  # [g]
        for k, j in enumerate(group):
            out[j] = summed[k]
    counts = tokens.completion_mask.sum(dim=-1).float().to(shared.device)
    return torch.stack(out), counts


@torch.no_grad()
def role_logps(
    shared: SharedBase, role: str, pairs: PairSet, rows: list[int], rows_per_forward: int, max_tokens: int = 0
) -> PairLogps:
    """Summed response log-probs of ``rows`` under ``role`` (dropout off, no gradients), ``rows_per_forward`` pairs
    at a time (in length-sorted forwards of at most ``max_tokens`` padded tokens), on the CPU -> a
    :class:`PairLogps` without reference fields (``chosen``, ``rejected``, token counts)."""
    chosen, rejected, c_tok, r_tok = [], [], [], []
    with shared.role(role, train=False):
        for s in range(0, len(rows), rows_per_forward):
            part = rows[s : s + rows_per_forward]
            logps, counts = response_logps(shared, pair_tokens(pairs, part, shared.pad_id), max_tokens)
            b = len(part)
            chosen.append(logps[:b].cpu())
            rejected.append(logps[b:].cpu())
            c_tok.append(counts[:b].cpu())
            r_tok.append(counts[b:].cpu())
    return PairLogps(torch.cat(chosen), torch.cat(rejected), torch.cat(c_tok), torch.cat(r_tok))


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
) -> dict:
    """Held-out figures of ``role`` as the policy on every pair of ``pairs`` (``ref``: the reference's log-probs of
    the same pairs, None for a reference-free loss): the mean loss, TRL's reward metrics
    (:func:`implicit_reward_metrics`), the mean summed log-probs, the pair count and the accuracy per ``kind``."""
    pol = role_logps(shared, role, pairs, list(range(len(pairs))), rows_per_forward, max_tokens)
    if ref is not None:
        pol.ref_chosen, pol.ref_rejected = ref.chosen, ref.rejected
    loss, rc, rr = loss_fn(pol)
    out = {"loss": float(loss.mean()), **implicit_reward_metrics(rc, rr), "n_pairs": len(pairs)}
    out["logps/chosen"], out["logps/rejected"] = float(pol.chosen.mean()), float(pol.rejected.mean())
    by_kind = accuracy_by_kind(rc, rr, pairs)
    if by_kind:
        out["accuracy_by_kind"] = by_kind
    return out
