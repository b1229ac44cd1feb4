"""lorarl.core.advantages.gae_skipping: GAE over the model's tokens of a multi-turn trajectory, tool tokens skipped."""

import torch

from lorarl.core.advantages import gae, gae_skipping


def test_hand_computed_example_from_the_docstring():
    nan = float("nan")
    r = torch.tensor([[0.0, nan, 0.0, 1.0]])
    v = torch.tensor([[0.5, nan, 0.6, 0.7]])
    m = torch.tensor([[True, False, True, True]])
    adv, ret = gae_skipping(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.4, 0.3]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), rtol=0, atol=1e-6)


def test_hand_computed_with_discounting():
    # model tokens at 0, 3 (tool tokens 1, 2), gamma 0.5, lam 0.5: V = [1, 2], r = [0, 4]
    # delta_1 = 4 + 0 - 2 = 2; A_1 = 2; delta_0 = 0 + 0.5 * 2 - 1 = 0; A_0 = 0 + 0.25 * 2 = 0.5
    r = torch.tensor([[0.0, 9.0, 9.0, 4.0]])
    v = torch.tensor([[1.0, 9.0, 9.0, 2.0]])
    m = torch.tensor([[True, False, False, True]])
    adv, ret = gae_skipping(r, v, m, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0, 2.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 0.0, 0.0, 4.0]]), rtol=0, atol=1e-6)


def test_equals_gae_on_the_compacted_sequence_and_on_prefix_masks():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    m = torch.rand(5, 12, generator=g) > 0.4
    adv, ret = gae_skipping(r, v, m, 0.9, 0.8)
    for b in range(5):  # reference: drop the skipped tokens, run plain GAE, put the values back
        idx = m[b].nonzero().squeeze(1)
        a_ref, r_ref = gae(r[b : b + 1, idx], v[b : b + 1, idx], torch.ones(1, len(idx), dtype=torch.bool), 0.9, 0.8)
        torch.testing.assert_close(adv[b, idx], a_ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[b, idx], r_ref[0], rtol=0, atol=1e-6)
        assert (adv[b, ~m[b]] == 0).all() and (ret[b, ~m[b]] == 0).all()
    prefix = torch.arange(12)[None, :] < torch.tensor([[12], [7], [1], [0], [5]])
    for got, want in zip(gae_skipping(r, v, prefix, 0.95, 0.9), gae(r, v, prefix, 0.95, 0.9)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
