"""Async reward functions (run concurrently, timeouts and failures counted like sync ones), failed values (NaN)
counted against reward.max_failure_fraction, and the remote reward against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import threading
import time

import pytest
import torch

from lorarl.config import RewardSpec, recipe_from_dict
from lorarl.config.rewards import RemoteRewardConfig
from lorarl.errors import LorarlError, RecipeError
from lorarl.rewards import RewardScorer
from lorarl.rewards.concurrent import is_async_reward
from lorarl.rewards.remote import RemoteReward, parse_scores, request_body


def scorer_with(*fns, timeout_s=5.0) -> RewardScorer:
    scorer = RewardScorer([RewardSpec(name="format") for _ in fns], timeout_s=timeout_s)
    scorer.fns = list(fns)
    scorer.values, scorer.failed_values = [0] * len(fns), [0] * len(fns)
    return scorer


SPANS: dict[str, tuple[float, float]] = {}  # name -> (start, end) of its last call, monotonic seconds


async def slow_one(prompts, completions, **kw):
    t = time.monotonic()
    await asyncio.sleep(0.5)
    SPANS["one"] = (t, time.monotonic())
    return [1.0] * len(completions)


async def slow_two(prompts, completions, **kw):
    t = time.monotonic()
    await asyncio.sleep(0.5)
    SPANS["two"] = (t, time.monotonic())
    return [2.0] * len(completions)


def overlap(*names: str) -> bool:
    """The calls ran at the same time: each started before every other ended (whatever the machine's load; run
    one after the other, the second starts after the first ended)."""
    return max(SPANS[n][0] for n in names) < min(SPANS[n][1] for n in names)


def test_two_async_rewards_run_concurrently():
    scorer = scorer_with(slow_one, slow_two)
    SPANS.clear()
    s = scorer(["p", "q"], ["a", "b"])
    assert overlap("one", "two"), f"two 0.5 s async rewards did not overlap: {SPANS}"
    assert s.per_function.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert (scorer.calls, scorer.failures) == (2, 0)


def test_async_rewards_run_while_a_sync_reward_runs():
    def sync_slow(prompts, completions, **kw):
        t = time.monotonic()
        time.sleep(0.5)
        SPANS["sync"] = (t, time.monotonic())
        return [3.0] * len(completions)

    scorer = scorer_with(slow_one, sync_slow, slow_two)
    SPANS.clear()
    s = scorer(["p"], ["a"])
    assert overlap("one", "sync", "two"), SPANS  # not one after the other
    assert s.per_function.tolist() == [[1.0, 3.0, 2.0]]
    assert s.total.tolist() == [6.0]


def test_is_async_reward_sees_partials_and_async_call_objects():
    import functools

    assert is_async_reward(slow_one) and is_async_reward(functools.partial(slow_one, x=1))
    assert is_async_reward(RemoteReward(RemoteRewardConfig(url="http://127.0.0.1:9/")))
    assert not is_async_reward(lambda prompts, completions, **kw: [0.0])


def test_async_failures_and_timeouts_are_counted_like_sync_ones():
    async def boom(prompts, completions, **kw):
        raise RuntimeError("server said no")

    async def hangs(prompts, completions, **kw):
        await asyncio.sleep(30)

    async def blocks_its_loop(prompts, completions, **kw):
        time.sleep(3)  # not cancellable: the scorer stops waiting at timeout + grace
        return [1.0]

    async def wrong_length(prompts, completions, **kw):
        return [1.0, 2.0]

    scorer = scorer_with(slow_one, boom, hangs, wrong_length, timeout_s=0.3)
    t0 = time.monotonic()
    s = scorer(["p"], ["a"])
    assert time.monotonic() - t0 < 1.5
    assert "RuntimeError: server said no" in s.failures["format_1"]
    assert "timed out after 0.3 s" in s.failures["format_2"]
    assert "returned 2 values for 1" in s.failures["format_3"]
    assert "timed out after 0.3 s" in s.failures["format"]  # slow_one (0.5 s > 0.3 s) too
    assert torch.isnan(s.per_function).all()
    assert (scorer.calls, scorer.failures) == (4, 4)

    scorer = scorer_with(blocks_its_loop, timeout_s=0.2)
    t0 = time.monotonic()
    s = scorer(["p"], ["a"])
    assert time.monotonic() - t0 < 2.5
    assert "blocked" in s.failures["format"] and (scorer.calls, scorer.failures) == (1, 1)


def test_nan_values_are_failed_values_none_is_not():
    def half_nan(prompts, completions, **kw):
        return [1.0, float("nan"), None, 0.0]

    scorer = scorer_with(half_nan)
    s = scorer(["p"] * 4, ["a"] * 4)
    assert (scorer.calls, scorer.failures) == (1, 0)  # the call itself worked
    assert (scorer.values, scorer.failed_values) == ([4], [1])
    assert s.failures["format"] == "1 of 4 values failed (returned NaN)"
    assert math.isnan(s.total[1]) and math.isnan(s.total[2]) and s.total[3] == 0.0
    for _ in range(3):
        scorer(["p"] * 4, ["a"] * 4)
    scorer.check_failure_budget(0.5)  # 4 of 16 values failed: 25%
    with pytest.raises(LorarlError, match=r"reward format: 4 of its 16 values failed \(25% > reward.max_failure"):
        scorer.check_failure_budget(0.2)
    state = scorer.state_dict()
    again = scorer_with(half_nan)
    again.load_state_dict(state)
    assert again.state_dict() == state == {"batches": 4, "call_failures": [0], "values": [16], "failed_values": [4]}
    again.load_state_dict({"calls": 3, "failures": 1})  # a checkpoint from before per-value counting
    assert (again.values, again.failed_values) == ([0], [0])
    assert (again.calls, again.call_failures) == (3, [1])  # one function: the failures were its own


def test_call_budget_names_the_recipe_key():
    async def boom(prompts, completions, **kw):
        raise RuntimeError("down")

    scorer = scorer_with(boom)
    for _ in range(4):
        s = scorer(["p"], ["a"])
    with pytest.raises(
        LorarlError, match=r"^reward format failed in 4 of its 4 calls \(100% > reward.max_failure_fraction=0.5\)"
    ):
        scorer.check_failure_budget(0.5, s.failures)


def test_call_budget_is_per_function():
    """One always-failing function of two is 100% of ITS calls (it was 50% of all calls, not above the default 0.5:
    the run trained on the other function for good); a function failing on every 2nd call is 50%, not above."""
    calls = []

    def flaky(prompts, completions, **kw):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("every other call")
        return [0.0] * len(completions)

    def boom(prompts, completions, **kw):
        raise RuntimeError("down")

    scorer = RewardScorer([RewardSpec(name="format"), RewardSpec(name="format")])
    scorer.fns = [flaky, boom]
    for _ in range(3):
        scorer(["p"], ["a"])
        scorer.check_failure_budget(0.5)  # fewer than 4 calls: not judged yet
    scorer(["p"], ["a"])
    assert (scorer.calls, scorer.call_failures, scorer.failure_fraction) == (8, [2, 4], 0.75)
    with pytest.raises(LorarlError, match=r"^reward format_1 failed in 4 of its 4 calls \(100% >"):
        scorer.check_failure_budget(0.5)
    scorer.fns = [flaky, flaky]
    scorer.call_failures = [2, 2]
    scorer.check_failure_budget(0.5)  # 2 of 4 each: 50%, not above 0.5


# ---- remote rewards ---------------------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    """POST /good: len(completion); /slow: sleeps 2 s; /short: one score too few; /text: a string among numbers;
    /flaky: HTTP 500 on the first request, then good; /openrlhf: {"rewards": [...]}; /nulls: null for row 0;
    /missing: 404; /notjson: text."""

    seen: list = []
    flaky_calls = 0

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, code: int, payload) -> None:
        body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.seen.append((self.path, body))
        good = [float(len(c)) for c in body["completions"]]
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/flaky":
            Handler.flaky_calls += 1
            if Handler.flaky_calls == 1:
                return self._send(500, {"error": "warming up"})
        routes = {
            "/short": (200, good[:-1]),
            "/text": (200, [good[0], "high"] + good[2:]),
            "/openrlhf": (200, {"rewards": good, "extra_logs": {}}),
            "/nulls": (200, [None] + good[1:]),
            "/missing": (404, {"error": "no"}),
            "/notjson": (200, "<html>"),
        }
        code, payload = routes.get(self.path, (200, good))
        self._send(code, payload)


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def remote_scorer(url: str, **cfg) -> RewardScorer:
    spec = RewardSpec(name="remote", remote=RemoteRewardConfig(url=url, **cfg))
    return RewardScorer([spec, RewardSpec(name="numeric_match")], timeout_s=10)


PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}]] * 3
COMPLETIONS = [[{"role": "assistant", "content": t}] for t in ("5", "It is 5", "six")]


def test_remote_reward_sends_trl_fields_and_reads_scores(server):
    Handler.seen.clear()
    scorer = remote_scorer(server + "/good")
    s = scorer(PROMPTS, COMPLETIONS, {"answer": ["5", "5", "5"]}, completion_ids=[[20], [1, 2, 3], [7, 8]])
    assert s.names == ["remote", "numeric_match"]
    assert s.per_function[:, 0].tolist() == [1.0, 1.0, 1.0]  # len() of the message list of each completion
    assert s.per_function[:, 1].tolist() == [1.0, 1.0, 0.0]
    path, body = Handler.seen[-1]
    assert body["prompts"] == PROMPTS and body["completions"] == COMPLETIONS
    assert body["completion_ids"] == [[20], [1, 2, 3], [7, 8]] and body["answer"] == ["5", "5", "5"]
    assert body["query"] == ["What is 2 + 3?5", "What is 2 + 3?It is 5", "What is 2 + 3?six"]  # OpenRLHF's fields
    assert body["labels"] == ["5", "5", "5"]
    assert s.extra["rewards/remote/retries"] == 0.0 and not s.failures


def test_remote_reward_accepts_openrlhf_answers_and_nulls(server):
    s = remote_scorer(server + "/openrlhf")(["ab", "c"], ["xyz", "w"], {"answer": ["1", "2"]})
    assert s.per_function[:, 0].tolist() == [3.0, 1.0]
    s = remote_scorer(server + "/nulls")(["ab", "c"], ["xyz", "w"], {"answer": ["1", "2"]})
    assert math.isnan(s.per_function[0, 0]) and s.per_function[1, 0] == 1.0 and not s.failures  # null: n/a


def test_remote_reward_retries_after_http_500(server):
    Handler.flaky_calls = 0
    scorer = remote_scorer(server + "/flaky", retries=2, backoff_s=0.05)
    s = scorer(["p", "q"], ["abc", "de"], {"answer": ["1", "2"]})
    assert Handler.flaky_calls == 2
    assert s.per_function[:, 0].tolist() == [3.0, 2.0] and not s.failures
    assert s.extra["rewards/remote/retries"] == 1.0
    assert (scorer.calls, scorer.failures) == (2, 0)


@pytest.mark.parametrize(
    "path, cfg, message",
    [
        ("/slow", {"timeout_s": 0.3, "retries": 1, "backoff_s": 0.0}, "no answer within 0.3 s (after 2 attempts)"),
        ("/short", {}, "answered 1 scores for 2 completions"),
        ("/text", {}, "answered a non-number at position 1: 'high'"),
        ("/missing", {"retries": 3}, "HTTP 404"),
        ("/notjson", {}, "answered non-JSON"),
    ],
)
def test_remote_reward_failures_are_counted_not_crashes(server, path, cfg, message):
    scorer = remote_scorer(server + path, **cfg)
    t0 = time.monotonic()
    s = scorer(["p", "q"], ["abc", "de"], {"answer": ["3", "9"]})
    assert time.monotonic() - t0 < 2.0
    assert s.failures["remote"].startswith(f"RemoteRewardError: {server}{path}: ")
    assert message in s.failures["remote"]
    assert torch.isnan(s.per_function[:, 0]).all()  # left out, not 0
    assert s.per_function[:, 1].tolist() == [0.0, 0.0] and s.total.tolist() == [0.0, 0.0]  # the rule still scores
    assert (scorer.calls, scorer.failures) == (2, 1)


def test_unreachable_server_is_a_counted_failure():
    scorer = remote_scorer("http://127.0.0.1:9/none", retries=1, backoff_s=0.0, timeout_s=1.0)
    s = scorer(["p"], ["a"], {"answer": ["1"]})
    assert "after 2 attempts" in s.failures["remote"] and scorer.failures == 1


def test_remote_wire_format_pure_functions():
    assert request_body(["a"], ["b"], {"answer": ["1"]}) == {
        "prompts": ["a"],
        "completions": ["b"],
        "answer": ["1"],
        "query": ["ab"],
        "labels": ["1"],
    }
    assert parse_scores([1, None, 2.5], 3) == [1.0, None, 2.5]
    assert parse_scores({"rewards": [0]}, 1) == [0.0]
    for bad, msg in [({"score": [1]}, "without 'rewards'"), ("1", "expected a JSON list"), ([True], "non-number")]:
        with pytest.raises(ValueError, match=msg):
            parse_scores(bad, 1)


def test_remote_and_judge_entries_are_validated_at_load():
    ok = recipe_from_dict({"reward": {"functions": [{"name": "remote", "remote": {"url": "http://127.0.0.1:8000"}}]}})
    assert ok.reward.functions[0].remote.retries == 2
    bad = [
        ({"name": "remote"}, "reward.functions[0].remote must be set for a reward named 'remote'"),
        ({"name": "remote", "remote": {"url": "localhost:8000"}}, "remote.url must be an http:// or https:// URL"),
        ({"name": "remote", "remote": {"url": "http://x", "timeout_s": 0}}, "remote.timeout_s must be > 0"),
        ({"name": "format", "remote": {"url": "http://x"}}, "remote is only read when reward.functions[0].name"),
    ]
    for entry, message in bad:
        with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]")):
            recipe_from_dict({"reward": {"functions": [entry]}})
