"""Rollouts: masks from generation (pad == EOS), grouping, log-probs at the sampling temperature with dropout off,
reference log-probs from the base, trimming of all-pad columns."""

from __future__ import annotations

import pytest
import torch

from lorarl.config import GenerationConfig, LoraSettings
from lorarl.model.logprobs import completion_logprobs, pack_completions, prompt_groups
from lorarl.model.tokens import completion_mask, pad_left
from lorarl.rollout import Rollout, generate_rollout


@pytest.mark.parametrize(
    "ids, mask, truncated",
    [
        ([[5, 2, 2]], [[1, 1, 0]], [False]),  # pad == eos: the first EOS counts, the padding after does not
        ([[2, 2, 2]], [[1, 0, 0]], [False]),  # EOS right away: one token
        ([[5, 6, 7]], [[1, 1, 1]], [True]),  # no EOS: truncated, every token counts
        ([[5, 6, 2]], [[1, 1, 1]], [False]),  # EOS as the last allowed token is not truncated
        ([[5, 9, 6]], [[1, 1, 0]], [False]),  # a second EOS id (9) also ends the completion
    ],
)
def test_completion_mask_table(ids, mask, truncated):
    m, t = completion_mask(torch.tensor(ids), [2, 9])
    assert m.tolist() == [[bool(x) for x in r] for r in mask]
    assert t.tolist() == truncated


def test_pad_left():
    ids, mask = pad_left([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


@pytest.fixture()
def policy_shared(tiny_shared):
    sb = tiny_shared
    sb.add_adapter("policy", LoraSettings(r=4, dropout=0.5))  # dropout must be OFF when recording log-probs
    torch.manual_seed(3)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.1)
    return sb


def _prompts(sb, texts):
    return [sb.tokenizer(t)["input_ids"] for t in texts]


def test_rollout_shapes_groups_and_logprobs(policy_shared):
    sb = policy_shared
    prompts = _prompts(sb, ["What is 2 + 3?", "Hi"])
    gen = GenerationConfig(max_new_tokens=6, temperature=0.7)
    torch.manual_seed(0)
    r = generate_rollout(sb, prompts, gen, group_size=3, record_old=True, reference="reference", prompt_index=[10, 20])
    assert len(r) == 6 and r.group_size == 3
    assert r.prompt_index == [10, 10, 10, 20, 20, 20]
    P = r.prompt_ids.shape[1]
    assert P == max(len(p) for p in prompts)
    # left padding: every row's prompt ends at column P - 1, and the rows of one group are the same prompt
    assert r.prompt_mask[:, -1].all()
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[2]) and not torch.equal(r.prompt_ids[0], r.prompt_ids[3])
    assert r.completion_ids.shape == r.completion_mask.shape == r.old_logprobs.shape == r.ref_logprobs.shape
    assert r.completion_ids.shape[1] <= 6
    assert len(r.completions) == 6 and all(isinstance(c, str) for c in r.completions)

    # old log-probs: the policy at the SAMPLING temperature, dropout off (so recomputing gives the same numbers)
    ids, att = r.input_ids, r.attention_mask
    with sb.role("policy", train=False):
        logits = sb.module(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, P - 1 : -1].float() / 0.7
    want = logits.gather(-1, r.completion_ids[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    m = r.completion_mask
    torch.testing.assert_close(r.old_logprobs[m], want[m], rtol=1e-4, atol=1e-4)
    # reference = adapters disabled = the bare base, which differs from the (perturbed) policy
    with sb.role("base"):
        base_lp, _ = sb.token_logprobs(ids, att, P, temperature=0.7)
    torch.testing.assert_close(r.ref_logprobs[m], base_lp[m], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(r.ref_logprobs[m], r.old_logprobs[m], atol=1e-3)
    # the role switch restored the mode
    assert not sb.module.training


def test_rollout_records_nothing_it_is_not_asked_for(policy_shared):
    r = generate_rollout(
        policy_shared, _prompts(policy_shared, ["x"]), GenerationConfig(max_new_tokens=3), group_size=2
    )
    assert r.old_logprobs is None and r.ref_logprobs is None


def test_rollout_masks_come_from_generation_with_pad_equal_eos(policy_shared, monkeypatch):
    """Generation pads finished rows with pad (== EOS for SmolLM2): the mask keeps the first EOS only, trailing
    all-pad columns are dropped, and the text excludes the special tokens."""
    sb = policy_shared
    eos = sb.tokenizer.eos_token_id
    assert sb.tokenizer.pad_token_id == eos
    assert eos in sb.eos_ids
    a, b = sb.tokenizer.encode("4")[0], sb.tokenizer.encode("5")[0]
    fake = [[a, eos, eos, eos, eos], [a, b, eos, eos, eos], [b, b, b, eos, eos], [eos, eos, eos, eos, eos]]

    def fake_generate(input_ids, attention_mask, **kw):
        assert kw["max_new_tokens"] == 5 and kw["pad_token_id"] == eos and kw["do_sample"]
        assert attention_mask[:, -1].all()  # left padded
        return torch.cat([input_ids, torch.tensor(fake)], dim=1)

    monkeypatch.setattr(sb, "generate", fake_generate)
    r = generate_rollout(
        sb, _prompts(sb, ["p", "longer prompt here"]), GenerationConfig(max_new_tokens=5), group_size=2, record_old=True
    )
    assert r.completion_mask.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert r.completion_ids.shape == (4, 4)  # column 5 was padding in every row
    assert r.lengths.tolist() == [2, 3, 4, 1]
    assert not r.truncated.any()
    assert r.completions == ["4", "45", "555", ""]
    assert r.completion_token_lists()[1] == [a, b, eos]
    assert torch.isfinite(r.old_logprobs[r.completion_mask]).all()


def test_rollout_select_drops_all_pad_prompt_columns(policy_shared):
    sb = policy_shared
    r = generate_rollout(
        sb,
        _prompts(sb, ["a", "a much longer prompt than the first"]),
        GenerationConfig(max_new_tokens=2),
        group_size=2,
        record_old=True,
    )
    short = r.select([0, 1])
    assert short.prompt_ids.shape[1] == 1 and short.prompt_mask.all()
    assert torch.equal(short.completion_ids, r.completion_ids[:2])
    assert torch.equal(short.old_logprobs, r.old_logprobs[:2])
    assert short.completions == r.completions[:2] and short.prompt_index == [0, 0]


def test_greedy_rollout_is_deterministic(policy_shared):
    sb = policy_shared
    p = _prompts(sb, ["What is 1 + 1?"])
    one = generate_rollout(sb, p, GenerationConfig(max_new_tokens=5), greedy=True)
    two = generate_rollout(sb, p, GenerationConfig(max_new_tokens=5), greedy=True)
    assert torch.equal(one.completion_ids, two.completion_ids)


def test_shared_prefix_prefill_matches_plain_generation(policy_shared):
    """G copies of a prompt are prefilled once and the KV cache copied: same tokens as G separate prefills."""
    sb = policy_shared
    prompts = _prompts(sb, ["What is 12 + 7?", "A much longer prompt, to get left padding in the batch"])
    gen = GenerationConfig(max_new_tokens=6)
    shared_prefix = generate_rollout(sb, prompts, gen, group_size=3, greedy=True)
    plain = generate_rollout(sb, prompts, gen, group_size=3, greedy=True, batch_size=6)  # one call, no sharing
    assert torch.equal(shared_prefix.completion_ids, plain.completion_ids)
    assert torch.equal(shared_prefix.completion_mask, plain.completion_mask)
    torch.manual_seed(11)
    a = generate_rollout(sb, prompts, gen, group_size=3)
    torch.manual_seed(11)
    b = generate_rollout(sb, prompts, gen, group_size=3, batch_size=6)
    assert torch.equal(a.completion_ids, b.completion_ids)  # same logits, same random draws


def test_prompt_groups():
    starts, inverse = prompt_groups([7, 7, 3, 7])
    assert starts == [0, 2] and inverse.tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kv-cache", "packs-under-checkpointing"])
def test_shared_prompt_forward_equals_full_forward_values_and_gradients(tiny_model_dir, monkeypatch, checkpointing):
    """Each distinct prompt runs once -- its KV cache indexed out to its rows (no checkpointing), or its completions
    packed behind it with a 4-D mask (checkpointing) -- and the completion log-probs, entropies and LoRA gradients
    equal one plain full forward of every row."""
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    sb = SharedBase.load(
        ModelConfig(
            name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=checkpointing
        )
    )
    sb.add_adapter("policy", LoraSettings(r=4))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.1)
    prompts = _prompts(sb, ["What is 12 + 7?", "A longer prompt that gets left padding less"])
    torch.manual_seed(2)
    r = generate_rollout(sb, prompts, GenerationConfig(max_new_tokens=6), group_size=4)
    mb = r.select([0, 2, 3, 4, 5, 7])  # a micro-batch that cuts both groups
    params = sb.trainable_parameters("policy")
    results = []
    full_forward = sb.token_logprobs
    for share in (True, False):
        calls = []
        monkeypatch.setattr(sb, "token_logprobs", lambda *a, calls=calls, **k: calls.append(1) or full_forward(*a, **k))
        with sb.role("policy", train=True):  # backward inside: checkpointing recomputes with the active adapter
            assert sb.module.training and sb.cfg.gradient_checkpointing == checkpointing
            lp, ent = completion_logprobs(sb, mb, temperature=0.8, with_entropy=True, share_prompts=share)
            m = mb.completion_mask
            (lp[m].sum() + 0.1 * ent[m].sum()).backward()
        assert len(calls) == (0 if share else 1)  # the shared paths never run the full forward
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in params]))
        for p in params:
            p.grad = None
    (lp_s, ent_s, g_s), (lp_f, ent_f, g_f) = results
    m = mb.completion_mask
    torch.testing.assert_close(lp_s[m], lp_f[m], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent_s[m], ent_f[m], rtol=1e-4, atol=1e-5)
    for a, b in zip(g_s, g_f):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    if checkpointing:
        assert float(lp_s[~m].abs().sum()) == 0.0  # positions past a completion get 0
        assert pack_completions(mb, sb.tokenizer.pad_token_id).input_ids.shape[0] == 2  # one pack per prompt


def test_pack_completions_layout_matches_docstring_example():
    """Prompt [a, b] with completions [x, y] and [z]: one pack, siblings never see each other."""
    a, b, x, y, z, pad = 11, 12, 21, 22, 23, 0
    r = Rollout(
        prompt_ids=torch.tensor([[a, b], [a, b]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        completion_ids=torch.tensor([[x, y], [z, pad]]),
        completion_mask=torch.tensor([[True, True], [True, False]]),
        truncated=torch.tensor([True, False]),
        completions=["", ""],
        prompt_index=[0, 0],
        group_size=2,
    )
    p = pack_completions(r, pad_id=pad)
    assert p.input_ids.tolist() == [[a, b, x, y, z]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert p.column[0].tolist() == [1, 2] and p.column[1].tolist()[0] == 1 and p.pack.unique().tolist() == [0]
    m = p.attention_mask[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],  # a
        [1, 1, 0, 0, 0],  # b
        [1, 1, 1, 0, 0],  # x: prompt + itself
        [1, 1, 1, 1, 0],  # y: prompt + x + itself
        [1, 1, 0, 0, 1],  # z: prompt + itself, not x / y
    ]
    # a tiny pack budget splits the group: each completion gets its own copy of the prompt
    p2 = pack_completions(r, pad_id=pad, pack_tokens=3)
    assert p2.input_ids.tolist() == [[a, b, x, y], [a, b, z, pad]]
    assert p2.pack[:, 0].tolist() == [0, 1]
