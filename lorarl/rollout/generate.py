"""Rollouts: sample completions with one role of the shared base and record what the update needs.

One function, :func:`generate_rollout`: it samples ``group_size`` completions of each prompt with a decode engine
(:mod:`lorarl.rollout.engines`; prompts left padded, so all completions start at the same column), builds the
completion mask from the generated ids (up to and including the first EOS, nothing after: pad may equal EOS),
drops trailing all-pad columns, and records log-probs with dropout off, at the sampling temperature:

* ``old_logprobs`` with the policy, only when asked (GRPO with ``num_iterations == 1`` does not need them: the
  detached log-probs of the training forward are the same numbers),
* ``ref_logprobs`` with the reference role, only when asked (``kl_coef > 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorarl.config import GenerationConfig
from lorarl.model import SharedBase
from lorarl.model.logprobs import completion_logprobs
from lorarl.model.tokens import completion_mask, pad_left
from lorarl.phases import phase
from lorarl.rollout.engines import Engine
from lorarl.rollout.registry import make_engine
from lorarl.rollout.types import Rollout


@torch.no_grad()
def sequence_logprobs(
    shared: SharedBase, role: str, rollout: Rollout, temperature: float, batch_size: int | None = None
) -> Tensor:
    """Completion log-probs ``[N, T]`` under ``role`` (dropout off), ``batch_size`` rows at a time."""
    n = len(rollout)
    step = batch_size or n
    out = []
    with shared.role(role, train=False):
        for s in range(0, n, step):
            lp, _ = completion_logprobs(shared, rollout.select(slice(s, s + step)), temperature)
            out.append(lp.float().cpu())
    return torch.cat(out, dim=0)


@torch.no_grad()
def generate_rollout(
    shared: SharedBase,
    prompts: list[list[int]],
    generation: GenerationConfig,
    *,
    group_size: int = 1,
    role: str = "policy",
    greedy: bool = False,
    max_new_tokens: int | None = None,
    record_old: bool = False,
    reference: str | None = None,
    batch_size: int | None = None,
    prompt_index: list[int] | None = None,
    record_sampler: bool = False,
    engine: Engine | None = None,
) -> Rollout:
    """Sample ``group_size`` completions for each prompt (token-id lists) with ``role`` and record log-probs.

    ``greedy`` decodes greedily (evaluation); otherwise sampling uses ``generation``'s temperature / top_p / top_k.
    ``record_old`` records ``old_logprobs`` with ``role``; ``reference`` (a role name, e.g. ``"reference"``)
    records ``ref_logprobs``. ``batch_size`` splits generation and scoring into chunks of rows (default: one
    ``generate`` call for everything). ``prompt_index`` labels the prompts (default ``0..len(prompts)-1``).
    ``record_sampler`` keeps the log-prob the sampler drew each token with (``sampler_logprobs``, for the parity
    health check). ``engine`` decodes (default: ``generation.engine``).
    """
    tok = shared.tokenizer
    index = prompt_index if prompt_index is not None else list(range(len(prompts)))
    rows = [p for p in prompts for _ in range(group_size)]  # [N] grouped: G copies of each prompt in a row
    row_index = [i for i in index for _ in range(group_size)]
    prompt_ids, prompt_mask = pad_left(rows, shared.pad_id)
    engine = engine or make_engine(generation.engine_for(shared.device.type))
    with phase("generation"), shared.role(role, train=False):
        sampled = engine.sample(
            shared,
            prompts,
            group_size,
            generation,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
            record_logprobs=record_sampler,
            batch_size=batch_size,
        )
    completion_ids = sampled.completion_ids
    mask, truncated = completion_mask(completion_ids, shared.eos_ids)
    T = max(int(mask.sum(dim=1).max()), 1)  # drop trailing columns that are padding in every row
    completion_ids, mask = completion_ids[:, :T], mask[:, :T]
    texts = tok.batch_decode([ids[m].tolist() for ids, m in zip(completion_ids, mask)], skip_special_tokens=True)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=truncated,
        completions=texts,
        prompt_index=row_index,
        group_size=group_size,
    )
    if sampled.sampler_logprobs is not None:
        rollout.sampler_logprobs = sampled.sampler_logprobs[:, :T].masked_fill(~mask, 0.0)
    with phase("scoring"):
        if record_old:
            rollout.old_logprobs = sequence_logprobs(shared, role, rollout, generation.temperature, batch_size)
        if reference:
            rollout.ref_logprobs = sequence_logprobs(shared, reference, rollout, generation.temperature, batch_size)
    return rollout
