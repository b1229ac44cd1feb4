"""TRL's completion formats as text (the one reading every reward, verifier and the code sandbox share), and the
bounded readers of what a model wrote: tagged blocks found in one pass, JSON nested at most :data:`MAX_JSON_DEPTH`
deep. Model output is hostile input: every reader here is linear in the text and raises nothing but ValueError."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_JSON_DEPTH = 64  # brackets a model's JSON may nest (1,000 "[" would reach the interpreter's recursion limit)


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


def tag_blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The contents of every ``open_tag ... close_tag`` block, as ``re.findall(open(.*?)close, re.S)`` finds them (the
    first closing tag after an opening one closes it; the search goes on after it), in one pass: each tag is looked
    for once (the regex tried every opening tag against the rest of the text, quadratic in unclosed tags).

    >>> tag_blocks("<a>1</a> <a>2<a>3</a> <a>4", "<a>", "</a>")
    ['1', '2<a>3']
    """
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return out
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:  # no closing tag after this opening one: none after any later one either
            return out
        out.append(text[start + len(open_tag) : end])
        pos = end + len(close_tag)


_JSON_STRUCTURE = re.compile(r'[\\"\[\]{}]')  # the characters json_depth looks at (the rest is skipped in C)


def json_depth(text: str, limit: int | None = None) -> int:
    """How deep the brackets (``{`` and ``[`` outside strings) of the JSON value at the start of ``text`` nest, in one
    pass that ends where that value's brackets close (what follows it is not read), or as soon as they pass
    ``limit``. Example: ``'{"a": [1, "[["]} [[['`` -> 2."""
    depth = deepest = 0
    in_string = False
    escaped = -1  # the position of the character a backslash in a string escapes
    for m in _JSON_STRUCTURE.finditer(text):
        ch, at = m.group(), m.start()
        if in_string:
            if at == escaped:
                continue
            if ch == "\\":
                escaped = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if limit is not None and deepest > limit:
                return deepest
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                return deepest
    return deepest


def decode_json(text: str, start: int = 0) -> tuple[Any, int]:
    """``json.JSONDecoder().raw_decode(text, start)``, refusing (ValueError, one line) JSON nested past
    :data:`MAX_JSON_DEPTH` and what Python's decoder raises besides JSONDecodeError (an integer past its 4,300
    digits)."""
    if json_depth(text[start:], MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} brackets")
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as e:
        raise ValueError(e.msg) from None
    except (ValueError, RecursionError) as e:
        raise ValueError(str(e).split(";")[0] or type(e).__name__) from None
