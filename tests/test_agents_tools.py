"""lorarl.agents: the calculator, tool loading and schemas, safe tool calls, environments, formats, the template's
prefix property."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

from lorarl.agents.builtins import calculator, format_number
from lorarl.agents.environment import EnvironmentSession, load_environment
from lorarl.agents.formats import make_format, parse_llama_json, parse_tagged, system_prompt_text
from lorarl.agents.render import ChatRenderer
from lorarl.agents.tools import argument_error, call_tool, load_tool, load_tools
from lorarl.errors import LorarlError

TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"

# ---- calculator ---------------------------------------------------------------------------------------------------


def test_calculator_is_exact():
    assert calculator("123 * 45") == "5535"
    assert calculator("987 * 65") == "64155"
    assert calculator("(2 + 3) / 6") == "5/6"
    assert calculator("0.1 + 0.2") == "0.3"  # exact, not 0.30000000000000004
    assert calculator("2 ** -2") == "0.25"
    assert calculator("-7 // 2") == "-4"
    assert calculator("10 % 4") == "2"
    assert calculator("123456789123456789 * 987654321987654321") == str(123456789123456789 * 987654321987654321)
    assert format_number(__import__("fractions").Fraction(-3, 8)) == "-0.375"


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "x + 1", "abs(-1)", "'a' * 3", "1 < 2", "2 ** 100000", "1 / 0", "(1,2)", ""],
)
def test_calculator_refuses_everything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        calculator(expr)


# ---- tools ----------------------------------------------------------------------------------------------------------


def test_load_tools_builtin_module_and_file(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text(
        'def shout(text: str, times: int = 1) -> str:\n    """Shout.\n\n    Args:\n        text: what\n'
        '        times: how often\n    """\n    return text.upper() * times\n'
    )
    tools = load_tools(["calculator", "lorarl.agents.builtins:python", f"{f}:shout"])
    assert [t.name for t in tools] == ["calculator", "python", "shout"]
    shout = tools[2].schema["function"]
    assert shout["parameters"]["properties"]["times"]["type"] == "integer"
    assert shout["parameters"]["required"] == ["text"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("calculater", "did you mean calculator"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
        ("lorarl.agents.builtins:nope", "has no 'nope'"),
        ("missing/file.py:f", "file missing/file.py not found"),
    ],
)
def test_missing_tool_is_one_line(spec, words):
    with pytest.raises(LorarlError) as e:
        load_tool(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def _tools(*fns):
    from lorarl.agents.tools import Tool, tool_schema

    return {f.__name__: Tool(f.__name__, f, tool_schema(f, f.__name__)) for f in fns}


def boom(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")


def sleepy(x: int) -> str:
    """Hang.

    Args:
        x: seconds
    """
    time.sleep(x)
    return "woke"


def weird(x: int) -> object:
    """Return a non-JSON object.

    Args:
        x: anything
    """
    return object()


def test_bad_tools_come_back_as_errors_never_raise():
    tools = _tools(boom, sleepy, weird)
    tools.update(_tools(calculator))
    ok = call_tool(tools, "calculator", {"expression": "6*7"}, 5)
    assert ok.error is None and ok.text == "42"
    cases = {
        "boom": ({"x": 1}, "kaput"),
        "weird": ({"x": 1}, "neither text nor JSON"),
        "nope": ({}, "unknown tool 'nope'"),
    }
    for name, (args, words) in cases.items():
        res = call_tool(tools, name, args, 5)
        assert res.error is not None and words in res.error
        assert json.loads(res.text)["error"] == res.error
    t0 = time.monotonic()
    res = call_tool(tools, "sleepy", {"x": 5}, 0.3)
    assert "timed out after 0.3 s" in res.error and time.monotonic() - t0 < 2
    assert "unknown parameter 'y'" in call_tool(tools, "boom", {"y": 1}, 5).error
    assert "missing required parameter 'x'" in call_tool(tools, "boom", {}, 5).error
    assert "must be integer, got str" in call_tool(tools, "boom", {"x": "1"}, 5).error
    assert "must be integer, got bool" in argument_error(tools["boom"].schema, {"x": True})
    assert "JSON object" in call_tool(tools, "boom", [1], 5).error


def test_python_tool_runs_in_the_sandbox():
    tools = load_tools(["python"])
    py = {t.name: t for t in tools}
    assert call_tool(py, "python", {"code": "print(6 * 7)"}, 20).text.strip() == "42"
    err = call_tool(py, "python", {"code": "raise ValueError('no')"}, 20)
    assert err.error and "ValueError: no" in err.error
    hang = call_tool(py, "python", {"code": "while True: pass"}, 20)  # the sandbox's own limits stop it
    assert hang.error and ("timeout" in hang.error or "cpu_limit" in hang.error)


# ---- environments ---------------------------------------------------------------------------------------------------

ENV_SOURCE = '''
INSTANCES = []

class Counter:
    """A TRL-style environment: reset(**row), tools as public methods, get_reward()."""

    def __init__(self):
        self.count = 0
        INSTANCES.append(self)
        self.closed = False

    def reset(self, target=0, **kwargs):
        self.target = target
        return f" Reach {target}."

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much
        """
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count == self.target)

    def close(self):
        self.closed = True


class Broken(Counter):
    def reset(self, **kwargs):
        raise RuntimeError("no world today")
'''


@pytest.fixture()
def env_file(tmp_path):
    f = tmp_path / "envs.py"
    f.write_text(ENV_SOURCE)
    return f


def test_environment_follows_trls_convention(env_file):
    cls = load_environment(f"{env_file}:Counter")
    s = EnvironmentSession(cls, {"prompt": "p", "target": 3})
    assert s.observation == " Reach 3." and [t.name for t in s.tools] == ["increment"]
    s.tools[0].fn(by=3)
    assert s.reward() == 1.0
    inst = s.instance
    s.release()
    assert inst.closed and s.instance is None
    bad = EnvironmentSession(load_environment(f"{env_file}:Broken"), {"prompt": "p"})
    assert "no world today" in bad.reset_error and bad.reward() != bad.reward()  # NaN
    with pytest.raises(LorarlError, match="has no 'Nope'"):
        load_environment(f"{env_file}:Nope")


# ---- formats --------------------------------------------------------------------------------------------------------


def test_hermes_tagged_calls():
    one = parse_tagged(
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    )
    assert [(c.name, c.arguments) for c in one.calls] == [("calculator", {"expression": "1+1"})]
    assert one.content == "Let me compute." and not one.malformed
    two = parse_tagged(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 2}"}'
        "</tool_call>"
    )
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {}), ("b", {"x": 2})]
    bad = parse_tagged('<tool_call>{"name": "a", "arguments": {</tool_call> <tool_call>{"arguments": {}}</tool_call>')
    assert not bad.calls and len(bad.malformed) == 2 and "not JSON" in bad.malformed[0]
    assert "string 'name'" in bad.malformed[1]
    unclosed = parse_tagged('ok <tool_call>{"name": "a"')
    assert not unclosed.calls and "without </tool_call>" in unclosed.malformed[0]
    assert parse_tagged("The answer is 5535.").calls == []


def test_llama_json_calls():
    one = parse_llama_json('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}')
    assert [(c.name, c.arguments) for c in one.calls] == [("calculator", {"expression": "2*3"})]
    two = parse_llama_json('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    bad = parse_llama_json('{"name": "a", "parameters": {"x": ')
    assert not bad.calls and "not JSON" in bad.malformed[0]
    wrong = parse_llama_json('{"name": "a", "parameters": [1]}')
    assert "must be a JSON object" in wrong.malformed[0]
    plain = parse_llama_json("The answer is 6.")
    assert plain.calls == [] and plain.malformed == [] and plain.content == "The answer is 6."


@pytest.fixture(scope="module")
def tokenizer():
    from lorarl.model import load_tokenizer
    from lorarl.model.registry import DEFAULT_MODEL, convert_embedded

    return load_tokenizer(str(convert_embedded(DEFAULT_MODEL)))


def _renderer(tok, template: str | None = None, fmt: str = "auto"):
    tok = copy.deepcopy(tok)
    if template is not None:
        tok.chat_template = template
    schemas = [t.schema for t in load_tools(["calculator"])]
    return ChatRenderer(tok, make_format(fmt, tok.chat_template), schemas, [tok.eos_token_id]), tok


def test_format_detection_and_the_system_prompt_convention(tokenizer):
    assert make_format("auto", tokenizer.chat_template).name == "system_prompt"  # SmolLM2: no tool support
    assert make_format("auto", (TEMPLATES / "qwen2_5.jinja").read_text()).name == "hermes"
    assert make_format("auto", (TEMPLATES / "llama3_1.jinja").read_text()).name == "llama3_json"
    r, tok = _renderer(tokenizer)
    text = tok.decode(r.prompt_ids([{"role": "user", "content": "What is 3 * 4?"}]))
    assert system_prompt_text(r.schemas) in text and text.index("<|im_start|>system") < text.index("What is 3 * 4?")
    assert '"name": "calculator"' in text
    suffix = tok.decode(r.tool_suffix_ids([("calculator", "12")]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    q, qtok = _renderer(tokenizer, (TEMPLATES / "qwen2_5.jinja").read_text())
    assert "<tools>" in qtok.decode(q.prompt_ids([{"role": "user", "content": "hi"}]))
    two = qtok.decode(q.tool_suffix_ids([("calculator", "12"), ("calculator", "13")]))
    assert two.count("<tool_response>") == 2 and two.endswith("<|im_start|>assistant\n")


def test_prefix_property_accepts_good_templates_and_refuses_a_broken_one(tokenizer):
    for name in ("qwen2_5.jinja", "qwen3_training.jinja"):
        _renderer(tokenizer, (TEMPLATES / name).read_text())[0].check_prefix_property()
    _renderer(tokenizer)[0].check_prefix_property()  # SmolLM2 with the system-prompt convention
    # a template that re-renders earlier turns: tool results are shown in full only while they are the last message
    broken = tokenizer.chat_template.replace(
        "message['content']", "(message['content'] if loop.last or message['role'] != 'user' else 'old')"
    )
    with pytest.raises(LorarlError, match="breaks the prefix property") as e:
        _renderer(tokenizer, broken)[0].check_prefix_property()
    assert "\n" not in str(e.value)
    with pytest.raises(LorarlError, match="prefix property"):  # Qwen3's template drops earlier reasoning (trl#6124)
        _renderer(tokenizer, (TEMPLATES / "qwen3.jinja").read_text())[0].check_prefix_property()


# ---- the recipe's agent section ------------------------------------------------------------------------------------


def _recipe(tmp_path, agent: dict, algo: str = "grpo"):
    import yaml

    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"algo": algo, "agent": agent}))
    return f


@pytest.mark.parametrize(
    "agent, words",
    [
        ({"tools": ["calculator"], "max_turns": 0}, "agent.max_turns must be >= 1"),
        ({"tools": []}, "agent needs agent.tools or agent.environment"),
        ({"tools": ["calculator"], "format": "xml"}, "agent.format"),
        ({"tools": ["calculator"], "max_turn": 2}, "unknown key agent.max_turn (did you mean agent.max_turns?)"),
        ({"environment": "NoColon"}, "agent.environment must be module:Class"),
    ],
)
def test_agent_section_is_checked_at_load(tmp_path, agent, words):
    from lorarl.config import load_recipe

    with pytest.raises(LorarlError) as e:
        load_recipe(_recipe(tmp_path, agent))
    assert words in str(e.value)


@pytest.mark.parametrize(
    "agent, words",
    [
        ({"tools": ["calculater"]}, "unknown tool 'calculater' (did you mean calculator?)"),
        ({"tools": ["lorarl.agents.builtins:nope"]}, "lorarl.agents.builtins has no 'nope'"),
        ({"environment": "lorarl.agents.builtins:NoSuchEnv"}, "has no 'NoSuchEnv'"),
        ({"environment": "lorarl.agents.builtins:calculator"}, "is not a class"),
    ],
)
def test_train_refuses_a_missing_tool_or_environment_before_the_model_loads(tmp_path, capsys, agent, words):
    from lorarl.cli import main

    rc = main(["train", str(_recipe(tmp_path, agent)), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "run").exists()


def test_agent_section_only_in_rl_recipes(tmp_path):
    from lorarl.config import load_recipe

    with pytest.raises(LorarlError, match="section agent does not apply to algo reward_model"):
        load_recipe(_recipe(tmp_path, {"tools": ["calculator"]}, algo="reward_model"))
