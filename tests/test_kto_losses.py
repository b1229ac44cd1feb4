"""KTO's losses and KL estimate (lorarl.core.kto_losses): against hand-computed values, and against TRL's own code on
identical tensors -- ``KTOTrainer._compute_loss`` (TRL 1.16 computes the KL term, both loss types, the weights and
the logged metrics inline in that method, so it is called on a minimal trainer object whose model returns the given
per-token log-probs, with TRL's precomputed reference log-probs) -- and the mismatched pairs against the
``KL_completion_ids`` TRL's ``_prepare_dataset`` builds."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from lorarl.algos.kto_scoring import kto_stats, with_margin
from lorarl.core.kto_losses import (
    apo_zero_unpaired_loss,
    kl_estimate,
    kto_loss,
    mismatched_rows,
    unpaired_loss,
    weight_ranges,
)


def t(*x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed values (the docstrings' examples)
# ---------------------------------------------------------------------------------------------------------------


def test_kto_loss_by_hand():
    desirable = torch.tensor([True, False])
    loss = kto_loss(t(2.0, -1.0), desirable, t(0.5), beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    # desirable: 1 - sigmoid(2 - 0.5); undesirable: 2 (1 - sigmoid(0.5 - (-1)))
    assert loss.tolist() == pytest.approx([1 - sig(1.5), 2 * (1 - sig(1.5))], abs=1e-12)
    assert loss.tolist() == pytest.approx([0.182426, 0.364851], abs=1e-6)
    # beta scales the log-ratio and z0 together; z0 = 0, beta 0.1: 1 - sigmoid(0.2), 1 - sigmoid(0.1)
    loss = kto_loss(t(2.0, -1.0), desirable, t(0.0), beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
    assert loss.tolist() == pytest.approx([1 - sig(0.2), 1 - sig(0.1)], abs=1e-12)


def test_apo_zero_unpaired_by_hand_reads_no_kl():
    desirable = torch.tensor([True, False])
    for kl in (0.0, 5.0):  # no reference point: z0 is not read
        loss = apo_zero_unpaired_loss(
            t(2.0, -1.0), desirable, t(kl), beta=1.0, desirable_weight=1.0, undesirable_weight=1.0
        )
        assert loss.tolist() == pytest.approx([1 - sig(2.0), sig(-1.0)], abs=1e-12)  # 0.11920, 0.26894
    weighted = apo_zero_unpaired_loss(
        t(2.0, -1.0), desirable, t(0.0), beta=1.0, desirable_weight=3.0, undesirable_weight=0.5
    )
    assert weighted.tolist() == pytest.approx([3 * (1 - sig(2.0)), 0.5 * sig(-1.0)], abs=1e-12)


def test_kl_estimate_is_the_clamped_detached_mean():
    assert float(kl_estimate(t(-3.0, -5.0), t(-4.0, -4.0))) == 0.0  # (1 - 1) / 2
    assert float(kl_estimate(t(-3.0, -3.0), t(-4.0, -4.0))) == 1.0
    assert float(kl_estimate(t(-5.0, -5.0), t(-4.0, -4.0))) == 0.0  # -1 clamped at 0
    pol = t(-3.0, -2.0).requires_grad_()
    assert not kl_estimate(pol, t(-4.0, -4.0)).requires_grad  # no gradient through z0


def test_mismatched_rows_rotate_by_one():
    assert mismatched_rows(4) == [3, 0, 1, 2]
    assert mismatched_rows(2) == [1, 0]
    with pytest.raises(ValueError, match="at least 2 rows"):
        mismatched_rows(1)


def test_unpaired_loss_rewards_and_gradients():
    logps = t(-3.0, -4.0, -2.0).requires_grad_()
    ref = t(-4.0, -4.0, -4.0)
    desirable = torch.tensor([True, False, False])
    losses, rewards = unpaired_loss("kto", logps, ref, desirable, t(0.0), beta=0.5)
    assert rewards.tolist() == [0.5, 0.0, 1.0] and not rewards.requires_grad  # beta x log-ratio
    losses.mean().backward()
    g = logps.grad.tolist()
    assert g[0] < 0 and g[1] > 0 and g[2] > 0  # descent raises the desirable row, lowers the undesirable ones


def test_weight_ranges_are_trls_eq8_bounds():
    # 100 desirable, 300 undesirable: w_d in [3, 3 x 1.33], or w_u in [(100 / 300) / 1.33, 100 / 300]
    assert weight_ranges(100, 300, 1.0, 1.0) == ((3.0, 3.99), (0.25, 0.33))
    assert weight_ranges(100, 300, 3.5, 1.0) is None  # desirable_weight balances them
    assert weight_ranges(100, 300, 1.0, 0.3) is None
    assert weight_ranges(200, 200, 1.0, 1.0) is None  # equal counts
    # TRL's counting: desirable at least 1, undesirable = rows - that (0 desirable of 4: 1 and 3)
    assert weight_ranges(0, 4, 1.0, 1.0) == ((3.0, 3.99), (0.25, 0.33))


def test_stats_by_kind_and_margin():
    stats = kto_stats(t(1.0, -2.0, 3.0), t(-5.0, -6.0, -7.0), torch.tensor([True, False, True]))
    assert stats == {
        "rewards/chosen": (4.0, 2.0),
        "logps/chosen": (-12.0, 2.0),
        "rewards/rejected": (-2.0, 1.0),
        "logps/rejected": (-6.0, 1.0),
    }
    only = kto_stats(t(1.0), t(-5.0), torch.tensor([False]))
    assert set(only) == {"rewards/rejected", "logps/rejected"}  # no desirable row: no chosen metrics (TRL's)
    assert with_margin({"rewards/chosen": 2.0, "rewards/rejected": -1.0})["rewards/margins"] == 3.0
    assert "rewards/margins" not in with_margin({"rewards/rejected": -1.0})


# ---------------------------------------------------------------------------------------------------------------
# TRL's own KTOTrainer._compute_loss on the same tensors
# ---------------------------------------------------------------------------------------------------------------


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x


def trl_kto(per_token, kl_per_token, ref, ref_kl, labels, loss_type, beta, dw, uw):
    """TRL 1.16's KTOTrainer._compute_loss on a minimal trainer: its model returns ``per_token`` (matched rows) or
    ``kl_per_token`` (the mismatched rows, told apart by their input ids) as the per-position log-probs; the
    reference sums are TRL's precomputed ``ref_logps`` / ``ref_KL_logps``. Returns ``(loss, logged metrics)``."""
    from trl.trainer.kto_trainer import KTOTrainer

    B, T = per_token.shape

    def model(input_ids, **kwargs):
        out = kl_per_token if int(input_ids[0, 0]) == 2 else per_token
        zeros = torch.zeros_like(out)
        return SimpleNamespace(log_probs=out, entropy=zeros, mean_logits=zeros)

    model.training = True
    trainer = SimpleNamespace(
        model=model,
        accelerator=_Accelerator(),
        calculate_KL=loss_type == "kto",
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=dw,
        undesirable_weight=uw,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer._compute_kl_logps = MethodType(KTOTrainer._compute_kl_logps, trainer)
    ones = torch.ones(B, T + 1, dtype=torch.long)
    inputs = {
        "input_ids": ones,  # first id 1: the matched rows
        "attention_mask": ones,
        "completion_mask": ones,
        "KL_input_ids": 2 * ones,  # first id 2: the mismatched rows
        "KL_attention_mask": ones,
        "KL_completion_mask": ones,
        "label": torch.tensor(labels),
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def lorarl_kto(per_token, kl_per_token, ref, ref_kl, labels, loss_type, beta, dw, uw):
    logps, kl_logps = per_token.sum(-1), kl_per_token.sum(-1)
    desirable = torch.tensor(labels)
    kl = kl_estimate(kl_logps, ref_kl) if loss_type == "kto" else torch.zeros(())
    losses, rewards = unpaired_loss(loss_type, logps, ref, desirable, kl, beta, dw, uw)
    stats = {k: s / c for k, (s, c) in kto_stats(rewards, logps, desirable).items()}
    return float(losses.mean()), {"kl": float(kl), **with_margin(stats)}


CASES = [
    # loss_type, beta, desirable_weight, undesirable_weight, labels
    ("kto", 0.1, 1.0, 1.0, [True, False, True, False, True, False]),
    ("kto", 0.5, 1.33, 1.0, [True, True, True, False, True, False, False, True]),
    ("kto", 2.0, 1.0, 0.4, [False, True, False, False]),
    ("kto", 0.3, 1.0, 1.0, [True, True, True, True]),  # desirable rows only
    ("kto", 0.3, 1.0, 2.0, [False, False, False]),  # undesirable rows only
    ("apo_zero_unpaired", 0.1, 1.0, 1.0, [True, False, False, True, True]),
    ("apo_zero_unpaired", 1.0, 0.5, 3.0, [False, True, True]),
    ("apo_zero_unpaired", 0.2, 1.0, 1.0, [True, True]),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type,beta,dw,uw,labels", CASES)
def test_matches_trl_kto_trainer(loss_type, beta, dw, uw, labels, seed):
    gen = torch.Generator().manual_seed(seed * 101 + len(labels))
    B, T = len(labels), 7
    per_token = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3  # [B, T] log-probs < 0
    kl_per_token = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = per_token.sum(-1) + torch.randn(B, generator=gen, dtype=torch.float64) * 4  # log-ratios of a few nats
    ref_kl = kl_per_token.sum(-1) + torch.randn(B, generator=gen, dtype=torch.float64) * 4 - 1.0
    args = (per_token, kl_per_token, ref, ref_kl, labels, loss_type, beta, dw, uw)
    trl_loss, trl_metrics = trl_kto(*args)
    ours_loss, ours_metrics = lorarl_kto(*args)
    assert ours_loss == pytest.approx(trl_loss, abs=1e-12)
    keys = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    assert {k for k in keys if k in trl_metrics} == set(ours_metrics)  # one kind only: its metrics only, as TRL
    for k, v in ours_metrics.items():
        assert v == pytest.approx(trl_metrics[k], abs=1e-9), k


def test_kl_estimate_matches_trl_when_clamped_and_when_not():
    """The same rows with the mismatched pairs' log-ratio mean below 0 (TRL clamps z0 to 0) and above it."""
    labels = [True, False, True, False]
    per_token = torch.full((4, 3), -1.0, dtype=torch.float64)
    kl_per_token = torch.full((4, 3), -2.0, dtype=torch.float64)  # sums -6
    ref = t(-2.5, -3.5, -3.0, -3.0)
    for shift, expected in ((-0.7, 0.0), (1.25, 1.25)):  # ref_KL = -6 - shift: the mean log-ratio is `shift`
        ref_kl = torch.full((4,), -6.0 - shift, dtype=torch.float64)
        args = (per_token, kl_per_token, ref, ref_kl, labels, "kto", 0.5, 1.0, 1.0)
        trl_loss, trl_metrics = trl_kto(*args)
        ours_loss, ours_metrics = lorarl_kto(*args)
        assert trl_metrics["kl"] == pytest.approx(expected) and ours_metrics["kl"] == pytest.approx(expected)
        assert ours_loss == pytest.approx(trl_loss, abs=1e-12)


def test_mismatched_pairs_are_trls_kl_completions(default_model_dir):
    """TRL's ``_prepare_dataset`` (run on a minimal trainer with the real tokenizer) gives each row the completion
    ids of the row before it within each ``per_device_train_batch_size`` slice: lorarl's :func:`mismatched_rows`
    applied to each slice gives the same ids."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOConfig
    from trl.trainer.kto_trainer import KTOTrainer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    rng = random.Random(0)
    n, per_device = 10, 4
    rows = {
        "prompt": [f"What is {i} + {i}?" for i in range(n)],
        "completion": [f" {2 * i + rng.randint(0, 1)}" for i in range(n)],
        "label": [rng.random() < 0.5 for _ in range(n)],
    }
    args = KTOConfig(output_dir="unused", bf16=False, per_device_train_batch_size=per_device, report_to=[])
    trainer = SimpleNamespace(calculate_KL=True, _tokenizer=tok, desirable_weight=1.0, undesirable_weight=1.0)
    ds = KTOTrainer._prepare_dataset(trainer, Dataset.from_dict(rows), tok, args, "train")
    completions, kl = ds["completion_ids"], ds["KL_completion_ids"]
    for s in range(0, n, per_device):
        part = list(range(s, min(s + per_device, n)))
        if len(part) < 2:  # TRL's last slice of one row is paired with itself; lorarl never builds such a batch
            assert kl[part[0]] == completions[part[0]]
            continue
        ours = [completions[part[j]] for j in mismatched_rows(len(part))]
        assert [kl[i] for i in part] == ours
