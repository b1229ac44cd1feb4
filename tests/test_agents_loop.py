"""The multi-turn loop (lorarl.agents.loop) on the tiny model: exact token ids, loss masks on the model's tokens,
tool failures as messages, budgets, one environment per rollout, one adapter for every turn, GRPO and PPO steps."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.agents.loop import agent_rollout
from lorarl.agents.setup import build_agent
from lorarl.config import GenerationConfig, recipe_from_dict
from lorarl.config.agent import AgentConfig
from lorarl.model.logprobs import completion_logprobs
from lorarl.rollout.engines import HFEngine, Sampled
from lorarl.rollout.fast import FastEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'
ROWS = [{"prompt": [{"role": "user", "content": "What is 123 * 45?"}], "answer": "5535"}]


class ScriptedEngine:
    """Answers turn ``k`` of a row with ``script(k, row_context_text)``; records which adapter and mode sampled."""

    name = "scripted"

    def __init__(self, script, then=None):
        self.script, self.then, self.calls, self.seen = script, then, 0, []

    def sample(self, shared, prompts, group_size, generation, *, max_new_tokens=None, record_logprobs=False, **kw):
        self.seen.append((shared.peft.active_adapter if shared.peft else None, shared.module.training))
        self.calls += 1
        if self.then is not None and self.calls > 1:  # later turns: the real engine
            return self.then.sample(
                shared, prompts, group_size, generation, max_new_tokens=max_new_tokens, record_logprobs=record_logprobs
            )
        tok = shared.tokenizer
        rows = [p for p in prompts for _ in range(group_size)]
        outs = []
        for i, p in enumerate(rows):
            text = tok.decode(p)
            turn = text.count("<tool_response>\n")  # (the system prompt names the tag without a new line)
            outs.append(tok(self.script(turn, text, i), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        width = max(len(o) for o in outs)
        ids = torch.full((len(outs), width), shared.pad_id, dtype=torch.long)
        for i, o in enumerate(outs):
            ids[i, : len(o)] = torch.as_tensor(o)
        return Sampled(ids, torch.zeros(ids.shape) if record_logprobs else None)


def _agent(shared, **cfg):
    cfg = AgentConfig(**{"tools": ["calculator"], **cfg})
    return build_agent(cfg, shared.tokenizer, shared.eos_ids)


def _policy(shared):
    from lorarl.config import LoraSettings

    shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    return shared


def two_turns(turn, text, i):
    return CALL if turn == 0 else "The answer is 5535."


def test_trajectory_is_exactly_the_ids_the_model_saw_with_a_model_token_mask(tiny_shared):
    shared = _policy(tiny_shared)
    agent = _agent(shared)
    gen = GenerationConfig(max_new_tokens=48)
    out = agent_rollout(shared, agent, ROWS, gen, group_size=2, engine=ScriptedEngine(two_turns), record_old=True)
    r, tok, eos = out.rollout, shared.tokenizer, shared.tokenizer.eos_token_id
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [eos]
    answer = tok("The answer is 5535.", add_special_tokens=False)["input_ids"] + [eos]
    suffix = agent.renderer.tool_suffix_ids([("calculator", "5535")])
    assert (
        tok.decode(suffix)
        == "\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = agent.renderer.prompt_ids(ROWS[0]["prompt"])
    for row in range(2):
        assert r.prompt_ids[row][r.prompt_mask[row]].tolist() == prompt
        assert r.completion_ids[row][r.completion_mask[row]].tolist() == call + suffix + answer
        assert r.model_mask[row].tolist()[: len(call + suffix + answer)] == (
            [True] * len(call) + [False] * len(suffix) + [True] * len(answer)
        )
        assert not r.model_mask[row, len(call + suffix + answer) :].any()
    assert torch.equal(r.loss_mask, r.model_mask) and r.old_logprobs.shape == r.completion_ids.shape
    assert r.completions == ["The answer is 5535.", "The answer is 5535."] and not r.truncated.any()
    m = out.stats.metrics()
    assert m["agent/turns_mean"] == 2 and m["tools/call_frequency"] == 1 and m["agent/tool_errors"] == 0
    assert m["agent/tool_tokens"] == 2 * len(suffix) and m["agent/truncated_ratio"] == 0


BAD_TOOLS = '''
import time

def slow(x: int) -> str:
    """Sleep.

    Args:
        x: seconds
    """
    time.sleep(x)
    return "late"

def broken(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("tool exploded")
'''


def test_bad_tool_calls_become_error_messages_and_are_counted(tiny_shared, tmp_path):
    f = tmp_path / "bad_tools.py"
    f.write_text(BAD_TOOLS)
    shared = _policy(tiny_shared)
    agent = _agent(shared, tools=["calculator", f"{f}:slow", f"{f}:broken"], tool_timeout_s=0.3)
    first = [
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',  # bad arguments
        '<tool_call>{"name": "slow", "arguments": {"x": 5}}</tool_call>',  # hangs past the timeout
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>',  # raises
        '<tool_call>{"name": "calculator", "arguments": {</tool_call>',  # malformed
        CALL + CALL,  # two good calls in one turn
    ]
    expect = ["unknown tool 'nope'", "unknown parameter 'expr'", "timed out", "tool exploded", "malformed", "5535"]
    rows = ROWS * len(first)
    engine = ScriptedEngine(lambda turn, text, i: first[i] if turn == 0 else "done")
    out = agent_rollout(shared, agent, rows, GenerationConfig(max_new_tokens=96), engine=engine)
    tok = shared.tokenizer
    for i, words in enumerate(expect):
        text = tok.decode(out.rollout.completion_ids[i][out.rollout.completion_mask[i]])
        assert words in text and text.endswith("done<|im_end|>"), (i, text)
    assert tok.decode(out.rollout.completion_ids[5]).count("5535") == 2
    m = out.stats.metrics()
    assert m["agent/tool_calls"] == 7 and m["agent/tool_errors"] == 4 and m["agent/malformed_calls"] == 1
    assert m["tools/failure_frequency"] == pytest.approx(5 / 7) and m["agent/turns_mean"] == 2


def test_budgets_truncate_trajectories(tiny_shared):
    shared = _policy(tiny_shared)
    gen = GenerationConfig(max_new_tokens=48)
    always_call = ScriptedEngine(lambda turn, text, i: CALL)
    out = agent_rollout(shared, _agent(shared, max_turns=3), ROWS, gen, engine=always_call)
    assert out.stats.turns == 3 and out.rollout.truncated.all()  # calls left unanswered at max_turns
    assert out.rollout.completion_ids.shape[1] <= 512
    tiny_budget = agent_rollout(shared, _agent(shared, max_tokens_per_turn=5), ROWS, gen, engine=always_call)
    assert int(tiny_budget.rollout.model_mask.sum()) == 5 and tiny_budget.rollout.truncated.all()
    total = agent_rollout(shared, _agent(shared, max_total_tokens=40), ROWS, gen, engine=always_call)
    assert total.rollout.completion_mask.sum() <= 40 and total.rollout.truncated.all()


ENV = '''
INSTANCES = []

class Counter:
    """Counts calls; rewards reaching the row's target."""

    def __init__(self):
        self.count, self.closed = 0, False
        INSTANCES.append(self)

    def reset(self, target=0, **kwargs):
        if target < 0:
            raise ValueError("negative target")
        self.target = target
        return f" (target {target})"

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
'''


def test_one_environment_instance_per_rollout_released_at_the_end(tiny_shared, tmp_path):
    f = tmp_path / "counter_env.py"
    f.write_text(ENV)
    shared = _policy(tiny_shared)
    agent = _agent(shared, tools=[], environment=f"{f}:Counter")
    instances = agent.resolved.environment.__init__.__globals__["INSTANCES"]  # the loaded file's list
    before = len(instances)
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "target": t} for t in (2, 3, -1)]
    by = {0: 2, 1: 2, 2: 5}  # row 0 and row 1 each add 2 (row 0 reaches its target); row 2's reset raises

    def script(turn, text, i):
        return (
            f'<tool_call>{{"name": "increment", "arguments": {{"by": {by[i // 2]}}}}}</tool_call>'
            if turn == 0
            else "ok"
        )

    out = agent_rollout(
        shared, agent, rows, GenerationConfig(max_new_tokens=48), group_size=2, engine=ScriptedEngine(script)
    )
    made = instances[before:]
    assert len(made) == 6 and all(e.closed for e in made)  # one per trajectory, each released
    assert [e.count for e in made[:4]] == [2, 2, 2, 2]  # each trajectory's calls went to its own instance
    assert out.env_rewards[:4].tolist() == [1.0, 1.0, 0.0, 0.0] and all(math.isnan(x) for x in out.env_rewards[4:])
    assert out.stats.reset_errors == 2
    text = shared.tokenizer.decode(out.rollout.prompt_ids[4][out.rollout.prompt_mask[4]])
    assert "environment error: ValueError: negative target" in text
    assert "(target 3)" in shared.tokenizer.decode(out.rollout.prompt_ids[2][out.rollout.prompt_mask[2]])


@pytest.mark.parametrize("engine_cls", [HFEngine, FastEngine])
def test_every_turn_is_sampled_by_the_same_adapter_and_scored_as_sampled(tiny_shared, engine_cls):
    from lorarl.config import LoraSettings

    shared = _policy(tiny_shared)
    shared.add_adapter("other", LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # make the policy differ from the base and from "other"
        for p in shared.adapter_parameters("policy"):
            p.add_(0.05 * torch.randn_like(p))
    agent = _agent(shared, max_tokens_per_turn=40)  # the scripted call (34 ids) fits
    engine = ScriptedEngine(two_turns, then=engine_cls())  # turn 1 scripted (a tool call), turn 2 really sampled
    gen = GenerationConfig(max_new_tokens=6)
    with shared.role("other"):
        out = agent_rollout(shared, agent, ROWS, gen, group_size=2, role="policy", engine=engine, record_sampler=True)
        assert shared.peft.active_adapter == "other"  # the caller's adapter is back after the rollout
    assert engine.seen == [("policy", False), ("policy", False)]  # both turns: the policy, eval mode
    r = out.rollout
    with shared.role("policy", train=True):
        lp, _ = completion_logprobs(shared, r, gen.temperature)
    call_len = len(shared.tokenizer(CALL, add_special_tokens=False)["input_ids"]) + 1
    turn2 = r.model_mask.clone()
    turn2[:, :call_len] = False  # the scripted turn has no sampler log-probs
    assert turn2.sum() > 0
    gap = (lp.detach() - r.sampler_logprobs)[turn2].abs().max()
    assert gap < 1e-4, gap  # the trainer scores exactly the ids (and context) the sampler drew turn 2 from


def _agent_recipe(model_dir, tmp_path, algo: str):
    f = tmp_path / "len_reward.py"
    f.write_text("def length(completions, **kw):\n    return [float(len(str(c))) for c in completions]\n")
    data = {
        "algo": algo,
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train_size": 8, "eval_size": 4},
        "reward": {"functions": [{"name": f"{f}:length"}]},
        "generation": {"max_new_tokens": 6},
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "agent": {"tools": ["calculator"], "max_turns": 2, "max_tokens_per_turn": 40},
        "health": {"parity_every": 0},
        "eval": {"n": 2, "batch_size": 2},
    }
    if algo == "grpo":
        data["grpo"] = {"group_size": 2}
    else:
        data["ppo"] = {"epochs": 1, "minibatch_size": 4}
    return recipe_from_dict(data)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_multi_turn_rl_step_trains_on_model_tokens_only(tiny_model_dir, tmp_path, monkeypatch, algo):
    from lorarl.algos import algorithm_class
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    recipe = _agent_recipe(tiny_model_dir, tmp_path, algo)
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    engine = ScriptedEngine(lambda turn, text, i: CALL, then=HFEngine())
    monkeypatch.setattr("lorarl.agents.loop.make_engine", lambda name: engine)
    algo_obj = algorithm_class(algo)(recipe, shared)
    seen = []
    if algo == "grpo":
        import lorarl.algos.grpo as grpo_mod

        real = grpo_mod.grpo_loss

        def spy(rows, **kw):
            seen.append((kw["loss_mask"], kw["rollout"]))
            return real(rows, **kw)

        monkeypatch.setattr(grpo_mod, "grpo_loss", spy)
    else:
        import lorarl.algos.ppo as ppo_mod

        real_gae = algo_obj.gae

        def spy_gae(rewards, values, mask, gamma, lam):
            seen.append(mask)
            return real_gae(rewards, values, mask, gamma, lam)

        algo_obj.gae = spy_gae
        assert real_gae is ppo_mod.gae_skipping
    before = [p.detach().clone() for p in shared.trainable_parameters("policy")]
    metrics = algo_obj.step(algo_obj.batch(1))
    assert metrics["agent/turns_mean"] == 2 and metrics["tools/call_frequency"] == 1
    assert metrics["agent/tool_tokens"] > 0
    assert seen
    if algo == "grpo":
        mask, rollout = seen[0]
        assert torch.equal(mask, rollout.model_mask) and (rollout.completion_mask & ~mask).any()
    else:
        mask = seen[0]  # [N, T] what GAE ran over: each row's turn 1, a gap (the tool message), turn 2
        for row in mask:
            on = row.nonzero().squeeze(1)
            assert (~row[on[0] : on[-1] + 1]).any(), row  # tool tokens inside the trajectory are left out
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(before, shared.trainable_parameters("policy")))
    assert moved and math.isfinite(metrics.get("loss", metrics.get("loss/policy_avg", 0.0)) or 0.0)
