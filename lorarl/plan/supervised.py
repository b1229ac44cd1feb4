"""The supervised steps for the planner: the reward model (Bradley-Terry over preference pairs,
:mod:`lorarl.algos.reward_model`) and SFT (:mod:`lorarl.algos.sft`). Neither generates nor runs a reference: a step
is one adapter's forward + backward over micro-batches, then the optimizer.

* ``reward_model``: a step takes ``reward_model.batch_size`` pairs, a micro-batch ``b`` pairs
  (``train.micro_batch_size``), i.e. ``R = 2b`` rows (chosen and rejected) of at most ``T = reward_model.max_length``
  tokens, scored in length-sorted forwards of at most ``M = reward_model.max_tokens_per_forward`` padded tokens:
  ``g = min(R, max(1, M // T))`` rows each (``M = 0``: ``g = R``). The score head reads each row's last hidden
  state: no vocabulary logits exist. The trained parameters are the ``reward`` adapter and its score head.
* ``sft``: a step takes ``sft.batch_size`` examples, a micro-batch ``R = b`` rows of at most ``T = sft.max_length``
  tokens in one forward, the loss from chunks of logits (as GRPO's training computes them, without entropy). lorarl
  runs a micro-batch's shared prompt prefix once; the plan counts every row in full (an upper bound). With
  ``sft.packing`` a row is a packed row of up to ``T`` tokens, so every row is nearly full and the plan is nearly
  exact rather than a bound; its attention mask (transformers' block-diagonal mask, ``R T^2`` bool) is inside the
  ``3 g T^2`` term.

``training`` (gradients): every forward's graph lives until the micro-batch's loss runs backward, so what a forward
keeps is held for all ``R T`` tokens: the adapter's gradients ``4 n`` + the checkpoints ``L R T H dt`` (without
checkpointing, every layer's saved activations) + the final hidden states ``R T H dt``; on top, the larger of one
forward's layer recomputed with its backward (``g T x`` per-layer bytes + a dequantized projection + the mask
``3 g T^2``) and, for SFT only, one chunk of logits recomputed in backward (``g c V (dt + 8)``, the fused chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorarl.plan.terms import checkpoint_bytes, final_hidden_bytes, train_logits_bytes
from lorarl.shapes import ModelShape

if TYPE_CHECKING:
    from lorarl.plan.settings import Moments, PlanSettings, StepSizes

SUPERVISED = ("reward_model", "sft")


def supervised_rows(s: PlanSettings, z: StepSizes) -> tuple[int, int]:
    """``(R, g)``: rows of a micro-batch and rows of one forward at ``T`` tokens.

    >>> supervised_rows(PlanSettings(algo="reward_model", max_tokens_per_forward=2048), z)  # b = 8 pairs, T = 512
    (16, 4)
    >>> supervised_rows(PlanSettings(algo="sft"), z)  # b = 8 rows
    (8, 8)
    """
    rows = 2 * z.micro_batch if s.algo == "reward_model" else z.micro_batch
    if s.algo != "reward_model" or s.max_tokens_per_forward <= 0:
        return rows, rows
    return rows, min(rows, max(1, s.max_tokens_per_forward // z.seq_len))


def supervised_training_moments(shape: ModelShape, s: PlanSettings, z: StepSizes) -> Moments:
    """The trained adapter's forward + backward over one micro-batch (see the module doc)."""
    rows, g = supervised_rows(s, z)
    return forward_backward_moments(shape, s, z, rows, g, logits=s.algo == "sft")


def forward_backward_moments(
    shape: ModelShape, s: PlanSettings, z: StepSizes, rows: int, g: int, logits: bool
) -> Moments:
    """A forward + backward over ``rows`` rows of ``T`` tokens, ``g`` rows per length-sorted forward (SFT, the reward
    model, DPO's policy): what it keeps for the backward, then the peak of one layer's recompute and (``logits``:
    a language-model loss, not a score head) of one chunk of the logits."""
    T, tok = z.seq_len, rows * z.seq_len
    if s.gradient_checkpointing:
        kept = {"lora_grads": 4 * z.n_policy, "checkpoints": checkpoint_bytes(shape, tok, z.dt)}
    else:
        kept = {"lora_grads": 4 * z.n_policy, "saved_activations": shape.num_hidden_layers * tok * z.per_layer}
    kept["final_hidden"] = final_hidden_bytes(shape, tok, z.dt)
    moments: Moments = {
        "layer": {
            **kept,
            "layer_recompute": g * T * z.per_layer if s.gradient_checkpointing else 0,
            "dequantized_weight": z.dequantized,
            "attention_mask": 3 * g * T * T,
        }
    }
    if logits:
        moments["logits"] = {**kept, "logits_chunk": train_logits_bytes(shape, g, z.chunk(g), z.dt, False)}
    return moments
