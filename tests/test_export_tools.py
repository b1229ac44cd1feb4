"""Exports of a run that trained with tools (lorarl.export.tools): the model card says how the model calls tools
(format, the exact system message, the tools' JSON schemas) and the Ollama Modelfile carries a tool template for the
system-prompt convention (checked against the tokenizer), or says why not. The run is a real one GRPO step with an
agent recipe on the tiny model (a scripted first turn makes the tool call)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lorarl.config import recipe_from_dict
from lorarl.export import export, locate
from lorarl.export.card import model_card
from lorarl.export.ollama import modelfile_text, write_modelfile
from lorarl.export.tools import check_tool_template, ollama_tool_template, render_tool_conversation, tool_use

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'


class CallThenAnswer:
    """A decode engine whose first turn is a calculator call and whose next turns answer (whatever the prompt)."""

    name = "scripted"

    def sample(self, shared, prompts, group_size, generation, *, max_new_tokens=None, record_logprobs=False, **kw):
        import torch

        from lorarl.rollout.engines import Sampled

        tok = shared.tokenizer
        outs = []
        for p in [p for p in prompts for _ in range(group_size)]:
            text = CALL if "<tool_response>\n" not in tok.decode(p) else "The answer is 5535."
            outs.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        ids = torch.full((len(outs), max(len(o) for o in outs)), shared.pad_id, dtype=torch.long)
        for i, o in enumerate(outs):
            ids[i, : len(o)] = torch.as_tensor(o)
        return Sampled(ids, torch.zeros(ids.shape) if record_logprobs else None)


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, tiny_model_dir) -> Path:
    """``lorarl train`` of one GRPO step with the calculator (system-prompt convention: the tiny template has no
    tool support), its recipe saved in the run directory as training writes it."""
    from lorarl.algos.loop import train

    root = tmp_path_factory.mktemp("agent_export")
    reward = root / "len_reward.py"
    reward.write_text("def length(completions, **kw):\n    return [float(len(str(c))) for c in completions]\n")
    data = {
        "algo": "grpo",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 4, "eval_size": 2, "system_prompt": "You are a careful calculator user."},
        "reward": {"functions": [{"name": f"{reward}:length"}]},
        "generation": {"max_new_tokens": 6},
        "train": {"steps": 1, "prompts_per_step": 1, "micro_batch_size": 2, "learning_rate": 1e-2},
        "grpo": {"group_size": 2},
        "agent": {"tools": ["calculator"], "max_turns": 2, "max_tokens_per_turn": 40},
        "health": {"parity_every": 0},
        "eval": {"n": 2, "batch_size": 2},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lorarl.agents.loop.make_engine", lambda name: CallThenAnswer())
        train(recipe_from_dict(data), root / "run")
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any(r.get("tools/call_frequency") == 1 for r in rows)  # the step really called the calculator
    return root / "run"


def _tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _text_block_after(card: str, heading: str) -> str:
    rest = card[card.index(heading) :]
    return re.search(r"```text\n(.*?)\n```", rest, re.DOTALL).group(1)


def test_the_card_says_how_the_model_calls_tools(agent_run, tiny_model_dir, tmp_path):
    summary = export(agent_run, tmp_path / "out", fmt="adapter", gate_n=0)
    card = (Path(summary["out"]) / "README.md").read_text()
    assert "## Tool use" in card and "tool-call format `system_prompt`" in card and "`calculator`" in card
    assert '`<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>`' in card
    system = _text_block_after(card, "## Tool use")
    assert system.startswith("You are a careful calculator user.\n\nYou can use tools. The tools, as JSON schemas:\n")
    # the card's system message is the one the run's prompts were rendered with in training
    from lorarl.agents.setup import build_agent

    src = locate(agent_run)
    tok = _tok(tiny_model_dir)
    agent = build_agent(src.recipe.agent, tok, [tok.eos_token_id], system_prompt=src.recipe.data.system_prompt)
    prompt = tok.decode(agent.renderer.prompt_ids([{"role": "system", "content": src.recipe.data.system_prompt},
                                                   {"role": "user", "content": "What is 2 * 3?"}]))  # fmt: skip
    assert prompt.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is 2 * 3?")
    schemas = json.loads(re.search(r"```json\n(\[.*?\])\n```", card, re.DOTALL).group(1))
    assert [s["function"]["name"] for s in schemas] == ["calculator"]
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]


def test_a_run_without_tools_has_no_tool_section(tiny_model_dir, tmp_path):
    from tests.export_runs import make_run

    run = make_run(tmp_path / "plain", tiny_model_dir)
    card = model_card(locate(run), "adapter", "bf16", {})
    assert "## Tool use" not in card
    text, _, _ = modelfile_text("m.gguf", _tok(tiny_model_dir), ["<|im_end|>"], locate(run))
    assert ".ToolCalls" not in text


def test_the_modelfile_carries_the_tool_template_and_the_exact_system_message(agent_run, tiny_model_dir, tmp_path):
    info = write_modelfile(tmp_path, "model.gguf", tiny_model_dir, locate(agent_run))
    assert info["tools"] == {"format": "system_prompt", "template": "system_prompt", "why": info["tools"]["why"]}
    text = (tmp_path / "Modelfile").read_text()
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.DOTALL).group(1)
    assert template.startswith("{{ if .Tools }}{{ end }}")  # Ollama offers tools only to templates naming .Tools
    for field in ("range $j, $c := .ToolCalls", "{{ $c.Function.Name }}", "{{ json $c.Function.Arguments }}",
                  'eq .Role "tool"', "<tool_response>\n{{ .Content }}\n</tool_response>"):  # fmt: skip
        assert field in template, field
    system = re.search(r'SYSTEM """(.*?)"""', text, re.DOTALL).group(1)
    use = tool_use(locate(agent_run), _tok(tiny_model_dir))
    assert system == use.system_message and '"name": "calculator"' in system
    # the card of a GGUF export says what the Modelfile carries
    card = model_card(locate(agent_run), "gguf", "bf16", {"gguf": "model.gguf", "modelfile": info, "out": tmp_path})
    assert "Ollama: the Modelfile's TEMPLATE renders tool calls" in card


def test_the_tool_template_text_matches_the_tokenizers_rendering(agent_run, tiny_model_dir):
    """The Python twin of the Go template renders a conversation with two calls in one turn, their two results and
    an answer exactly as the tokenizer renders lorarl's messages; a template that differs is refused."""
    tok = _tok(tiny_model_dir)
    use = tool_use(locate(agent_run), tok)
    assert check_tool_template(use, tok)
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
    ]
    assert render_tool_conversation(msgs, True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert not check_tool_template(use, tok)
    template, why = ollama_tool_template(use, "chatml", tok)
    assert template is None and "did not reproduce" in why


def test_hermes_and_llama_formats_say_why_the_modelfile_has_no_tool_template(agent_run, tiny_model_dir, tmp_path):
    run = tmp_path / "hermes"
    run.mkdir()
    (run / "policy").symlink_to(agent_run / "policy")
    recipe = yaml.safe_load((agent_run / "recipe.yaml").read_text())
    recipe["agent"]["format"] = "hermes"
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    info = write_modelfile(tmp_path, "model.gguf", tiny_model_dir, locate(run))
    assert info["tools"]["template"] is None and "hermes format" in info["tools"]["why"]
    assert any("no tool template" in n for n in info["notes"])
    assert ".ToolCalls" not in (tmp_path / "Modelfile").read_text()
    card = model_card(locate(run), "gguf", "bf16", {"gguf": "model.gguf", "modelfile": info, "out": tmp_path})
    assert (
        "tools=SCHEMAS" in card
        and "Ollama: no tool template in the Modelfile: the model calls tools in the hermes" in card
    )
