"""The recipe -> OpenRLHF 0.11 mapping: flags of ``python -m openrlhf.cli.train_ppo_ray`` (dotted names: the CLI
moved to ``--actor.*``, ``--rollout.*``, ... in 0.10; ``--prompt_max_len`` / ``--generate_max_len`` are gone).

OpenRLHF 0.11 generates with vLLM only, and its weight sync to vLLM sends PEFT parameter names vLLM cannot load
(OpenRLHF issues #991, #1081), so LoRA training cannot be continued there: the hand-off starts from the merged policy
(``model/``) and trains all its weights, all models colocated on the same GPUs. Every flag was checked by OpenRLHF
0.11.2's own parser and its post-parse checks (``tests/test_handoff.py``). Units: OpenRLHF's LR scheduler steps once
per optimizer update over the whole run, so lorarl's warm-up (in RL steps) becomes a ratio of the run; its adaptive
KL controller measures KL per token, lorarl per sequence.
"""

from __future__ import annotations

from lorarl.export.engines.common import NO_CLIP, Derived, HandOff, Mapping, here, kl_target_per_token, whole_number
from lorarl.export.engines.shared_keys import grpo_policy_loss, shared_keys

SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
TRAIN_MICRO = Derived("${TRAIN_MICRO}", "the largest divisor of (samples per optimizer step / GPUs) that is <= --micro")
ROLLOUT_MICRO = Derived("${ROLLOUT_MICRO}", "the largest divisor of (rollout samples / GPUs) that is <= --micro")
FULL_FT = (
    "OpenRLHF 0.11 cannot train LoRA with its vLLM rollout (issues #991, #1081): the merged policy trains all weights"
)


def out(rel: str) -> Derived:
    return Derived("${OUT}/" + rel, f"--out DIR/{rel}", path=True)


def openrlhf_mapping(h: HandOff) -> Mapping:
    """The OpenRLHF mapping of the hand-off's recipe (GRPO or PPO)."""
    m = Mapping()
    shared_keys(h, m, "data/train.jsonl", "data/test.jsonl")
    _data(h, m)
    _model(h, m)
    _placement(h, m)
    _optim(h, m, "actor", h.recipe.train.max_grad_norm, "")
    _checkpoints(h, m)
    if h.recipe.algo == "grpo":
        _grpo(h, m)
    else:
        _ppo(h, m)
    return m


def _data(h: HandOff, m: Mapping) -> None:
    r, t = h.recipe, h.recipe.train
    n = t.steps * t.prompts_per_step
    m.key(
        "--data.prompt_dataset",
        here("data/train.jsonl"),
        "train.steps",
        f"{n} rows = train.steps x train.prompts_per_step, passes over the training rows in a seeded order: OpenRLHF "
        "has no step limit, so the file sets the run to train.steps steps",
    )
    m.key("--train.num_episodes", 1, "train.steps", "one pass over that file")
    m.key("--data.input_key", "prompt")
    if h.label_key:
        m.key("--data.label_key", h.label_key, "", "handed to reward_func as labels")
    if h.conversational:
        m.key("--data.apply_chat_template", True, "", "prompts are chat messages")
    m.key("--reward.remote_url", here("reward.py"), "reward.functions", "a .py file with reward_func")
    m.key(
        "--data.max_len",
        r.data.max_prompt_tokens + r.generation.max_new_tokens,
        "data.max_prompt_tokens / generation.max_new_tokens",
        "prompt + response",
    )
    m.key("--rollout.max_new_tokens", r.generation.max_new_tokens, "generation.max_new_tokens")
    m.skip(
        "data.on_bad_row",
        r.data.on_bad_row,
        "OpenRLHF keeps the end of a prompt longer than data.max_prompt_tokens (with a warning)",
    )
    m.key("--rollout.temperature", r.generation.temperature, "generation.temperature")
    m.key("--rollout.top_p", r.generation.top_p, "generation.top_p")
    m.skip("generation.top_k", r.generation.top_k, "OpenRLHF samples without top-k, which is lorarl's 0")
    m.key("--train.seed", t.seed, "train.seed")
    if "test" in h.splits:
        m.key("--eval.dataset", here("data/test.jsonl"), "data.eval_source")
        m.key(
            "--eval.steps",
            r.eval.every or t.steps,
            "eval.every",
            "every N steps (0: at the last step only; OpenRLHF skips the last one when N does not divide it)",
        )
        m.key("--eval.temperature", 0.0, "", "greedy, as `lorarl eval` (OpenRLHF's default: 0.6)")
        m.key("--eval.n_samples_per_prompt", 1, "", "one greedy answer per prompt")
    else:
        m.skip("eval.every", r.eval.every, "no held-out data: no evaluation")


def _model(h: HandOff, m: Mapping) -> None:
    r = h.recipe
    m.key("--actor.model_name_or_path", Derived("${MODEL}", "--model (default: this folder's model/)", path=True))
    m.apply("model.name", r.model.name, "model/: the base with the policy adapter merged in (bf16)")
    for k in ("r", "alpha", "dropout", "target_modules"):
        m.skip(f"lora.{k}", getattr(r.lora, k), FULL_FT)
    if r.model.gradient_checkpointing:
        m.key("--actor.gradient_checkpointing_enable", True, "model.gradient_checkpointing")
    else:
        m.skip("model.gradient_checkpointing", False, "off, OpenRLHF's default")
    m.skip("model.trust_remote_code", r.model.trust_remote_code, "OpenRLHF always loads with trust_remote_code=True")
    m.key("--ds.param_dtype", "bf16", "", "DeepSpeed bf16")


def _placement(h: HandOff, m: Mapping) -> None:
    """All models on the same GPUs (colocated, vLLM and DeepSpeed sleeping in turn): any GPU count works."""
    gpus, nodes = Derived("${GPUS}", "--gpus"), Derived("${NODES}", "--nodes")
    roles = ["actor", "ref"] + (["critic"] if h.recipe.algo == "ppo" else [])
    for role in roles:
        m.key(f"--{role}.num_nodes", nodes)
        m.key(f"--{role}.num_gpus_per_node", gpus)
    m.key("--train.colocate_all", True, "", "actor, reference, critic and vLLM share the GPUs")
    m.key("--vllm.num_engines", Derived("${VLLM_ENGINES}", "GPUs / --vllm-tp"))
    m.key("--vllm.tensor_parallel_size", Derived("${VLLM_TP}", "--vllm-tp"))
    m.key("--vllm.gpu_memory_utilization", Derived("${VLLM_MEM}", "--vllm-mem"))
    m.key("--vllm.enable_sleep", True, "", "vLLM frees its memory while DeepSpeed trains")
    m.key("--ds.enable_sleep", True, "", "DeepSpeed offloads while vLLM generates")


def _optim(h: HandOff, m: Mapping, role: str, clip: float, clip_note: str) -> None:
    """``--actor.*`` / ``--critic.*`` optimizer, schedule and clipping (the learning rate stays OpenRLHF's)."""
    t = h.recipe.train
    m.key(f"--{role}.adam.weight_decay", t.weight_decay, "train.weight_decay")
    m.key(f"--{role}.max_norm", clip, "train.max_grad_norm", clip_note)
    m.key(f"--{role}.lr_scheduler", SCHEDULERS[t.lr_scheduler], "train.lr_scheduler", "decays to 0, as lorarl's")
    m.key(
        f"--{role}.lr_warmup_ratio",
        round(t.warmup_steps / t.steps, 8),
        "train.warmup_steps",
        "OpenRLHF counts optimizer updates over the whole run: warmup_steps / steps of it",
    )


def _checkpoints(h: HandOff, m: Mapping) -> None:
    t = h.recipe.train
    m.key("--ckpt.path", out("ckpt"), "", "DeepSpeed checkpoints (resumed with --ckpt.load_enable)")
    m.key("--ckpt.output_dir", out("final"), "", "the final model (Hugging Face format)")
    m.key("--ckpt.save_steps", t.save_every or t.steps, "train.save_every", "0 (final only) -> the last step")
    m.key("--ckpt.max_num", t.keep_last, "train.keep_last")
    m.key("--ckpt.save_hf", True, "", "each checkpoint also as a Hugging Face folder")
    m.key("--ckpt.load_enable", True, "", "a re-run resumes from --out, as `lorarl train --resume`")
    if t.keep_best:
        m.key(
            "--ckpt.best_metric_key",
            "",
            "train.keep_best / train.keep_best_mode",
            f"OpenRLHF keeps the best checkpoint by its eval pass@1 (reward.py's mean, larger is better), not by "
            f"lorarl's {t.keep_best} ({t.keep_best_mode})",
        )
    else:
        m.key("--ckpt.best_metric_key", "none", "train.keep_best", "off, as in lorarl (OpenRLHF's default: on)")
        m.skip("train.keep_best_mode", t.keep_best_mode, "unused: train.keep_best is off")
    m.key("--logger.logging_steps", t.log_every, "train.log_every", "TensorBoard / wandb rows")
    m.skip("train.log_completions", t.log_completions, "OpenRLHF does not log sampled completions to a file")
    if "tensorboard" in t.report_to:
        m.key("--logger.tensorboard_dir", out("tensorboard"), "train.report_to")
    m.skip("train.report_to", t.report_to, "console always; wandb needs --logger.wandb.key (yours)")
    m.skip("train.project", t.project, "used by wandb only: --logger.wandb.project")
    m.skip("train.learning_rate", t.learning_rate, f"a LoRA learning rate; {FULL_FT} (OpenRLHF's default LR)")


def _kl(h: HandOff, m: Mapping, coef: float, key: str) -> None:
    m.key(
        "--algo.kl.init_coef",
        coef,
        key,
        "0 runs no reference; the reference is the exported policy (model/), not lorarl's base",
    )


def _grpo(h: HandOff, m: Mapping) -> None:
    g, t = h.recipe.grpo, h.recipe.train
    dr = g.std_scaling == "none"
    m.key("--algo.advantage.estimator", "dr_grpo" if dr else "group_norm", "algo / grpo.std_scaling")
    if g.std_scaling == "batch":
        m.skip("grpo.std_scaling", "batch", "OpenRLHF divides by the group's std (group_norm) or not at all (dr_grpo)")
    m.key("--rollout.n_samples_per_prompt", g.group_size, "grpo.group_size")
    m.key("--rollout.batch_size", t.prompts_per_step, "train.prompts_per_step")
    m.key("--train.batch_size", t.prompts_per_step * g.group_size, "train.prompts_per_step", "one update per step")
    m.key("--train.micro_batch_size", TRAIN_MICRO, "train.micro_batch_size")
    m.key("--rollout.micro_batch_size", ROLLOUT_MICRO, "train.micro_batch_size")
    m.key("--train.max_epochs", g.num_iterations, "grpo.num_iterations")
    m.key("--actor.eps_clip_low_high", [g.clip_eps_low, g.clip_eps_high], "grpo.clip_eps_low / grpo.clip_eps_high")
    modes = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}
    if g.loss_reduction not in modes:
        m.skip("grpo.loss_reduction", g.loss_reduction, "OpenRLHF has token-mean and seq-mean-token-mean only")
    else:
        m.key("--actor.loss_agg_mode", modes[g.loss_reduction], "grpo.loss_reduction")
    grpo_policy_loss(g, m, "OpenRLHF")
    _kl(h, m, g.kl.coef, "grpo.kl.coef")
    if g.kl.coef > 0:
        m.key("--algo.kl.use_loss", True, "grpo.kl.coef", "KL as a loss term (GRPO)")
        m.key("--algo.kl.estimator", "k3", "grpo.kl.estimator")
        if g.kl.estimator == "k3_unbiased":
            m.key("--algo.kl.unbiased_gradient", True, "grpo.kl.estimator", "the gradient of KL(pi || pi_ref)")
    else:
        m.skip("grpo.kl.estimator", g.kl.estimator, "unused: grpo.kl.coef is 0")
    m.key("--reward.clip_range", [-NO_CLIP, NO_CLIP], "", "lorarl does not clip (OpenRLHF's default: +-10)")
    if g.entropy_coef:
        m.key("--actor.entropy_coef", g.entropy_coef, "grpo.entropy_coef")
    else:
        m.skip("grpo.entropy_coef", 0.0, "OpenRLHF's default adds no entropy term, as lorarl's 0")
    ratio = f"{((g.group_size - 1) / g.group_size) ** 0.5:.4g}"
    m.skip(
        "grpo.unbiased_std",
        g.unbiased_std,
        "OpenRLHF divides by the unbiased std" + ("" if g.unbiased_std else f" (advantages x{ratio})"),
    )
    m.skip("grpo.mask_truncated", g.mask_truncated, "no OpenRLHF setting drops truncated completions from the loss")
    m.skip("grpo.kl.ref_refresh_every", g.kl.ref_refresh_every, "OpenRLHF's reference is fixed")
    m.skip("grpo.importance_sampling_level", g.importance_sampling_level, "not mapped: OpenRLHF's token-level ratio")
    for k in ("enabled", "max_rounds"):
        m.skip(f"grpo.dynamic_sampling.{k}", getattr(g.dynamic_sampling, k), "not mapped: OpenRLHF's default, off")
    _tis(m, g.tis, "grpo")


def _tis(m: Mapping, tis, prefix: str) -> None:
    m.skip(f"{prefix}.tis.mode", tis.mode, "not mapped: OpenRLHF's default, no sampler / trainer correction")
    m.skip(f"{prefix}.tis.cap", tis.cap, "not mapped")


def _ppo(h: HandOff, m: Mapping) -> None:
    p, t = h.recipe.ppo, h.recipe.train
    m.key("--algo.advantage.estimator", "gae", "algo")
    m.key("--rollout.n_samples_per_prompt", 1, "", "one response per prompt")
    m.key("--rollout.batch_size", t.prompts_per_step, "train.prompts_per_step")
    m.key("--train.batch_size", p.minibatch_size, "ppo.minibatch_size", "responses per optimizer step")
    m.key("--train.micro_batch_size", TRAIN_MICRO, "train.micro_batch_size")
    m.key("--rollout.micro_batch_size", ROLLOUT_MICRO, "train.micro_batch_size")
    m.key("--train.max_epochs", p.epochs, "ppo.epochs")
    m.key("--actor.eps_clip_low_high", [p.clip_eps, p.clip_eps], "ppo.clip_eps")
    m.key("--algo.advantage.gamma", p.gamma, "ppo.gamma")
    m.key("--algo.advantage.lambd", p.lam, "ppo.lam")
    if p.entropy_coef:
        m.key("--actor.entropy_coef", p.entropy_coef, "ppo.entropy_coef")
    else:
        m.skip("ppo.entropy_coef", 0.0, "OpenRLHF's default adds no entropy term, as lorarl's 0")
    m.skip(
        "ppo.whiten_advantages", p.whiten_advantages, "OpenRLHF always whitens GAE advantages over the batch's tokens"
    )
    m.skip("ppo.target_approx_kl", p.target_approx_kl, "OpenRLHF has no approx-KL early stop of the epochs")
    _tis(m, p.tis, "ppo")
    _ppo_kl(h, m)
    _score(h, m)
    _critic(h, m)
    for k, v in (("coef", p.ptx.coef), ("source", p.ptx.source), ("batch_size", p.ptx.batch_size)):
        m.skip(f"ppo.ptx.{k}", v, "OpenRLHF 0.11 has no pretraining-loss term")


def _ppo_kl(h: HandOff, m: Mapping) -> None:
    k = h.recipe.ppo.kl
    _kl(h, m, k.coef, "ppo.kl.coef")
    m.key("--algo.kl.estimator", k.estimator, "ppo.kl.estimator", f"{k.estimator} per token in the reward, as lorarl's")
    if k.adaptive:
        target, note = kl_target_per_token(h, "OpenRLHF")
        m.key("--algo.kl.target", target, "ppo.kl.adaptive / ppo.kl.target", note)
        m.key("--algo.kl.horizon", k.horizon, "ppo.kl.horizon", "in responses, as lorarl's")
    else:
        m.skip("ppo.kl.adaptive", False, "off: no --algo.kl.target, the coefficient is fixed")
        m.skip("ppo.kl.target", k.target, "unused: the KL coefficient is fixed")
        m.skip("ppo.kl.horizon", k.horizon, "unused: the KL coefficient is fixed")


def _score(h: HandOff, m: Mapping) -> None:
    s = h.recipe.ppo.score
    m.skip("ppo.score.normalize", s.normalize, "OpenRLHF's reward normalisation applies to reward models only")
    if s.clip is not None and not s.normalize:
        m.key("--reward.clip_range", [-s.clip, s.clip], "ppo.score.clip")
    else:
        why = "in std units after the normalisation, which is not mapped" if s.clip is not None else "lorarl: no clip"
        m.key("--reward.clip_range", [-NO_CLIP, NO_CLIP], "", f"never binds ({why}; OpenRLHF's default: +-10)")
        if s.clip is not None:
            m.skip("ppo.score.clip", s.clip, why)
        else:
            m.skip("ppo.score.clip", None, "not set: no clip")
    v = s.no_eos_penalty
    if v is not None and v <= 0:
        m.key(
            "--reward.stop_properly_penalty_coef",
            float(v),
            "ppo.score.no_eos_penalty",
            "< 0 replaces the score of truncated responses (0: multiplies it by 0), before clipping",
        )
    else:
        m.skip("ppo.score.no_eos_penalty", v, "OpenRLHF multiplies by a coefficient in [0, 1], never replaces by > 0")


def _critic(h: HandOff, m: Mapping) -> None:
    c, t = h.recipe.ppo.critic, h.recipe.train
    if c.vf_coef > 0:
        note = "train.max_grad_norm / vf_coef: the critic loss has no coefficient in OpenRLHF (AdamW is scale-free)"
        _optim(h, m, "critic", whole_number(t.max_grad_norm / c.vf_coef), note)
        m.apply("ppo.critic.vf_coef", c.vf_coef, "--critic.max_norm (see there)")
    else:
        _optim(h, m, "critic", t.max_grad_norm, "")
        m.skip("ppo.critic.vf_coef", 0.0, "0 freezes lorarl's critic; OpenRLHF's critic always trains")
    m.key(
        "--critic.value_clip",
        c.value_clip if c.value_clip is not None else NO_CLIP,
        "ppo.critic.value_clip",
        "" if c.value_clip is not None else "lorarl: unclipped",
    )
    m.skip("ppo.critic.learning_rate", c.learning_rate, f"{FULL_FT} (OpenRLHF's default critic LR)")
    for k in ("r", "alpha", "dropout", "target_modules"):
        m.skip(
            f"ppo.critic.lora.{k}",
            getattr(c.lora, k),
            "the critic is the merged policy + a fresh value head, all trained",
        )
    m.skip("ppo.critic.init", c.init, "OpenRLHF starts the critic from model/ with a fresh value head")
    m.skip("ppo.critic.loss", c.loss, "OpenRLHF's value loss is the clipped 0.5 x squared error (lorarl's mse)")
    m.skip("ppo.critic.huber_delta", c.huber_delta, "OpenRLHF has no Huber value loss")
    m.key("--critic.save_value_network", True, "", "the critic is saved with the final model")
