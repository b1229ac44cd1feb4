"""What a model samples from, built from scratch so that nothing is inherited silently.

A model folder's ``generation_config.json`` can ask for logits processors (``repetition_penalty`` 1.05 for
Qwen2.5-Instruct, 1.1 for others; ``min_p``; ``no_repeat_ngram_size``; ``suppress_tokens``; ``top_k`` / ``top_p``).
transformers applies every field of the model's generation config that a call leaves unset, so a rollout that only
overrides temperature / top_p / top_k samples from a distribution that the trainer's ``softmax(logits / T)`` does not
describe (the PPO ratio, the KL and GRPO's gradient then refer to something else).

lorarl therefore replaces the base's generation config, once, by a clean one holding only its token ids
(:func:`use_clean_generation_config`; the folder's original is kept for reporting), and every ``generate`` call
passes every sampling field explicitly (:func:`generate_kwargs`). Sampling for training is the plain
``softmax(logits / temperature)``: ``top_p < 1`` and ``top_k > 0`` are refused for training recipes (the recipe
check names the key) and allowed for evaluation and chat.
"""

from __future__ import annotations

from typing import Any

# Fields that add a logits processor or warper when set; their neutral value. Passing them explicitly means a
# model folder's generation config cannot switch them on.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_length": 0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
}
# Fields that shape sampling and have no neutral value but None (left out of the clean config).
NONE_SAMPLING = (
    "min_p",
    "min_new_tokens",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "guidance_scale",
    "watermarking_config",
)


def inherited_processors(hub_config) -> dict[str, Any]:
    """The fields of a model folder's generation config that would change what is sampled if inherited
    (``{name: value}``), e.g. ``{"repetition_penalty": 1.05, "top_k": 20}``: what lorarl ignores."""
    if hub_config is None:
        return {}
    out = {}
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = getattr(hub_config, name, None)
        if value is not None and value != neutral:
            out[name] = value
    for name in NONE_SAMPLING:
        value = getattr(hub_config, name, None)
        if value not in (None, [], {}):
            out[name] = value
    for name, neutral in (("top_k", 0), ("top_p", 1.0)):
        value = getattr(hub_config, name, None)
        if value not in (None, neutral) and not (name == "top_k" and value == 50):  # 50: transformers' global default
            out[name] = value
    return out


def use_clean_generation_config(model, eos_ids: list[int], pad_id: int) -> Any:
    """Replace ``model.generation_config`` by one holding only the token ids (EOS list, pad, BOS); return the
    original. Afterwards, a field a ``generate`` call leaves unset falls back to transformers' global default,
    never to what the model folder asked for."""
    from transformers import GenerationConfig

    hub = getattr(model, "generation_config", None)
    bos = getattr(hub, "bos_token_id", None) if hub is not None else None
    model.generation_config = GenerationConfig(
        eos_token_id=list(eos_ids), pad_token_id=int(pad_id), bos_token_id=bos, **NEUTRAL_SAMPLING
    )
    return hub


def generate_kwargs(
    *,
    greedy: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
) -> dict[str, Any]:
    """Every sampling field of a ``generate`` call, explicit: greedy decoding, or ``softmax(logits / temperature)``
    optionally truncated by ``top_k`` / ``top_p`` (evaluation and chat only; training recipes keep 0 / 1)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "eos_token_id": list(eos_ids),
        "pad_token_id": int(pad_id),
        "num_beams": 1,
        **NEUTRAL_SAMPLING,
    }
    if greedy:
        kwargs.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
    else:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    return kwargs
