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

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from lorarl.config import GenerationConfig
from lorarl.model import SharedBase


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
    group_size:      ``G``.
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


def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists -> ``(ids [B, P] long, mask [B, P] bool)``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


def eos_token_ids(shared: SharedBase) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = set()
    if shared.tokenizer.eos_token_id is not None:
        ids.add(int(shared.tokenizer.eos_token_id))
    gen_eos = getattr(getattr(shared.base, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return sorted(ids)


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


def prompt_groups(prompt_index: list[int]) -> tuple[list[int], Tensor]:
    """Rows that share a prompt: ``(first row of each distinct prompt [U], row -> distinct prompt [B])``.

    Example: ``[7, 7, 3, 7]`` -> ``([0, 2], tensor([0, 0, 1, 0]))``.
    """
    first: dict[int, int] = {}
    inverse = []
    for p in prompt_index:
        if p not in first:
            first[p] = len(first)
        inverse.append(first[p])
    starts = [prompt_index.index(p) for p in first]
    return starts, torch.as_tensor(inverse, dtype=torch.long)


def completion_logprobs(
    shared: SharedBase, rollout: Rollout, temperature: float, with_entropy: bool = False, share_prompts: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[B, T]`` (and entropies) of the completion tokens of ``rollout`` under the active role, with
    gradients if enabled.

    With ``share_prompts`` each distinct prompt runs through the model once: its keys / values are indexed out to
    the rows that share it (an exact rewrite of the full forward -- gradients flow back through the shared prompt
    once per row, summed), and the completions run on top. For a group of ``G`` completions of a ``P``-token
    prompt this processes ``P + G*T`` tokens instead of ``G*(P + T)``. With gradient checkpointing on in train mode
    (no cache there) the completions are packed behind their prompt instead (:func:`packed_completion_logprobs`).
    Falls back to one full forward when the prompts are all distinct, or under checkpointing with an attention
    implementation that takes no 4-D mask (sdpa and eager do).
    """
    P = rollout.prompt_ids.shape[1]
    starts, inverse = prompt_groups(rollout.prompt_index)
    checkpointing = shared.module.training and shared.cfg.gradient_checkpointing
    takes_4d_mask = getattr(shared.base.config, "_attn_implementation", "sdpa") in ("sdpa", "eager")
    if not share_prompts or len(starts) == len(rollout) or P < 2 or (checkpointing and not takes_4d_mask):
        return shared.token_logprobs(
            rollout.input_ids.to(shared.device), rollout.attention_mask.to(shared.device), P, temperature, with_entropy
        )
    if checkpointing:
        return packed_completion_logprobs(shared, rollout, temperature, with_entropy)
    from transformers import DynamicCache

    from lorarl.model import chunked_token_logprobs

    dev = shared.device
    decoder = shared._decoder()
    starts_t = torch.as_tensor(starts, dtype=torch.long)
    p_ids, p_mask = rollout.prompt_ids[starts_t].to(dev), rollout.prompt_mask[starts_t].long().to(dev)  # [U, P]
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder(
        input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, past_key_values=DynamicCache(), use_cache=True
    )
    cache = out.past_key_values
    cache.batch_select_indices(inverse.to(dev))  # [U, ...] -> [B, ...], differentiable indexing
    full_mask = rollout.attention_mask.to(dev)  # [B, P + T]
    c_pos = ((full_mask.cumsum(-1) - 1).clamp(min=0))[:, P:]  # [B, T]
    c_out = decoder(
        input_ids=rollout.completion_ids.to(dev),
        attention_mask=full_mask,
        position_ids=c_pos,
        past_key_values=cache,
        use_cache=True,
    )
    last_prompt = out.last_hidden_state[:, -1:][inverse.to(dev)]  # [B, 1, H]: predicts completion token 0
    hidden = torch.cat([last_prompt, c_out.last_hidden_state[:, :-1]], dim=1)  # [B, T, H]: state before token t
    head = shared._lm_head()
    return chunked_token_logprobs(
        hidden, head, rollout.completion_ids.to(dev), temperature, shared.cfg.logprob_chunk_size, with_entropy
    )


PACK_TOKENS = 1024  # a pack holds one prompt and as many of its completions as fit in this many tokens


@dataclass
class PrefixPacks:
    """Completions packed behind their shared prompt, one pack per row (see :func:`pack_completions`).

    input_ids [R, L], position_ids [R, L] long; attention_mask [R, 1, L, L] bool (True: query may attend to key);
    pack [B, T] and column [B, T] long: where the hidden state that predicts completion token ``(b, t)`` sits.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    pack: Tensor
    column: Tensor


def pack_completions(rollout: Rollout, pad_id: int, pack_tokens: int = PACK_TOKENS) -> PrefixPacks:
    """Lay out the rows of ``rollout`` as packs ``[prompt | completion 1 | completion 2 | ...]``: each distinct
    prompt is written once and its completions follow it (only their masked tokens). Every completion token
    attends to the whole prompt and causally to its own completion, never to a sibling; its position id continues
    the prompt's (``p, p+1, ...``), so each completion sees exactly what it sees in its own row. A pack is closed
    when the next completion would take it past ``pack_tokens`` (a pack always takes at least one completion).
    Padding attends only to itself (no empty softmax rows).

    Example: prompt ``[a, b]``, completions ``[x, y]`` and ``[z]`` -> ids ``[a, b, x, y, z]``, positions
    ``[0, 1, 2, 3, 2]``; ``z`` attends to ``a, b, z``; ``x`` is predicted at column 1 (``b``), ``y`` at 2, ``z`` at 1.
    """
    B, T = rollout.completion_ids.shape
    packs: list[tuple[list[int], list[int], list[int]]] = []  # (ids, positions, segment: -1 prompt, k completion k)
    pack_of = torch.zeros(B, T, dtype=torch.long)
    column_of = torch.zeros(B, T, dtype=torch.long)
    open_pack: dict[int, int] = {}  # prompt index -> its pack still taking completions
    for b in range(B):
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b]].tolist()
        completion = rollout.completion_ids[b][rollout.completion_mask[b]].tolist()
        key = rollout.prompt_index[b]
        k = open_pack.get(key)
        if k is None or len(packs[k][0]) + len(completion) > max(pack_tokens, len(prompt) + len(completion)):
            k = len(packs)
            packs.append((list(prompt), list(range(len(prompt))), [-1] * len(prompt)))
            open_pack[key] = k
        ids, pos, seg = packs[k]
        p, start = len(prompt), len(ids)
        ids.extend(completion)
        pos.extend(range(p, p + len(completion)))
        seg.extend([b] * len(completion))
        pack_of[b] = k
        cols = torch.arange(T) + start - 1  # token t is predicted by the state just before it ...
        cols[0] = p - 1  # ... and the first one by the prompt's last token
        column_of[b] = cols.clamp(max=max(start + len(completion) - 1, p - 1))
    L = max(len(ids) for ids, _, _ in packs)
    R = len(packs)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segment = torch.full((R, L), -2, dtype=torch.long)  # -2: padding
    for r, (ids, pos, seg) in enumerate(packs):
        input_ids[r, : len(ids)] = torch.as_tensor(ids)
        position_ids[r, : len(ids)] = torch.as_tensor(pos)
        segment[r, : len(ids)] = torch.as_tensor(seg)
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]  # [R, L, 1], [R, 1, L]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = (k_seg == q_seg) & (q_seg != -2)
    allowed = causal & ((k_seg == -1) | same)
    allowed |= torch.eye(L, dtype=torch.bool)  # padding rows see themselves
    return PrefixPacks(input_ids, position_ids, allowed[:, None], pack_of, column_of)


def packed_completion_logprobs(
    shared: SharedBase, rollout: Rollout, temperature: float, with_entropy: bool = False, pack_tokens: int = PACK_TOKENS
) -> tuple[Tensor, Tensor | None]:
    """:func:`completion_logprobs` through prompt-sharing packs (:func:`pack_completions`): one plain forward with
    a 4-D attention mask and no cache, so it works under activation checkpointing. For ``G`` completions of a
    ``P``-token prompt the model runs ``P + sum(lengths)`` tokens instead of ``G * (P + T)``. Positions past a
    row's completion mask get log-prob (and entropy) 0."""
    from lorarl.model import chunked_token_logprobs

    dev = shared.device
    packs = pack_completions(rollout, shared.tokenizer.pad_token_id, pack_tokens)
    decoder = shared._decoder()
    dtype = decoder.get_input_embeddings().weight.dtype
    allowed = packs.attention_mask.to(dev)  # moved as bool: a quarter of fp32's bytes
    bias = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    out = decoder(  # an additive 4-D mask: eager and sdpa both take it
        input_ids=packs.input_ids.to(dev),
        attention_mask=bias,
        position_ids=packs.position_ids.to(dev),
        use_cache=False,
    )
    hidden = out.last_hidden_state[packs.pack.to(dev), packs.column.to(dev)]  # [B, T, H]
    head = shared._lm_head()
    mask = rollout.completion_mask.to(dev)
    lp, ent = chunked_token_logprobs(
        hidden, head, rollout.completion_ids.to(dev), temperature, shared.cfg.logprob_chunk_size, with_entropy
    )
    lp = lp.masked_fill(~mask, 0.0)
    return lp, (ent.masked_fill(~mask, 0.0) if ent is not None else None)


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

    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = shared._decoder()(
        input_ids=input_ids.to(shared.device),
        attention_mask=attention_mask.long().to(shared.device),
        position_ids=position_ids.to(shared.device),
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
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos_ids = eos_token_ids(shared)
    index = prompt_index if prompt_index is not None else list(range(len(prompts)))
    rows = [p for p in prompts for _ in range(group_size)]  # [N] grouped: G copies of each prompt in a row
    row_index = [i for i in index for _ in range(group_size)]
    prompt_ids, prompt_mask = pad_left(rows, pad_id)
    new_tokens = max_new_tokens or generation.max_new_tokens
    kwargs = {"max_new_tokens": new_tokens, "eos_token_id": eos_ids, "pad_token_id": pad_id}
    if greedy:
        kwargs.update(do_sample=False, top_k=None, top_p=None, temperature=None)
    else:
        kwargs.update(
            do_sample=True, temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k
        )
    n = len(rows)
    P = prompt_ids.shape[1]
    chunks = []
    with shared.role(role, train=False):
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
    if record_old:
        rollout.old_logprobs = sequence_logprobs(shared, role, rollout, generation.temperature, batch_size)
    if reference:
        rollout.ref_logprobs = sequence_logprobs(shared, reference, rollout, generation.temperature, batch_size)
    return rollout
