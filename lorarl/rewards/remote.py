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

Failures: a connection error, a timeout (``remote.timeout_s`` per request) or HTTP 429 / 5xx is retried
``remote.retries`` times after ``backoff_s * 2**(k-1)`` seconds; any other HTTP status, an answer that is not JSON,
of the wrong length or holding a non-number fails at once. A failed call is one :class:`RemoteRewardError` with one
line naming the URL and the cause; the scorer counts it (the function's column is NaN for that batch, left out),
against ``reward.max_failure_fraction``. The request runs in a worker thread of the scoring call's event loop, so a
remote reward runs concurrently with the other ``async`` rewards.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

from lorarl.config.rewards import RemoteRewardConfig
from lorarl.core.messages import completion_text

RETRY_STATUS = (429, 500, 502, 503, 504)


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
    """The JSON object POSTed for a batch (the module docstring's wire format)."""
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

    def _post(self, data: bytes) -> Any:
        req = urllib.request.Request(
            self.cfg.url, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code in RETRY_STATUS:
                raise _Retryable(f"HTTP {e.code} {e.reason}") from None
            raise RemoteRewardError(f"{self.cfg.url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise _Retryable(f"no answer within {self.cfg.timeout_s:g} s") from None
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteRewardError(f"{self.cfg.url}: answered non-JSON ({raw[:80]!r})") from None

    async def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        t0 = time.monotonic()
        self._retries = 0
        try:
            data = json.dumps(request_body(prompts, completions, columns), default=_jsonable).encode()
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"{self.cfg.url}: the batch cannot be sent as JSON ({e})") from None
        loop = asyncio.get_running_loop()
        attempts = self.cfg.retries + 1
        try:
            for attempt in range(1, attempts + 1):
                try:
                    payload = await loop.run_in_executor(None, self._post, data)
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
