"""The fidelity gate of an agent run (issue 34): each model runs the run's prompt format (system prompt + the tools'
schemas), its tools and its turn loop, not the bare prompt. A scripted runtime shows the loop (a calculator call,
the calculator's real result fed back, the final answer scored); a tiny agent run exported merged shows the gate
sends the rendered prompts and agrees with itself."""

from __future__ import annotations

import json

from export_runs import make_run

from lorarl.agents.setup import build_agent
from lorarl.config import Recipe
from lorarl.config.agent import AgentConfig
from lorarl.export.agent_gate import AgentTurns, LoopBase

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 42"}}</tool_call>'


class Scripted:
    """A gate runtime that answers turn ``k`` with ``turns[k]`` (then EOS) and records the prompts it was given."""

    def __init__(self, tok, eos, turns):
        self.tok, self.eos, self.turns, self.prompts = tok, eos, turns, []

    def greedy(self, prompts, max_new_tokens):
        self.prompts.append([list(p) for p in prompts])
        text = self.turns[len(self.prompts) - 1]
        return [self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]] * len(prompts)


def test_the_gate_runs_the_tools_and_turns_of_the_run(tiny_shared):
    tok, eos = tiny_shared.tokenizer, tiny_shared.end_of_turn_id
    recipe = Recipe()
    recipe.agent = AgentConfig(tools=["calculator"], max_turns=3, max_tokens_per_turn=64)
    recipe.data.system_prompt = "You multiply."
    row = {"prompt": "What is 37 * 42?", "answer": "1554"}
    turns = AgentTurns(recipe, [row], LoopBase(tok, tiny_shared.eos_ids, tiny_shared.pad_id), 64)
    runtime = Scripted(tok, eos, [CALL, "37 * 42 = 1554"])
    prompts, trajectories, answers, metrics = turns.run(runtime)

    agent = build_agent(recipe.agent, tok, tiny_shared.eos_ids, system_prompt="You multiply.")
    messages = [{"role": "system", "content": "You multiply."}, {"role": "user", "content": row["prompt"]}]
    rendered = agent.renderer.prompt_ids(messages)  # what training rendered: system prompt + the tool's schema
    assert prompts == [rendered] and runtime.prompts[0] == [rendered]
    assert "calculator" in tok.decode(rendered) and "You multiply." in tok.decode(rendered)
    second = runtime.prompts[1][0]  # turn 2 continues the prompt, the call and the calculator's real result
    assert second[: len(rendered)] == rendered and "1554" in tok.decode(second[len(rendered) :])
    assert second == rendered + trajectories[0][: len(second) - len(rendered)]
    assert answers == ["37 * 42 = 1554"]
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0


def test_merged_export_of_an_agent_run_is_gated_on_the_rendered_prompts(tiny_model_dir, tmp_path, monkeypatch):
    import yaml

    from lorarl.export import export, runtimes
    from lorarl.model import load_tokenizer

    run = make_run(tmp_path / "run", tiny_model_dir, max_new_tokens=6)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["algo"] = "sft"
    recipe["agent"] = {"tools": ["calculator"], "max_turns": 2, "max_tokens_per_turn": 6, "max_total_tokens": 48}
    recipe["data"]["arithmetic"] = {"operations": ["*"], "digits": 3, "digits_b": 2}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    seen = []
    real = runtimes.TransformersRuntime.greedy
    monkeypatch.setattr(
        runtimes.TransformersRuntime, "greedy", lambda self, p, m: seen.append(p) or real(self, p, m)
    )  # fmt: skip

    export(run, tmp_path / "merged", fmt="merged", dtype="fp32", gate_n=4, gate=1.0)
    gate = json.loads((tmp_path / "merged" / "gate.json").read_text())
    assert gate["prompts"] == 4 and gate["greedy_agreement"] == 1.0 and gate["logprob_max_abs_delta"] < 1e-4
    assert gate["agent"]["trained"] == gate["agent"]["export"] and gate["agent"]["trained"]["agent/turns_mean"] >= 1
    first = load_tokenizer(str(tiny_model_dir)).decode(seen[0][0])  # the export's first turn: the rendered prompt
    assert "calculator" in first and "What is" in first  # the tool's schema and the task's question
