"""Memory planner: predict the peak GPU memory of a recipe and pick micro-batch sizes that fit a budget.

``lorarl plan RECIPE [--budget-gb 24] [--model-config PATH|NAME]`` reads the recipe, takes the model's shape from
``--model-config`` (a ``config.json``, a folder holding one, or a name from :data:`KNOWN_CONFIGS`) or else from the
recipe's model folder, **without loading weights**, and prints one JSON object: the predicted peak of each phase of
one step, a term-by-term breakdown, and the micro-batch sizes it picked.

Modules
-------
* :mod:`lorarl.shapes`: :class:`ModelShape`, the published shapes :data:`KNOWN_CONFIGS`, :func:`model_shape`;
* :mod:`lorarl.plan.terms`: one pure function per term below, each with its formula and a worked example, the
  constants, and :func:`total_bytes` (the budget's view of a peak);
* :mod:`lorarl.plan.estimate`: :class:`PlanSettings` and :func:`estimate_memory`, composed of one function per
  phase (persistent terms, generation, scoring, training, critic training, optimizer);
* :mod:`lorarl.plan.engine`: the generation phase under the fast decode engine (static cache, graph pool);
* :mod:`lorarl.plan.choice`: :func:`pick_micro_batch` (the largest sizes that fit a budget) and its advice;
* :mod:`lorarl.plan.recipes`: a recipe's settings and shape, :func:`plan_recipe` (``lorarl plan``),
  :func:`resolve_micro_batch` (``train.micro_batch_size: auto``).

What is modelled (one step of lorarl's GRPO / PPO loop on one base model, every role a LoRA adapter)
-----------------------------------------------------------------------------------------------------
Notation: ``H`` hidden size, ``I`` MLP intermediate size, ``L`` layers, ``V`` vocabulary, ``nh`` / ``nkv`` query /
key-value heads, ``d`` head dim, ``qd = nh d``, ``kvd = nkv d``; ``dt`` bytes of the compute dtype (2 for bf16 on
GPU, 4 for fp32); ``P`` prompt tokens, ``C`` = ``max_new_tokens``, ``T = P + C``; ``B`` rows in a forward pass.

Persistent (every phase):

* **base linear weights** (the 7 projections of each decoder layer). NF4 with double quantization (bitsandbytes,
  block size 64): 4 bits per weight + one 8-bit absmax per 64 weights + one fp32 absmax-of-absmax per 256 blocks
  = 4 + 8/64 + 32/(64*256) = **4.127 bits = 0.51587 bytes per parameter** (+ about 1.1 KB of code tables per
  layer). Without double quantization: 4 + 32/64 = 4.5 bits. Unquantized: ``dt`` bytes.
* **base other weights**: embeddings ``V H``, ``lm_head`` ``V H`` unless tied, RMSNorm weights ``(2L + 1) H``,
  q/k/v biases (Qwen2) - all in the compute dtype (bitsandbytes never quantizes embeddings or ``lm_head``).
* **LoRA adapters**: ``r (in + out)`` fp32 parameters per targeted projection (PEFT keeps adapters fp32 on a bf16
  base). Trainable adapters also hold two fp32 AdamW states (``8`` bytes/param, kept between steps); their fp32
  gradients (``4`` bytes/param) live from the first backward to the optimizer step (training phase only).
  Frozen adapters (PPO's reward model, sized like the policy's; a reference adapter - ``init_adapter`` or
  iterative GRPO - when ``kl_coef > 0``): ``4`` bytes/param. Value / score heads: ``H + 1`` fp32 params each.
* **cuBLAS workspace**: 32 MiB, taken through PyTorch's allocator at the first matmul (CUDA only).

A phase's peak is the largest of its *moments* (terms alive at the same time); each phase adds its moment's
terms to the persistent ones. ``tokens = B T``.

Generation (``B = generation rows`` per ``generate`` call; GRPO: ``group_size x prompts_per_step`` by default),
``max`` of:

* **prefill**: KV cache of the prompts ``B P kv`` (``kv = 2 L kvd dt`` bytes per token: keys and values of every
  layer) + one layer's forward over ``B P`` tokens (:func:`layer_forward_bytes_per_token`) + the last position's
  logits ``B V (dt + 4)``;
* **end of decoding**: the full KV cache ``B (T - 1) kv`` + one layer's concatenation copy ``B (T - 1) kv / L`` +
  a dequantized projection ``max(in x out) dt`` (bitsandbytes dequantizes a whole weight for a batched matmul) +
  the sampling logits ``B V (dt + 12)`` (``+ 16`` with top-p / top-k: sorted values and int64 indices).

With shared prompts (GRPO, ``group_size > 1``, all rows in one ``generate`` call; ``lorarl.rollout``) the prefill
runs over the ``m`` distinct prompts only (``m P kv`` + one layer's forward over ``m P`` tokens), then a **cache
copy** moment holds ``(m + B) P kv`` while each prompt's cache is copied to the rows that share it.

Under the fast decode engine (``generation.engine: fast``, :mod:`lorarl.plan.engine`) generation allocates a
**static KV cache** ``B Lc kv`` (``Lc = P + C``, rounded up to 64 with CUDA graphs) and one decode step's
allocations, the **graph pool** ``max(dequantized projection + B x layer forward, B V (dt + 16))``; with CUDA graphs
both are kept between rollouts, so they are persistent terms (in every phase), and the generation moments are the
prefill of the ``m`` distinct prompts, the copy of their caches to the rows, and the output buffers ``12 B C``.
The engine keeps two decode states: with a held-out evaluation between steps (``eval.every > 0``) whose batch
(``eval.batch_size`` rows, ``P + eval.max_new_tokens`` columns) the training state cannot take, its static cache
is a persistent term too (``eval_static_kv_cache``) and the shared graph pool is the larger of the two steps'.

Scoring (no-grad forwards over the rollout, ``B`` = the scoring rows: GRPO's reference log-probs when
``kl_coef > 0``, old log-probs when ``num_iterations > 1``; PPO's old / reference log-probs, values and reward
scores), ``max`` of: hidden states ``2 tokens H dt`` + one layer's forward (with or without an active adapter) +
the 4-D attention mask ``B T^2``; or hidden states + one chunk of logits ``B c V max(8, dt + 4)`` (fp32 logits / T
and one fp32 temporary of logsumexp), ``c = max(1, min(logprob_chunk_size, C, logprob_chunk_tokens // B))``
(a chunk holds at most ``logprob_chunk_tokens`` tokens' logits, however many rows). With shared prompts (GRPO) the prompts'
caches ``B P kv`` are held in both moments and the forward runs over the completions only (``tokens = B C``).

Training (``B = micro_batch_size``, gradient checkpointing on): LoRA gradients + **checkpoints** (each decoder
layer's input, ``L tokens H dt``) + ``max`` of:

* **a chunk of logits**, recomputed in backward: ``B c V (dt + 8)`` through the fused chunk
  (:class:`lorarl.model.chunked.ChunkLogprobs`: the head's output, one fp32 gradient buffer, its cast; whenever no
  gradient flows through the entropy), ``B c V (dt + 18)`` with an entropy bonus (``entropy_coef > 0``: bf16
  logits, the fp32 copy kept for logsumexp, exp, softmax for the entropy, the gradient and the gather's scatter
  buffer) + the last hidden state and its norm ``tokens H (2 dt + 4)`` + the loss's per-token fp32
  terms ``12 x 4 B C``;
* **one layer recomputed** with its backward: ``tokens x`` :func:`layer_train_bytes_per_token` (``48 H + 10 I``
  for NF4 + bf16 + fp32 LoRA on all linear layers) + a dequantized projection + the attention mask ``3 B T^2``.

Packed GRPO training (checkpointing on, shared prompts): each micro-batch's completions sit behind their shared
prompt, ``k`` per pack of at most ``PACK_TOKENS`` tokens (``lorarl.rollout``): ``tokens = packs (P + k C)`` and a
4-D additive mask of ``packs (P + k C)^2 (dt + 1)`` bytes (:func:`lorarl.plan.terms.packed_layout`).

Without checkpointing every layer keeps its saved tensors: ``L tokens x (per-layer bytes)``. PPO's critic takes
its own optimizer step after the policy's (phase ``critic_training``): the same minus the logits, plus fp32
hidden states for the value head ``4 B C H``. Optimizer: LoRA grads + a foreach AdamW temporary (4 bytes per parameter).

The constants of these formulas were checked on an H100 (``scripts/validate_plan_gpu.py``: random-init NF4
Llama-3.1-8B, Qwen2.5-7B / 1.5B / 0.5B and Mistral-7B, one GRPO and one PPO step each, two sets of shapes):
every phase's peak within 13% of ``torch.cuda.max_memory_allocated`` (``docs/plan_validation/``).

What ``torch.cuda.max_memory_allocated`` sees is ``peak_bytes``. The budget is checked against
``peak_bytes x (1 + ALLOCATOR_SLACK) + RUNTIME_OVERHEAD_BYTES``: the CUDA context and the caching allocator's
reserved-but-free blocks are not allocations but do take device memory (measured on the H100: 0.70-0.77 GiB of
context, 7-26% of slack; the whole-device figure came within -21%..+17% of what the device reported).

Example::

    >>> est = estimate_memory(model_shape("qwen2.5-1.5b"), group_size=8, prompts_per_step=2, prompt_len=128,
    ...                       max_new_tokens=256, micro_batch_size=4)
    >>> sorted(est["phases"])
    ['generation', 'optimizer', 'scoring', 'training']
"""

from __future__ import annotations

from lorarl.plan.choice import pick_micro_batch
from lorarl.plan.estimate import estimate_memory
from lorarl.plan.recipes import (
    ARITHMETIC_PROMPT_TOKENS,
    CPU_DEFAULT_MICRO_BATCH,
    format_plan,
    plan_recipe,
    recipe_model_shape,
    recipe_settings,
    resolve_micro_batch,
)
from lorarl.plan.settings import PlanSettings, StepSizes, plan_settings
from lorarl.plan.terms import (
    ALLOCATOR_SLACK,
    CUBLAS_WORKSPACE_BYTES,
    GB,
    GIB,
    LOGIT_BYTES_NO_GRAD,
    LOGIT_BYTES_TRAIN_EXTRA,
    NF4_BLOCK,
    NF4_CODE_BYTES_PER_TENSOR,
    NF4_NESTED_BLOCK,
    RUNTIME_OVERHEAD_BYTES,
    base_weight_bytes,
    decode_step_bytes,
    layer_forward_bytes_per_token,
    layer_train_bytes_per_token,
    lora_params,
    nf4_bytes,
    resolve_targets,
    static_cache_columns,
    static_kv_cache_bytes,
    total_bytes,
)
from lorarl.shapes import KNOWN_CONFIGS, LINEAR_NAMES, ModelShape, known_config, model_shape

__all__ = [
    "ALLOCATOR_SLACK",
    "ARITHMETIC_PROMPT_TOKENS",
    "CPU_DEFAULT_MICRO_BATCH",
    "CUBLAS_WORKSPACE_BYTES",
    "GB",
    "GIB",
    "KNOWN_CONFIGS",
    "LINEAR_NAMES",
    "LOGIT_BYTES_NO_GRAD",
    "LOGIT_BYTES_TRAIN_EXTRA",
    "NF4_BLOCK",
    "NF4_CODE_BYTES_PER_TENSOR",
    "NF4_NESTED_BLOCK",
    "RUNTIME_OVERHEAD_BYTES",
    "ModelShape",
    "PlanSettings",
    "StepSizes",
    "base_weight_bytes",
    "decode_step_bytes",
    "estimate_memory",
    "format_plan",
    "known_config",
    "layer_forward_bytes_per_token",
    "layer_train_bytes_per_token",
    "lora_params",
    "model_shape",
    "nf4_bytes",
    "pick_micro_batch",
    "plan_recipe",
    "plan_settings",
    "recipe_model_shape",
    "recipe_settings",
    "resolve_micro_batch",
    "resolve_targets",
    "static_cache_columns",
    "static_kv_cache_bytes",
    "total_bytes",
]
