"""Capturing the decode step once and replaying it (CUDA graphs), and what a captured step depends on.

A CUDA graph records the kernels of one :meth:`~lorarl.rollout.fast.state.DecodeState.step` with the tensors it
read at capture time. Replaying it re-runs those kernels on whatever those tensors hold now, so:

* data that changes between steps or rollouts lives in the state's buffers (tokens, column, masks, the cache),
  copied in place; an optimizer that updates LoRA weights in place is seen by the next replay;
* everything the Python code decided at capture time is baked in: which adapter is active or whether adapters are
  disabled, each LoRA layer's rank, scaling, dropout module and variant, every module's train / eval mode (dropout
  draws a mask only in train mode), autocast and the default dtype, the sampler settings, and the storage, shape
  and dtype of every active LoRA weight (a tensor *replaced* by a new one would be read at its old address).
  :func:`adapter_key` collects exactly these; a step is captured per (state shape, adapter key, sampler settings)
  and a changed key captures a new one, so a rollout can never decode with a stale adapter.

Random draws inside a graph come from the default CUDA generator (PyTorch registers it with every capture and
advances its offset at each replay), so ``torch.manual_seed`` keeps rollouts reproducible. Capture is tried once
per key; if it fails (an op that synchronises with the host, say), the step runs eagerly and the reason is kept
(:attr:`StatePool.failures`, reported by ``lorarl bench rollout``). Failed captures and the decode batches that ran
eagerly because of them are counted (:func:`engine_metrics`): the run loop logs them as ``rollout/*`` metrics, the
health checks warn once, and ``lorarl doctor`` names them.

Up to :data:`KEEP_STATES` decode states are kept, least recently used dropped first: a training rollout and a
held-out evaluation (greedy, another batch) each keep their own static cache and captured steps, so an evaluation
in the middle of training does not cost the next training step a new capture.
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
# decode states (static cache + captured steps) kept per shared base, least recently used dropped first: the
# training rollout's and the held-out evaluation's (another batch shape, greedy) live side by side
KEEP_STATES = 2


def lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA layers inside ``module`` (anything with ``lora_A`` and ``active_adapters``)."""
    return [m for m in module.modules() if hasattr(m, "lora_A") and hasattr(m, "active_adapters")]


def _tensor_id(t: torch.Tensor) -> tuple:
    """Where and how a captured kernel reads ``t``: storage address, shape, strides, dtype, device."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device))


def _adapter_tensors(layer: torch.nn.Module, name: str) -> tuple:
    """Every tensor of adapter ``name`` in a PEFT LoRA ``layer`` (A / B, embedding A / B, DoRA magnitude)."""
    out = []
    for holder in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        d = getattr(layer, holder, None)
        if d is None or name not in d:
            continue
        item = d[name]
        tensors = [item] if isinstance(item, torch.Tensor) else [t for _, t in item.named_parameters()]
        out += [(holder, _tensor_id(t)) for t in tensors]
    return tuple(out)


def _dropout_id(layer: torch.nn.Module, name: str) -> tuple:
    """The LoRA dropout module of adapter ``name``: its type, probability and mode (train mode draws masks)."""
    d = layer.lora_dropout[name] if name in getattr(layer, "lora_dropout", {}) else None
    return (type(d).__name__, float(getattr(d, "p", 0.0)), bool(d.training)) if d is not None else ()


def lora_layer_key(layer: torch.nn.Module) -> tuple:
    """One LoRA layer's part of :func:`adapter_key`: disabled / merged, then per active adapter its name, rank,
    alpha, scaling, variant, dropout and tensors."""
    active = tuple(a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {}))
    per_adapter = tuple(
        (
            a,
            layer.r.get(a),
            layer.lora_alpha.get(a),
            float(layer.scaling[a]),
            type(getattr(layer, "lora_variant", {}).get(a)).__name__,
            bool(getattr(layer, "lora_bias", {}).get(a, False)),
            _dropout_id(layer, a),
            _adapter_tensors(layer, a),
        )
        for a in active
    )
    return (
        bool(layer.disable_adapters),
        bool(layer.merged),
        bool(getattr(layer, "cast_input_dtype_enabled", True)),
        per_adapter,
    )


def numerics_key() -> tuple:
    """The process-wide state a captured step bakes in: autocast (on / dtype, CUDA and CPU), the default dtype,
    grad mode."""
    autocast = tuple((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu"))
    return (autocast, torch.get_default_dtype(), torch.is_grad_enabled())


def adapter_key(shared: SharedBase) -> tuple:
    """What a captured decode step baked in beyond its buffers: which modules are in train mode (dropout, the base's
    and LoRA's), per LoRA layer its active adapters and their rank / scaling / dropout / tensors
    (:func:`lora_layer_key`), and autocast / dtype / grad mode (:func:`numerics_key`). Equal keys mean a replay
    computes what an eager step would."""
    module = shared.module
    training = tuple(i for i, m in enumerate(module.modules()) if m.training)
    return (training, tuple(lora_layer_key(m) for m in lora_layers(module)), numerics_key())


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
    :data:`KEEP_STATES` states are kept; :func:`release` frees them all. ``keep`` False (``generation.keep_cache``,
    resolved by the run loop): the engine calls :meth:`clear` after each rollout, so scoring and training have that
    memory, and the next rollout allocates and captures again."""

    def __init__(self) -> None:
        self.states: OrderedDict[tuple, DecodeState] = OrderedDict()
        self.graphs: dict[tuple, CapturedStep | None] = {}
        self.failures: dict[str, str] = {}  # state shape -> the last capture failure's reason
        self.captures = 0  # decode steps captured
        self.capture_failures = 0  # captures that failed (their key then decodes eagerly)
        self.eager_fallbacks = 0  # decode batches that ran eagerly because their capture had failed
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.keep = True  # keep states between rollouts (generation.keep_cache: auto resolves it per run)

    def clear(self) -> None:
        """Free every kept decode state and captured step (counters stay: they are the run's). The graphs' private
        pool is dropped with them (a new handle for the next capture), so its blocks return to the allocator."""
        self.graphs.clear()
        self.states.clear()
        if self.pool is not None:
            self.pool = torch.cuda.graph_pool_handle()

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
        self, shared: SharedBase, state: DecodeState, sampler: SamplerSettings, kernel: bool = False
    ) -> tuple[Callable[[], None], bool]:
        """``(step, captured)``: the captured step for the state, the active adapters, ``sampler`` and whether the
        NF4 kernel decodes (``kernel``; captured now if new), or the eager step when capture failed for that key."""
        skey = (state.rows, state.length, state.new_tokens, state.kv_dtype)
        key = (skey, adapter_key(shared), sampler, kernel)
        if key not in self.graphs:
            try:
                self.graphs[key] = CapturedStep(lambda: state.step(sampler), lambda: rewind(state), self.pool)
                self.captures += 1
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to the eager step
                reason = f"{type(e).__name__}: {e}"
                self.failures[str(skey)] = reason
                self.graphs[key] = None
                self.capture_failures += 1
                warnings.warn(f"fast engine: CUDA graph capture failed, decoding eagerly ({reason})", stacklevel=2)
        graph = self.graphs[key]
        if graph is None:
            self.eager_fallbacks += 1
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


def engine_metrics(shared: SharedBase) -> dict:
    """The fast engine's CUDA-graph counters for ``shared`` since it was loaded, as run metrics (empty when no
    rollout asked for CUDA graphs): ``rollout/graph_captures``, ``rollout/graph_capture_failures``,
    ``rollout/eager_fallbacks`` (decode batches run eagerly because their capture failed) and, after a failure,
    ``rollout/graph_capture_error`` (the last reason)."""
    pool = _POOLS.get(shared)
    if pool is None:
        return {}
    out = {
        "rollout/graph_captures": pool.captures,
        "rollout/graph_capture_failures": pool.capture_failures,
        "rollout/eager_fallbacks": pool.eager_fallbacks,
    }
    if pool.failures:
        out["rollout/graph_capture_error"] = list(pool.failures.values())[-1]
    return out


def release(shared: SharedBase) -> None:
    """Free the decode states and captured steps kept for ``shared`` (static caches and graph pool)."""
    _POOLS.pop(shared, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
