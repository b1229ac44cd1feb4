"""Tool-use cold start: the shipped task's traces, their encoding (the ids a rollout produces, loss on the assistant's
turns), an SFT step on them, and `lorarl eval` running the same tool loop."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lorarl.agents.loop import agent_rollout
from lorarl.agents.setup import build_agent
from lorarl.agents.traces import encode_trace
from lorarl.config import GenerationConfig, recipe_from_dict
from lorarl.config.agent import AgentConfig
from lorarl.errors import DataError
from lorarl.tasks.arithmetic import make_problems
from lorarl.tasks.tool_traces import make_tool_traces

TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


def test_the_shipped_task_is_3_by_2_digit_multiplication_with_disjoint_splits():
    train = make_problems("train", 300, seed=1, operations=["*"], digits=3, digits_b=2)
    held = make_problems("eval", 200, seed=1, operations=["*"], digits=3, digits_b=2)
    assert all(100 <= r["a"] <= 999 and 10 <= r["b"] <= 99 and r["answer"] == str(r["a"] * r["b"]) for r in train)
    assert not {(r["a"], r["b"]) for r in train} & {(r["a"], r["b"]) for r in held}
    assert len({(r["a"], r["b"]) for r in held}) == 200


def test_traces_call_the_real_calculator_on_training_problems_only():
    rows = make_tool_traces(50, seed=1, operations=["*"], digits=3, digits_b=2)
    held = {(r["a"], r["b"]) for r in make_problems("eval", 2000, seed=1, operations=["*"], digits=3, digits_b=2)}
    for r in rows:
        call, tool, final = r["completion"]
        assert call["tool_calls"][0]["function"]["arguments"]["expression"] == f"{r['a']} * {r['b']}"
        assert tool == {"role": "tool", "name": "calculator", "content": r["answer"]}
        assert final["content"].endswith(f"= {r['answer']}") and (r["a"], r["b"]) not in held


class Replay:
    """Samples, turn by turn, the texts of a trace's assistant turns (a model that learned the trace)."""

    name = "replay"

    def __init__(self, texts):
        self.texts, self.turn = texts, 0

    def sample(self, shared, prompts, group_size, generation, **kw):
        from lorarl.rollout.engines import Sampled

        tok = shared.tokenizer
        ids = tok(self.texts[self.turn], add_special_tokens=False)["input_ids"] + [shared.end_of_turn_id]
        self.turn += 1
        return Sampled(torch.tensor([ids] * len(prompts) * group_size))


@pytest.mark.parametrize("template", [None, "qwen2_5.jinja"])
def test_a_trace_encodes_to_the_ids_a_rollout_of_it_produces(tiny_shared, template):
    shared = tiny_shared
    if template is not None:  # a hermes template on the same vocabulary
        shared.tokenizer = copy.deepcopy(shared.tokenizer)
        shared.tokenizer.chat_template = (TEMPLATES / template).read_text()
    from lorarl.config import LoraSettings

    shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    agent = build_agent(AgentConfig(tools=["calculator"], max_tokens_per_turn=64), shared.tokenizer, shared.eos_ids)
    row = make_tool_traces(1, seed=3, operations=["*"], digits=3, digits_b=2)[0]
    p_ids, c_ids, mask = encode_trace(agent, shared.tokenizer, row, shared.end_of_turn_id, 4096, 0)
    # the assistant turns as the template writes them, sampled back by a model that learned them
    texts, start = [], 0
    for k in range(len(mask) + 1):
        if k == len(mask) or (k > start and mask[k] != mask[k - 1]):
            if mask[start]:
                texts.append(shared.tokenizer.decode(c_ids[start : k - 1]))
            start = k
    assert len(texts) == 2
    out = agent_rollout(shared, agent, [row], GenerationConfig(max_new_tokens=64), engine=Replay(texts))
    r = out.rollout
    assert r.prompt_ids[0][r.prompt_mask[0]].tolist() == p_ids
    assert r.completion_ids[0][r.completion_mask[0]].tolist() == c_ids
    assert r.model_mask[0][: len(mask)].tolist() == mask
    assert out.stats.tool_calls == 1 and out.stats.tool_errors == 0 and r.completions[0].endswith(row["answer"])


def test_a_trace_must_end_with_the_assistant(tiny_shared):
    agent = build_agent(AgentConfig(tools=["calculator"]), tiny_shared.tokenizer, tiny_shared.eos_ids)
    row = make_tool_traces(1, seed=3, operations=["*"], digits=3, digits_b=2)[0]
    row["completion"] = row["completion"][:2]
    with pytest.raises(DataError, match="row 7: a trace must end with an assistant message"):
        encode_trace(agent, tiny_shared.tokenizer, row, tiny_shared.end_of_turn_id, 4096, 7)


def _recipe(model_dir, algo="sft"):
    data = {
        "algo": algo,
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 8, "eval_size": 4, "arithmetic": {"operations": ["*"], "digits": 3, "digits_b": 2}},
        "agent": {"tools": ["calculator"], "max_turns": 2, "max_tokens_per_turn": 8},
        "train": {"steps": 1, "micro_batch_size": 4, "learning_rate": 1e-2},
        "eval": {"n": 2, "batch_size": 2},
    }
    if algo == "sft":
        data["sft"] = {"batch_size": 4}
    return recipe_from_dict(data)


def test_sft_on_traces_trains_on_the_assistant_turns_only(tiny_model_dir, monkeypatch):
    import lorarl.algos.sft as sft_mod
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    algo = sft_mod.SFT(_recipe(tiny_model_dir), shared)
    data = algo.data
    assert data.loss_masks is not None and len(data) == 8
    for c, m in zip(data.completion_ids, data.loss_masks):
        assert len(c) == len(m) and m[0] and m[-1] and not all(m)  # call ... tool message (False) ... answer
    seen = []
    real = sft_mod.completion_nll
    spy = lambda lp, mask, n: seen.append((mask, n)) or real(lp, mask, n)  # noqa: E731
    monkeypatch.setitem(sft_mod.SFT_LOSSES, "nll", spy)  # the loss sft.loss_type nll (the default) calls
    batch = algo.batch(1)
    metrics = algo.step(batch)
    assert metrics["completion_tokens"] == sum(sum(data.loss_masks[i]) for i in batch.rows)
    assert metrics["completion_tokens"] < sum(len(data.completion_ids[i]) for i in batch.rows)
    assert sum(int(m.sum()) for m, _ in seen) == metrics["completion_tokens"]


def test_eval_runs_the_same_tool_loop(tiny_model_dir, monkeypatch):
    from lorarl.evaluate import evaluate

    calls = []
    real = agent_rollout

    def spy(*a, **kw):
        calls.append(kw.get("greedy"))
        return real(*a, **kw)

    monkeypatch.setattr("lorarl.agents.loop.agent_rollout", spy)
    out = evaluate(_recipe(tiny_model_dir, algo="grpo"), "base", n=2)
    assert calls == [True] and out["n"] == 2
    assert out["agent/turns_mean"] >= 1 and "tools/call_frequency" in out
