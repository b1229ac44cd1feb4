"""``ppo.kl.estimator``: PPO's per-token KL penalty in the reward with the k1 / k2 / k3 estimators (verl's
``algorithm.kl_penalty`` options ``kl`` / ``mse`` / ``low_var_kl``), against hand values, verl's formula, and one real
PPO step on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.config import recipe_from_dict
from lorarl.core.advantages import KL_PENALTIES, kl_shaped_rewards
from lorarl.core.losses import kl_k2
from lorarl.errors import LorarlError


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    """verl's ``kl_penalty_forward`` (verl/trainer/ppo/core_algos.py, v0.5-0.9), its k1 / k2 / k3 branches as
    written there: ``kl`` / ``k1``, ``mse`` / ``k2``, ``low_var_kl`` / ``k3`` (clamped, which never binds here)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def test_shaped_rewards_with_each_estimator_hand_values():
    """One row, two tokens: logprobs [-1, -2], ref [-1.5, -1], score 1 at the last token, beta 0.1."""
    scores, lp, ref = torch.tensor([1.0]), torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    m = torch.ones(1, 2, dtype=torch.bool)
    hand = {
        "k1": [0.5, -1.0],
        "k2": [0.125, 0.5],  # 0.5 * 0.5^2, 0.5 * 1^2
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1],  # d = ref - lp = -0.5, 1.0
    }
    for name, kl_hand in hand.items():
        rewards, kl = kl_shaped_rewards(scores, lp, ref, m, 0.1, KL_PENALTIES[name])
        assert kl[0].tolist() == pytest.approx(kl_hand, abs=1e-6), name
        assert rewards[0].tolist() == pytest.approx([-0.1 * kl_hand[0], 1.0 - 0.1 * kl_hand[1]], abs=1e-6), name
    # the default stays k1 (InstructGPT), so existing PPO recipes keep their reward
    assert kl_shaped_rewards(scores, lp, ref, m, 0.1)[1][0].tolist() == pytest.approx([0.5, -1.0])


def test_estimators_match_verl_formula_and_padding_gets_nothing():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=g) * 3
    ref = lp + torch.randn(4, 7, generator=g) * 0.7
    mask = torch.rand(4, 7, generator=g) > 0.3
    for name, verl_name in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        _, kl = kl_shaped_rewards(torch.zeros(4), lp, ref, mask, 0.05, KL_PENALTIES[name])
        want = verl_kl_penalty(lp, ref, verl_name) * mask  # verl: kld * response_mask
        torch.testing.assert_close(kl, want, rtol=1e-6, atol=1e-7)


def test_recipe_key_is_validated():
    assert recipe_from_dict({"algo": "ppo", "ppo": {"kl": {"estimator": "k3"}}}).ppo.kl.estimator == "k3"
    assert recipe_from_dict({"algo": "ppo"}).ppo.kl.estimator == "k1"
    with pytest.raises(LorarlError, match="ppo.kl.estimator"):
        recipe_from_dict({"algo": "ppo", "ppo": {"kl": {"estimator": "k4"}}})


def test_ppo_step_penalises_with_the_chosen_estimator(tiny_model_dir, tmp_path, monkeypatch):
    """One real PPO step with ``ppo.kl.estimator: k2``: the logged per-token KL is the masked mean of
    ``0.5 (old - ref)^2`` over the log-probs the step shaped its rewards with."""
    from test_ppo import toy_recipe

    from lorarl.algos import ppo as ppo_module
    from lorarl.model import SharedBase

    seen = []
    real = ppo_module.kl_shaped_rewards

    def recording(scores, logprobs, ref_logprobs, mask, *args, **kwargs):
        seen.append((logprobs.clone(), ref_logprobs.clone(), mask.clone()))
        return real(scores, logprobs, ref_logprobs, mask, *args, **kwargs)

    monkeypatch.setattr(ppo_module, "kl_shaped_rewards", recording)
    d = toy_recipe(tiny_model_dir, tmp_path, kl__estimator="k2", kl__adaptive=False, kl__coef=0.5, epochs=1)
    d["train"].update(prompts_per_step=4, micro_batch_size=4)
    d["generation"]["temperature"] = 1.0
    recipe = recipe_from_dict(d)
    algo = ppo_module.PPO(recipe, SharedBase.load(recipe.model))
    assert algo.kl_penalty is kl_k2
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference (a fresh LoRA has B = 0: no KL at all)
        for name, p in algo.shared.module.named_parameters():
            if "lora_B.policy" in name:
                p.normal_(0.0, 0.2)
    out = algo.step(algo.batch(1))
    assert len(seen) == 1
    old, ref, mask = seen[0]
    assert not torch.equal(old, ref)  # the reference really ran (with kl.coef 0 it would be old itself)
    m = mask.float()
    want = float((0.5 * (old - ref) ** 2 * m).sum() / m.sum())
    assert want > 1e-4
    assert out["kl_per_token"] == pytest.approx(want, rel=1e-6)
