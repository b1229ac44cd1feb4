"""What a user types or the browser sends, checked and turned into plain values: sampling settings (one
:class:`~lorarl.config.GenerationConfig`, with chat's own ranges), the reward-columns JSON box, Chatbot histories and
the system prompt. Every problem is a :class:`~lorarl.errors.LorarlError` with one clear message."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lorarl.config import GenerationConfig
from lorarl.errors import LorarlError

# the UI's starting values (temperature 0 is greedy in chat, unlike in training recipes)
CHAT_DEFAULTS = GenerationConfig(max_new_tokens=128, temperature=0.7, top_p=0.9, top_k=0)
MAX_TEMPERATURE = 5.0
MAX_NEW_TOKENS = 4096


def _number(value: Any, name: str, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise LorarlError(f"{name} must be a number, got {value!r}") from None


def check_generation(generation: GenerationConfig | None) -> GenerationConfig:
    """A checked copy of chat sampling settings (``None``: :data:`CHAT_DEFAULTS`). ``temperature == 0`` is greedy;
    ``top_p`` / ``top_k`` truncate sampling (allowed in chat, unlike training)."""
    g = generation or CHAT_DEFAULTS
    checked = GenerationConfig(
        max_new_tokens=_number(g.max_new_tokens, "max_new_tokens", int),
        temperature=_number(g.temperature, "temperature", float),
        top_p=_number(g.top_p, "top_p", float),
        top_k=_number(g.top_k, "top_k", int),
    )
    if not 0.0 <= checked.temperature <= MAX_TEMPERATURE:
        raise LorarlError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {g.temperature}")
    if not 0.0 < checked.top_p <= 1.0:
        raise LorarlError(f"top_p must be in (0, 1], got {g.top_p}")
    if checked.top_k < 0:
        raise LorarlError(f"top_k must be >= 0 (0: off), got {g.top_k}")
    if not 1 <= checked.max_new_tokens <= MAX_NEW_TOKENS:
        raise LorarlError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {g.max_new_tokens}")
    return checked


def generation_from_ui(temperature: Any, top_p: Any, max_new_tokens: Any) -> GenerationConfig:
    """The settings panel's (or the API's) values -> checked :class:`GenerationConfig`."""
    return check_generation(
        dataclasses.replace(CHAT_DEFAULTS, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    )


SEED_LIMIT = 2**63  # torch.manual_seed takes a 64-bit seed


def check_seed(seed: Any) -> int:
    """The sampling seed as an int (empty: 0; negative: leave the RNG as it is): a whole number with
    ``|seed| < 2**63``, else one line (``1e30``, ``inf``, ``1.5``)."""
    if seed is None:
        return 0
    try:
        value = int(seed)
        whole = value == seed if isinstance(seed, float) else True
    except (TypeError, ValueError, OverflowError):
        raise LorarlError(f"seed must be a whole number, got {seed!r}") from None
    if not whole:
        raise LorarlError(f"seed must be a whole number, got {seed!r}")
    if not -SEED_LIMIT < value < SEED_LIMIT:
        raise LorarlError(f"seed must be between -2**63 and 2**63 (negative: random), got {seed!r}")
    return value


def parse_columns(text: str | None) -> dict[str, Any]:
    """The "reward columns" box (a JSON object, e.g. ``{"answer": "42"}``; empty: none) -> a dict."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise LorarlError(f'reward columns must be a JSON object, e.g. {{"answer": "42"}} ({e.msg})') from None
    if not isinstance(value, dict):
        raise LorarlError('reward columns must be a JSON object, e.g. {"answer": "42"}')
    return value


def _content_text(content: Any) -> str:
    """Gradio message content (a string, or a list of ``{"type": "text", "text": ...}`` parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", content.get("content", "")) or "")
    if isinstance(content, (list, tuple)):
        return "".join(_content_text(c) for c in content)
    return str(content)


def plain_history(history: Any) -> list[dict]:
    """A Chatbot value -> ``[{"role": "user" | "assistant", "content": str}]``. Folded tool messages (a
    ``metadata`` title: a tool pane's calls and results) are left out: the conversation keeps the answers."""
    out = []
    for m in history or []:
        if isinstance(m, dict) and (m.get("metadata") or {}).get("title"):
            continue
        if isinstance(m, dict) and m.get("role") in ("user", "assistant"):
            out.append({"role": m["role"], "content": _content_text(m.get("content"))})
    return out


def display_history(history: Any) -> list[dict]:
    """A Chatbot value as it is shown again: :func:`plain_history`'s messages plus the folded tool messages
    (``{"role": "assistant", "content", "metadata": {"title", ...}}``) where they were."""
    out = []
    for m in history or []:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            continue
        msg = {"role": m["role"], "content": _content_text(m.get("content"))}
        meta = m.get("metadata") or {}
        if meta.get("title"):
            msg["metadata"] = {k: meta[k] for k in ("title", "log", "status") if meta.get(k) is not None}
        out.append(msg)
    return out


def system_messages(system: str | None) -> list[dict]:
    """The shared system prompt as a message list (empty when blank: the chat template's default applies)."""
    return [{"role": "system", "content": system}] if system and system.strip() else []
