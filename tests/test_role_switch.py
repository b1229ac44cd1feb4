"""``SharedBase.role`` switches only what changes (issue 32, host time per step): no peft ``set_adapter`` for the
adapter already active, no ``module.train`` when every flag already matches; a real switch still restores the
adapter, the ``requires_grad`` flags and the train flags."""

from __future__ import annotations

import torch

from lorarl.config import LoraSettings
from lorarl.model.shared import set_train


def test_only_what_changes_is_switched(tiny_shared, monkeypatch):
    sb = tiny_shared
    sb.add_adapter("policy", LoraSettings(r=4), trainable=True)
    sb.add_adapter("reward", LoraSettings(r=4), trainable=False)
    sb.peft.set_adapter("policy")
    for n, trainable in (("policy", True), ("reward", False)):  # what each adapter had (set_adapter flips them)
        for p in sb.adapter_parameters(n):
            p.requires_grad_(trainable)
    sb.module.eval()
    calls = []
    real = sb.peft.set_adapter
    monkeypatch.setattr(sb.peft, "set_adapter", lambda name: (calls.append(name), real(name)))

    with sb.role("policy", train=False):  # active already, eval already: nothing switched
        assert sb.peft.active_adapter == "policy"
    assert calls == []
    with sb.role("policy", train=True):
        assert sb.module.training and all(m.training for m in sb.module.modules())
    assert calls == [] and not any(m.training for m in sb.module.modules())  # flags flipped and restored

    with sb.role("reward"), torch.no_grad():
        assert sb.peft.active_adapter == "reward"
    assert calls == ["reward", "policy"] and sb.peft.active_adapter == "policy"
    assert all(p.requires_grad for p in sb.adapter_parameters("policy"))
    assert not any(p.requires_grad for p in sb.adapter_parameters("reward"))  # frozen again


def test_set_train_calls_train_only_when_a_flag_differs(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)).eval()
    calls = []
    real = net.train
    monkeypatch.setattr(net, "train", lambda mode=True: (calls.append(mode), real(mode))[1])
    set_train(net, False)
    assert calls == []
    set_train(net, True)
    assert calls == [True] and all(m.training for m in net.modules())
    net[1].eval()  # one submodule differs: the whole tree is set again
    set_train(net, True)
    assert calls == [True, True] and net[1].training
