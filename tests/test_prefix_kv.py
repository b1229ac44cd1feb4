"""Keys / values kept between the calls of a multi-turn rollout (lorarl.rollout.prefix_kv): the matching and
gathering helpers on hand-worked examples, and both engines continuing kept rows as a fresh prefill of the whole
context does (the same greedy tokens, the same sampler log-probs to fp32 rounding), in the engine and in the turn
loop."""

from __future__ import annotations

import pytest
import torch

from lorarl.agents.loop import agent_rollout
from lorarl.agents.setup import build_agent
from lorarl.bench.agent_turns import EveryTurnCalls, FixedTurnEngine
from lorarl.config import GenerationConfig, LoraSettings
from lorarl.config.agent import AgentConfig
from lorarl.rollout.engines import HFEngine
from lorarl.rollout.fast import FastEngine
from lorarl.rollout.prefix_kv import fed_columns, gather_columns, match_prefixes, right_aligned_columns

ENGINES = [HFEngine, FastEngine]


def test_helpers_match_their_docstring_examples():
    kept = [[1, 2], [1, 2, 3, 4]]
    prompts = [[1, 2, 3, 4, 5], [1, 2, 9], [1, 2, 3, 4], [7]]
    assert match_prefixes(kept, prompts) == [(1, 4), (0, 2), (1, 3), (-1, 0)]
    assert match_prefixes([], [[1, 2]]) == [(-1, 0)]
    index, valid = right_aligned_columns([[3, 4], [0, 1, 2]], 3)
    assert index.tolist() == [[0, 3, 4], [0, 1, 2]]
    assert valid.tolist() == [[False, True, True], [True, True, True]]
    mask = torch.tensor([[False, True], [True, True]])
    sampled = torch.tensor([[5, 2, 7], [6, 6, 6]])
    assert fed_columns(mask, sampled, 2, [2]) == [[1, 2, 3], [0, 1, 2, 3]]  # row 0 ends at its EOS (id 2)
    assert fed_columns(mask, sampled, 0, [2]) == [[1], [0, 1]]  # nothing sampled was fed back


def test_gather_columns_picks_rows_and_columns_and_zeros_the_rest():
    x = torch.arange(8.0).reshape(2, 1, 4, 1)  # row 0 holds 0..3, row 1 holds 4..7 (1 head, dim 1)
    index = torch.tensor([[0, 2, 3], [0, 0, 1]])
    valid = torch.tensor([[False, True, True], [True, True, True]])
    out = gather_columns(x, torch.tensor([1, 0]), index, valid)
    assert out.shape == (2, 1, 3, 1)
    assert out[:, 0, :, 0].tolist() == [[0.0, 6.0, 7.0], [0.0, 0.0, 1.0]]


@pytest.fixture()
def policy_shared(tiny_shared):
    tiny_shared.add_adapter("policy", LoraSettings(r=4, alpha=8))
    torch.manual_seed(3)
    with torch.no_grad():  # an adapter that changes the outputs
        for p in tiny_shared.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.1)
    return tiny_shared


def _ids(sb, text: str) -> list[int]:
    return sb.tokenizer(text, add_special_tokens=False)["input_ids"]


def _row(sampled, i: int) -> list[int]:
    return sampled.completion_ids[i].tolist()


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_continuing_kept_rows_equals_prefilling_the_whole_context(policy_shared, engine_cls):
    sb = policy_shared
    gen = GenerationConfig(max_new_tokens=6)
    prompts = [_ids(sb, "What is 12 + 7?"), _ids(sb, "A much longer prompt, so that the batch is left padded")]
    opts = dict(greedy=True, record_logprobs=True)
    with sb.role("policy"):
        engine = engine_cls()
        with engine.reusing_kv() as kv:
            first = engine.sample(sb, prompts, 2, gen, **opts)  # 4 rows, each prompt prefilled once for its group
            assert kv.reused_tokens == 0 and kv.prefilled_tokens == sum(len(p) for p in prompts)
            # turn 2: every row's context + a tool message of its own length; one more row that extends nothing
            ctx = [prompts[i // 2] + _row(first, i) + _ids(sb, "\nresult" + " 42" * (i + 1) + "\n") for i in range(4)]
            ctx.append(_ids(sb, "A new question without history"))
            second = engine.sample(sb, ctx, 1, gen, **opts)
            reused, prefilled = kv.reused_tokens, kv.prefilled_tokens - sum(len(p) for p in prompts)
            assert reused + prefilled == sum(len(c) for c in ctx)
            # the 4 continued rows hold their prompt and 5 of their 6 sampled ids (the 6th was never fed back); the
            # new row holds nothing. S columns go through the model for every row, S the most any row lacks
            held = [len(prompts[i // 2]) + 5 for i in range(4)] + [0]
            S = max(len(c) - h for c, h in zip(ctx, held))
            assert S < len(ctx[0]) and reused == sum(max(len(c) - S, 0) for c in ctx) > 0
            ctx2 = [c + _row(second, i) + _ids(sb, "\nagain\n") for i, c in enumerate(ctx[:3])]
            third = engine.sample(sb, ctx2, 1, gen, **opts)  # turn 3, fewer rows (the others finished)
            assert kv.reused_tokens > reused
        assert engine.prefix_kv is None and kv.kept is None  # released when the scope ends
        for c, got in ((ctx, second), (ctx2, third)):
            fresh = engine_cls().sample(sb, c, 1, gen, **opts)  # no reuse: the whole context prefilled
            assert torch.equal(got.completion_ids, fresh.completion_ids)
            torch.testing.assert_close(got.sampler_logprobs, fresh.sampler_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_kept_rows_of_another_adapter_state_are_refused(policy_shared, engine_cls):
    sb = policy_shared
    gen = GenerationConfig(max_new_tokens=3)
    prompt = _ids(sb, "What is 12 + 7?")
    engine = engine_cls()
    with engine.reusing_kv():
        with sb.role("policy"):
            first = engine.sample(sb, [prompt], 1, gen, greedy=True)
        with sb.role("base"), pytest.raises(RuntimeError, match="another adapter state"):
            engine.sample(sb, [prompt + _row(first, 0)], 1, gen, greedy=True)


@pytest.mark.parametrize("engine_name", ["hf", "fast"])
def test_turn_loop_with_kept_kv_gives_the_trajectories_of_the_loop_without(policy_shared, engine_name):
    """Real sampling (greedy) through the turn loop, 3 model turns and 2 tool messages per trajectory (the turn
    structure fixed as ``lorarl bench agent-turns`` fixes it): the same ids and sampler log-probs with and without
    keys / values kept between turns; with them, turns 2 and 3 prefill only the tool messages and the last id."""
    from lorarl.rollout.registry import make_engine

    sb = policy_shared
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in ("What is 123 * 45?", "And 7 * 8?")]
    out = {}
    for reuse in (True, False):
        cfg = AgentConfig(tools=["lorarl.bench.agent_turns:lookup"], max_turns=3, max_tokens_per_turn=5, reuse_kv=reuse)
        agent = build_agent(cfg, sb.tokenizer, sb.eos_ids)
        agent.fmt = EveryTurnCalls(agent.fmt)
        engine = FixedTurnEngine(make_engine(engine_name), 5)
        out[reuse] = agent_rollout(
            sb, agent, rows, GenerationConfig(max_new_tokens=5), group_size=2, greedy=True, engine=engine,
            record_sampler=True,
        )  # fmt: skip
    a, b = out[True].rollout, out[False].rollout
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.model_mask, b.model_mask)
    torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, rtol=0, atol=1e-5)
    assert out[True].stats.turns == 3 * 4 and out[True].stats.tool_calls == 2 * 4
    m, m0 = out[True].stats.metrics(), out[False].stats.metrics()
    assert m0["agent/kv_reused_tokens"] == 0 and m0["agent/prefill_tokens"] == 0  # (no scope: nothing counted)
    prompt_lens = a.prompt_mask.sum(1).tolist()
    s = int((~a.model_mask & a.completion_mask).sum()) // (4 * 2)  # ids of one tool message (all the same here)
    # a turn is 4 sampled ids + the forced end-of-turn id; 3 of the 4 were fed back, so turn 2 continues the kept
    # prompt + 3 ids and computes 2 + s columns, turn 3 continues prompt + 5 + s + 3 ids
    assert m["agent/kv_reused_tokens"] == sum((p + 3) + (p + 5 + s + 3) for p in prompt_lens)
    # what went through the model: each prompt once for its group (turn 1), then 2 x (2 + s) per row
    assert m["agent/prefill_tokens"] == sum(prompt_lens[::2]) + 4 * 2 * (2 + s)


def test_models_whose_keys_depend_on_more_than_the_prefix_are_not_reused():
    """Sliding-window layers keep only their last columns; dynamic / longrope rotary factors change with the
    length: for these the turn loop prefills every turn's whole context (agent/kv_reused_tokens stays 0)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    from lorarl.rollout.prefix_kv import reuse_refusal

    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert reuse_refusal(LlamaConfig(**small)) is None
    assert reuse_refusal(MistralConfig(**small, sliding_window=None)) is None
    assert "DynamicSlidingWindowLayer" in reuse_refusal(MistralConfig(**small, sliding_window=16))
    assert "DynamicSlidingWindowLayer" in reuse_refusal(Gemma2Config(**small, head_dim=16, sliding_window=16))
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 4.0}
    assert "longrope" in reuse_refusal(LlamaConfig(**small, rope_scaling=longrope, max_position_embeddings=256))
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert "dynamic" in reuse_refusal(LlamaConfig(**small, rope_scaling=dynamic))
