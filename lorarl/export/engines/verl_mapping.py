"""The recipe -> verl 0.9 mapping: Hydra overrides of ``verl/trainer/config/ppo_trainer.yaml`` for
``python -m verl.trainer.main_ppo`` (FSDP actor and critic, vLLM rollout, LoRA continued from the exported adapter).

Every key was checked against verl 0.9.1's own config: composed in struct mode with its trainer YAML and validated by
its config classes (``tests/test_handoff.py``). Units: verl's LR scheduler steps once per RL step (one
``update_actor`` call), as lorarl's does, so warm-up and decay carry over as they are; verl measures the adaptive KL
controller's KL per token, lorarl per sequence.
"""

from __future__ import annotations

from lorarl.export.engines.common import (
    NO_CLIP,
    Derived,
    HandOff,
    Mapping,
    here,
    kl_target_per_token,
    target_modules,
    whole_number,
)
from lorarl.export.engines.shared_keys import grpo_policy_loss, shared_keys

LOSS_AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_sum_norm": "seq-mean-token-sum-norm",
    "seq_mean_token_sum": "seq-mean-token-sum",
}
A = "actor_rollout_ref"
MICRO = Derived("${MICRO}", "the largest divisor of (samples per optimizer step / GPUs) that is <= --micro")
BASE = Derived("${BASE}", "--base (default: the base the adapter was trained on)", path=True)


def verl_mapping(h: HandOff) -> Mapping:
    """The verl mapping of the hand-off's recipe (GRPO or PPO)."""
    m = Mapping()
    shared_keys(h, m, "data/train.parquet", "data/test.parquet")
    _data(h, m)
    _model(h, m, A + ".model", h.recipe.lora, "lora")
    _rollout(h, m)
    _optim(h, m, A + ".actor.optim", h.recipe.train.learning_rate, "train.learning_rate", h.recipe.train.max_grad_norm)
    _trainer(h, m)
    if h.recipe.algo == "grpo":
        _grpo(h, m)
    else:
        _ppo(h, m)
    m.entries.sort(key=lambda e: e.engine_key)
    return m


def _data(h: HandOff, m: Mapping) -> None:
    r, t = h.recipe, h.recipe.train
    m.key("data.train_files", here("data/train.parquet"), "data.source", "every training row")
    if "test" in h.splits:
        m.key("data.val_files", here("data/test.parquet"), "data.eval_source", "the test split")
    else:  # verl builds a validation set whatever happens: give it the training rows, never evaluate
        m.key("data.val_files", here("data/train.parquet"), "data.eval_source", "none: no evaluation (test_freq -1)")
    m.key("data.prompt_key", "prompt", "", "the parquet's chat-message column")
    m.key("data.max_prompt_length", r.data.max_prompt_tokens, "data.max_prompt_tokens")
    m.key("data.max_response_length", r.generation.max_new_tokens, "generation.max_new_tokens")
    m.key(
        "data.filter_overlong_prompts",
        r.data.on_bad_row == "skip",
        "data.on_bad_row",
        "skip: longer prompts are dropped; fail: verl stops on one (truncation=error)",
    )
    m.key("data.truncation", "error", "data.on_bad_row")
    m.key("data.train_batch_size", t.prompts_per_step, "train.prompts_per_step", "prompts per RL step")
    m.key("data.seed", t.seed, "train.seed", "shuffling seed")
    m.key("data.trust_remote_code", r.model.trust_remote_code, "model.trust_remote_code")
    m.key("reward.custom_reward_function.path", here("reward.py"), "reward.functions")
    m.key("reward.custom_reward_function.name", "compute_score", "reward.functions")


def _model(h: HandOff, m: Mapping, prefix: str, lora, lora_key: str) -> None:
    """``actor_rollout_ref.model`` or ``critic.model``: the base, LoRA and checkpointing."""
    r = h.recipe
    m.key(prefix + ".path", BASE, "model.name", "the full-precision base")
    m.key(prefix + ".trust_remote_code", r.model.trust_remote_code, "model.trust_remote_code")
    m.key(prefix + ".enable_gradient_checkpointing", r.model.gradient_checkpointing, "model.gradient_checkpointing")
    m.key(prefix + ".lora_rank", lora.r, f"{lora_key}.r")
    alpha_note = "" if float(lora.alpha).is_integer() else f"verl takes an int; the adapter's own alpha {lora.alpha}"
    m.key(prefix + ".lora_alpha", int(round(lora.alpha)), f"{lora_key}.alpha", alpha_note)
    m.key(prefix + ".target_modules", target_modules(lora.target_modules), f"{lora_key}.target_modules")
    m.skip(f"{lora_key}.dropout", lora.dropout, "verl's LoRA has no dropout setting (it trains without dropout)")
    if prefix.startswith(A):
        m.key(
            prefix + ".lora_adapter_path",
            here("adapter"),
            "",
            "the trained policy adapter: verl loads it (PeftModel, trainable) and continues training it",
        )


def _rollout(h: HandOff, m: Mapping) -> None:
    g, t = h.recipe.generation, h.recipe.train
    p = A + ".rollout"
    m.key(p + ".name", "vllm", "", "rollout engine")
    m.key(p + ".temperature", g.temperature, "generation.temperature")
    m.key(p + ".top_p", g.top_p, "generation.top_p")
    m.key(p + ".top_k", g.top_k or -1, "generation.top_k", "-1 = off (lorarl: 0)")
    m.key(p + ".seed", t.seed, "train.seed", "vLLM sampling seed")
    m.key(p + ".tensor_model_parallel_size", Derived("${VLLM_TP}", "--vllm-tp"))
    m.key(p + ".gpu_memory_utilization", Derived("${VLLM_MEM}", "--vllm-mem"))
    m.key(p + ".load_format", "safetensors", "", "vLLM loads the base from disk; verl then syncs the LoRA weights")
    m.key(p + ".log_prob_micro_batch_size_per_gpu", MICRO, "train.micro_batch_size")
    m.key(p + ".val_kwargs.do_sample", False, "", "evaluation is greedy, as in `lorarl eval`")
    m.key(p + ".val_kwargs.temperature", 0, "")
    m.key(A + ".ref.log_prob_micro_batch_size_per_gpu", MICRO, "train.micro_batch_size", "the reference's forward")


def _optim(h: HandOff, m: Mapping, p: str, lr: float, lr_key: str, clip: float, clip_note: str = "") -> None:
    """An FSDP optimizer section (``actor.optim`` / ``critic.optim``): AdamW, the schedule, gradient clipping."""
    t = h.recipe.train
    m.key(p + ".lr", lr, lr_key)
    m.key(p + ".weight_decay", t.weight_decay, "train.weight_decay")
    m.key(p + ".clip_grad", clip, "train.max_grad_norm", clip_note)
    m.key(
        p + ".lr_warmup_steps",
        t.warmup_steps,
        "train.warmup_steps",
        "in RL steps: verl steps the scheduler once per RL step, as lorarl does",
    )
    if t.lr_scheduler in ("constant", "cosine"):
        m.key(p + ".lr_scheduler_type", t.lr_scheduler, "train.lr_scheduler", "over trainer.total_training_steps")
        if t.lr_scheduler == "cosine":
            m.key(p + ".min_lr_ratio", 0.0, "train.lr_scheduler", "decays to 0 at the end, as lorarl's")
    elif p.startswith(A):
        m.skip("train.lr_scheduler", t.lr_scheduler, "verl's FSDP optimizer schedules are constant or cosine only")


def _trainer(h: HandOff, m: Mapping) -> None:
    t = h.recipe.train
    m.key("trainer.total_training_steps", t.steps, "train.steps")
    m.key("trainer.total_epochs", t.steps, "train.steps", "an upper bound that never binds: every epoch has >= 1 step")
    m.key(
        "trainer.save_freq",
        t.save_every or t.steps,
        "train.save_every",
        "verl also saves the last step; 0 (final only) -> every train.steps",
    )
    m.key("trainer.max_actor_ckpt_to_keep", t.keep_last, "train.keep_last")
    test = "test" in h.splits
    m.key(
        "trainer.test_freq",
        (h.recipe.eval.every or t.steps) if test else -1,
        "eval.every",
        "evaluate the test split every N steps and at the last (0: the last only), and before training",
    )
    m.skip("train.keep_best", t.keep_best, "verl keeps the newest checkpoints only")
    m.skip("train.keep_best_mode", t.keep_best_mode, "verl keeps the newest checkpoints only")
    m.key("trainer.val_before_train", test, "", "the exported policy's score on the test split, at step 0")
    loggers = ["console"] + [b for b in t.report_to if b != "console"]
    m.key("trainer.logger", loggers, "train.report_to", "console always")
    m.key("trainer.project_name", t.project, "train.project")
    m.key("trainer.experiment_name", Derived("${NAME}", "the export folder's name", path=True), "")
    m.key("trainer.default_local_dir", Derived("${OUT}/checkpoints", "--out DIR/checkpoints", path=True))
    m.key("trainer.n_gpus_per_node", Derived("${GPUS}", "--gpus"))
    m.key("trainer.nnodes", Derived("${NODES}", "--nodes"))
    m.skip("train.log_every", t.log_every, "verl logs every step")
    m.skip("train.log_completions", t.log_completions, "verl dumps every rollout with trainer.rollout_data_dir=DIR")


def _grpo(h: HandOff, m: Mapping) -> None:
    g, t, gen = h.recipe.grpo, h.recipe.train, h.recipe.generation
    act = A + ".actor"
    m.key("algorithm.adv_estimator", "grpo", "algo")
    m.key(A + ".rollout.n", g.group_size, "grpo.group_size")
    m.key(act + ".ppo_mini_batch_size", t.prompts_per_step, "train.prompts_per_step", "one update per rollout batch")
    m.key(act + ".ppo_micro_batch_size_per_gpu", MICRO, "train.micro_batch_size")
    m.key(act + ".ppo_epochs", g.num_iterations, "grpo.num_iterations")
    m.key(act + ".clip_ratio_low", g.clip_eps_low, "grpo.clip_eps_low")
    m.key(act + ".clip_ratio_high", g.clip_eps_high, "grpo.clip_eps_high")
    if g.loss_reduction in LOSS_AGG:
        m.key(act + ".loss_agg_mode", LOSS_AGG[g.loss_reduction], "grpo.loss_reduction")
    else:  # micro_batch_token_mean (TRL's bnpo)
        m.skip(
            "grpo.loss_reduction", g.loss_reduction, "verl has no per-micro-batch token mean (token-mean is closest)"
        )
    grpo_policy_loss(g, m, "verl")
    if g.loss_reduction == "seq_sum_norm":
        m.key(act + ".loss_scale_factor", gen.max_new_tokens, "grpo.loss_reduction", "Dr. GRPO's constant")
    m.key(act + ".use_kl_loss", g.kl.coef > 0, "grpo.kl.coef", "the KL term in the loss; reference = base")
    m.key(act + ".kl_loss_coef", g.kl.coef, "grpo.kl.coef")
    if g.kl.estimator == "k3":
        m.key(act + ".kl_loss_type", "low_var_kl", "grpo.kl.estimator", "k3 (verl clamps it to [-10, 10])")
    elif g.num_iterations == 1:
        m.key(
            act + ".kl_loss_type",
            "k3+",
            "grpo.kl.estimator",
            "k3 value, k2 gradient: on-policy (num_iterations 1) the gradient of k3_unbiased",
        )
    else:
        m.skip("grpo.kl.estimator", g.kl.estimator, "verl has no importance-weighted k3 for off-policy updates")
    differs = g.entropy_coef and g.loss_reduction != "token_mean"
    note = f"verl reduces the entropy by loss_agg_mode, lorarl (as TRL) by token mean: {g.loss_reduction} differs"
    m.key(act + ".entropy_coeff", g.entropy_coef, "grpo.entropy_coef", note if differs else "")
    m.key("algorithm.use_kl_in_reward", False, "", "GRPO puts the KL in the loss, not the reward")
    if g.std_scaling == "batch":
        m.skip("grpo.std_scaling", "batch", "verl divides by the group's std or not at all (group / none)")
    else:
        m.key("algorithm.norm_adv_by_std_in_grpo", g.std_scaling == "group", "grpo.std_scaling", "none: Dr. GRPO")
    m.skip(
        "grpo.unbiased_std",
        g.unbiased_std,
        "verl divides by the unbiased std (n - 1)" + ("" if g.unbiased_std else f": advantages x{_std_ratio(g)}"),
    )
    if g.mask_truncated:
        m.skip("grpo.mask_truncated", True, "no verl setting drops truncated completions from the loss")
    else:
        m.skip("grpo.mask_truncated", False, "off, as in verl")
    m.skip(
        "grpo.kl.ref_refresh_every",
        g.kl.ref_refresh_every,
        "verl's reference stays the base" if g.kl.ref_refresh_every else "off: verl's reference stays the base",
    )
    if g.importance_sampling_level == "sequence":
        m.key(act + ".policy_loss.loss_mode", "gspo", "grpo.importance_sampling_level", "GSPO's sequence ratio")
    else:
        m.skip("grpo.importance_sampling_level", "token", "verl's default (vanilla) PPO loss is token-level, as lorarl")
    why = "verl's main_ppo has no dynamic sampling (its DAPO recipe has algorithm.filter_groups)"
    m.skip("grpo.dynamic_sampling.enabled", g.dynamic_sampling.enabled, why if g.dynamic_sampling.enabled else "off")
    m.skip("grpo.dynamic_sampling.max_rounds", g.dynamic_sampling.max_rounds, why)
    _tis(m, g.tis, "grpo")


def _tis(m: Mapping, tis, prefix: str) -> None:
    """grpo.tis / ppo.tis: verl's token-level truncated importance sampling (algorithm.rollout_correction)."""
    if tis.mode == "always":
        m.key("algorithm.rollout_correction.rollout_is", "token", f"{prefix}.tis.mode", "truncated IS, every token")
        m.key("algorithm.rollout_correction.rollout_is_threshold", tis.cap, f"{prefix}.tis.cap")
        m.key(A + ".rollout.calculate_log_probs", True, f"{prefix}.tis.mode", "the sampler's log-probs")
        return
    why = (
        "verl has no parity-triggered switch (tis.mode: always sets rollout_is: token)" if tis.mode == "auto" else "off"
    )
    m.skip(f"{prefix}.tis.mode", tis.mode, why)
    m.skip(f"{prefix}.tis.cap", tis.cap, why)


def _std_ratio(g) -> str:
    return f"{((g.group_size - 1) / g.group_size) ** 0.5:.4g}"


def _ppo(h: HandOff, m: Mapping) -> None:
    p = h.recipe.ppo
    act = A + ".actor"
    m.key("algorithm.adv_estimator", "gae", "algo")
    m.key(A + ".rollout.n", 1, "", "one response per prompt")
    m.key(act + ".ppo_mini_batch_size", p.minibatch_size, "ppo.minibatch_size", "responses per optimizer step")
    m.key(act + ".ppo_micro_batch_size_per_gpu", MICRO, "train.micro_batch_size")
    m.key(act + ".ppo_epochs", p.epochs, "ppo.epochs")
    for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        m.key(f"{act}.{k}", p.clip_eps, "ppo.clip_eps")
    m.key(act + ".loss_agg_mode", "token-mean", "", "lorarl's PPO losses are token means over the minibatch")
    m.key(act + ".entropy_coeff", p.entropy_coef, "ppo.entropy_coef")
    m.key(act + ".use_kl_loss", False, "", "PPO puts the KL in the reward")
    m.key("algorithm.gamma", p.gamma, "ppo.gamma")
    m.key("algorithm.lam", p.lam, "ppo.lam")
    _ppo_kl(h, m)
    _critic(h, m)
    if p.whiten_advantages:
        m.skip("ppo.whiten_advantages", True, "verl always whitens GAE advantages over the batch's tokens, as lorarl")
    else:
        m.skip("ppo.whiten_advantages", False, "verl always whitens GAE advantages")
    m.skip("ppo.target_approx_kl", p.target_approx_kl, "verl has no approx-KL early stop of the epochs")
    m.skip("ppo.score.normalize", p.score.normalize, "verl has no running normalisation of the score")
    m.skip("ppo.score.clip", p.score.clip, "verl does not clip the score")
    m.skip("ppo.score.no_eos_penalty", p.score.no_eos_penalty, "verl has no no-EOS replacement of the score")
    for k, v in (("coef", p.ptx.coef), ("source", p.ptx.source), ("batch_size", p.ptx.batch_size)):
        m.skip(f"ppo.ptx.{k}", v, "verl has no pretraining-loss term (PPO-ptx)")
    _tis(m, p.tis, "ppo")


def _ppo_kl(h: HandOff, m: Mapping) -> None:
    k = h.recipe.ppo.kl
    m.key("algorithm.use_kl_in_reward", k.coef > 0, "ppo.kl.coef", "per-token penalty; reference = base")
    penalty = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[k.estimator]  # verl's names for the same estimators
    m.key("algorithm.kl_penalty", penalty, "ppo.kl.estimator", f"{k.estimator} per token in the reward, as lorarl's")
    m.key("algorithm.kl_ctrl.type", "adaptive" if k.adaptive else "fixed", "ppo.kl.adaptive")
    m.key("algorithm.kl_ctrl.kl_coef", k.coef, "ppo.kl.coef")
    if k.adaptive:
        target, note = kl_target_per_token(h, "verl")
        m.key("algorithm.kl_ctrl.target_kl", target, "ppo.kl.target", note)
        m.key("algorithm.kl_ctrl.horizon", k.horizon, "ppo.kl.horizon", "in responses, as lorarl's")
    else:
        m.skip("ppo.kl.target", k.target, "unused: the KL coefficient is fixed")
        m.skip("ppo.kl.horizon", k.horizon, "unused: the KL coefficient is fixed")


def _critic(h: HandOff, m: Mapping) -> None:
    c, t = h.recipe.ppo.critic, h.recipe.train
    _model(h, m, "critic.model", c.lora, "ppo.critic.lora")
    lr, lr_key = (
        (c.learning_rate, "ppo.critic.learning_rate") if c.learning_rate else (t.learning_rate, "train.learning_rate")
    )
    if c.vf_coef > 0:
        clip_note = (
            f"train.max_grad_norm / ppo.critic.vf_coef: lorarl clips the gradient of vf_coef x value loss at "
            f"{t.max_grad_norm}; verl's critic loss has no coefficient (AdamW is scale-free)"
        )
        _optim(h, m, "critic.optim", lr, lr_key, whole_number(t.max_grad_norm / c.vf_coef), clip_note)
        m.apply("ppo.critic.vf_coef", c.vf_coef, "critic.optim.clip_grad (see there)")
    else:
        _optim(h, m, "critic.optim", lr, lr_key, t.max_grad_norm)
        m.skip("ppo.critic.vf_coef", 0.0, "0 freezes lorarl's critic; verl's critic always trains")
    if c.learning_rate:
        m.apply("ppo.critic.learning_rate", c.learning_rate, "critic.optim.lr")
    else:
        m.skip("ppo.critic.learning_rate", None, "not set: the critic uses train.learning_rate")
    m.key("critic.ppo_micro_batch_size_per_gpu", MICRO, "train.micro_batch_size")
    m.key("trainer.max_critic_ckpt_to_keep", t.keep_last, "train.keep_last")
    m.key(
        "critic.cliprange_value",
        c.value_clip if c.value_clip is not None else NO_CLIP,
        "ppo.critic.value_clip",
        "" if c.value_clip is not None else "lorarl: unclipped",
    )
    if c.loss == "mse":
        m.skip("ppo.critic.loss", "mse", "verl's value loss is the clipped 0.5 x squared error, as lorarl's mse")
        m.skip("ppo.critic.huber_delta", c.huber_delta, "unused with loss mse")
    else:
        m.skip("ppo.critic.loss", c.loss, "verl's value loss is squared error only")
        m.skip("ppo.critic.huber_delta", c.huber_delta, "verl's value loss is squared error only")
    m.skip(
        "ppo.critic.init",
        c.init,
        "verl starts a fresh value head" + (" (as init fresh)" if c.init == "fresh" else ", not the reward model's"),
    )
