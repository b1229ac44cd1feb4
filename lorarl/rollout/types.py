"""The rollout batch: ``N`` completions grouped by prompt, with their masks and recorded log-probs."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Rollout:
    """``N`` completions, grouped: rows ``[g*G, (g+1)*G)`` answer prompt ``g`` (``G = group_size``).

    prompt_ids:      ``[N, P]`` long, left padded.
    prompt_mask:     ``[N, P]`` bool, True on prompt tokens.
    completion_ids:  ``[N, T]`` long, right padded (``T`` = the longest completion, at most ``max_new_tokens``).
    completion_mask: ``[N, T]`` bool, True on completion tokens up to and including the first EOS.
    truncated:       ``[N]`` bool, True where no EOS came within ``max_new_tokens``.
    completions:     ``N`` decoded completion texts (special tokens dropped).
    prompt_index:    ``N`` indices of each row's prompt in the prompt list given (each repeated ``G`` times).
    old_logprobs:    ``[N, T]`` fp32 log-probs of the completion tokens under the sampling policy, or None.
    ref_logprobs:    ``[N, T]`` fp32 log-probs under the reference, or None.
    sampler_logprobs: ``[N, T]`` fp32 log-probs the sampler drew each token with (0 outside the mask), or None.
    group_size:      ``G``.
    model_mask:      ``[N, T]`` bool, True on the tokens the model sampled, or None (= ``completion_mask``). A
                     multi-turn trajectory (:mod:`lorarl.agents`) is one completion holding the model's turns and the
                     tool messages between them: ``completion_mask`` covers all of it (attended), ``model_mask`` only
                     the model's tokens (the loss, KL, parity and critic count these).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    completions: list[str]
    prompt_index: list[int]
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    group_size: int = 1
    sampler_logprobs: Tensor | None = None
    model_mask: Tensor | None = None

    @property
    def loss_mask(self) -> Tensor:
        """``[N, T]`` bool: the tokens the model sampled (``model_mask``, else ``completion_mask``)."""
        return self.completion_mask if self.model_mask is None else self.model_mask

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """``[N, P + T]`` prompt and completion."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``[N, P + T]`` long: prompt tokens and completion tokens through the first EOS."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1).long()

    @property
    def lengths(self) -> Tensor:
        """``[N]`` completion lengths in tokens (EOS included)."""
        return self.completion_mask.sum(dim=1)

    def completion_token_lists(self) -> list[list[int]]:
        """``N`` lists of completion token ids (mask applied)."""
        return [ids[m].tolist() for ids, m in zip(self.completion_ids, self.completion_mask)]

    def select(self, rows: Tensor | list[int] | slice) -> Rollout:
        """The rows ``rows`` as a Rollout (for micro-batches); prompt columns that are all padding are dropped."""
        if isinstance(rows, slice):
            rows = list(range(len(self)))[rows]
        idx = torch.as_tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx.tolist()]
            else:
                out[f.name] = v
        keep = out["prompt_mask"].any(dim=0).nonzero()
        first = int(keep[0]) if len(keep) else out["prompt_mask"].shape[1] - 1
        out["prompt_ids"], out["prompt_mask"] = out["prompt_ids"][:, first:], out["prompt_mask"][:, first:]
        return Rollout(**out)
