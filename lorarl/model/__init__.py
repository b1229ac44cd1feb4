"""The one base model and its roles: loading, the embedded-model registry, :class:`SharedBase` (adapters, heads,
role switching), the log-prob forward paths and the token conventions (padding, positions, EOS)."""

from lorarl.model.chunked import chunked_token_logprobs
from lorarl.model.loading import load_base, load_tokenizer, lora_config, new_head, pick_device
from lorarl.model.logprobs import completion_logprobs
from lorarl.model.shared import HEAD_FILE, HEAD_ROLES, REFERENCE, SharedBase
from lorarl.model.tokens import eos_token_ids, last_token_index, pad_left, pad_right, position_ids

__all__ = [
    "HEAD_FILE",
    "HEAD_ROLES",
    "REFERENCE",
    "SharedBase",
    "chunked_token_logprobs",
    "completion_logprobs",
    "eos_token_ids",
    "last_token_index",
    "load_base",
    "load_tokenizer",
    "lora_config",
    "new_head",
    "pad_left",
    "pad_right",
    "pick_device",
    "position_ids",
]
