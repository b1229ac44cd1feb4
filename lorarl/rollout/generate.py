"""Rollouts: sample completions with one role of the shared base and record what the update needs.

One function, :func:`generate_rollout`: it repeats each prompt ``group_size`` times, samples every completion in
one batched ``generate`` call (prompts left padded, so all completions start at the same column), builds the
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
from lorarl.model.sampling import generate_kwargs
from lorarl.model.tokens import completion_mask, pad_left, position_ids
from lorarl.phases import phase
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
def prefill_cache(shared: SharedBase, input_ids: Tensor, attention_mask: Tensor):
    """Run prompts ``[M, P']`` through the active role's decoder once (no logits) -> a ``DynamicCache`` of their
    keys / values, with the same position ids ``generate`` uses for left-padded rows."""
    from transformers import DynamicCache

    out = shared.decoder()(
        input_ids=input_ids.to(shared.device),
        attention_mask=attention_mask.long().to(shared.device),
        position_ids=position_ids(attention_mask).to(shared.device),
        past_key_values=DynamicCache(),
        use_cache=True,
    )
    return out.past_key_values


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
) -> Rollout:
    """Sample ``group_size`` completions for each prompt (token-id lists) with ``role`` and record log-probs.

    ``greedy`` decodes greedily (evaluation); otherwise sampling uses ``generation``'s temperature / top_p / top_k.
    ``record_old`` records ``old_logprobs`` with ``role``; ``reference`` (a role name, e.g. ``"reference"``)
    records ``ref_logprobs``. ``batch_size`` splits generation and scoring into chunks of rows (default: one
    ``generate`` call for everything). ``prompt_index`` labels the prompts (default ``0..len(prompts)-1``).
    """
    tok = shared.tokenizer
    pad_id = shared.pad_id
    eos_ids = shared.eos_ids
    index = prompt_index if prompt_index is not None else list(range(len(prompts)))
    rows = [p for p in prompts for _ in range(group_size)]  # [N] grouped: G copies of each prompt in a row
    row_index = [i for i in index for _ in range(group_size)]
    prompt_ids, prompt_mask = pad_left(rows, pad_id)
    kwargs = generate_kwargs(
        greedy=greedy,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        max_new_tokens=max_new_tokens or generation.max_new_tokens,
        eos_ids=eos_ids,
        pad_id=pad_id,
    )
    n = len(rows)
    P = prompt_ids.shape[1]
    chunks = []
    with phase("generation"), shared.role(role, train=False):
        if group_size > 1 and P > 1 and batch_size is None:
            # The G copies of a prompt share their prefix: run the prompt once, copy its KV cache G times, and let
            # generate() continue from it (it computes only the last prompt token). Prefill work drops G-fold.
            unique_ids, unique_mask = pad_left(prompts, pad_id)  # [M, P]
            cache = prefill_cache(shared, unique_ids[:, :-1], unique_mask[:, :-1])
            cache.batch_repeat_interleave(group_size)
            ids, mask = prompt_ids.to(shared.device), prompt_mask.long().to(shared.device)
            out = shared.generate(ids, mask, past_key_values=cache, **kwargs)
            chunks.append((0, out[:, P:].cpu()))
        else:
            step = batch_size or n
            for s in range(0, n, step):
                ids, mask = (
                    prompt_ids[s : s + step].to(shared.device),
                    prompt_mask[s : s + step].long().to(shared.device),
                )
                out = shared.generate(ids, mask, **kwargs)
                chunks.append((s, out[:, P:].cpu()))
    width = max(c.shape[1] for _, c in chunks)
    completion_ids = torch.full((n, max(width, 1)), pad_id, dtype=torch.long)  # [N, T] right padded
    for s, c in chunks:
        completion_ids[s : s + c.shape[0], : c.shape[1]] = c
    mask, truncated = completion_mask(completion_ids, eos_ids)
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
    with phase("scoring"):
        if record_old:
            rollout.old_logprobs = sequence_logprobs(shared, role, rollout, generation.temperature, batch_size)
        if reference:
            rollout.ref_logprobs = sequence_logprobs(shared, reference, rollout, generation.temperature, batch_size)
    return rollout
