"""Token selection on the device: what the fast engine draws each token with, written as small pure functions.

Every function here is an exact rewrite of what transformers' ``generate`` does with lorarl's sampling kwargs
(:func:`lorarl.model.sampling.generate_kwargs`), so that the same logits give the same scores, the same
probabilities and - with the same random stream - the same tokens:

* scores ``s = logits / T`` in fp32 (lorarl's :class:`~lorarl.model.sampling.TemperatureScaling`; greedy decoding
  uses ``T = 1``), then top-k and top-p as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (chat and
  evaluation only; training samples the untruncated ``softmax(s)``);
* a sampled token is drawn from ``p = softmax(s)`` in one of two ways (:attr:`SamplerSettings.draw`), both exact:

  - ``race`` (the default on CUDA): ``argmax_i p_i / q_i`` with ``q_i ~ Exp(1)`` i.i.d., the exponential race,
    ``P(i wins) = p_i / sum_j p_j``. It is the algorithm ``torch.multinomial(p, 1)`` itself runs (one
    ``exponential_`` draw over ``[N, V]`` from the same generator), so with the same seed it draws ``generate``'s
    tokens; it needs no host synchronisation and can be captured in a CUDA graph (``torch.multinomial`` cannot);
  - ``inverse_cdf`` (the default on CPU): one uniform ``u`` per row and the first token whose cumulative
    probability (fp64) exceeds ``u``. Same distribution, other draws: ``V`` exponentials per row cost a CPU about
    25 ns each (1.2 ms per row and step for a 49k vocabulary, most of a small model's step at batch 64), a
    cumulative sum a fraction of that;
* greedy is ``argmax_i s_i``; the log-prob recorded for the drawn token is ``log_softmax(s)[token]`` (what
  :class:`~lorarl.model.sampling.SamplerLogprobs` records, and what scoring recomputes at the same temperature).

Finished rows (an EOS already drawn) keep decoding: their new token is replaced by the pad id
(:func:`mask_finished`), as ``generate`` does, so no shape ever depends on the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplerSettings:
    """How tokens are selected. ``temperature`` is ignored when ``greedy``; ``top_k = 0`` / ``top_p = 1`` are off.
    ``record`` computes the log-prob of every drawn token."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    record: bool = False
    draw: str = "race"  # race | inverse_cdf

    @property
    def filters(self) -> bool:
        """Whether top-k / top-p truncate the distribution (never for training rollouts)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def scaled_scores(logits: Tensor, settings: SamplerSettings) -> Tensor:
    """fp32 scores ``logits / T`` (``generate`` upcasts the last position's logits to fp32, then lorarl's
    temperature processor divides; ``T = 1`` and greedy leave them as they are).

    Example: logits ``[2., 1.]``, ``T = 0.5`` -> ``[4., 2.]``.
    """
    scores = logits.float()
    if settings.greedy or settings.temperature == 1.0:
        return scores
    return scores / settings.temperature


def top_k_filter(scores: Tensor, k: int) -> Tensor:
    """transformers' ``TopKLogitsWarper``: scores below the ``k``-th largest of their row become ``-inf``
    (``k`` is clamped to ``[1, V]``; ties with the ``k``-th value are kept).

    Example: ``[3., 1., 2.]``, ``k = 2`` -> ``[3., -inf, 2.]``.
    """
    k = min(max(k, 1), scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, -math.inf)


def top_p_filter(scores: Tensor, p: float) -> Tensor:
    """transformers' ``TopPLogitsWarper``: sort ascending, drop the tokens whose cumulative probability is at most
    ``1 - p`` (the least likely ones), always keep the most likely token.

    Example: probabilities ``[0.5, 0.3, 0.2]``, ``p = 0.7`` -> the 0.2 token is dropped (cumulative ascending
    ``0.2 <= 0.3``), the others kept.
    """
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, -math.inf)


def filtered_scores(logits: Tensor, settings: SamplerSettings) -> Tensor:
    """The scores a token is drawn from: :func:`scaled_scores`, then top-k, then top-p (the order ``generate``
    applies them: lorarl's temperature processor first, transformers' warpers after it)."""
    scores = scaled_scores(logits, settings)
    if settings.filters and settings.top_k > 0:
        scores = top_k_filter(scores, settings.top_k)
    if settings.filters and settings.top_p < 1.0:
        scores = top_p_filter(scores, settings.top_p)
    return scores


def exponential_race(probs: Tensor) -> Tensor:
    """One token per row drawn from ``probs`` ``[N, V]``: ``argmax_i p_i / q_i``, ``q_i ~ Exp(1)`` i.i.d.
    ``P(i) = p_i / sum_j p_j`` because ``q_i / p_i ~ Exp(p_i)`` and the smallest of independent exponentials
    is ``i`` with probability ``p_i / sum_j p_j``. The same draws and arithmetic as ``torch.multinomial(probs, 1)``
    (its one-sample path), hence the same tokens from the same generator state."""
    q = torch.empty_like(probs).exponential_(1)
    return torch.div(probs, q, out=q).argmax(dim=-1)


def inverse_cdf(probs: Tensor) -> Tensor:
    """One token per row drawn from ``probs`` ``[N, V]``: the first ``i`` with ``C_i > u C_V``, ``C = cumsum(p)``
    in fp64 and ``u ~ U[0, 1)`` (one draw per row). ``P(i) = (C_i - C_{i-1}) / C_V = p_i / sum_j p_j``; zero-
    probability tokens are never drawn (their ``C_i`` equals the previous one). fp64 keeps the rounding of the sum
    far below sampling noise (about ``V x 1e-16`` of probability mass).

    Example: ``p = [0.2, 0.0, 0.8]``: ``u < 0.2`` draws 0, ``u >= 0.2`` draws 2.
    """
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def select_tokens(logits: Tensor, settings: SamplerSettings) -> tuple[Tensor, Tensor | None]:
    """``(tokens [N] long, log-probs [N] fp32 or None)`` from the last position's logits ``[N, V]``.

    Greedy: ``argmax s``; else :func:`exponential_race` or :func:`inverse_cdf` on ``softmax(s)``. The log-prob is
    ``log_softmax(s)[token]`` of the scores drawn from (recorded only when ``settings.record``)."""
    scores = filtered_scores(logits, settings)
    if settings.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        draw = exponential_race if settings.draw == "race" else inverse_cdf
        tokens = draw(torch.softmax(scores, dim=-1))
    if not settings.record:
        return tokens, None
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def mask_finished(tokens: Tensor, unfinished: Tensor, pad_id: int) -> Tensor:
    """Rows that already ended get the pad id instead of their new token: ``t u + pad (1 - u)``.

    Example: tokens ``[5, 6]``, unfinished ``[True, False]``, pad 0 -> ``[5, 0]``.
    """
    return torch.where(unfinished, tokens, torch.full_like(tokens, pad_id))


def cache_length(prompt_len: int, new_tokens: int, bucket: int = 1) -> int:
    """Columns of the static KV cache: ``ceil((P + C) / bucket) x bucket`` (``bucket > 1`` lets prompts of
    different lengths reuse one cache and its captured decode step). The last generated token is never fed back,
    so ``P + C - 1`` columns are written; one spare keeps the formula simple.

    Example: ``P = 100``, ``C = 128``, bucket 128 -> 256; bucket 1 -> 228.
    """
    need = prompt_len + new_tokens
    return -(-need // bucket) * bucket
