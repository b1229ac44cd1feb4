"""Token conventions, each written once: padding, position ids, the last valid index, EOS ids, completion masks.

One mask meaning everywhere: ``True`` (or 1) where a token counts. Masks come from the tokens a model generated or
the lengths of the sequences given, never from comparing ids with ``pad_token_id`` (pad may equal EOS: SmolLM2,
Llama-3 chat models, Qwen2.5 all have such set-ups).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists -> ``(ids [B, P] long, mask [B, P] bool)``. Prompts are left padded so every
    completion starts at the same column.

    Example: ``[[5, 6], [7]]``, pad 0 -> ids ``[[5, 6], [0, 7]]``, mask ``[[1, 1], [0, 1]]``.
    """
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists -> ``(ids [B, L] long, mask [B, L] long)`` (whole sequences scored from their start:
    reward-model pairs, SFT examples, pretraining text).

    Example: ``[[5, 6], [7]]``, pad 0 -> ids ``[[5, 6], [7, 0]]``, mask ``[[1, 1], [1, 0]]``.
    """
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids, mask


def position_ids(attention_mask: Tensor) -> Tensor:
    """Position ids ``[B, L]`` long from an attention mask: ``cumsum(mask) - 1``, clamped at 0, so a left-padded row
    counts its first real token as position 0 (what ``generate`` uses; padding gets 0 and is masked anyway).

    Example: mask ``[[0, 1, 1], [1, 1, 1]]`` -> ``[[0, 0, 1], [0, 1, 2]]``.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Index ``[B]`` of the last position of each row where the mask is set (-1 for an all-zero row). Read from the
    attention mask, never from ``pad_token_id``.

    Example: mask ``[[1, 1, 0], [0, 1, 1]]`` -> ``[1, 2]``.
    """
    T = attention_mask.shape[1]
    positions = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values


def _as_ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    if isinstance(value, Iterable):
        return {int(v) for v in value if v is not None}
    return set()


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion, sorted: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models often list end-of-turn and end-of-text). Generation stops at any of them; the reward model reads
    its score at the one that ended the response (:func:`append_eos` keeps training on the same ids).
    """
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return sorted(ids)


def end_of_turn_id(model, tokenizer) -> int:
    """The EOS id a finished chat response ends with: the one the chat template closes an assistant turn with, when
    it is one of :func:`eos_token_ids` (``<|im_end|>`` for Qwen2.5 and SmolLM2, ``<|eot_id|>`` for Llama-3), else
    the tokenizer's EOS. The one EOS rule: a completion ends at its first id of :func:`eos_token_ids`, and wherever
    a finished response is scored by a reward model -- in its training pairs and in rollouts -- its final token is
    written as this id (:func:`with_end_of_turn`), so the score is always read at the token it was trained on."""
    eos = eos_token_ids(model, tokenizer)
    if getattr(tokenizer, "chat_template", None) and len(eos) > 1:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=False
            )
            closing = [i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in eos]
            if closing:
                return int(closing[-1])
        except Exception:  # a template that needs other roles or variables: fall back to the tokenizer's EOS
            pass
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    if eos:
        return eos[0]
    raise ValueError("the tokenizer has no EOS token and the model's generation config lists none")


def with_end_of_turn(ids: list[int], eos_ids: list[int], end_id: int) -> list[int]:
    """A response's token ids ending with exactly one ``end_id``: a final EOS of another kind is replaced, a
    missing one appended.

    Example: eos ``{2, 9}``, end 2: ``[5, 9]`` -> ``[5, 2]``; ``[5]`` -> ``[5, 2]``; ``[5, 2]`` -> ``[5, 2]``.
    """
    if ids and ids[-1] in eos_ids:
        return list(ids[:-1]) + [end_id]
    return list(ids) + [end_id]


def end_finished_with(completion_ids: Tensor, mask: Tensor, truncated: Tensor, end_id: int) -> Tensor:
    """``completion_ids [N, T]`` with the last token of every finished (not truncated) row -- the EOS that ended it,
    whichever id -- written as ``end_id``; truncated rows unchanged.

    Example: ids ``[[5, 9, 0], [5, 6, 7]]``, mask ``[[1, 1, 0], [1, 1, 1]]``, truncated ``[F, T]``, end 2
    -> ``[[5, 2, 0], [5, 6, 7]]``.
    """
    out = completion_ids.clone()
    last = mask.long().sum(dim=1) - 1  # [N]
    rows = (~truncated) & (last >= 0)
    out[rows, last[rows]] = end_id
    return out


def completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """From generated ids ``[N, T]``: ``(mask [N, T] bool, truncated [N] bool)``.

    The mask is True up to and including each row's first EOS and False after it (generation pads finished rows,
    with a pad that may itself be EOS). Rows without EOS are truncated: all ``T`` positions count.

    Example: eos 2, ids ``[[5, 2, 2], [5, 6, 7]]`` -> mask ``[[1, 1, 0], [1, 1, 1]]``, truncated ``[False, True]``.
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device))
    eos_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # an EOS strictly before this position
    mask = ~eos_before
    truncated = ~is_eos.any(dim=1)
    return mask, truncated
