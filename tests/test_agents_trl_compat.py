"""What a tool or environment written for TRL's GRPOTrainer may do, and lorarl runs unchanged: ``async def`` tools,
environment methods and ``get_reward``; an environment as the only reward source (TRL's ``reward_funcs`` left out),
logged under its class name; and a turn's tool calls running concurrently across rows, each row's in order."""

from __future__ import annotations

import json
import math
import threading

import pytest
import yaml

from lorarl.agents.environment import EnvironmentSession, load_environment
from lorarl.agents.tools import PendingCall, call_tool, call_tools, load_tool
from lorarl.errors import LorarlError

ASYNC_TOOLS = '''
import asyncio


async def lookup(query: str) -> str:
    """Look something up.

    Args:
        query: what to look up
    """
    await asyncio.sleep(0)
    return "found " + query


async def hang(x: int) -> str:
    """Never answers.

    Args:
        x: anything
    """
    await asyncio.sleep(60)
    return "late"


def returns_a_coroutine(x: int) -> str:
    """A plain function that hands back a coroutine.

    Args:
        x: a number
    """
    async def inner():
        return str(x * 2)

    return inner()


class AsyncCounter:
    """TRL's convention with async methods: a tool method and get_reward."""

    def __init__(self):
        self.count = 0

    async def reset(self, target=0, **kwargs):
        self.target = target
        return f" (reach {target})"

    async def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much
        """
        await asyncio.sleep(0)
        self.count += by
        return str(self.count)

    async def get_reward(self) -> float:
        return float(self.count == self.target)


class LoopBound:
    """An async reset that keeps something bound to the running event loop, used by a later async tool call."""

    async def reset(self, **kwargs):
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()

    async def touch(self, x: int) -> str:
        """Use what reset made.

        Args:
            x: anything
        """
        async with self.lock:
            return "same loop" if asyncio.get_running_loop() is self.loop else "another loop"


class NoReward:
    """An environment without get_reward."""

    def reset(self, **kwargs):
        return None

    def poke(self, x: int) -> str:
        """Poke.

        Args:
            x: where
        """
        return "ok"
'''


@pytest.fixture()
def module_file(tmp_path):
    f = tmp_path / "async_things.py"
    f.write_text(ASYNC_TOOLS)
    return f


def test_async_tools_are_awaited_under_the_time_limit(module_file):
    tools = {t.name: t for t in (load_tool(f"{module_file}:{n}") for n in ("lookup", "hang", "returns_a_coroutine"))}
    assert tools["lookup"].schema["function"]["parameters"]["required"] == ["query"]
    ok = call_tool(tools, "lookup", {"query": "pi"}, timeout_s=5)
    assert (ok.text, ok.error) == ("found pi", None)
    late = call_tool(tools, "hang", {"x": 1}, timeout_s=0.2)
    assert late.error == "hang: timed out after 0.2 s" and "timed out" in late.text
    assert call_tool(tools, "returns_a_coroutine", {"x": 21}, timeout_s=5).text == "42"


def test_async_environment_methods_and_get_reward(module_file):
    cls = load_environment(f"{module_file}:AsyncCounter")
    s = EnvironmentSession(cls, {"prompt": "p", "target": 3})
    assert s.reset_error is None and s.observation == " (reach 3)"
    tools = {t.name: t for t in s.tools}
    assert list(tools) == ["increment"]
    assert call_tool(tools, "increment", {"by": 2}, timeout_s=5).text == "2"
    assert s.reward() == 0.0  # awaited, not a coroutine turned into NaN
    assert call_tool(tools, "increment", {"by": 1}, timeout_s=5).text == "3"
    assert s.reward() == 1.0


def test_an_environments_async_calls_share_one_event_loop(module_file):
    s = EnvironmentSession(load_environment(f"{module_file}:LoopBound"), {"prompt": "p"})
    assert s.reset_error is None
    tools = {t.name: t for t in s.tools}
    for _ in range(2):
        assert call_tool(tools, "touch", {"x": 1}, timeout_s=5).text == "same loop"


def _meeting_tools(workers: int):
    """Two rows, each calling ``meet`` then ``note``: ``meet`` waits (2 s at most) for the other row's ``meet``, so
    it answers only when the rows' calls run at the same time."""
    from lorarl.agents.tools import Tool, tool_schema

    barrier, log, lock = threading.Barrier(2, timeout=2.0), [], threading.Lock()

    def meet(row: int) -> str:
        """Wait for the other row.

        Args:
            row: this row
        """
        barrier.wait()
        with lock:
            log.append((row, "meet"))
        return "met"

    def note(row: int) -> str:
        """Write down.

        Args:
            row: this row
        """
        with lock:
            log.append((row, "note"))
        return "noted"

    tools = {f.__name__: Tool(f.__name__, f, tool_schema(f, f.__name__)) for f in (meet, note)}
    rows = [[PendingCall(tools, "meet", {"row": r}), PendingCall(tools, "note", {"row": r})] for r in (0, 1)]
    return call_tools(rows + [[]], timeout_s=10, workers=workers), log


def test_a_turns_calls_run_concurrently_across_rows_and_in_order_within_a_row():
    results, log = _meeting_tools(workers=2)
    assert [[r.text for r in row] for row in results] == [["met", "noted"], ["met", "noted"], []]
    for row in (0, 1):  # each row's calls in the order the model made them
        assert [what for r, what in log if r == row] == ["meet", "note"]
    alone, _ = _meeting_tools(workers=1)  # one call at a time: nobody to meet, an error told to the model
    assert alone[0][0].error is not None and alone[0][1].text == "noted"


# ---- the environment as the only reward -------------------------------------------------------------------------


def _recipe_file(tmp_path, **sections):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"algo": "grpo", **sections}))
    return f


def test_reward_functions_may_be_empty_only_with_an_environment(tmp_path, module_file):
    from lorarl.config import load_recipe

    r = load_recipe(
        _recipe_file(tmp_path, reward={"functions": []}, agent={"environment": f"{module_file}:AsyncCounter"})
    )
    assert r.reward.functions == []
    with pytest.raises(LorarlError, match="reward.functions must name at least one function"):
        load_recipe(_recipe_file(tmp_path, reward={"functions": []}, agent={"tools": ["calculator"]}))


def test_an_environment_without_get_reward_cannot_be_the_only_reward(tmp_path, capsys, module_file):
    from lorarl.cli import main

    f = _recipe_file(tmp_path, reward={"functions": []}, agent={"environment": f"{module_file}:NoReward"})
    rc = main(["train", str(f), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "has no get_reward" in err[0] and "reward.functions is empty" in err[0]
    assert not (tmp_path / "run").exists()


def test_grpo_step_scored_by_the_environment_alone(tiny_model_dir, tmp_path, monkeypatch, module_file):
    from test_agents_loop import ScriptedEngine

    from lorarl.algos import algorithm_class
    from lorarl.config import ModelConfig, recipe_from_dict
    from lorarl.model import SharedBase

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "Count to 3.", "target": 3}) + "\n" for _ in range(8)))
    recipe = recipe_from_dict({
        "algo": "grpo",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"source": str(rows), "eval_size": 2},
        "reward": {"functions": []},
        "generation": {"max_new_tokens": 6},
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "agent": {"environment": f"{module_file}:AsyncCounter", "max_turns": 2, "max_tokens_per_turn": 40},
        "grpo": {"group_size": 2},
        "health": {"parity_every": 0},
        "eval": {"n": 2, "batch_size": 2},
    })  # fmt: skip
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))

    def script(turn, text, i):  # rows 0 and 2 add 3 (reward 1), rows 1 and 3 add 1 (reward 0)
        by = 3 if i % 2 == 0 else 1
        return f'<tool_call>{{"name": "increment", "arguments": {{"by": {by}}}}}</tool_call>' if turn == 0 else "ok"

    monkeypatch.setattr("lorarl.agents.loop.make_engine", lambda name: ScriptedEngine(script))
    algo = algorithm_class("grpo")(recipe, shared)
    metrics = algo.step(algo.batch(1))
    assert metrics["rewards/AsyncCounter/mean"] == 0.5 and metrics["reward"] == 0.5
    assert metrics["tools/call_frequency"] == 1 and math.isfinite(metrics["loss"])
