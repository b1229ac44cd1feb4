"""Chat panes of runs trained with tools (lorarl.chat.tools): the tool loop with the run's tools, exact ids appended
as in training, calls and results folded beside the answer, only the recipe's tools, and the plain panes of the same
request unchanged (tiny model; a scripted model turn where the test needs a known call)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import yaml

from lorarl.chat import Catalog, ChatEngine, ChatSession, plain_history
from lorarl.config import GenerationConfig, LoraSettings, ModelConfig
from lorarl.model import SharedBase

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'
BAD = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
USER = [{"role": "user", "content": "What is 123 * 45?"}]
GREEDY = GenerationConfig(temperature=0.0, top_p=1.0, max_new_tokens=12)


def load_tiny(model_dir: Path) -> SharedBase:
    return SharedBase.load(
        ModelConfig(name=str(model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    )


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """``agent`` (trained with the calculator) and ``plain`` (no agent section), the same adapter weights."""
    runs = tmp_path_factory.mktemp("chat_tools") / "runs"
    sb = load_tiny(tiny_model_dir)
    sb.add_adapter("policy", LoraSettings(r=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    base = {"algo": "grpo", "model": {"name": str(tiny_model_dir)}}
    agent = {"tools": ["calculator"], "max_turns": 3, "max_tokens_per_turn": 48, "max_total_tokens": 400}
    for name, recipe in (("agent", {**base, "agent": agent}), ("plain", base)):
        sb.save_adapter("policy", runs / name / "policy")
        (runs / name / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return runs


@pytest.fixture
def engine(runs_dir, tiny_model_dir) -> ChatEngine:
    return ChatEngine(load_tiny(tiny_model_dir), Catalog(runs_dir, str(tiny_model_dir)))


def turns_taken(text: str) -> int:
    """Model turns already taken since the last message the user typed (tool results come back as user messages
    starting with <tool_response>)."""
    typed = [i for i in range(len(text)) if text.startswith("<|im_start|>user\n", i)]
    typed = [i for i in typed if not text.startswith("<tool_response>", i + len("<|im_start|>user\n"))]
    return text[typed[-1] :].count("<|im_start|>assistant") - 1


def script_tool_turns(monkeypatch, turns: list[str]) -> list[list[list[int]]]:
    """Tool panes (their prompt carries the tools) write ``turns[k]`` at turn ``k`` (then EOS); other panes run the
    real model. Returns the prompts each scripted call saw."""
    real = ChatEngine.generate_ids
    seen: list[list[list[int]]] = []

    def scripted(self, model, tok, names, prompts, request, max_new, on_text, seed=True):
        if "You can use tools" not in tok.decode(prompts[0]):
            return real(self, model, tok, names, prompts, request, max_new, on_text, seed)
        seen.append([list(p) for p in prompts])
        outs = []
        for r, p in enumerate(prompts):
            k = turns_taken(tok.decode(p))
            outs.append(tok(turns[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            on_text(r, turns[k])
        return outs

    monkeypatch.setattr(ChatEngine, "generate_ids", scripted)
    return seen


def test_a_tool_pane_runs_the_calculator_and_appends_the_ids_training_appends(engine, monkeypatch):
    seen = script_tool_turns(monkeypatch, [CALL, "The answer is 5535."])
    steps_seen = []
    answers = engine.generate(
        ["agent/policy", "plain/policy"], [USER] * 2, GREEDY, on_steps=lambda i, s: steps_seen.append((i, s))
    )
    tool, plain = answers
    assert [(s.name, s.arguments, s.result, s.error) for s in tool.steps] == [
        ("calculator", {"expression": "123 * 45"}, "5535", None)
    ]
    assert tool.text == "The answer is 5535." and tool.finished and tool.turns == 2
    assert steps_seen and steps_seen[-1][0] == 0
    # turn 2 continued from exactly: the prompt, the model's call and its EOS, the template's tool-message ids
    agent = engine.tools.agent(engine.catalog.get("agent/policy"), engine.shared.tokenizer, engine.shared.eos_ids)
    tok = engine.shared.tokenizer
    prompt = agent.renderer.prompt_ids(USER)
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert seen[0] == [prompt]
    assert seen[1] == [prompt + call + agent.renderer.tool_suffix_ids([("calculator", "5535")])]
    # the plain pane of the same request answers as it does alone (no tools, no steps)
    alone = engine.generate(["plain/policy"], [USER], GREEDY)[0]
    assert plain.steps == [] and plain.token_ids == alone.token_ids and plain.turns == 0


def test_only_the_runs_tools_can_run(engine, monkeypatch):
    """The run trained with the calculator only: a call to the python tool is refused (an error the model reads),
    and a malformed call is answered with an error too."""
    script_tool_turns(monkeypatch, [BAD + "\n<tool_call>{oops</tool_call>", "Done."])
    ran = []
    monkeypatch.setattr("lorarl.sandbox.run_python", lambda *a, **k: ran.append(a))
    answer = engine.generate(["agent/policy"], [USER], GREEDY)[0]
    assert not ran
    (unknown, malformed) = answer.steps
    assert unknown.name == "python" and "unknown tool 'python'" in unknown.error and "calculator" in unknown.result
    assert malformed.arguments is None and "malformed tool call" in malformed.result
    assert answer.text == "Done."


def test_max_turns_ends_a_pane_that_keeps_calling(engine, monkeypatch):
    script_tool_turns(monkeypatch, [CALL] * 5)
    answer = engine.generate(["agent/policy"], [USER], GREEDY)[0]
    assert answer.turns == 3 and len(answer.steps) == 2 and not answer.finished
    assert "agent.max_turns = 3" in answer.text


def test_the_real_model_answers_a_tool_pane_beside_a_plain_one(engine):
    """No script: the tiny model's own turns go through the loop (whatever it writes) without error, greedy and
    deterministic, and the plain pane of the batch is the same answer as alone."""
    first = engine.generate(["agent/policy", "plain/policy"], [USER] * 2, GREEDY)
    again = engine.generate(["agent/policy", "plain/policy"], [USER] * 2, GREEDY)
    assert [a.token_ids for a in first] == [a.token_ids for a in again]
    assert first[0].turns >= 1 and len(first[0].token_ids) <= 48
    assert first[1].token_ids == engine.generate(["plain/policy"], [USER], GREEDY)[0].token_ids


def test_the_pane_shows_calls_and_results_folded_beside_the_answer(engine, monkeypatch, tmp_path):
    from lorarl.chat.handlers import Handlers

    script_tool_turns(monkeypatch, [CALL, "The answer is 5535."])
    handlers = Handlers(ChatSession(engine, tmp_path / "p.jsonl", tmp_path / "t.jsonl"))
    request = types.SimpleNamespace(session_hash="test")
    hist = [[], [], [], []]
    frames = list(
        handlers.on_send(
            "What is 123 * 45?", 2, "agent/policy", "plain/policy", "base", "base", *hist,
            "", 0.0, 1.0, 12, 0, "none", "", request,
        )
    )  # fmt: skip
    bots = frames[-1][:4]
    tool_pane, plain_pane = bots[0], bots[1]
    assert tool_pane[0] == {"role": "user", "content": "What is 123 * 45?"}
    folded = tool_pane[1]
    assert folded["metadata"]["title"] == '🛠️ calculator({"expression": "123 * 45"})'
    assert folded["metadata"]["status"] == "done" and "5535" in folded["content"]
    assert tool_pane[2] == {"role": "assistant", "content": "The answer is 5535."}
    assert len(tool_pane) == 3 and not any("metadata" in m for m in plain_pane)
    # the next turn's conversation keeps the answers, not the folded tool messages; they stay on screen
    assert plain_history(tool_pane) == [tool_pane[0], tool_pane[2]]
    frames = list(
        handlers.on_send(
            "And 2 + 2?", 2, "agent/policy", "plain/policy", "base", "base", tool_pane, plain_pane, [], [],
            "", 0.0, 1.0, 12, 0, "none", "", request,
        )
    )  # fmt: skip
    again = frames[-1][0]
    assert again[:3] == tool_pane and again[3]["content"] == "And 2 + 2?"
    assert again[4]["metadata"]["title"].startswith("🛠️ calculator")
    # Regenerate drops the last exchange with its folded calls, and answers it again
    frames = list(
        handlers.on_regen(
            2, "agent/policy", "plain/policy", "base", "base", again, frames[-1][1], [], [],
            "", 0.0, 1.0, 12, 0, "none", "", request,
        )
    )  # fmt: skip
    assert frames[-1][0] == again


def test_a_run_whose_tool_is_missing_is_one_clear_error(runs_dir, tiny_model_dir, tmp_path):
    from lorarl.errors import LorarlError

    runs = tmp_path / "runs"
    import shutil

    shutil.copytree(runs_dir / "agent", runs / "broken")
    recipe = yaml.safe_load((runs / "broken" / "recipe.yaml").read_text())
    recipe["agent"]["tools"] = ["calculater"]
    (runs / "broken" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    eng = ChatEngine(load_tiny(tiny_model_dir), Catalog(runs, str(tiny_model_dir)))
    with pytest.raises(LorarlError, match="unknown tool 'calculater'"):
        eng.generate(["broken/policy"], [USER], GREEDY)


def test_respond_reports_the_tool_calls_of_each_pane(engine, monkeypatch, tmp_path):
    script_tool_turns(monkeypatch, [CALL, "The answer is 5535."])
    session = ChatSession(engine, tmp_path / "p.jsonl", tmp_path / "t.jsonl")
    out = session.respond("What is 123 * 45?", ["agent/policy", "plain/policy"], generation=GREEDY)
    assert out["answers"][0] == "The answer is 5535." and out["finished"][0]
    assert out["tool_calls"] == [
        [{"name": "calculator", "arguments": {"expression": "123 * 45"}, "result": "5535", "error": None}],
        [],
    ]


def test_stop_between_turns_ends_a_tool_pane(engine, monkeypatch):
    import threading

    script_tool_turns(monkeypatch, [CALL, "The answer is 5535."])
    stop = threading.Event()
    answer = engine.generate(["agent/policy"], [USER], GREEDY, stop=stop, on_steps=lambda i, s: stop.set())[0]
    assert answer.turns == 1 and len(answer.steps) == 1 and not answer.finished and answer.text == ""


def test_gradio_keeps_the_folded_messages_through_a_round_trip():
    """The installed gradio Chatbot shows a message with a metadata title as a collapsed block ("status": "done"), and
    sends it back with the title; the chat reads it back as shown, and leaves it out of the conversation."""
    import gradio as gr

    from lorarl.chat.inputs import display_history
    from lorarl.chat.tools import ToolStep, tool_messages

    shown = [{"role": "user", "content": "q"}]
    shown += tool_messages([ToolStep("calculator", {"expression": "1+1"}, "2")], "Two.")
    bot = gr.Chatbot()
    back = bot.preprocess(bot.postprocess(shown))
    assert back[1]["metadata"] == {"title": '🛠️ calculator({"expression": "1+1"})', "status": "done"}
    assert display_history(back) == shown
    assert plain_history(back) == [shown[0], shown[-1]]


def test_the_python_tool_runs_in_the_sandbox(engine, runs_dir, monkeypatch):
    """A run trained with the python tool: the pane's code runs in lorarl's sandbox (a private temporary directory,
    the memory limit), and what it printed is the result."""
    import json
    import os

    recipe = yaml.safe_load((runs_dir / "agent" / "recipe.yaml").read_text())
    recipe["agent"]["tools"] = ["python"]
    (runs_dir / "py" / "policy").mkdir(parents=True, exist_ok=True)
    for f in (runs_dir / "agent" / "policy").iterdir():
        (runs_dir / "py" / "policy" / f.name).write_bytes(f.read_bytes())
    (runs_dir / "py" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    engine.catalog.scan()

    def call(code: str) -> str:
        return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"

    script_tool_turns(monkeypatch, [call("import os\nprint(6 + 1)\nprint(os.getcwd())"), "Seven."])
    (step,) = engine.generate(["py/policy"], [USER], GREEDY)[0].steps
    printed, cwd = step.result.splitlines()
    assert step.error is None and printed == "7" and cwd != os.getcwd()
    script_tool_turns(monkeypatch, [call("bytearray(9**10)"), "Done."])  # 3.5 GB: past the 512 MB limit
    (step,) = engine.generate(["py/policy"], [USER], GREEDY)[0].steps
    assert step.error is not None and "MemoryError" in step.result
