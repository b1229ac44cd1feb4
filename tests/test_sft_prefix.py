"""SFT runs the prompt prefix a micro-batch's rows share once (the system prompt with the tool schemas is ~170 of a
tool trace's ~286 tokens): the split by hand, and on the tiny model the loss and every LoRA gradient equal those of
a plain per-row forward of the full logits, computed here independently, with and without activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from test_agents_sft import _recipe

from lorarl.algos.sft import SFT, common_prefix, prefix_split, sft_loss
from lorarl.model import SharedBase


def test_common_prefix_by_hand():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([[5, 6], [5, 6]]) == 2
    assert common_prefix([[1, 2], [3, 2]]) == 0


def test_prefix_split_by_hand():
    T, F = True, False
    prefix, rests, masks = prefix_split([[1, 2, 3], [1, 2, 4]], [[7], [8, 9]], [[T], [T, F]])
    assert prefix == [1, 2]
    assert rests == [[3, 7], [4, 8, 9]]
    assert masks == [[F, T], [F, T, F]]
    # identical prompts: the whole prompt is the prefix, the rests are the completions
    assert prefix_split([[1, 2], [1, 2]], [[7], [8]], [[T], [T]]) == ([1, 2], [[7], [8]], [[T], [T]])


def full_logits_nll(shared: SharedBase, data, rows: list[int]) -> torch.Tensor:
    """The old path, independently: each row's prompt + completion (left-padded prompts), the model's own full
    ``[B, L, V]`` logits, log_softmax, the completion tokens' log-probs, summed over the loss mask, / loss tokens."""
    P = max(len(data.prompt_ids[i]) for i in rows)
    C = max(len(data.completion_ids[i]) for i in rows)
    ids = torch.full((len(rows), P + C), shared.pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    lmask = torch.zeros((len(rows), C), dtype=torch.bool)
    for b, i in enumerate(rows):
        p, c = data.prompt_ids[i], data.completion_ids[i]
        ids[b, P - len(p) : P] = torch.tensor(p)
        ids[b, P : P + len(c)] = torch.tensor(c)
        att[b, P - len(p) : P + len(c)] = 1
        lmask[b, : len(c)] = torch.tensor(data.loss_masks[i])
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = shared.module(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, ids[:, P:, None])[..., 0]
    return -(lp * lmask).sum() / lmask.sum()


def sft_with_lora_moved(recipe) -> SFT:
    """SFT's set-up on its own base, the LoRA weights moved off their init (a non-zero B, so the gradient reaches
    every LoRA matrix), seeded."""
    shared = SharedBase.load(recipe.model)
    torch.manual_seed(0)
    algo = SFT(recipe, shared)
    with torch.no_grad():
        for p in algo.policy.params:
            p.add_(torch.randn_like(p) * 0.05)
    return algo


@pytest.mark.parametrize("checkpointing", [False, True])  # shared KV cache / packs behind one prefix
def test_shared_prefix_loss_and_gradients_equal_the_full_logits_path(tiny_model_dir, checkpointing):
    recipe = _recipe(tiny_model_dir)
    recipe.model.gradient_checkpointing = checkpointing
    algo = sft_with_lora_moved(recipe)
    shared = algo.shared
    data, rows = algo.data, [0, 1, 2, 3]
    assert common_prefix([data.prompt_ids[i] for i in rows]) > 100  # the system prompt with the tool's schema
    total = sum(sum(data.loss_masks[i]) for i in rows)
    results = []
    with shared.role("policy", train=True, dropout=True):
        for compute in (lambda: full_logits_nll(shared, data, rows), lambda: sft_loss(shared, data, total, rows)[0]):
            for p in algo.policy.params:
                p.grad = None
            loss = compute()
            loss.backward()
            results.append((float(loss.detach()), [p.grad.clone() for p in algo.policy.params]))
    (want, want_g), (got, got_g) = results
    assert got == pytest.approx(want, rel=1e-5)
    assert all(g.abs().sum() > 0 for g in want_g)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
