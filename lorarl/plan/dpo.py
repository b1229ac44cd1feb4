"""DPO's step (:mod:`lorarl.algos.dpo`) for the planner: no generation, a no-grad reference pass and the policy's
forward + backward over preference pairs; and KTO's (:mod:`lorarl.algos.kto`), the same phases over unpaired rows.

A step takes ``train.prompts_per_step`` = ``dpo.batch_size`` pairs; a micro-batch holds ``b`` pairs
(``train.micro_batch_size``), i.e. ``R = 2b`` rows (each pair's chosen and rejected response behind its prompt), each
at most ``T = P + C`` tokens (``dpo.max_length``, the longest pair the loader keeps). The rows run in length-sorted
groups of at most ``M = dpo.max_tokens_per_forward`` padded tokens (:func:`lorarl.algos.reward_model.length_groups`),
so with every row at ``T`` a group holds ``g = min(R, max(1, M // T))`` rows (``M = 0``: one group, ``g = R``).
Prompt sharing between the two rows of a pair is left out, so the figures are an upper bound.

* ``reference`` (no gradients, adapters off or the frozen ``model.init_adapter``; none when no loss reads it (``simpo``, ``sft``);
  with ``precompute_ref_log_probs`` the same pass runs once over every pair before step 1, so its peak is the same):
  per group, the hidden states ``2 g T H dt`` + one layer's forward over ``g T`` tokens + the attention mask
  ``g T^2``, or the hidden states + one chunk of logits ``g c V max(8, dt + 4)``.
* ``training`` (policy, gradients): every group's graph lives until the micro-batch's loss runs backward, so what a
  forward keeps is held for all ``R T`` tokens: the LoRA gradients ``4 n`` + the checkpoints ``L R T H dt`` (without
  checkpointing every layer's saved activations) + the final hidden states ``R T H dt``; on top, the larger of one
  group's chunk of logits recomputed in backward (``g c V (dt + 8)``, the fused chunk) and one group's layer recomputed
  with its backward (``g T x`` per-layer bytes + a dequantized projection + the mask ``3 g T^2``).
* ``optimizer``: as for GRPO.

KTO: a step takes ``kto.batch_size`` rows, a micro-batch ``b`` rows of one completion each (``R = b``). Its no-grad
phase scores the batch under the reference and the KL estimate's mismatched pairs under both the reference and the
policy, ``b`` rows per forward; the policy's pass runs the LoRA, so ``reference`` counts one layer's forward with the
adapter (its largest pass). ``training`` is DPO's on ``R = b`` rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.plan.supervised import forward_backward_moments
from lorarl.plan.terms import layer_forward_bytes, scoring_logits_bytes
from lorarl.shapes import ModelShape

if TYPE_CHECKING:
    from lorarl.plan.settings import Moments, PlanSettings, StepSizes


ROWS_PER_EXAMPLE = {"dpo": 2, "kto": 1}  # a DPO pair is a chosen and a rejected row; a KTO row is one completion


def dpo_rows(s: PlanSettings, z: StepSizes) -> tuple[int, int]:
    """``(R, g)``: rows of a micro-batch (``2 x`` its pairs; KTO: its rows) and rows of one length-sorted forward at
    ``T`` tokens.

    >>> dpo_rows(PlanSettings(algo="dpo", max_tokens_per_forward=2048), z)  # b = 8 pairs, T = 512
    (16, 4)
    >>> dpo_rows(PlanSettings(algo="kto", max_tokens_per_forward=2048), z)  # b = 8 rows
    (8, 4)
    """
    rows = ROWS_PER_EXAMPLE[s.algo] * z.micro_batch
    if s.max_tokens_per_forward <= 0:
        return rows, rows
    return rows, min(rows, max(1, s.max_tokens_per_forward // z.seq_len))


def dpo_reference_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The reference's no-grad pass over one group (see the module doc); none without a reference."""
    if not s.dpo_reference:
        return {}
    _, g = dpo_rows(s, z)
    T = z.seq_len
    hidden = 2 * g * T * shape.hidden_size * z.dt
    return {
        "layer": {
            "hidden_states": hidden,
            # KTO's KL pass scores the policy (its LoRA) without gradients too
            "layer_forward": layer_forward_bytes(
                shape, z.dt, g * T, s.reference_adapter or s.algo == "kto", z.dequantized
            ),
            "attention_mask": g * T * T,
        },
        "logits": {"hidden_states": hidden, "logits_chunk": scoring_logits_bytes(shape, g, z.chunk(g), z.dt)},
    }


def dpo_training_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The policy's forward + backward over one micro-batch (see the module doc): SFT's, on ``2 x`` the pairs."""
    rows, g = dpo_rows(s, z)
    return forward_backward_moments(shape, s, z, rows, g, logits=True)
