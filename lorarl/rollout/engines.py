"""Decode engines: what turns prompts into sampled completions for a rollout, behind one interface.

An engine samples ``group_size`` completions per prompt with the active role of the shared base and returns the
generated ids (right padded) and, when asked, the log-probability the sampler drew each token with (the parity
health check compares it with what the trainer computes). ``generation.engine`` picks one (``auto``, the default:
``fast`` on CUDA, ``hf`` elsewhere, :meth:`lorarl.config.GenerationConfig.engine_for`):

* ``hf`` (:class:`HFEngine`): transformers' ``generate`` through PEFT, each prompt prefilled once for its ``G``
  samples (its KV cache copied ``G`` times), every sampling field explicit (:mod:`lorarl.model.sampling`).
* ``fast`` (:class:`~lorarl.rollout.fast.FastEngine`): a static KV cache, the model's own decode step on one token
  per row (captured once as a CUDA graph and replayed on CUDA), tokens drawn on the device (on CUDA with
  ``torch.multinomial``'s own algorithm), the live LoRA adapter unmerged; falls back to ``hf`` for models it
  cannot drive (``docs/rollout_engine.md``).

Engines are registered by name in :data:`lorarl.rollout.registry.ENGINES`, above this module and the fast engine
(which falls back to :class:`HFEngine`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, fields
from typing import Protocol, cast

import torch
from torch import Tensor

from lorarl.config import GenerationConfig
from lorarl.model import SharedBase
from lorarl.model.kvcache import cache_arg, output_cache
from lorarl.model.sampling import SamplerLogprobs, generation_kwargs
from lorarl.model.tokens import pad_left, position_ids
from lorarl.rollout.prefix_kv import KeptRows, ReusesKV, fed_columns
from lorarl.runstate import abandon_if_stopped, observed_stop
from lorarl.stepprogress import progress_criteria


@dataclass
class Sampled:
    """What an engine returns for ``N`` rows (prompt ``i`` repeated ``G`` times, grouped).

    completion_ids:   ``[N, T]`` long, the new tokens, padded after each row's end with the pad id.
    sampler_logprobs: ``[N, T]`` fp32 log-prob each token was drawn with, or None when not recorded.
    """

    completion_ids: Tensor
    sampler_logprobs: Tensor | None = None


@dataclass(frozen=True)
class SampleCall:
    """One :meth:`Engine.sample` call, gathered for a :class:`DecodeEngine`'s ``_sample`` (the fields are
    ``sample``'s parameters after ``shared``)."""

    prompts: list[list[int]]
    group_size: int
    generation: GenerationConfig
    greedy: bool = False
    max_new_tokens: int | None = None
    record_logprobs: bool = False
    batch_size: int | None = None

    def keywords(self) -> dict:
        """The call's parameters by name, as ``sample`` takes them (fields not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Engine(Protocol):
    """Samples completions with the active role (called inside ``shared.role(...)``, no grad). Any object with a
    ``name`` and this ``sample`` is an engine (the tests' doubles, the gate runtime); lorarl's own engines subclass
    :class:`DecodeEngine` and inherit this ``sample``, so its signature is written once."""

    name: str

    def sample(
        self,
        shared: SharedBase,
        prompts: list[list[int]],
        group_size: int,
        generation: GenerationConfig,
        *,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        record_logprobs: bool = False,
        batch_size: int | None = None,
    ) -> Sampled:
        """``group_size`` completions of each prompt (token-id lists), sampled with ``generation``'s temperature /
        top-p / top-k (or greedily), at most ``max_new_tokens`` (default ``generation.max_new_tokens``);
        ``batch_size`` rows per decode batch (default: all). For a :class:`DecodeEngine`: its ``_sample`` on the
        call's parameters gathered in a :class:`SampleCall`."""
        call = SampleCall(prompts, group_size, generation, greedy, max_new_tokens, record_logprobs, batch_size)
        return cast("DecodeEngine", self)._sample(shared, call)


class DecodeEngine(ReusesKV, Engine):
    """Base of lorarl's own engines (:class:`HFEngine`, :class:`~lorarl.rollout.fast.FastEngine`): the public
    ``sample`` is :meth:`Engine.sample`'s, which calls :meth:`_sample`; ``with engine.reusing_kv():`` from
    :class:`~lorarl.rollout.prefix_kv.ReusesKV`."""

    @abstractmethod
    def _sample(self, shared: SharedBase, call: SampleCall) -> Sampled:
        """:meth:`Engine.sample` with its parameters after ``shared`` gathered in ``call``."""


@torch.no_grad()
def stop_criteria() -> dict:
    """``generate``'s ``stopping_criteria`` for the stop flag a training step observes
    (:func:`lorarl.runstate.observed_stop`): every row ends at the next token once a stop is requested. Empty
    outside a training step."""
    watched = observed_stop()
    if watched is None:
        return {}
    from lorarl.model.sampling import stopping_criteria

    return {"stopping_criteria": stopping_criteria(watched)}


def prefill_cache(shared: SharedBase, input_ids: Tensor, attention_mask: Tensor):
    """Run prompts ``[M, P']`` through the active role's decoder once (no logits) -> a ``DynamicCache`` of their
    keys / values, with the same position ids ``generate`` uses for left-padded rows."""
    from transformers import DynamicCache

    out = shared.decoder()(
        input_ids=input_ids.to(shared.device),
        attention_mask=attention_mask.long().to(shared.device),
        position_ids=position_ids(attention_mask).to(shared.device),
        **cache_arg(DynamicCache()),
        use_cache=True,
    )
    return output_cache(out)


class HFEngine(DecodeEngine):
    """transformers' ``generate`` (the reference implementation every other engine is tested against). Inside
    ``with engine.reusing_kv():`` a call continues the previous call's rows where its prompts extend them: their
    kept keys / values go to ``generate`` as its cache, which then computes only the new prompt tokens
    (:mod:`lorarl.rollout.prefix_kv`)."""

    name = "hf"

    def _sample(self, shared: SharedBase, call: SampleCall) -> Sampled:
        prompts, group_size, batch_size = call.prompts, call.group_size, call.batch_size
        pad_id = shared.pad_id
        rows = [p for p in prompts for _ in range(group_size)]  # [N] grouped: G copies of each prompt in a row
        prompt_ids, prompt_mask = pad_left(rows, pad_id)
        n, P = len(rows), prompt_ids.shape[1]
        recorder = SamplerLogprobs() if call.record_logprobs else None
        kwargs = generation_kwargs(
            call.generation,
            greedy=call.greedy,
            eos_ids=shared.eos_ids,
            pad_id=pad_id,
            max_new_tokens=call.max_new_tokens,
            recorder=recorder,
        )
        chunks: list[tuple[int, Tensor, Tensor | None]] = []
        kv = self.prefix_kv
        if kv is not None:
            kv.check(shared)
            kv.begin()
        shared_prefill = group_size > 1 and P > 1 and batch_size is None
        if kv is not None and kv.kept is not None and group_size == 1:
            # continue the kept rows: each chunk left padded on its own, its matched columns handed over as the cache
            step = batch_size or n
            for s in range(0, n, step):
                ids, mask, cache, _ = kv.prefill_cache(shared, rows[s : s + step])
                out = self._generate(shared, ids, mask, cache, kwargs, rows[s : s + step])
                chunks.append((s, out.cpu(), recorder.finish(out) if recorder else None))
        elif shared_prefill:
            # The G copies of a prompt share their prefix: run the prompt once, copy its KV cache G times, and let
            # generate() continue from it (it computes only the last prompt token). Prefill work drops G-fold.
            unique_ids, unique_mask = pad_left(prompts, pad_id)  # [M, P]
            cache = prefill_cache(shared, unique_ids[:, :-1], unique_mask[:, :-1])
            cache.batch_repeat_interleave(group_size)
            out = self._generate(shared, prompt_ids, prompt_mask, cache, kwargs, rows)
            chunks.append((0, out.cpu(), recorder.finish(out) if recorder else None))
            if kv is not None:
                kv.prefilled_tokens += sum(len(p) for p in prompts)
        else:
            step = batch_size or n
            for s in range(0, n, step):
                ids, mask = prompt_ids[s : s + step], prompt_mask[s : s + step]
                out = self._generate(shared, ids, mask, None, kwargs, rows[s : s + step])
                chunks.append((s, out.cpu(), recorder.finish(out) if recorder else None))
            if kv is not None:
                kv.prefilled_tokens += sum(len(p) for p in rows)
        if kv is not None:
            kv.commit()
        width = max(max(c.shape[1] for _, c, _ in chunks), 1)
        completion_ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, T] right padded
        logprobs = torch.zeros(n, width) if recorder is not None else None
        for s, c, lp in chunks:
            completion_ids[s : s + c.shape[0], : c.shape[1]] = c
            if lp is not None:
                logprobs[s : s + lp.shape[0], : lp.shape[1]] = lp
        return Sampled(completion_ids, logprobs)

    def _generate(self, shared: SharedBase, ids: Tensor, mask: Tensor, cache, kwargs: dict, rows: list[list[int]]):
        """``generate`` on left-padded prompts ``ids`` / ``mask`` ``[n, W]`` (``cache``: keys / values of their first
        columns, or None) -> the new tokens ``[n, T]``; inside a reuse scope the rows' real tokens are kept."""
        dev, W = shared.device, ids.shape[1]
        extra = cache_arg(cache) if cache is not None else {}
        extra.update(stop_criteria())  # a stop request ends the call at the next token, and the step is abandoned
        tokens = progress_criteria(W, kwargs.get("max_new_tokens") or 0)  # RUN/step.json's token count (a step only)
        if tokens:
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList([*extra.get("stopping_criteria", []), *tokens])
        if self.prefix_kv is None:
            new = shared.generate(ids.to(dev), mask.long().to(dev), **extra, **kwargs)[:, W:]
            abandon_if_stopped()
            return new
        out = shared.generate(ids.to(dev), mask.long().to(dev), **extra, **kwargs, return_dict_in_generate=True)
        abandon_if_stopped()
        new = out.sequences[:, W:]
        kept = output_cache(out)
        columns = fed_columns(mask.bool(), new, kept.get_seq_length() - W, shared.eos_ids)
        kept_ids = [p + new[i, : len(c) - len(p)].tolist() for i, (p, c) in enumerate(zip(rows, columns))]
        self.prefix_kv.add(KeptRows.from_cache(list(kept.layers), columns, kept_ids))
        return new
