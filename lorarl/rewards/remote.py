"""A reward computed by an HTTP server (``reward.functions: [{name: remote, remote: {url: ...}}]``).

Wire format (one POST per scoring call, ``Content-Type: application/json``), TRL's reward-function fields::

    {"prompts": [...], "completions": [...], "completion_ids": [[...], ...], "<column>": [...], ...,
     "query": ["<prompt text><completion text>", ...], "labels": [...]}

``prompts`` / ``completions`` are strings, or chat-message lists for conversational data, exactly as a TRL reward
function receives them; every dataset column is sent under its name. ``query`` and ``labels`` are OpenRLHF's
``--remote_rm_url`` fields (``query``: the prompt's text -- the last user message for chat prompts, without the
chat template -- followed by the completion; ``labels``: the ``answer`` column, when there is one).

The answer must be a JSON list of ``N`` numbers or ``null`` (``null``: does not apply, left out like a reward
function's ``None``), or an object holding that list under ``"rewards"`` (what OpenRLHF's reward servers return).

Failures: a connection error, a timeout (``remote.timeout_s`` per request: connecting, sending and reading the
whole answer, however slowly the server trickles it) or HTTP 429 / 5xx is retried
``remote.retries`` times after ``backoff_s * 2**(k-1)`` seconds; any other HTTP status, an answer that is not JSON,
of the wrong length or holding a non-number fails at once. A failed call is one :class:`RemoteRewardError` with one
line naming the URL and the cause; the scorer counts it (the function's column is NaN for that batch, left out),
against ``reward.max_failure_fraction``. The request is asyncio's own HTTP/1.1 exchange on the scoring call's event
loop (no thread to leak when a server stalls), so a remote reward runs concurrently with the other ``async``
rewards. It speaks plain ``http://`` and ``https://`` (system certificates) to the URL itself: no proxy, no redirects
(a 3xx is a failed call); an answer is read up to :data:`MAX_ANSWER_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from typing import Any

from lorarl.config.rewards import RemoteRewardConfig
from lorarl.core.messages import completion_text
from lorarl.rewards.call_args import CALL_ARGS

RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_ANSWER_BYTES = 16 * 2**20  # a longer answer is a failed call


class RemoteRewardError(Exception):
    """A remote reward call that failed (after its retries)."""


class _Retryable(Exception):
    pass


def prompt_text_of(prompt: Any) -> str:
    """A prompt as plain text: a string as it is; a message list as its last user message's content."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        for m in reversed(prompt):
            if isinstance(m, dict) and m.get("role") == "user":
                return completion_text([{"role": "assistant", "content": m.get("content", "")}])
    return ""


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"cannot send a {type(value).__name__} as JSON")


def request_body(prompts: list, completions: list, columns: dict[str, list]) -> dict:
    """The JSON object POSTed for a batch (the module docstring's wire format): the data, not the trainer's objects
    and callables (``trainer_state``, ``log_metric``, ``log_extra``, ``environments``)."""
    columns = {k: v for k, v in columns.items() if k not in CALL_ARGS}
    body = {"prompts": list(prompts), "completions": list(completions), **columns}
    body["query"] = [prompt_text_of(p) + completion_text(c) for p, c in zip(prompts, completions)]
    if "answer" in columns and "labels" not in columns:
        body["labels"] = columns["answer"]
    return body


def parse_scores(payload: Any, n: int) -> list[float | None]:
    """A server's answer -> ``N`` floats / None. Raises ValueError with one line saying what is wrong."""
    if isinstance(payload, dict):
        if "rewards" not in payload:
            raise ValueError(f"answered an object without 'rewards' (keys: {', '.join(map(str, payload)) or 'none'})")
        payload = payload["rewards"]
    if not isinstance(payload, list):
        raise ValueError(f"answered a {type(payload).__name__}, expected a JSON list of {n} numbers")
    if len(payload) != n:
        raise ValueError(f"answered {len(payload)} scores for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(payload):
        if v is None:
            out.append(None)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"answered a non-number at position {i}: {v!r}")
        else:
            out.append(float(v))
    return out


class RemoteReward:
    """An async reward function POSTing each batch to ``cfg.url`` (TRL's signature)."""

    def __init__(self, cfg: RemoteRewardConfig):
        self.cfg = cfg
        self.__name__ = "remote"
        self._retries = 0
        self._seconds = 0.0

    async def _post(self, data: bytes) -> Any:
        """One POST and its decoded JSON answer, all of it within ``remote.timeout_s`` seconds."""
        url = self.cfg.url
        try:
            code, reason, raw = await asyncio.wait_for(http_post(url, data), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise _Retryable(f"no answer within {self.cfg.timeout_s:g} s") from None
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        except OSError as e:  # cannot connect (refused, unknown host, TLS)
            raise _Retryable(f"{type(e).__name__}: {e.strerror or e}") from None
        except ValueError as e:
            raise RemoteRewardError(f"{url}: {e}") from None
        if code in RETRY_STATUS:
            raise _Retryable(f"HTTP {code} {reason}")
        if not 200 <= code < 300:
            raise RemoteRewardError(f"{url}: HTTP {code} {reason}")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise RemoteRewardError(f"{url}: answered non-JSON ({raw[:80]!r})") from None

    async def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        t0 = time.monotonic()
        self._retries = 0
        try:
            data = json.dumps(request_body(prompts, completions, columns), default=_jsonable).encode()
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"{self.cfg.url}: the batch cannot be sent as JSON ({e})") from None
        attempts = self.cfg.retries + 1
        try:
            for attempt in range(1, attempts + 1):
                try:
                    payload = await self._post(data)
                    break
                except _Retryable as e:
                    if attempt == attempts:
                        raise RemoteRewardError(f"{self.cfg.url}: {e} (after {attempts} attempts)") from None
                    self._retries += 1
                    await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                return parse_scores(payload, len(completions))
            except ValueError as e:
                raise RemoteRewardError(f"{self.cfg.url}: {e}") from None
        finally:
            self._seconds = time.monotonic() - t0

    def step_metrics(self) -> dict[str, float]:
        """``rewards/remote/retries`` and ``rewards/remote/seconds`` of the last call."""
        return {"retries": float(self._retries), "seconds": self._seconds}


async def http_post(url: str, data: bytes) -> tuple[int, str, bytes]:
    """POST ``data`` (JSON) to an ``http://`` / ``https://`` URL over asyncio streams -> ``(status, reason, body)``.
    The caller bounds it with ``asyncio.wait_for`` (cancelling it closes the connection). Raises ValueError (one line)
    on an answer that is not HTTP/1.x or longer than :data:`MAX_ANSWER_BYTES`; OSError / ConnectionError /
    ``asyncio.IncompleteReadError`` on the connection's failures."""
    u = urllib.parse.urlsplit(url)
    https = u.scheme == "https"
    reader, writer = await asyncio.open_connection(
        u.hostname, u.port or (443 if https else 80), ssl=ssl.create_default_context() if https else None
    )
    try:
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = (
            f"POST {target} HTTP/1.1\r\nHost: {u.netloc.rsplit('@', 1)[-1]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\nUser-Agent: lorarl\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + data)
        await writer.drain()
        status = (await reader.readline()).decode("latin-1").split(" ", 2)
        if len(status) < 2 or not status[0].startswith("HTTP/1.") or not status[1].isdigit():
            raise ValueError(f"answered something that is not HTTP/1.x ({' '.join(status)[:60]!r})")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
            if len(headers) > 100:
                raise ValueError("answered more than 100 header lines")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader)
        elif "content-length" in headers:
            size = int(headers["content-length"]) if headers["content-length"].isdigit() else -1
            if not 0 <= size <= MAX_ANSWER_BYTES:
                raise ValueError(f"answered a Content-Length of {headers['content-length'][:20]!r}")
            body = await reader.readexactly(size)
        else:
            body = await _read_to_end(reader)
        return int(status[1]), (status[2].strip() if len(status) > 2 else ""), body
    finally:
        writer.close()


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while chunk := await reader.read(65536):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise ValueError(f"answered more than {MAX_ANSWER_BYTES} bytes")
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_text = (await reader.readline()).split(b";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ValueError(f"answered a malformed chunk size ({size_text[:20]!r})") from None
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return bytes(body)
        if len(body) + size > MAX_ANSWER_BYTES:
            raise ValueError(f"answered more than {MAX_ANSWER_BYTES} bytes")
        body += await reader.readexactly(size)
        await reader.readline()
