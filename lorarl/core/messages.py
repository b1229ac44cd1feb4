"""TRL's completion formats as text (the one reading every reward, verifier and the code sandbox share)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def completion_text(completion: object) -> str:
    """The text of a completion as a TRL reward function receives it: a string as it is; a conversational completion
    (a message dict, or a list of messages) as the content of its last assistant message, where ``content`` is a
    string or a list of ``{"type": "text", "text": ...}`` parts; ``""`` when there is no such text.

    >>> completion_text([{"role": "assistant", "content": "<answer>9</answer>"}])
    '<answer>9</answer>'
    >>> completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    'ab'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, Sequence):
        for message in reversed(completion):
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, Sequence):
                    return "".join(
                        part.get("text", "")
                        for part in content
                        if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                    )
                return ""
    return ""
