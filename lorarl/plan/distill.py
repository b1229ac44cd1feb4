"""On-policy distillation in the plan (``algo: distill``, :mod:`lorarl.algos.distill`): a GRPO-shaped step of
``train.prompts_per_step`` completions (one per prompt, no reference, no scoring pass) whose training phase also runs
the frozen teacher, planned with these terms.

Persistent (every phase):

* a teacher **adapter** on the one base (``distill.teacher`` a PEFT adapter or run folder): a frozen LoRA adapter
  sized like the policy's, ``4`` bytes per parameter (``lora_teacher_frozen``);
* a teacher **model** (any other folder or name, a merged export): a second base loaded once with the base's
  quantization and dtype, its weights by :func:`lorarl.plan.terms.base_weight_bytes` on its own shape
  (``teacher_base_*``; read from its ``config.json``, never its weights).

Training (``B = micro_batch_size`` completions of ``T = P + C`` tokens), the largest of:

* **teacher forward** (before the student's): the teacher's no-grad forward over ``B T`` tokens, as a scoring pass:
  hidden states ``2 B T H_T dt`` + one of its layers' forward + the attention mask ``B T^2``;
* **divergence chunk** (the student's backward through a chunk of both models' logits, recomputed): what the step
  keeps (LoRA gradients, checkpoints) + the student's last hidden state + the teacher's completion states
  ``B C H_T dt`` + ``B c V (2 dt + 24)`` for a KL (``beta`` 0 or 1), ``(2 dt + 40)`` for the JSD: the two heads'
  outputs and the fp32 log-softmaxes, probabilities, differences and gradients autograd holds in the chunk's
  backward (:data:`DIVERGENCE_BYTES_KL`, measured on the CPU allocator with the profiler for fp32 and bf16);
* **layer**: one student layer recomputed with its backward (as GRPO's) + the teacher's completion states.
"""

from __future__ import annotations

from lorarl.errors import LorarlError
from lorarl.plan.settings import Moments, PlanSettings, StepSizes, plan_settings
from lorarl.plan.supervised import forward_backward_moments
from lorarl.plan.terms import dequantized_weight_bytes, frozen_model_terms, layer_forward_bytes, loss_terms_bytes
from lorarl.shapes import ModelShape, model_shape

# bytes per [row, position, vocab] element of a divergence chunk's backward, beyond the two heads' outputs (2 dt):
# six fp32 copies for a KL (beta 0 / 1), ten for the generalized JSD (the mixture's log and both KLs). Measured:
# chunked_divergence forward + backward of 4 x 16 positions x 49,152 logits on the CPU, torch's allocator read by
# the profiler: 32 / 48 bytes per element in fp32, 28 / 44 in bf16 (tests/test_distill.py re-measures it).
DIVERGENCE_BYTES_KL = 24
DIVERGENCE_BYTES_JSD = 40


def divergence_chunk_bytes(vocab: int, rows: int, chunk: int, dtype_bytes: int, beta: float) -> int:
    """A chunk of the distillation loss in its backward: ``B c V (2 dt + 24)`` for ``beta`` 0 or 1, ``+ 40`` between.

    4 rows x 128 positions of a 151,936-token vocabulary in bf16, reverse KL: ``4 x 128 x 151936 x 28``:

    >>> divergence_chunk_bytes(151936, 4, 128, 2, 1.0)
    2178146304
    """
    extra = DIVERGENCE_BYTES_KL if beta in (0.0, 1.0) else DIVERGENCE_BYTES_JSD
    return rows * chunk * vocab * (2 * dtype_bytes + extra)


def distill_settings(recipe, settings: PlanSettings, budget_bytes: float | None = None) -> PlanSettings:
    """A distillation recipe's :class:`PlanSettings`: ``settings`` (what every sampling recipe shares) with one
    completion per prompt, no reference, no entropy bonus, no judge, and the teacher: its kind (``adapter`` or
    ``model``) and, for a model, its folder or name and its quantization -- ``model.quantization`` as written, or for
    ``auto`` what the loader picks for the teacher's own size (:func:`lorarl.model.loading.choose_quantization`
    against ``budget_bytes``: a 7B teacher beside a 0.5B student is NF4 on a 24 GB card while the student is bf16)."""
    from lorarl.model.loading import choose_quantization
    from lorarl.model.teacher import adapter_folder

    spec = recipe.distill.teacher
    is_adapter = adapter_folder(spec) is not None
    quant = settings.quantization
    if not is_adapter:
        teacher = model_teacher_shape(spec)  # one line now when its shape cannot be read
        if recipe.model.quantization == "auto":
            quant = choose_quantization(2 * teacher.num_params(), budget_bytes, settings.device)[0]
    return plan_settings(
        settings,
        algo="distill",
        group_size=1,
        kl_coef=0.0,
        num_iterations=1,
        training_entropy=False,
        judge="none",
        teacher="adapter" if is_adapter else "model",
        teacher_model=None if is_adapter else spec,
        teacher_quantization=quant,
        distill_beta=recipe.distill.beta,
    )


def model_teacher_shape(spec: str) -> ModelShape:
    """A second-model teacher's shape (its ``config.json``, or a known name); one line naming ``distill.teacher``
    when it cannot be read offline."""
    try:
        return model_shape(spec)
    except LorarlError as e:
        raise LorarlError(
            f"distill.teacher {spec}: its shape cannot be read offline (a folder with a config.json, or a known "
            f"name); train and export the teacher first ({e})"
        ) from None


def teacher_shape(shape: ModelShape, s: PlanSettings) -> ModelShape:
    """The teacher's shape: its own for a model teacher, else the base's."""
    return model_teacher_shape(s.teacher_model) if s.teacher == "model" and s.teacher_model else shape


def teacher_persistent_terms(shape: ModelShape, s: PlanSettings, n_policy: int, dtype_bytes: int) -> dict[str, float]:
    """What the teacher holds in every phase (module docstring); nothing without one."""
    teacher, quant = teacher_shape(shape, s), s.teacher_quantization or s.quantization
    return frozen_model_terms("teacher", s.teacher, teacher, quant, dtype_bytes, s.double_quant, n_policy)


def distill_training_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The training phase's moments (module docstring): the student's forward + backward over a micro-batch of
    full rows (:func:`lorarl.plan.supervised.forward_backward_moments`: one completion per prompt shares nothing)
    with the teacher's terms."""
    t = teacher_shape(shape, s)
    mb, T, C = z.micro_batch, z.seq_len, z.new_tokens
    student = forward_backward_moments(shape, s, z, mb, mb, logits=False)["layer"]
    kept = {k: v for k, v in student.items() if k not in ("layer_recompute", "dequantized_weight", "attention_mask")}
    teacher_states = {"teacher_hidden": mb * C * t.hidden_size * z.dt}
    vocab = min(shape.vocab_size, t.vocab_size)
    dequantized = dequantized_weight_bytes(t, s.teacher_quantization or s.quantization, z.dt)  # its largest (NF4)
    return {
        "teacher_forward": {
            "teacher_hidden_states": 2 * mb * T * t.hidden_size * z.dt,
            "teacher_layer_forward": layer_forward_bytes(t, z.dt, mb * T, s.teacher == "adapter", dequantized),
            "attention_mask": mb * T * T,
        },
        "logits": {
            **kept,
            **teacher_states,
            "divergence_chunk": divergence_chunk_bytes(vocab, mb, z.chunk(mb), z.dt, s.distill_beta),
            "loss_terms": loss_terms_bytes(mb, C),
        },
        "layer": {**student, **teacher_states},
    }
