"""The verl hand-off: parquet rows in verl's layout, ``main_ppo`` Hydra overrides for the recipe, the launch line."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from lorarl.config import Recipe
from lorarl.export.engines.common import (
    LORARL_COLUMNS,
    Engine,
    HandOff,
    KeyMap,
    Unmapped,
    columns_json,
    messages,
    shell_word,
    target_modules,
    whole_number,
)

LOSS_AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_sum_norm": "seq-mean-token-sum-norm",
}


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def verl_rows(rows: list[dict], split: str, data_source: str, gt: str | None, system_prompt: str | None) -> list[dict]:
    """verl's RL dataset rows: chat-message ``prompt``, ``data_source``, ``reward_model.ground_truth`` (the ``gt``
    column as a string) and ``extra_info`` carrying the whole lorarl row as JSON for the reward functions."""
    out = []
    for i, row in enumerate(rows):
        truth = row.get(gt) if gt else None
        out.append(
            {
                "data_source": data_source,
                "prompt": messages(row["prompt"], system_prompt),
                "ability": "lorarl",
                "reward_model": {"style": "rule", "ground_truth": None if truth is None else str(truth)},
                # JSON, so rows of any shape fit one parquet schema
                "extra_info": {"split": split, "index": i, LORARL_COLUMNS: columns_json(row)},
            }
        )
    return out


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def _write_split(h: HandOff, split: str, rows: list[dict], path: Path) -> None:
    write_parquet(verl_rows(rows, split, h.data_source, h.ground_truth, h.recipe.data.system_prompt), path)


# ---------------------------------------------------------------------------------------------------------------
# Key mapping
# ---------------------------------------------------------------------------------------------------------------


def _shared_keys(r: Recipe, paths: dict[str, str]) -> tuple[list[KeyMap], list[Unmapped]]:
    """Data, model, LoRA, rollout, optimizer, trainer and reward keys (the same for GRPO and PPO)."""
    t = r.train
    m = [
        KeyMap("data.train_files", paths["train"], "data.source"),
        KeyMap("data.prompt_key", "prompt", "", "the parquet's chat-message column"),
        KeyMap("data.max_prompt_length", r.data.max_prompt_tokens, "data.max_prompt_tokens"),
        KeyMap("data.max_response_length", r.generation.max_new_tokens, "generation.max_new_tokens"),
        KeyMap("data.train_batch_size", t.prompts_per_step, "train.prompts_per_step", "prompts per step"),
        KeyMap("data.seed", t.seed, "train.seed", "shuffling seed", unsure=True),
    ]
    if "test" in paths:
        m.append(KeyMap("data.val_files", paths["test"], "data.eval_source", "lorarl's held-out split"))
    m += [
        KeyMap("actor_rollout_ref.model.path", paths["base"], "model.name", "the full-precision base folder"),
        KeyMap("actor_rollout_ref.model.trust_remote_code", r.model.trust_remote_code, "model.trust_remote_code"),
        KeyMap(
            "actor_rollout_ref.model.enable_gradient_checkpointing",
            r.model.gradient_checkpointing,
            "model.gradient_checkpointing",
        ),
        KeyMap("actor_rollout_ref.model.lora_rank", r.lora.r, "lora.r"),
        KeyMap("actor_rollout_ref.model.lora_alpha", whole_number(r.lora.alpha), "lora.alpha"),
        KeyMap("actor_rollout_ref.model.target_modules", target_modules(r.lora.target_modules), "lora.target_modules"),
        KeyMap(
            "actor_rollout_ref.model.lora_adapter_path",
            paths["adapter"],
            "(the trained policy adapter)",
            "continue from the trained adapter; older verl has no such key: drop it and set model.path to a "
            "`lorarl export --format merged` folder instead",
            unsure=True,
        ),
        KeyMap("actor_rollout_ref.rollout.load_format", "safetensors", "", "needed by verl's LoRA rollout sync"),
        KeyMap("actor_rollout_ref.rollout.name", "vllm", "", "rollout engine (vllm or sglang)"),
        KeyMap("actor_rollout_ref.rollout.temperature", r.generation.temperature, "generation.temperature"),
        KeyMap("actor_rollout_ref.rollout.top_p", r.generation.top_p, "generation.top_p"),
        KeyMap("actor_rollout_ref.rollout.top_k", r.generation.top_k or -1, "generation.top_k", "-1 = off (lorarl: 0)"),
        KeyMap("actor_rollout_ref.actor.optim.lr", t.learning_rate, "train.learning_rate"),
        KeyMap("actor_rollout_ref.actor.optim.weight_decay", t.weight_decay, "train.weight_decay"),
        KeyMap("actor_rollout_ref.actor.optim.lr_warmup_steps", t.warmup_steps, "train.warmup_steps"),
        KeyMap("actor_rollout_ref.actor.grad_clip", t.max_grad_norm, "train.max_grad_norm"),
        KeyMap("trainer.total_training_steps", t.steps, "train.steps"),
        KeyMap("trainer.save_freq", t.save_every or -1, "train.save_every", "-1 = never (lorarl: 0)"),
        KeyMap("trainer.n_gpus_per_node", 8, "", "your cluster"),
        KeyMap("trainer.nnodes", 1, "", "your cluster"),
        KeyMap("custom_reward_function.path", paths["reward"], "rewards", "the recipe's rule rewards"),
        KeyMap("custom_reward_function.name", "compute_score", "rewards"),
    ]
    skip: list[Unmapped] = []
    if t.lr_scheduler in ("constant", "cosine"):
        m.append(
            KeyMap(
                "actor_rollout_ref.actor.optim.warmup_style",
                t.lr_scheduler,
                "train.lr_scheduler",
                "newer verl names it optim.lr_scheduler_type",
                unsure=True,
            )
        )
    else:
        skip.append(Unmapped("train.lr_scheduler", t.lr_scheduler, "verl schedules are constant or cosine"))
    if isinstance(t.micro_batch_size, int):
        m.append(
            KeyMap("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size")
        )
    skip.append(Unmapped("lora.dropout", r.lora.dropout, "verl's LoRA config has no dropout key"))
    return m, skip


def _grpo_keys(r: Recipe) -> tuple[list[KeyMap], list[Unmapped]]:
    g, t = r.grpo, r.train
    m = [
        KeyMap("algorithm.adv_estimator", "grpo", "algo"),
        KeyMap("actor_rollout_ref.rollout.n", g.group_size, "grpo.group_size"),
        KeyMap(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            t.prompts_per_step,
            "train.prompts_per_step",
            "one optimizer step per rollout batch, as in lorarl (verl counts prompts here)",
        ),
        KeyMap("actor_rollout_ref.actor.ppo_epochs", g.num_iterations, "grpo.num_iterations"),
        KeyMap("actor_rollout_ref.actor.clip_ratio_low", g.clip_eps_low, "grpo.clip_eps_low"),
        KeyMap("actor_rollout_ref.actor.clip_ratio_high", g.clip_eps_high, "grpo.clip_eps_high"),
        KeyMap("actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG[g.loss_reduction], "grpo.loss_reduction"),
        KeyMap("actor_rollout_ref.actor.use_kl_loss", g.kl_coef > 0, "grpo.kl_coef", "KL as a loss term (GRPO)"),
        KeyMap("actor_rollout_ref.actor.kl_loss_coef", g.kl_coef, "grpo.kl_coef"),
        KeyMap("actor_rollout_ref.actor.kl_loss_type", "low_var_kl", "grpo.kl_estimator", "low_var_kl = k3"),
        KeyMap("actor_rollout_ref.actor.entropy_coeff", g.entropy_coef, "grpo.entropy_coef"),
        KeyMap("algorithm.use_kl_in_reward", False, "", "GRPO puts the KL in the loss, not the reward"),
        KeyMap(
            "algorithm.norm_adv_by_std_in_grpo",
            g.std_scaling != "none",
            "grpo.std_scaling",
            "True = divide by the group std"
            + ("; lorarl's 'batch' std has no verl equivalent" if g.std_scaling == "batch" else ""),
        ),
    ]
    skip: list[Unmapped] = []
    if g.kl_estimator != "k3":
        skip.append(Unmapped("grpo.kl_estimator", g.kl_estimator, "verl's low_var_kl is plain (clipped) k3"))
    skip.append(Unmapped("grpo.unbiased_std", g.unbiased_std, "verl uses torch.std (unbiased)"))
    if g.mask_truncated:
        skip.append(
            Unmapped("grpo.mask_truncated", True, "no single verl key; see verl's DAPO recipe (overlong filtering)")
        )
    if g.ref_refresh_every:
        skip.append(Unmapped("grpo.ref_refresh_every", g.ref_refresh_every, "no verl equivalent"))
    return m, skip


def _ppo_keys(r: Recipe, paths: dict[str, str]) -> tuple[list[KeyMap], list[Unmapped]]:
    p, t = r.ppo, r.train
    m = [
        KeyMap("algorithm.adv_estimator", "gae", "algo"),
        KeyMap("actor_rollout_ref.rollout.n", 1, "", "one sample per prompt"),
        KeyMap("actor_rollout_ref.actor.ppo_mini_batch_size", p.minibatch_size, "ppo.minibatch_size"),
        KeyMap("actor_rollout_ref.actor.ppo_epochs", p.epochs, "ppo.epochs"),
        KeyMap("actor_rollout_ref.actor.clip_ratio", p.clip_eps, "ppo.clip_eps"),
        KeyMap("actor_rollout_ref.actor.entropy_coeff", p.entropy_coef, "ppo.entropy_coef"),
        KeyMap("actor_rollout_ref.actor.use_kl_loss", False, "", "PPO puts the KL in the reward"),
        KeyMap("algorithm.gamma", p.gamma, "ppo.gamma"),
        KeyMap("algorithm.lam", p.lam, "ppo.lam"),
        KeyMap("algorithm.use_kl_in_reward", p.kl_coef > 0, "ppo.kl_coef"),
        KeyMap("algorithm.kl_penalty", "kl", "", "k1, as lorarl's per-token KL reward"),
        KeyMap("algorithm.kl_ctrl.type", "adaptive" if p.adaptive_kl else "fixed", "ppo.adaptive_kl"),
        KeyMap("algorithm.kl_ctrl.kl_coef", p.kl_coef, "ppo.kl_coef"),
        KeyMap("algorithm.kl_ctrl.target_kl", p.kl_target, "ppo.kl_target"),
        KeyMap("algorithm.kl_ctrl.horizon", p.kl_horizon, "ppo.kl_horizon"),
        KeyMap("critic.model.path", paths["base"], "model.name"),
        KeyMap("critic.model.lora_rank", p.critic_lora.r, "ppo.critic_lora.r"),
        KeyMap("critic.model.lora_alpha", whole_number(p.critic_lora.alpha), "ppo.critic_lora.alpha"),
        KeyMap(
            "critic.model.target_modules",
            target_modules(p.critic_lora.target_modules),
            "ppo.critic_lora.target_modules",
        ),
        KeyMap("critic.optim.lr", t.learning_rate, "train.learning_rate"),
        KeyMap("critic.cliprange_value", p.value_clip if p.value_clip is not None else 1e9, "ppo.value_clip"),
        KeyMap("critic.grad_clip", t.max_grad_norm, "train.max_grad_norm"),
    ]
    skip = [Unmapped("ppo.vf_coef", p.vf_coef, "verl trains the critic with its own optimizer (no shared loss)")]
    if p.reward_source != "rules":
        skip.append(
            Unmapped(
                "ppo.reward_source",
                p.reward_source,
                "lorarl's LoRA reward model is not exported: reward.py holds only the rule rewards; verl needs a "
                "sequence-classification reward model (reward_model.*)",
            )
        )
    if p.whiten_advantages is False:
        skip.append(Unmapped("ppo.whiten_advantages", False, "verl always whitens GAE advantages"))
    if p.ptx_coef:
        skip.append(Unmapped("ppo.ptx_coef", p.ptx_coef, "no verl equivalent"))
    return m, skip


def verl_mapping(recipe: Recipe, paths: dict[str, str]) -> tuple[list[KeyMap], list[Unmapped]]:
    """verl ``main_ppo`` overrides for the recipe (``paths``: train/test parquet, reward.py, adapter, base)."""
    m, skip = _shared_keys(recipe, paths)
    algo_keys, algo_skip = _grpo_keys(recipe) if recipe.algo == "grpo" else _ppo_keys(recipe, paths)
    return sorted(m + algo_keys, key=lambda e: e.engine_key), skip + algo_skip


# ---------------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------------


def _hydra_value(v: Any) -> str:
    """A value as a Hydra override takes it (lists as one quoted ``[a,b]`` word)."""
    if isinstance(v, list):
        return shlex.quote("[" + ",".join(str(x) for x in v) + "]")
    return shell_word(v)


def launch_arguments(entries: list[KeyMap]) -> list[str]:
    return [f"{e.engine_key}={_hydra_value(e.value)}" for e in entries]


def rows_paragraph(h: HandOff) -> str:
    return (
        "Rows follow verl's format: `prompt` (chat messages), `data_source`, `reward_model.ground_truth` "
        f"(the `{h.ground_truth}` column), `extra_info` (split, index and every lorarl column as JSON). "
        "`reward.py:compute_score(data_source, solution_str, ground_truth, extra_info)` returns the recipe's "
        "weighted reward."
    )


VERL = Engine(
    name="verl",
    title="verl",
    data_ext="parquet",
    launcher="verl.trainer.main_ppo",
    chat_only=True,
    write_split=_write_split,
    mapping=lambda h: verl_mapping(h.recipe, h.paths),
    launch_arguments=launch_arguments,
    rows_paragraph=rows_paragraph,
    reward_label=lambda h: "answer",
)
