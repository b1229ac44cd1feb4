"""``generation.engine: fast``: decode with a static KV cache, one step at a time, sampling on the device.

For each batch of rows (all rows, or ``batch_size`` at a time) :class:`FastEngine`:

1. prefills each distinct prompt once with the active role (:func:`~lorarl.rollout.fast.state.prefill`) and copies
   its keys / values to the rows that share it, in a static cache (:class:`~lorarl.rollout.fast.state.DecodeState`);
2. draws completion token 0 from the prefill's logits, then runs the decode step ``C - 1`` times at most: the model's
   own decoder layers (PEFT LoRA wrappers, unmerged, on the 4-bit or full-precision base) on one token per row,
   tokens drawn on the device (:mod:`~lorarl.rollout.fast.sampling`), finished rows decoding into padding;
3. reads on the host only every ``k`` steps whether every row has ended (``generation.eos_check_every`` on CUDA;
   every step on CPU, where the read costs nothing), and stops then. Before every step it reads the training
   step's stop flag (:func:`lorarl.runstate.abandon_if_stopped`, a Python attribute): a SIGTERM ends the decode
   within a token and abandons the step.

On CUDA with ``generation.cuda_graphs`` the step is captured once per shape, adapter state and sampler, and
replayed (:mod:`~lorarl.rollout.fast.graphs`); the cache and the captured steps are kept between rollouts. On CPU
(or with graphs off) the same step runs eagerly and nothing is kept.

Models whose attention the engine cannot drive with one full-attention mask (sliding-window or chunked layers,
attention implementations that take no 4-D mask) fall back to :class:`~lorarl.rollout.engines.HFEngine`, with a
warning naming the reason (:func:`unsupported_reason`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lorarl.kernels.lora_decode import kernel_decode
from lorarl.rollout.engines import DecodeEngine, HFEngine, SampleCall, Sampled
from lorarl.rollout.fast.graphs import pool_for
from lorarl.rollout.fast.sampling import SamplerSettings, cache_length
from lorarl.rollout.fast.state import DecodeState, cache_layers, prefill, unique_prompts
from lorarl.rollout.prefix_kv import KeptRows, fed_columns
from lorarl.runstate import abandon_if_stopped
from lorarl.stepprogress import note_tokens

if TYPE_CHECKING:
    from lorarl.config import GenerationConfig
    from lorarl.model import SharedBase

GRAPH_BUCKET = 64  # with CUDA graphs the cache length is rounded up to this, so prompt lengths share a capture
DEFAULT_EOS_CHECK_EVERY = 8
_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unsupported_reason(shared: SharedBase) -> str | None:
    """Why the fast engine cannot decode ``shared``'s model (None when it can): an attention implementation that
    takes no 4-D mask, or cache layers other than full attention (sliding window, chunked, linear attention)."""
    if shared in _REASONS:
        return _REASONS[shared]
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    reason = None
    if shared.attn_implementation not in ("sdpa", "eager"):
        reason = f"attention implementation {shared.attn_implementation!r} takes no 4-D mask (sdpa and eager do)"
    else:
        try:
            kinds = {type(layer).__name__ for layer in StaticCache(shared.decoder().config, max_cache_len=8).layers}
        except Exception as e:  # noqa: BLE001 - a config transformers cannot build a static cache for
            kinds = {f"no static cache ({type(e).__name__}: {e})"}
        if kinds != {StaticLayer.__name__}:
            reason = f"cache layers {sorted(kinds)} (only full-attention layers are supported)"
    _REASONS[shared] = reason
    return reason


def keeps_cache(shared: SharedBase, generation: GenerationConfig) -> bool:
    """Whether the decode states outlive a rollout: ``generation.keep_cache`` when it is true or false; ``auto``:
    what the run resolved for this base (:attr:`~lorarl.rollout.fast.graphs.StatePool.keep`, set from the planner
    by the run loop; True where nothing resolved it, e.g. the chat)."""
    want = getattr(generation, "keep_cache", "auto")
    return want if isinstance(want, bool) else pool_for(shared).keep


def sampler_settings(generation: GenerationConfig, greedy: bool, record: bool, draw: str) -> SamplerSettings:
    """The sampler of a rollout: ``generation``'s temperature / top-k / top-p, or greedy; tokens drawn by ``draw``
    (:mod:`~lorarl.rollout.fast.sampling`). Recording log-probs with top-k / top-p is refused as
    :class:`~lorarl.rollout.engines.HFEngine` refuses it."""
    s = SamplerSettings(
        greedy=greedy,
        temperature=float(generation.temperature),
        top_k=int(generation.top_k),
        top_p=float(generation.top_p),
        record=record,
        draw=draw,
    )
    if record and s.filters:
        raise ValueError("sampler log-probs are recorded only without top-p / top-k (they apply after the recorder)")
    return s


class FastEngine(DecodeEngine):
    """The static-cache decode engine (see the module doc). ``cuda_graphs`` / ``eos_check_every`` override the
    recipe's ``generation.cuda_graphs`` / ``generation.eos_check_every``; ``draw`` picks how sampled tokens are drawn
    (``race``: ``torch.multinomial``'s own algorithm, the default on CUDA; ``inverse_cdf``: the default on CPU).
    Inside ``with engine.reusing_kv():`` a call prefills only what the previous call's rows do not already hold
    (:mod:`lorarl.rollout.prefix_kv`). ``nf4_kernel`` overrides ``generation.nf4_kernel`` (``auto``: the NF4 LoRA
    layers decode through :mod:`lorarl.kernels.lora_decode` where it can run; ``off``); ``kernel_reason`` says why
    the last call did not use it (None: it did)."""

    name = "fast"

    def __init__(
        self,
        cuda_graphs: bool | None = None,
        eos_check_every: int | None = None,
        draw: str | None = None,
        nf4_kernel: str | None = None,
    ):
        if draw not in (None, "race", "inverse_cdf"):
            raise ValueError(f"draw must be race or inverse_cdf, got {draw!r}")
        self.cuda_graphs = cuda_graphs
        self.eos_check_every = eos_check_every
        self.draw = draw
        self.steps_run = 0  # decode steps of the last call (token 0 included), for benchmarks
        self.used_graphs = False
        self.nf4_kernel = nf4_kernel
        self.kernel_reason: str | None = "not run yet"

    def _sample(self, shared: SharedBase, call: SampleCall) -> Sampled:
        reason = unsupported_reason(shared)
        if reason is not None:
            warnings.warn(f"generation.engine fast: {reason}; using hf", stacklevel=3)  # sample's caller
            hf = HFEngine()
            hf.prefix_kv = self.prefix_kv
            return hf.sample(shared, **call.keywords())
        prompts, group_size, generation = call.prompts, call.group_size, call.generation
        draw = self.draw or ("race" if shared.device.type == "cuda" else "inverse_cdf")
        sampler = sampler_settings(generation, call.greedy, call.record_logprobs, draw)
        C = int(call.max_new_tokens or generation.max_new_tokens)
        rows = [i for i in range(len(prompts)) for _ in range(group_size)]  # [N] grouped, prompt index per row
        n, step = len(rows), call.batch_size or len(rows)
        ids = torch.full((n, C), shared.pad_id, dtype=torch.long)
        logprobs = torch.zeros(n, C) if call.record_logprobs else None
        width, self.steps_run = 1, 0
        if self.prefix_kv is not None:
            self.prefix_kv.begin()
        setting = self.nf4_kernel or getattr(generation, "nf4_kernel", "auto")
        with kernel_decode(shared.module, shared.device, setting) as self.kernel_reason:
            for s in range(0, n, step):
                c_ids, c_lp = self._decode(shared, prompts, rows[s : s + step], C, sampler, generation)
                ids[s : s + c_ids.shape[0], : c_ids.shape[1]] = c_ids
                if logprobs is not None:
                    logprobs[s : s + c_lp.shape[0], : c_lp.shape[1]] = c_lp
                width = max(width, c_ids.shape[1])
        if self.prefix_kv is not None:
            self.prefix_kv.commit()
        if self._graphs_on(shared, generation) and not keeps_cache(shared, generation):
            pool_for(shared).clear()  # scoring and training get the static cache's memory (generation.keep_cache)
        return Sampled(ids[:, :width], logprobs[:, :width] if logprobs is not None else None)

    def _graphs_on(self, shared: SharedBase, generation: GenerationConfig) -> bool:
        wanted = self.cuda_graphs if self.cuda_graphs is not None else getattr(generation, "cuda_graphs", True)
        return bool(wanted) and shared.device.type == "cuda"

    def _check_every(self, shared: SharedBase, generation: GenerationConfig) -> int:
        """Steps between host reads of "every row ended?": the engine's own setting, else every step on CPU
        (the read costs nothing there) and ``generation.eos_check_every`` on CUDA (each read waits for the GPU)."""
        if self.eos_check_every:
            return max(1, int(self.eos_check_every))
        if shared.device.type != "cuda":
            return 1
        return max(1, int(getattr(generation, "eos_check_every", DEFAULT_EOS_CHECK_EVERY)))

    @torch.no_grad()
    def _decode(
        self,
        shared: SharedBase,
        prompts: list[list[int]],
        rows: list[int],
        new_tokens: int,
        sampler: SamplerSettings,
        generation: GenerationConfig,
    ) -> tuple[Tensor, Tensor | None]:
        """Decode one batch of rows (``rows``: the prompt index of each) -> ``(ids [n, t], log-probs [n, t])`` on
        the CPU, ``t`` the steps run."""
        uniq, inverse = unique_prompts(rows)
        prompt_cache, logits, mask = prefill(shared, [prompts[u] for u in uniq], self.prefix_kv)
        keys = prompt_cache.layers[0].keys  # [M, kv heads, P, head dim]
        graphs = self._graphs_on(shared, generation)
        length = cache_length(mask.shape[1], new_tokens, GRAPH_BUCKET if graphs else 1)
        shape = (len(rows), length, new_tokens, keys.dtype, keys.shape[1], keys.shape[3])
        if graphs:
            pool = pool_for(shared)
            state = pool.state(shared, *shape)
            run, self.used_graphs = pool.runner(shared, state, sampler, kernel=self.kernel_reason is None)
        else:
            state = DecodeState(shared, *shape)
            run, self.used_graphs = (lambda: state.step(sampler)), False
        state.load(prompt_cache, inverse, mask)
        del prompt_cache
        state.first_token(logits.index_select(0, torch.as_tensor(inverse, device=logits.device)), sampler)
        del logits
        every, done = self._check_every(shared, generation), 1
        while done < new_tokens:
            if done % every == 0 and not bool(state.unfinished.any()):
                break
            abandon_if_stopped()  # a training step's stop request (a host flag: no device sync): the step is abandoned
            run()
            done += 1
            note_tokens(done, new_tokens)  # RUN/step.json (at most once a second; a no-op outside a training step)
        self.steps_run += done
        if self.prefix_kv is not None:  # keep the rows' real tokens for the next call (sampled token s: column P + s)
            row_mask = mask.index_select(0, torch.as_tensor(inverse))
            columns = fed_columns(row_mask, state.out_tokens[:, :done], done - 1, shared.eos_ids)
            ids = [
                prompts[r] + state.out_tokens[i, : len(c) - len(prompts[r])].tolist()
                for i, (r, c) in enumerate(zip(rows, columns))
            ]
            self.prefix_kv.add(KeptRows.from_cache(cache_layers(state.cache), columns, ids))
        out_ids = state.out_tokens[:, :done].to("cpu", copy=True)
        out_lp = state.out_logprobs[:, :done].to("cpu", copy=True) if sampler.record else None
        return out_ids, out_lp
