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
    rewards = [r["reward"] for r in rows]
    ev = [r["explained_variance"] for r in rows]
    assert len(rows) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert ev[0] < 0 < max(ev[-4:]), ev  # a fresh critic is worse than a constant; it learns
    kl_coefs = [r["kl_coef"] for r in rows]
    assert len(set(kl_coefs)) > 1  # the adaptive controller moved beta
    for key in (  # TRL's PPO names where the quantity is the same (docs/metrics.md)
        "rm_score",
        "objective/kl",
        "kl_coef",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/value_avg",
        "explained_variance",
        "policy/entropy_avg",
        "returns_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
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
        rows[-1]["kl_coef"] * (1 + max(min(rows[-1]["objective/kl"] / 0.5 - 1, 0.2), -0.2) * 8 / 100)
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


# ------------------------------------------------------------------ the step's pieces, by hand


@pytest.fixture()
def ppo_algo(tiny_model_dir, tmp_path):
    """A PPO algorithm on the tiny model and one rollout of 8 responses, phases 1-3 done by hand (fixed data)."""
    from lorarl.algos.ppo import PPO

    d = toy_recipe(tiny_model_dir, tmp_path, minibatch_size=4, epochs=3)
    d["train"].update(prompts_per_step=8, micro_batch_size=2)
    d["generation"]["temperature"] = 1.0
    algo = PPO(recipe_from_dict(d), SharedBase.load(recipe_from_dict(d).model))
    return algo


def _fixed_batch(algo, ratio: float = 1.5):
    """A PPOBatch whose old log-probs are the policy's own minus log(ratio): every ratio is exactly ``ratio``;
    advantages alternate +1 / -1 by row; values = the critic's own, returns = values + 2."""
    from lorarl.algos.ppo import critic_values
    from lorarl.algos.ppo_losses import PPOBatch
    from lorarl.rollout import generate_rollout

    sb = algo.shared
    torch.manual_seed(0)
    r = generate_rollout(sb, [algo.prompts.token_ids[i] for i in range(8)], algo.recipe.generation, role="policy")
    with torch.no_grad(), sb.role("policy"):
        lp, _ = sb.token_logprobs(r.input_ids, r.attention_mask, r.prompt_ids.shape[1])
    v = critic_values(sb, r.input_ids, r.attention_mask, r.prompt_ids.shape[1], 8)
    adv = torch.tensor([1.0, -1.0] * 4)[:, None].expand_as(lp).clone()
    m = r.completion_mask
    return PPOBatch(r, m, lp - math.log(ratio), adv, v, v + 2.0)


def test_policy_and_critic_losses_are_token_means_over_the_minibatch(ppo_algo):
    """Hand values: every ratio 1.5, eps 0.2 -> A=+1 tokens lose -1.2 (clipped), A=-1 tokens +1.5 (unclipped);
    the critic's error is 2 everywhere -> 0.5 * 2^2 = 2 per token, times vf_coef. Two micro-batches of a 4-row
    minibatch, divided by the minibatch's tokens, sum to the minibatch loss."""
    from lorarl.algos.ppo_losses import critic_loss, policy_loss

    algo = ppo_algo
    cfg = algo.recipe.ppo
    batch = _fixed_batch(algo)
    rows = torch.tensor([0, 1, 2, 3])
    m = batch.mask[rows]
    denom = (4, float(m.sum()))
    want_policy = (-1.2 * float(m[[0, 2]].sum()) + 1.5 * float(m[[1, 3]].sum())) / denom[1]
    total = 0.0
    for part in (rows[:2], rows[2:]):
        loss, stats = policy_loss(algo.shared, cfg, 1.0, batch, None, ("rl", part, denom))
        total += float(loss.detach())
    assert total == pytest.approx(want_policy, abs=1e-5)
    closs, _ = critic_loss(algo.shared, cfg, batch, ("rl", rows, denom))
    assert float(closs.detach()) == pytest.approx(cfg.critic.vf_coef * 2.0, abs=1e-5)


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy(ppo_algo):
    from lorarl.algos.ppo_losses import policy_loss
    from lorarl.core.losses import entropy_from_logits

    algo = ppo_algo
    batch = _fixed_batch(algo)
    rows = torch.arange(8)
    denom = (8, float(batch.mask.sum()))
    base, _ = policy_loss(algo.shared, algo.recipe.ppo, 1.0, batch, None, ("rl", rows, denom))
    algo.recipe.ppo.entropy_coef = 0.3
    bonus, stats = policy_loss(algo.shared, algo.recipe.ppo, 1.0, batch, None, ("rl", rows, denom))
    r = batch.rollout
    with torch.no_grad(), algo.shared.role("policy"):
        logits = algo.shared.module(input_ids=r.input_ids, attention_mask=r.attention_mask).logits
    ent = entropy_from_logits(logits[:, r.prompt_ids.shape[1] - 1 : -1].float())[batch.mask]
    assert float(bonus.detach()) - float(base.detach()) == pytest.approx(
        -0.3 * float(ent.mean()), abs=1e-5
    )  # a bonus: lower loss
    assert stats["entropy"][0] / stats["entropy"][1] == pytest.approx(float(ent.mean()), abs=1e-5)


def test_ptx_term_is_coef_times_the_texts_mean_nll(ppo_algo, tmp_path):
    from lorarl.algos.ppo_losses import policy_loss

    algo = ppo_algo
    tok = algo.shared.tokenizer
    ptx = [tok("Two plus two is four.")["input_ids"], tok("The sky is blue today.")["input_ids"]]
    algo.recipe.ppo.ptx.coef = 0.5
    loss, stats = policy_loss(algo.shared, algo.recipe.ppo, 1.0, _fixed_batch(algo), ptx, ("ptx", [0, 1], None))
    nll = []
    for ids in ptx:
        x = torch.tensor([ids])
        with torch.no_grad(), algo.shared.role("policy"):
            logits = algo.shared.module(input_ids=x).logits[0, :-1].float()
        nll += (-torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)).tolist()
    assert float(loss.detach()) == pytest.approx(0.5 * sum(nll) / len(nll), abs=1e-5)  # a token mean over both texts
    assert stats["ptx_loss"][0] == pytest.approx(sum(nll) / len(nll), abs=1e-5)


def test_early_stop_holds_the_update_that_would_pass_the_target(ppo_algo, monkeypatch):
    """target_approx_kl tiny: the first minibatch (ratio 1, approx KL 0) is applied; the second one's approx KL is
    measured before its update and, past the target, that update is held back -- policy and critic -- and the
    epochs end. The LR schedule still advances once for the step."""
    from lorarl.algos import ppo as ppo_mod

    algo = ppo_algo
    algo.recipe.ppo.target_approx_kl = 1e-9
    calls = []
    real = ppo_mod.optimizer_step_halving

    def spy(params, optimizer, *a, **kw):
        before = [p.detach().clone() for p in params]
        res, size = real(params, optimizer, *a, **kw)
        calls.append(
            (optimizer is algo.policy.optimizer, res.held, any(not torch.equal(p, b) for p, b in zip(params, before)))
        )
        return res, size

    monkeypatch.setattr(ppo_mod, "optimizer_step_halving", spy)
    lr_sched = algo.policy.scheduler.last_epoch
    row = algo.step(algo.batch(1))
    # policy applied, critic applied, policy held (unchanged) -- then nothing more
    assert calls == [(True, False, True), (False, False, True), (True, True, False)], calls
    assert row["early_stop"] is True and row["updates"] == 1
    assert algo.policy.scheduler.last_epoch == algo.critic.scheduler.last_epoch == lr_sched + 1


def test_first_minibatch_ratio_is_one_with_lora_dropout(tiny_model_dir, tmp_path, monkeypatch):
    from lorarl.algos import ppo_losses
    from lorarl.algos.ppo import PPO

    init = tmp_path / "init"
    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    sb.add_adapter("p", LoraSettings(r=8, alpha=16, dropout=0.1))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in sb.adapter_parameters("p"):
            p.copy_(torch.randn_like(p) * 0.3)
    sb.save_adapter("p", init)
    d = toy_recipe(tiny_model_dir, tmp_path, minibatch_size=4)
    d["model"]["init_adapter"] = str(init)
    d["lora"]["dropout"] = 0.1
    d["train"].update(prompts_per_step=8, micro_batch_size=4)
    recipe = recipe_from_dict(d)
    seen = []
    real = ppo_losses.ppo_clip_loss

    def spy(logprobs, old, adv, mask, *args):
        seen.append(torch.exp(logprobs.detach() - old)[mask.bool()])
        return real(logprobs, old, adv, mask, *args)

    monkeypatch.setattr(ppo_losses, "ppo_clip_loss", spy)
    algo = PPO(recipe, SharedBase.load(recipe.model))
    torch.manual_seed(0)
    algo.step(algo.batch(1))
    assert len(seen[0]) > 10
    torch.testing.assert_close(seen[0], torch.ones_like(seen[0]), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ failed rewards


def test_rewarded_rows_hand_values():
    from lorarl.algos.ppo import rewarded_rows

    total = torch.tensor([1.0, float("nan"), float("nan"), -2.0])
    truncated = torch.tensor([False, False, True, True])
    assert rewarded_rows(total, truncated, None).tolist() == [True, False, False, True]
    assert rewarded_rows(total, truncated, -1.0).tolist() == [True, False, True, True]  # the penalty is its score


HALF_FAILING = '''
def half(prompts, completions, **kw):
    """1, 2, 3, ... on even rows; NaN (a failed value) on odd rows."""
    return [float("nan") if i % 2 else float(i + 1) for i in range(len(completions))]
'''


def test_a_row_whose_reward_failed_is_left_out_of_the_update(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A reward function that fails (NaN) on the odd rows of 8: those rows leave the mask the losses, GAE and
    whitening read (no advantage, no value target), the step's reward is the mean over the rewarded rows
    (1 + 3 + 5 + 7) / 4 = 4, not the old (16 + 4 zeros) / 8 = 2, and the failure is reported with what PPO does."""
    from lorarl.algos.ppo import PPO

    (tmp_path / "half.py").write_text(HALF_FAILING)
    d = toy_recipe(tiny_model_dir, tmp_path, minibatch_size=4, epochs=1)
    d["reward"] = {"functions": [{"name": f"{tmp_path / 'half.py'}:half"}], "max_failure_fraction": 1.0}
    d["train"].update(prompts_per_step=8, micro_batch_size=4)
    recipe = recipe_from_dict(d)
    algo = PPO(recipe, SharedBase.load(recipe.model))
    seen = {}

    def capture(data, step):
        seen["data"] = data
        return {}, 0, False

    monkeypatch.setattr(algo, "optimise", capture)
    metrics = algo.step(algo.batch(1))
    data = seen["data"]
    odd, even = torch.arange(1, 8, 2), torch.arange(0, 8, 2)
    assert not data.mask[odd].any()
    assert torch.equal(data.mask[even], data.rollout.loss_mask[even]) and data.mask[even].any(dim=1).all()
    assert torch.all(data.advantages[odd] == 0) and torch.all(data.returns[odd] == 0)
    kept = data.advantages[data.mask]  # whitened over the rewarded rows' tokens alone: mean 0, unbiased std 1
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(kept.std()) == pytest.approx(1.0, abs=1e-3)
    assert metrics["reward"] == pytest.approx(4.0)
    out = capsys.readouterr().out
    assert (
        "step 1: reward half failed (4 of 8 values failed (returned NaN)); its rows are left out of the update" in out
    )


def test_reward_source_both_leaves_a_row_without_a_rule_value_out(monkeypatch):
    """reward.source both: total = model_weight * RM score + the rules' total; a row whose rule functions failed
    is NaN (left out, as with rules alone), not the reward model's score with the rules counted as 0.
    Hand values: weight 0.5, RM [10, 20, 30], rules [1, NaN, 3] -> [6, NaN, 18]."""
    import types

    from lorarl.rewards import source
    from lorarl.rewards.scorer import RewardScores

    class Rollout(types.SimpleNamespace):
        def __len__(self):
            return 3

    rollout = Rollout(
        completion_ids=torch.tensor([[5, 2], [6, 2], [7, 2]]),
        completion_mask=torch.ones(3, 2, dtype=torch.bool),
        truncated=torch.zeros(3, dtype=torch.bool),
        prompt_ids=torch.ones(3, 1, dtype=torch.long),
        attention_mask=torch.ones(3, 3, dtype=torch.long),
    )
    rules = torch.tensor([1.0, float("nan"), 3.0])
    src = source.RewardSource.__new__(source.RewardSource)
    src.shared, src.batch_size, src.uses_rm, src.uses_rules, src.model_weight = (
        types.SimpleNamespace(end_of_turn_id=2), 4, True, True, 0.5
    )  # fmt: skip
    src.rules = types.SimpleNamespace(
        score_rollout=lambda p, r, environments=None: RewardScores(rules[:, None], rules, ["f"])
    )
    monkeypatch.setattr(source, "reward_model_scores", lambda *a: torch.tensor([10.0, 20.0, 30.0]))
    total = src.score_rollout(None, rollout).total
    torch.testing.assert_close(total, torch.tensor([6.0, float("nan"), 18.0]), equal_nan=True)
