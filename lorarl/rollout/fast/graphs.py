"""Capturing the decode step once and replaying it (CUDA graphs), and what a captured step depends on.

A CUDA graph records the kernels of one :meth:`~lorarl.rollout.fast.state.DecodeState.step` with the tensors it
read at capture time. Replaying it re-runs those kernels on whatever those tensors hold now, so:

* data that changes between steps or rollouts lives in the state's buffers (tokens, column, masks, the cache),
  copied in place; an optimizer that updates LoRA weights in place is seen by the next replay;
* everything the Python code decided at capture time is baked in: which adapter is active or whether adapters are
  disabled, each LoRA layer's scaling, dropout's mode, the sampler settings, and the storage of every active LoRA
  weight (a tensor *replaced* by a new one would be read at its old address). :func:`adapter_key` collects exactly
  these; a step is captured per (adapter key, sampler settings) and a changed key captures a new one, so a rollout
  can never decode with a stale adapter.

Random draws inside a graph come from the default CUDA generator (PyTorch registers it with every capture and
advances its offset at each replay), so ``torch.manual_seed`` keeps rollouts reproducible. Capture is tried once
per key; if it fails (an op that synchronises with the host, say), the step runs eagerly and the reason is kept
(:attr:`StatePool.failures`, reported by ``lorarl bench rollout``).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lorarl.rollout.fast.sampling import SamplerSettings
from lorarl.rollout.fast.state import DecodeState

if TYPE_CHECKING:
    from lorarl.model import SharedBase

WARMUP_STEPS = 3  # eager steps on a side stream before capture (lazy initialisation, cuBLAS / allocator warm-up)
# decode states (static cache + captured steps) kept per shared base, least recently used dropped first: one, as the
# planner counts (an evaluation of another batch shape in the middle of training costs a new capture, not memory)
KEEP_STATES = 1


def lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA layers inside ``module`` (anything with ``lora_A`` and ``active_adapters``)."""
    return [m for m in module.modules() if hasattr(m, "lora_A") and hasattr(m, "active_adapters")]


def adapter_key(shared: SharedBase) -> tuple:
    """What a captured decode step baked in about the adapters: the module's train mode and, per LoRA layer, its
    active adapters, whether adapters are disabled or merged, the scaling and the storage address of each active
    adapter's ``A`` and ``B`` weights. Equal keys mean a replay computes what an eager step would."""
    layers = []
    for m in lora_layers(shared.module):
        active = tuple(a for a in m.active_adapters if a in m.lora_A)
        weights = tuple((m.lora_A[a].weight.data_ptr(), m.lora_B[a].weight.data_ptr()) for a in active)
        scaling = tuple(float(m.scaling[a]) for a in active)
        layers.append((active, bool(m.disable_adapters), bool(m.merged), scaling, weights))
    return (bool(shared.module.training), tuple(layers))


class CapturedStep:
    """One decode step captured as a CUDA graph: warm up on a side stream, capture, restore the RNG state.

    ``rewind`` resets the state's counters before each warm-up step (the warm-up writes into the buffers like a
    real step); the caller loads real data afterwards."""

    def __init__(self, step: Callable[[], None], rewind: Callable[[], None], pool: Any):
        rng = torch.cuda.get_rng_state()  # the warm-up draws must not shift the run's random stream
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    rewind()
                    step()
            torch.cuda.current_stream().wait_stream(side)
            rewind()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                step()
        finally:
            restore_rng(rng)

    def __call__(self) -> None:
        self.graph.replay()


class StatePool:
    """Decode states kept between rollouts on one shared base (CUDA graphs on), each with its captured steps.

    Keeping them is what makes capture pay off (a GRPO run decodes the same shape every step); the planner counts
    the static cache and the graph pool as held through every phase (:mod:`lorarl.plan`). At most
    :data:`KEEP_STATES` states are kept; :func:`release` frees them all."""

    def __init__(self) -> None:
        self.states: OrderedDict[tuple, DecodeState] = OrderedDict()
        self.graphs: dict[tuple, CapturedStep | None] = {}
        self.failures: dict[str, str] = {}
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None

    def state(self, shared: SharedBase, rows: int, length: int, new_tokens: int, kv_dtype, heads, head_dim):
        """A kept state that fits the batch (most recently used first), else a new one (evicting the oldest)."""
        for key, st in reversed(self.states.items()):
            if st.fits(rows, length, new_tokens, kv_dtype):
                self.states.move_to_end(key)
                return st
        while len(self.states) >= KEEP_STATES:
            old_key, _ = self.states.popitem(last=False)
            self.graphs = {k: g for k, g in self.graphs.items() if k[0] != old_key}
        st = DecodeState(shared, rows, length, new_tokens, kv_dtype, heads, head_dim)
        self.states[(rows, length, new_tokens, kv_dtype)] = st
        return st

    def runner(
        self, shared: SharedBase, state: DecodeState, sampler: SamplerSettings
    ) -> tuple[Callable[[], None], bool]:
        """``(step, captured)``: the captured step for the state, the active adapters and ``sampler`` (captured
        now if new), or the eager step when capture failed for that key."""
        skey = (state.rows, state.length, state.new_tokens, state.kv_dtype)
        key = (skey, adapter_key(shared), sampler)
        if key not in self.graphs:
            try:
                self.graphs[key] = CapturedStep(lambda: state.step(sampler), lambda: rewind(state), self.pool)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to the eager step
                reason = f"{type(e).__name__}: {e}"
                self.failures[str(skey)] = reason
                self.graphs[key] = None
                warnings.warn(f"fast engine: CUDA graph capture failed, decoding eagerly ({reason})", stacklevel=2)
        graph = self.graphs[key]
        if graph is None:
            return (lambda: state.step(sampler)), False
        return graph, True


def restore_rng(state: torch.Tensor) -> None:
    """Put the default CUDA generator back (after a capture's warm-up); warn instead of failing the capture."""
    try:
        torch.cuda.set_rng_state(state)
    except RuntimeError as e:  # a torch that refuses it: rollouts stay reproducible, only shifted by the warm-up
        warnings.warn(f"fast engine: could not restore the CUDA RNG state after capture ({e})", stacklevel=2)


def rewind(state: DecodeState) -> None:
    """Counters back to the start of a cache (used between warm-up steps; real batches go through ``load``)."""
    state.column.zero_()
    state.step_index.zero_()
    for layer in state.cache.layers:
        layer.cumulative_length.zero_()


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_for(shared: SharedBase) -> StatePool:
    """The :class:`StatePool` of ``shared`` (created on first use, dropped with the shared base)."""
    if shared not in _POOLS:
        _POOLS[shared] = StatePool()
    return _POOLS[shared]


def release(shared: SharedBase) -> None:
    """Free the decode states and captured steps kept for ``shared`` (static caches and graph pool)."""
    _POOLS.pop(shared, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
