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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import threading

    import torch

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


class TemperatureScaling:
    """``scores / temperature`` as a logits processor (what transformers' TemperatureLogitsWarper does), placed
    where lorarl puts it: after transformers' own processors and before :class:`SamplerLogprobs`."""

    def __init__(self, temperature: float):
        self.temperature = float(temperature)

    def __call__(self, input_ids, scores):
        return scores / self.temperature


class SamplerLogprobs:
    """Records the log-probability the sampler drew each token with: at every decode step it keeps
    ``log_softmax(scores)`` of the final scores (after temperature; training rollouts use no top-k / top-p, so these
    are the scores ``generate`` samples from) and, one step later, gathers the token that was drawn. Memory: one
    ``[N, V]`` fp32 tensor at a time. :meth:`finish` gathers the last token from the generated ids.
    """

    def __init__(self) -> None:
        self.gathered: list = []
        self.last = None

    def __call__(self, input_ids, scores):
        import torch

        if self.last is not None:
            self.gathered.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))  # the token drawn last step
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids):
        """``[N, T]`` fp32 log-probs of ``completion_ids`` (the new tokens ``generate`` returned), on CPU."""
        import torch

        cols = list(self.gathered)
        T = completion_ids.shape[1]
        if self.last is not None and len(cols) < T:
            cols.append(
                self.last.gather(1, completion_ids[:, len(cols) : len(cols) + 1].to(self.last.device)).squeeze(1)
            )
        out = torch.stack(cols[:T], dim=1).float().cpu() if cols else torch.zeros(completion_ids.shape[0], 0)
        self.gathered, self.last = [], None
        return out


def generate_kwargs(
    *,
    greedy: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    recorder: SamplerLogprobs | None = None,
) -> dict[str, Any]:
    """Every sampling field of a ``generate`` call, explicit: greedy decoding, or ``softmax(logits / temperature)``
    optionally truncated by ``top_k`` / ``top_p`` (evaluation and chat only; training recipes keep 0 / 1).

    The temperature is applied by lorarl's :class:`TemperatureScaling` (transformers' own warper is left at 1.0), so
    a ``recorder`` placed after it sees the exact scores that are sampled from (refused with top-k / top-p, which
    transformers applies after every custom processor)."""
    from transformers import LogitsProcessorList

    kwargs: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "eos_token_id": list(eos_ids),
        "pad_token_id": int(pad_id),
        "num_beams": 1,
        **NEUTRAL_SAMPLING,
    }
    if greedy:
        # top_k 50: transformers' default, which greedy decoding never applies (any other value makes it warn)
        kwargs.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
        if recorder is not None:
            kwargs["logits_processor"] = LogitsProcessorList([recorder])
        return kwargs
    if recorder is not None and (top_p < 1.0 or top_k > 0):
        raise ValueError("sampler log-probs are recorded only without top-p / top-k (they apply after the recorder)")
    kwargs.update(do_sample=True, temperature=1.0, top_p=float(top_p), top_k=int(top_k))
    processors = [] if float(temperature) == 1.0 else [TemperatureScaling(temperature)]
    if recorder is not None:
        processors.append(recorder)
    if processors:
        kwargs["logits_processor"] = LogitsProcessorList(processors)
    return kwargs


def generation_kwargs(
    generation,
    *,
    greedy: bool,
    eos_ids: list[int],
    pad_id: int,
    max_new_tokens: int | None = None,
    recorder: SamplerLogprobs | None = None,
) -> dict[str, Any]:
    """:func:`generate_kwargs` from a recipe's :class:`lorarl.config.GenerationConfig` (``max_new_tokens``
    overrides its own, e.g. for evaluation)."""
    return generate_kwargs(
        greedy=greedy,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        max_new_tokens=max_new_tokens or generation.max_new_tokens,
        eos_ids=eos_ids,
        pad_id=pad_id,
        recorder=recorder,
    )


class StopFlag:
    """A stopping criterion that ends every row once ``event`` is set (the chat's Stop button, a training step's
    SIGTERM flag: :func:`lorarl.rollout.engines.stop_criteria`)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs) -> torch.Tensor:
        import torch

        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def stopping_criteria(event: threading.Event):
    """A ``StoppingCriteriaList`` holding a :class:`StopFlag` for ``event`` (transformers is imported only here)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StopFlag, StoppingCriteria):
        pass

    return StoppingCriteriaList([_Stop(event)])
