"""The per-term byte formulas of the planner: each a small pure function of a :class:`ModelShape` and a few sizes.

Notation (see :class:`ModelShape`): ``H`` hidden size, ``I`` MLP intermediate size, ``L`` layers, ``V``
vocabulary, ``qd`` / ``kvd`` query / key-value width; ``dt`` bytes of the compute dtype (2 for bf16 on GPU, 4 for
fp32); ``B`` rows in a forward pass, ``P`` prompt tokens, ``C`` = ``max_new_tokens``, ``T = P + C``, ``c`` the
log-prob chunk (positions whose logits exist at once). The worked examples use
``shape = model_shape("llama-3.1-8b")`` (``H = 4096``, ``I = 14336``, ``L = 32``, ``V = 128256``, ``qd = 4096``,
``kvd = 1024``) in bf16.

The constants were checked on an H100 (``scripts/validate_plan_gpu.py``, ``docs/plan_validation/``).
"""

from __future__ import annotations

import math

from lorarl.shapes import LINEAR_NAMES, ModelShape

GIB = 1024**3
GB = 1e9

NF4_BLOCK = 64  # weights per absmax block
NF4_NESTED_BLOCK = 256  # absmax values per second-level block (double quantization)
NF4_CODE_BYTES_PER_TENSOR = 256 * 4 + 16 * 4 + 8  # nested code table + NF4 code + offset, per quantized weight
CUBLAS_WORKSPACE_BYTES = 32 * 1024**2  # allocated through PyTorch's allocator at the first matmul (Hopper)
LOGIT_BYTES_NO_GRAD = 8  # per [row, position, vocab] element: fp32 logits / T + one fp32 temporary of logsumexp
LOGIT_BYTES_TRAIN_EXTRA = 18  # + dt: bf16 logits, fp32 copy kept, exp, softmax (entropy), gradient, scatter buffer
# + dt: a chunk through lorarl.model.chunked.ChunkLogprobs (no gradient through the entropy: SFT, DPO, GRPO / PPO
# without an entropy bonus): the head's output, one fp32 buffer for the log-softmax gradient, its cast to dt.
# Measured on CPU (peak RSS of one chunk's forward + backward, 8 x 128 positions x 49,152): 10.2 bytes per element
# in bf16, 9.2 in fp32; the autograd path with an entropy gradient took 27.2 there.
LOGIT_BYTES_FUSED = 8
SAMPLING_LOGIT_BYTES = 12  # + dt per [row, vocab] element while sampling a token
SAMPLING_FILTER_BYTES = 16  # + sorted values and int64 indices with top-p / top-k
LOSS_TERMS_PER_TOKEN = 12  # fp32 per-token tensors of the policy loss alive with the logits chunk
# Device memory that is not an allocation. Measured on an H100 (torch 2.11, CUDA 13): the CUDA context and kernels
# took 0.70-0.77 GiB; the caching allocator held 7-26% more than the peak allocation at the end of a step
# (blocks of differently shaped phases do not reuse each other).
RUNTIME_OVERHEAD_BYTES = int(0.8 * GIB)
ALLOCATOR_SLACK = 0.25


# ---- parameters -----------------------------------------------------------------------------------------------
def resolve_targets(shape: ModelShape, target_modules: str | list[str]) -> list[str]:
    """LoRA target projections of one layer. ``all-linear`` is every projection (PEFT leaves ``lm_head`` out);
    a list keeps the names that end like a projection (``self_attn.q_proj`` -> ``q_proj``).

    >>> resolve_targets(shape, ["q_proj", "model.layers.0.self_attn.v_proj"])
    ['q_proj', 'v_proj']
    """
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return list(LINEAR_NAMES)
        target_modules = [target_modules]
    return [n for n in LINEAR_NAMES if any(t == n or t.endswith("." + n) or t.endswith(n) for t in target_modules)]


def lora_params(shape: ModelShape, r: int, targets: list[str]) -> int:
    """LoRA parameters of one adapter: ``L sum_targets r (in + out)`` (``A`` is ``r x in``, ``B`` is ``out x r``).

    Llama-3.1-8B, ``r = 16`` on all linear layers: ``32 x 16 x (8192 + 5120 + 5120 + 8192 + 3 x 18432)``:

    >>> lora_params(shape, 16, resolve_targets(shape, "all-linear"))
    41943040
    """
    shapes = shape.linear_shapes()
    return shape.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def head_params(shape: ModelShape) -> int:
    """Parameters of a value / score head (a ``H -> 1`` linear layer with bias): ``H + 1``.

    >>> head_params(shape)
    4097
    """
    return shape.hidden_size + 1


# ---- weights --------------------------------------------------------------------------------------------------
def nf4_bytes(numel: int, double_quant: bool = True) -> float:
    """Bytes of ``numel`` weights in NF4 (bitsandbytes, block size 64): ``numel/2`` of 4-bit codes + the absmax
    of each block of 64 - 8-bit with double quantization, whose fp32 second-level absmax adds 4 bytes per 256
    blocks (``4 + 8/64 + 32/(64 x 256) = 4.127 bits = 0.51587 bytes per weight``); else fp32 per 64 (4.5 bits).

    One ``4096 x 14336`` projection: 29360128 bytes of codes + 917504 absmax bytes + 4 x 3584:

    >>> nf4_bytes(4096 * 14336), nf4_bytes(4096 * 14336, double_quant=False)
    (30291968.0, 33030144.0)
    """
    blocks = math.ceil(numel / NF4_BLOCK)
    if double_quant:
        return numel / 2 + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK)
    return numel / 2 + 4 * blocks


def base_weight_bytes(
    shape: ModelShape, quantization: str, dtype_bytes: int, double_quant: bool = True
) -> dict[str, float]:
    """Base weights: the decoder projections (``L x 7`` weights, NF4 or ``dtype_bytes``) and the rest (always
    ``dtype_bytes``: bitsandbytes never quantizes embeddings or ``lm_head``).

    ``base_linear_weights = L sum_proj (nf4_bytes(in x out) + NF4_CODE_BYTES_PER_TENSOR)`` (the code tables: about
    1.1 KB per layer weight), unquantized ``L (sum in x out) dt``; ``base_other_weights = dt x``
    :meth:`ModelShape.other_params` (embeddings ``V H``, ``lm_head`` ``V H`` unless tied, norms ``(2L + 1) H``,
    q/k/v biases). NF4 Llama-3.1-8B: 3.35 GiB of projections + 1.96 GiB of the rest (5.31 GiB measured on an H100):

    >>> base_weight_bytes(shape, "nf4", 2)
    {'base_linear_weights': 3600662272.0, 'base_other_weights': 2101878784}
    """
    L = shape.num_hidden_layers
    if quantization == "nf4":
        lin = L * sum(
            nf4_bytes(i * o, double_quant) + NF4_CODE_BYTES_PER_TENSOR for i, o in shape.linear_shapes().values()
        )
    else:
        lin = L * shape.linear_params_per_layer() * dtype_bytes
    other = sum(shape.other_params().values()) * dtype_bytes
    return {"base_linear_weights": lin, "base_other_weights": other}


def frozen_model_terms(
    role: str, kind: str, shape: ModelShape, quantization: str, dtype_bytes: int, double_quant: bool, n_policy: int
) -> dict[str, float]:
    """A frozen second model's persistent terms: ``kind`` ``adapter`` -> a LoRA adapter sized like the policy's,
    ``4`` bytes per parameter (``lora_<role>_frozen``); ``model`` -> a second base on its own ``shape``, loaded with
    the base's quantization and dtype (``<role>_base_*``, :func:`base_weight_bytes`); anything else -> nothing.
    The LLM judge (``judge``) and the distillation teacher (``teacher``) are such models."""
    if kind == "adapter":
        return {f"lora_{role}_frozen": 4 * n_policy}
    if kind == "model":
        weights = base_weight_bytes(shape, quantization, dtype_bytes, double_quant)
        return {f"{role}_{k}": v for k, v in weights.items()}
    return {}


def dequantized_weight_bytes(shape: ModelShape, quantization: str, dtype_bytes: int) -> int:
    """The largest projection dequantized for a batched matmul (bitsandbytes dequantizes a whole NF4 weight):
    ``max(in x out) dt``; 0 unquantized.

    Llama-3.1-8B's MLP projections, ``4096 x 14336 x 2``:

    >>> dequantized_weight_bytes(shape, "nf4", 2)
    117440512
    """
    if quantization != "nf4":
        return 0
    return max(i * o for i, o in shape.linear_shapes().values()) * dtype_bytes


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """KV cache per token: the keys and values of every layer, ``2 L kvd dt``.

    Llama-3.1-8B in bf16: ``2 x 32 x 1024 x 2`` = 128 KiB per token:

    >>> kv_bytes_per_token(shape, 2)
    131072
    """
    return 2 * shape.num_hidden_layers * shape.kvd * dtype_bytes


# ---- one decoder layer ----------------------------------------------------------------------------------------
def layer_train_bytes_per_token(
    shape: ModelShape, dtype_bytes: int, targets: list[str], lora_fp32: bool = True
) -> float:
    """Bytes per token of one decoder layer recomputed with gradients under checkpointing: the tensors it saves
    for backward plus the backward's gradient buffers (the working set of one layer's backward).

    ``cast = 4`` when the LoRA branch upcasts its input to fp32 (fp32 adapters on a bf16 base), else 0.
    Saved: the norms' fp32 copies ``2 x 4 H`` (none when ``dt = 4``); each targeted projection's input as the
    LoRA branch keeps it (``4 in`` each when upcast; else the shared input once, ``dt in``); attention q, repeated
    k / v and output ``4 dt qd``; the MLP's gate, up and activation ``3 dt I``. Gradient buffers: ``4 dt H``.
    For NF4 + bf16 + LoRA on all linear layers this is ``48 H + 10 I``; H100 measurements of Llama-3.1-8B,
    Qwen2.5-7B, Mistral-7B and Qwen2.5-0.5B/1.5B agree within 15% (``scripts/validate_plan_gpu.py``).

    Llama-3.1-8B: ``48 x 4096 + 10 x 14336`` (bf16, fp32 LoRA on all linear layers); bf16 LoRA on q / v only:
    ``4 x 4096 + 2 x 4096 (shared q/k/v input) + 4 x 2 x 4096 + 3 x 2 x 14336 + 4 x 2 x 4096``:

    >>> layer_train_bytes_per_token(shape, 2, resolve_targets(shape, "all-linear"))
    339968.0
    >>> layer_train_bytes_per_token(shape, 2, ["q_proj", "v_proj"], lora_fp32=False)
    192512.0
    """
    H, F, qd = shape.hidden_size, shape.intermediate_size, shape.qd
    dt = dtype_bytes
    cast = 4 if (lora_fp32 and dt < 4) else 0
    shapes = shape.linear_shapes()
    norms = 2 * 4 * H if dt < 4 else 0
    lora_inputs = 0.0
    shared_inputs: set[str] = set()
    group = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    for t in targets:
        fan_in = shapes[t][0]
        if cast:
            lora_inputs += cast * fan_in
        elif group.get(t, t) not in shared_inputs:  # the projection's own input is saved; q/k/v, gate/up share
            shared_inputs.add(group.get(t, t))
            lora_inputs += dt * fan_in
    attention = 4 * dt * qd
    mlp = 3 * dt * F
    grad_buffers = 4 * dt * H
    return norms + lora_inputs + attention + mlp + grad_buffers


def layer_forward_bytes_per_token(shape: ModelShape, dtype_bytes: int, lora: bool = True) -> int:
    """Peak bytes per token of one layer's forward without saved tensors (generation prefill, scoring, the
    checkpointed forward). The MLP's up projection is the peak: the activation ``dt I`` and the projection's
    output ``dt I`` are alive while the LoRA branch holds ``lora_B``'s fp32 output and its scaled copy ``2 x 4 I``
    (``(2 dt + 8) I``; without an active adapter ``2 dt I``), plus the residual stream, the normed input and its
    fp32 copy for the LoRA branch ``(2 dt + 4) H``.

    Llama-3.1-8B in bf16: ``12 x 14336 + 8 x 4096`` with an adapter, ``4 x 14336 + 8 x 4096`` without:

    >>> layer_forward_bytes_per_token(shape, 2), layer_forward_bytes_per_token(shape, 2, lora=False)
    (204800, 90112)
    """
    F, H, dt = shape.intermediate_size, shape.hidden_size, dtype_bytes
    return ((2 * dt + 8) if lora else 2 * dt) * F + (2 * dt + 4) * H


def layer_forward_bytes(shape: ModelShape, dtype_bytes: int, tokens: int, lora: bool, dequantized: int) -> int:
    """Peak of one layer's forward over ``tokens`` positions: ``max(tokens x fwd(lora), tokens x fwd(no adapter)
    + dequantized)`` with ``fwd`` :func:`layer_forward_bytes_per_token` - a dequantized weight is alive only during
    its own base matmul, not with the LoRA branch.

    Llama-3.1-8B, 512 tokens with an adapter, NF4 (a 112 MiB dequantized projection): ``512 x 204800`` wins over
    ``512 x 90112 + 117440512``:

    >>> layer_forward_bytes(shape, 2, 512, True, dequantized_weight_bytes(shape, "nf4", 2))
    163577856
    """
    per = layer_forward_bytes_per_token(shape, dtype_bytes, lora)
    return max(tokens * per, tokens * layer_forward_bytes_per_token(shape, dtype_bytes, False) + dequantized)


def packed_layout(
    group_size: int, micro_batch: int, prompt_len: int, new_tokens: int, pack_tokens: int
) -> tuple[int, int]:
    """``(packs, pack length)`` of a packed GRPO micro-batch: ``[prompt | c_1 | ... | c_k]`` holds
    ``k = max(1, min(G, B, (pack_tokens - P) // C))`` completions of one prompt, one more pack when a micro-batch
    starts inside a group (``B mod G != 0``), at most ``B`` packs; a pack is ``P + k C`` tokens long.

    8 completions of a 96-token prompt, 16 new tokens, packs of 1024 tokens, micro-batch 8: one pack of 224 tokens:

    >>> packed_layout(8, 8, 96, 16, 1024)
    (1, 224)
    """
    per_pack = max(1, min(group_size, micro_batch, (pack_tokens - prompt_len) // max(new_tokens, 1)))
    n_packs = min(micro_batch, math.ceil(micro_batch / per_pack) + (1 if micro_batch % group_size else 0))
    return n_packs, prompt_len + per_pack * new_tokens


def checkpoint_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Gradient checkpoints: each decoder layer's input, ``L tokens H dt``.

    Llama-3.1-8B, 1024 tokens in bf16: ``32 x 1024 x 4096 x 2``:

    >>> checkpoint_bytes(shape, 1024, 2)
    268435456
    """
    return shape.num_hidden_layers * tokens * shape.hidden_size * dtype_bytes


# ---- logits ---------------------------------------------------------------------------------------------------
def sampling_logits_bytes(shape: ModelShape, rows: int, dtype_bytes: int, filters: bool = False) -> int:
    """Logits of one sampled position: ``B V (dt + 12)`` (the last position's logits, their fp32 copy, softmax
    and the sampling's temporaries); ``+ 16`` per element with top-p / top-k (sorted values, int64 indices).

    64 rows of Llama-3.1-8B in bf16: ``64 x 128256 x 14``:

    >>> sampling_logits_bytes(shape, 64, 2)
    114917376
    """
    return rows * shape.vocab_size * (dtype_bytes + SAMPLING_LOGIT_BYTES + (SAMPLING_FILTER_BYTES if filters else 0))


def prefill_logits_bytes(shape: ModelShape, rows: int, dtype_bytes: int) -> int:
    """The prefill's last-position logits and their fp32 copy: ``B V (dt + 4)``.

    >>> prefill_logits_bytes(shape, 64, 2)
    49250304
    """
    return rows * shape.vocab_size * (dtype_bytes + 4)


def scoring_logits_bytes(shape: ModelShape, rows: int, chunk: int, dtype_bytes: int) -> int:
    """A no-grad chunk of log-probs: ``B c V max(8, dt + 4)`` (fp32 logits / T and one fp32 temporary of
    logsumexp, :data:`LOGIT_BYTES_NO_GRAD`).

    16 rows x 128 positions of Llama-3.1-8B's vocabulary: ``16 x 128 x 128256 x 8``:

    >>> scoring_logits_bytes(shape, 16, 128, 2)
    2101346304
    """
    return rows * chunk * shape.vocab_size * max(LOGIT_BYTES_NO_GRAD, dtype_bytes + 4)


def train_logits_bytes(shape: ModelShape, rows: int, chunk: int, dtype_bytes: int, entropy: bool = True) -> int:
    """A chunk of logits recomputed in backward. With a gradient through the entropy (``entropy``: an entropy
    bonus, autograd's checkpointed path): ``B c V (dt + 18)`` (bf16 logits, the fp32 copy kept for logsumexp, exp,
    softmax for the entropy, the gradient and the gather's scatter buffer, :data:`LOGIT_BYTES_TRAIN_EXTRA`).
    Otherwise (the entropy only logged, or none) the fused chunk: ``B c V (dt + 8)`` (:data:`LOGIT_BYTES_FUSED`).

    4 rows x 128 positions of Llama-3.1-8B in bf16: ``4 x 128 x 128256 x 20`` (``x 10`` fused):

    >>> train_logits_bytes(shape, 4, 128, 2), train_logits_bytes(shape, 4, 128, 2, entropy=False)
    (1313341440, 656670720)
    """
    extra = LOGIT_BYTES_TRAIN_EXTRA if entropy else LOGIT_BYTES_FUSED
    return rows * chunk * shape.vocab_size * (dtype_bytes + extra)


def final_hidden_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """The last hidden state and its final norm (with the norm's fp32 copy): ``tokens H (2 dt + 4)``.

    >>> final_hidden_bytes(shape, 1024, 2)
    33554432
    """
    return tokens * shape.hidden_size * (2 * dtype_bytes + 4)


def loss_terms_bytes(rows: int, new_tokens: int) -> int:
    """The policy loss's per-token fp32 tensors (log-probs, ratios, clipped terms, advantages, KL, masks, ...):
    ``12 x 4 B C`` (:data:`LOSS_TERMS_PER_TOKEN`).

    >>> loss_terms_bytes(4, 128)
    24576
    """
    return rows * new_tokens * 4 * LOSS_TERMS_PER_TOKEN


def value_head_input_bytes(shape: ModelShape, rows: int, new_tokens: int) -> int:
    """The fp32 hidden states a value head reads at the completion positions: ``4 B C H``.

    >>> value_head_input_bytes(shape, 4, 128)
    8388608
    """
    return rows * new_tokens * shape.hidden_size * 4


# ---- the budget -----------------------------------------------------------------------------------------------
def total_bytes(peak_allocated: float) -> int:
    """Device memory a peak allocation needs: ``peak (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES`` (the CUDA
    context and the caching allocator's reserved-but-free blocks are not allocations but take device memory).

    10 GB allocated need ``1.25 x 10^10 + 0.8 GiB``:

    >>> total_bytes(10e9)
    13358993459
    """
    return int(peak_allocated * (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES)


# ---- the fast decode engine (generation.engine: fast) ---------------------------------------------------------
FAST_SAMPLING_LOGIT_BYTES = 16  # + dt per [row, vocab]: fp32 scores, softmax, Exp(1) draws, log_softmax (recorded)
GRAPH_BUCKET = 64  # with CUDA graphs the static cache's length is rounded up to this (lorarl.rollout.fast)


def static_cache_columns(prompt_len: int, new_tokens: int, bucket: int = 1) -> int:
    """Columns of the fast engine's static KV cache: ``ceil((P + C) / bucket) x bucket`` (``bucket`` is
    :data:`GRAPH_BUCKET` with CUDA graphs, so prompts of other lengths reuse the cache and its captured step).

    >>> static_cache_columns(128, 128, 64), static_cache_columns(100, 128, 64), static_cache_columns(100, 128)
    (256, 256, 228)
    """
    return -(-(prompt_len + new_tokens) // bucket) * bucket


def static_kv_cache_bytes(shape: ModelShape, rows: int, columns: int, dtype_bytes: int) -> int:
    """The static KV cache, allocated whole before decoding: ``B x columns x 2 L kvd dt``.

    16 rows of Llama-3.1-8B, 256 columns, bf16: ``16 x 256 x 128 KiB`` = 512 MiB:

    >>> static_kv_cache_bytes(shape, 16, 256, 2)
    536870912
    """
    return rows * columns * kv_bytes_per_token(shape, dtype_bytes)


def decode_step_bytes(shape: ModelShape, rows: int, dtype_bytes: int, dequantized: int) -> int:
    """What one decode step of the fast engine allocates beyond the cache (the CUDA graph pool when the step is
    captured: the allocator reuses a freed block inside one capture, so the pool is the step's largest moment):
    ``max(dequantized + B x`` :func:`layer_forward_bytes_per_token` ``, B V (dt + 16))`` - a layer's forward with
    a dequantized projection, or the sampling (logits, fp32 scores, softmax, the Exp(1) draws, log-softmax).

    16 rows of Llama-3.1-8B, NF4, bf16: ``max(117440512 + 16 x 204800, 16 x 128256 x 18)``:

    >>> decode_step_bytes(shape, 16, 2, 117440512)
    120717312
    """
    layer = dequantized + rows * layer_forward_bytes_per_token(shape, dtype_bytes, lora=True)
    sampling = rows * shape.vocab_size * (dtype_bytes + FAST_SAMPLING_LOGIT_BYTES)
    return max(layer, sampling)


def decode_output_bytes(rows: int, new_tokens: int) -> int:
    """The fast engine's output buffers: int64 ids and fp32 log-probs, ``12 B C``.

    >>> decode_output_bytes(16, 128)
    24576
    """
    return 12 * rows * new_tokens
