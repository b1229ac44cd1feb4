"""PPO on one shared base (tiny model): an easily learnable reward rises and the critic's explained variance turns
positive; one base serves policy, reference, critic and reward, each optimizer step changes only its own role
(backward included: gradient checkpointing recomputes with the right adapter);
checkpoints hold both adapters, heads, optimizers and the loop's state; eval prints reward_mean."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorarl.algos import ppo
from lorarl.algos.loop import train
from lorarl.config import LoraSettings, ModelConfig, recipe_from_dict
from lorarl.core.stats import RunningMoments, explained_variance
from lorarl.model import SharedBase

TOY_REWARD = '''
def newlines(prompts, completions, completion_ids=None, **kw):
    """Fraction of the completion's tokens that are a newline (id 198): learnable by one logit."""
    return [sum(1 for t in ids if t == 198) / max(len(ids), 1) for ids in completion_ids]
'''


def toy_recipe(tiny_model_dir, tmp_path, **ppo_overrides) -> dict:
    reward_file = tmp_path / "toy_reward.py"
    reward_file.write_text(TOY_REWARD)
    cfg = {
        "epochs": 2,
        "minibatch_size": 8,
        "kl": {"coef": 0.01, "adaptive": True, "target": 0.5, "horizon": 100},
        "critic": {"vf_coef": 1.0, "value_clip": None, "learning_rate": 5e-3, "lora": {"r": 8, "alpha": 16.0}},
    }
    reward = {"source": "rules", "functions": [{"name": f"{reward_file}:newlines"}]}
    for key, value in ppo_overrides.items():  # "reward.source" or "critic.init": a sub-section's key
        section, _, name = key.rpartition("__")
        target = reward if section == "reward" else (cfg.setdefault(section, {}) if section else cfg)
        target[name] = value
    return {
        "algo": "ppo",
        "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16.0},
        "data": {"source": "arithmetic", "train_size": 64, "eval_size": 8},
        "reward": reward,
        # the tiny random model's logits are nearly flat; at temperature 0.1 token 198 is sampled now and then
        "generation": {"max_new_tokens": 6, "temperature": 0.1},
        "ppo": cfg,
        "train": {"steps": 10, "prompts_per_step": 16, "micro_batch_size": 16, "learning_rate": 5e-3, "seed": 0},
        "eval": {"n": 8, "batch_size": 8},
    }


# ------------------------------------------------------------------ small helpers


def test_running_moments_match_the_whole_data():
    torch.manual_seed(0)
    chunks = [torch.randn(5) * 3 + 1, torch.randn(1), torch.randn(12) * 0.5 - 2]
    m = RunningMoments()
    for c in chunks:
        m.update(c)
    allx = torch.cat(chunks).double()
    assert m.count == 18
    assert m.mean == pytest.approx(float(allx.mean()), rel=1e-9)
    assert m.std == pytest.approx(float(allx.std()), rel=1e-9)
    m2 = RunningMoments()
    m2.load_state_dict(m.state_dict())
    assert m2.normalize(torch.tensor([m.mean])).abs().item() < 1e-6


def test_explained_variance():
    v = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    r = torch.tensor([[1.0, 2.0, 4.0, float("nan")]])
    m = torch.tensor([[1, 1, 1, 0]])
    # Var[r - v] = Var[0, 0, 1] = 1/3 ; Var[r] = 7/3 (unbiased)
    assert explained_variance(v, r, m) == pytest.approx(1 - (1 / 3) / (7 / 3), rel=1e-6)
    assert explained_variance(r.nan_to_num(), r.nan_to_num(), m) == pytest.approx(1.0)
    assert math.isnan(explained_variance(v, torch.ones_like(v), m))


# ------------------------------------------------------------------ learning


@pytest.fixture(scope="module")
def toy_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo-toy")
    recipe = recipe_from_dict(toy_recipe(tiny_model_dir, tmp))
    summary = train(recipe, tmp / "run")
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return tmp / "run", summary, rows


def test_easy_reward_rises_and_critic_explained_variance_turns_positive(toy_run):
    run_dir, summary, rows = toy_run
    rewards = [r["reward_mean"] for r in rows]
    ev = [r["explained_variance"] for r in rows]
    assert len(rows) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert ev[0] < 0 < max(ev[-4:]), ev  # a fresh critic is worse than a constant; it learns
    kl_coefs = [r["kl_coef"] for r in rows]
    assert len(set(kl_coefs)) > 1  # the adaptive controller moved beta
    for key in (
        "rm_score",
        "kl",
        "kl_coef",
        "approx_kl",
        "clip_frac",
        "value_loss",
        "explained_variance",
        "entropy",
        "returns_mean",
        "completion_len",
        "truncated_frac",
        "peak_mem_gb",
    ):
        assert key in rows[-1], key
    for name in ("recipe.yaml", "metrics.jsonl", "plot.png", "tb"):
        assert (run_dir / name).exists(), name
    for role in ("policy", "critic"):
        assert (run_dir / role / "adapter_config.json").is_file()
    assert (run_dir / "critic" / "head.safetensors").is_file()
    assert summary["steps"] == 10


# ------------------------------------------------------------------ one base, every role


def make_adapters(tiny_model_dir, folder):
    """A reward-model run dir (``reward/`` with a score head) and an SFT-like ``init`` policy adapter."""
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    shared.add_adapter("reward", LoraSettings(r=4), head=True)
    shared.add_adapter("init", LoraSettings(r=8))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in shared.adapter_parameters("reward") + shared.adapter_parameters("init"):
            p.add_(torch.randn_like(p) * 0.05)
    shared.save_adapter("reward", folder / "reward")
    shared.save_adapter("init", folder / "init")
    return folder, folder / "init"


def test_one_base_serves_all_roles_and_each_step_changes_only_its_role(tiny_model_dir, tmp_path, monkeypatch):
    rm_run, init = make_adapters(tiny_model_dir, tmp_path / "rm_run")
    (tmp_path / "ptx.jsonl").write_text('{"text": "Two plus two is four."}\n{"text": "The sky is blue."}\n')
    d = toy_recipe(
        tiny_model_dir,
        tmp_path,
        reward__source="both",
        reward__adapter=str(rm_run),
        critic__init="reward",
        score__normalize=True,
        score__clip=3.0,
        score__no_eos_penalty=-1.0,
        ptx__coef=0.5,
        ptx__source=str(tmp_path / "ptx.jsonl"),
        epochs=1,
        minibatch_size=4,
        critic__value_clip=0.2,
    )
    d["train"].update(steps=2, prompts_per_step=8, micro_batch_size=2, save_every=1)
    d["model"]["init_adapter"] = str(init)  # the policy starts from it; the reference is that adapter, frozen
    recipe = recipe_from_dict(d)

    loaded: list[SharedBase] = []
    real_load = SharedBase.load.__func__

    def load_once(cls, cfg, device=None):
        loaded.append(real_load(cls, cfg, device))
        return loaded[-1]

    monkeypatch.setattr(SharedBase, "load", classmethod(load_once))
    calls: list[tuple[set, set]] = []
    first: dict = {}
    real_step = ppo.optimizer_step_halving

    def checked_step(params, optimizer, make_batches, size, loss_fn, **kw):
        sb = loaded[0]
        named = dict(sb.peft.named_parameters()) | {f"heads.{n}": p for n, p in sb.heads.named_parameters()}
        if not first:  # before any update: the warm-started critic equals the reward model
            first.update({n: p.detach().clone() for n, p in named.items()})
            for pr, pc in zip(sb.trainable_parameters("reward"), sb.trainable_parameters("critic")):
                assert torch.equal(pr, pc)
            for pp, pref in zip(sb.adapter_parameters("policy"), sb.adapter_parameters("reference")):
                assert torch.equal(pp, pref)  # the policy starts as the init adapter = the reference
        before = {n: p.detach().clone() for n, p in named.items()}
        result = real_step(params, optimizer, make_batches, size, loss_fn, **kw)
        ids = {id(p) for p in params}
        changed = {n for n, p in named.items() if not torch.equal(p, before[n])}
        allowed = {n for n, p in named.items() if id(p) in ids}
        calls.append((changed, allowed))
        return result

    monkeypatch.setattr(ppo, "optimizer_step_halving", checked_step)
    train(recipe, tmp_path / "run")

    assert len(loaded) == 1  # ONE base model loaded
    sb = loaded[0]
    assert sb.peft.get_base_model() is sb.base
    assert set(sb.adapters) == {"policy", "critic", "reward", "reference"}
    assert not any(p.requires_grad for p in sb.adapter_parameters("reference"))
    # each optimizer holds exactly its role's adapter + head; the reward adapter is frozen
    policy_ids = {id(p) for p in sb.trainable_parameters("policy")}
    critic_ids = {id(p) for p in sb.trainable_parameters("critic")}
    assert {id(p) for p in sb.heads["critic"].parameters()} <= critic_ids
    assert not any(p.requires_grad for p in sb.trainable_parameters("reward"))
    assert calls and all(changed and changed <= allowed for changed, allowed in calls)
    names = dict(sb.peft.named_parameters()) | {f"heads.{n}": p for n, p in sb.heads.named_parameters()}
    moved = {n for n, p in names.items() if not torch.equal(p, first[n])}
    assert moved, "nothing trained"
    assert all(id(names[n]) in policy_ids | critic_ids for n in moved)  # base, reward, reference bit-identical
    assert any(id(names[n]) in policy_ids for n in moved)
    # the critic's LoRA weights (not only its head) train: backward recomputes with the critic adapter active
    critic_lora = {id(p) for p in sb.adapter_parameters("critic")}
    assert any(id(names[n]) in critic_lora for n in moved)

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["score_used"] == pytest.approx(-1.0)  # every tiny-model response is truncated: the penalty
    assert rows[-1]["ptx_loss"] is not None and rows[-1]["rm_score"] is not None

    # the checkpoint holds both adapters with heads, both optimizers, the KL coefficient, reward stats, data position
    ck = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (ck / "policy" / "adapter_config.json").is_file() and (ck / "critic" / "head.safetensors").is_file()
    state = json.loads((ck / "state.json").read_text())
    assert state["roles"] == ["policy", "critic"] and state["loop"]["step"] == 2
    algo = state["algo"]
    assert algo["kl_ctl"]["value"] == pytest.approx(
        rows[-1]["kl_coef"] * (1 + max(min(rows[-1]["kl"] / 0.5 - 1, 0.2), -0.2) * 8 / 100)
    )
    assert algo["reward_stats"]["count"] == 16
    trainer = torch.load(ck / "trainer_state.pt", weights_only=True)
    assert set(trainer["optimizers"]) == {"policy", "critic"} and trainer["optimizers"]["critic"]["state"]

    # resume: continues at step 3 from the saved state
    monkeypatch.undo()
    recipe3 = recipe_from_dict({**d, "train": {**d["train"], "steps": 3}})
    out = train(recipe3, tmp_path / "run", resume=True)
    assert out["steps_this_run"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["kl_coef"] == pytest.approx(algo["kl_ctl"]["value"])


def test_ppo_needs_a_reward_adapter(tiny_model_dir, tmp_path):
    from lorarl.errors import LorarlError

    d = toy_recipe(tiny_model_dir, tmp_path, reward__source="reward_model")
    with pytest.raises(LorarlError, match="reward.adapter is not set"):
        train(recipe_from_dict(d), tmp_path / "run")


def test_eval_cli_prints_reward_mean_last(toy_run, tiny_model_dir, tmp_path, capsys):
    import yaml

    from lorarl.cli import main

    run_dir, _, _ = toy_run
    recipe_path = tmp_path / "ppo.yaml"
    recipe_path.write_text(yaml.safe_dump(toy_recipe(tiny_model_dir, tmp_path)))
    for ckpt in ("base", str(run_dir)):
        assert main(["eval", str(recipe_path), "--checkpoint", ckpt, "--n", "4"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        result = json.loads(last)
        assert result["n"] == 4 and isinstance(result["reward_mean"], float) and "accuracy" in result
