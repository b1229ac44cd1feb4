"""The OpenRLHF hand-off: JSONL prompt rows, ``openrlhf.cli.train_ppo_ray`` flags for the recipe, the launch line."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from lorarl.config import Recipe
from lorarl.export.engines.common import (
    LORARL_COLUMNS,
    Engine,
    HandOff,
    KeyMap,
    Unmapped,
    columns_json,
    messages,
    row_columns,
    shell_word,
    target_modules,
)

# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def openrlhf_rows(
    rows: list[dict], gt: str | None, system_prompt: str | None, conversational: bool, with_columns: bool
) -> list[dict]:
    """OpenRLHF prompt rows: ``prompt`` (chat messages when ``conversational``, else the text) and the dataset's
    columns, the ``gt`` column as a string; ``with_columns`` adds the whole row as JSON (``lorarl_columns``)."""
    out = []
    for row in rows:
        prompt = messages(row["prompt"], system_prompt) if conversational else row["prompt"]
        item = {"prompt": prompt, **row_columns(row)}
        if gt:
            item[gt] = None if row.get(gt) is None else str(row.get(gt))
        if with_columns:  # the --label_key column when user rewards may read any column
            item[LORARL_COLUMNS] = columns_json(row)
        out.append(item)
    return out


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _write_split(h: HandOff, split: str, rows: list[dict], path: Path) -> None:
    with_columns = h.label_key == LORARL_COLUMNS
    write_jsonl(openrlhf_rows(rows, h.ground_truth, h.recipe.data.system_prompt, h.conversational, with_columns), path)


# ---------------------------------------------------------------------------------------------------------------
# Key mapping
# ---------------------------------------------------------------------------------------------------------------


def _shared_flags(
    r: Recipe, paths: dict[str, str], train_rows: int, conversational: bool, label_key: str | None
) -> tuple[list[KeyMap], list[Unmapped]]:
    """Model, data, sampling, LoRA, optimizer and schedule flags (the same for GRPO and PPO)."""
    t = r.train
    episodes = max(1, math.ceil(t.steps * t.prompts_per_step / max(train_rows, 1)))
    m = [
        KeyMap(
            "--pretrain",
            paths["base"],
            "model.name",
            "the full-precision base; to start from the trained policy use a `lorarl export --format merged` folder",
        ),
        KeyMap("--prompt_data", paths["train"], "data.source"),
        KeyMap("--input_key", "prompt", ""),
        KeyMap("--remote_rm_url", paths["reward"], "rewards", "a .py file with reward_func"),
        KeyMap("--prompt_max_len", r.data.max_prompt_tokens, "data.max_prompt_tokens"),
        KeyMap("--generate_max_len", r.generation.max_new_tokens, "generation.max_new_tokens"),
        KeyMap("--temperature", r.generation.temperature, "generation.temperature"),
        KeyMap("--top_p", r.generation.top_p, "generation.top_p"),
        KeyMap("--lora_rank", r.lora.r, "lora.r"),
        KeyMap("--lora_alpha", int(round(r.lora.alpha)), "lora.alpha", "an int in OpenRLHF"),
        KeyMap("--lora_dropout", r.lora.dropout, "lora.dropout"),
        KeyMap("--target_modules", target_modules(r.lora.target_modules), "lora.target_modules"),
        KeyMap("--actor_learning_rate", t.learning_rate, "train.learning_rate"),
        KeyMap("--l2", t.weight_decay, "train.weight_decay"),
        KeyMap("--max_norm", t.max_grad_norm, "train.max_grad_norm"),
        KeyMap(
            "--lr_warmup_ratio", round(t.warmup_steps / t.steps, 6), "train.warmup_steps", "a fraction of all steps"
        ),
        KeyMap("--rollout_batch_size", t.prompts_per_step, "train.prompts_per_step"),
        KeyMap("--num_episodes", episodes, "train.steps", f"passes over the {train_rows} prompts ~ {t.steps} steps"),
        KeyMap("--seed", t.seed, "train.seed"),
        KeyMap("--save_steps", t.save_every or -1, "train.save_every"),
    ]
    if label_key:
        m.append(KeyMap("--label_key", label_key, "", "handed to reward_func as labels"))
    if "test" in paths:
        m.append(KeyMap("--eval_dataset", paths["test"], "data.eval_source"))
    if conversational:
        m.append(KeyMap("--apply_chat_template", True, "", "prompts are chat messages"))
    if r.model.gradient_checkpointing:
        m.append(KeyMap("--gradient_checkpointing", True, "model.gradient_checkpointing"))
    sched = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[t.lr_scheduler]
    m.append(KeyMap("--lr_scheduler", sched, "train.lr_scheduler", "a transformers scheduler name", unsure=True))
    if isinstance(t.micro_batch_size, int):
        m.append(KeyMap("--micro_train_batch_size", t.micro_batch_size, "train.micro_batch_size"))
        m.append(KeyMap("--micro_rollout_batch_size", t.micro_batch_size, "train.micro_batch_size"))
    skip: list[Unmapped] = []
    if r.generation.top_k:
        skip.append(Unmapped("generation.top_k", r.generation.top_k, "OpenRLHF's PPO CLI has no top_k flag"))
    skip.append(
        Unmapped(
            "(policy adapter)",
            paths["adapter"],
            "OpenRLHF starts a fresh LoRA: merge the trained one with `lorarl export --format merged` and pass that folder as --pretrain",
        )
    )
    return m, skip


def _grpo_flags(r: Recipe) -> tuple[list[KeyMap], list[Unmapped]]:
    g, t = r.grpo, r.train
    dr = g.std_scaling == "none" and g.loss_reduction == "seq_sum_norm"
    m = [
        KeyMap(
            "--advantage_estimator",
            "dr_grpo" if dr else "group_norm",
            "grpo.std_scaling",
            "Dr. GRPO: no std scaling, sum-norm loss" if dr else "GRPO: group mean / std",
            unsure=dr,
        ),
        KeyMap("--n_samples_per_prompt", g.group_size, "grpo.group_size"),
        KeyMap(
            "--train_batch_size",
            t.prompts_per_step * g.group_size,
            "train.prompts_per_step",
            "samples per optimizer step (prompts x group)",
        ),
        KeyMap("--max_epochs", g.num_iterations, "grpo.num_iterations"),
        KeyMap("--eps_clip_low_high", [g.clip_eps_low, g.clip_eps_high], "grpo.clip_eps_low / grpo.clip_eps_high"),
        KeyMap("--init_kl_coef", g.kl_coef, "grpo.kl_coef"),
        KeyMap("--gamma", 1.0, ""),
    ]
    skip: list[Unmapped] = []
    if g.kl_coef > 0:
        m += [
            KeyMap("--use_kl_loss", True, "grpo.kl_coef", "KL as a loss term (GRPO)"),
            KeyMap("--kl_estimator", "k3", "grpo.kl_estimator"),
        ]
    if g.std_scaling == "none" and not dr:
        m.append(KeyMap("--no_advantage_std_norm", True, "grpo.std_scaling", unsure=True))
    if g.std_scaling == "batch":
        skip.append(Unmapped("grpo.std_scaling", "batch", "OpenRLHF's group_norm divides by the group std"))
    if g.entropy_coef:
        m.append(KeyMap("--entropy_loss_coef", g.entropy_coef, "grpo.entropy_coef"))
    if g.loss_reduction != "token_mean" and not dr:
        skip.append(Unmapped("grpo.loss_reduction", g.loss_reduction, "OpenRLHF averages over tokens"))
    if g.mask_truncated:
        skip.append(Unmapped("grpo.mask_truncated", True, "no OpenRLHF equivalent"))
    return m, skip


def _ppo_flags(r: Recipe) -> tuple[list[KeyMap], list[Unmapped]]:
    p, t = r.ppo, r.train
    m = [
        KeyMap("--advantage_estimator", "gae", "algo"),
        KeyMap("--n_samples_per_prompt", 1, ""),
        KeyMap("--train_batch_size", p.minibatch_size, "ppo.minibatch_size"),
        KeyMap("--max_epochs", p.epochs, "ppo.epochs"),
        KeyMap("--eps_clip", p.clip_eps, "ppo.clip_eps"),
        KeyMap("--value_clip", p.value_clip if p.value_clip is not None else 1e9, "ppo.value_clip"),
        KeyMap("--gamma", p.gamma, "ppo.gamma"),
        KeyMap("--lambd", p.lam, "ppo.lam"),
        KeyMap("--init_kl_coef", p.kl_coef, "ppo.kl_coef"),
        KeyMap("--critic_learning_rate", t.learning_rate, "train.learning_rate"),
    ]
    if p.adaptive_kl:
        m += [
            KeyMap("--kl_target", p.kl_target, "ppo.kl_target"),
            KeyMap("--kl_horizon", p.kl_horizon, "ppo.kl_horizon"),
        ]
    if p.reward_normalize:
        m.append(KeyMap("--normalize_reward", True, "ppo.reward_normalize"))
    if p.reward_clip is not None:
        m.append(KeyMap("--reward_clip_range", [-p.reward_clip, p.reward_clip], "ppo.reward_clip", unsure=True))
    if p.entropy_coef:
        m.append(KeyMap("--entropy_loss_coef", p.entropy_coef, "ppo.entropy_coef"))
    if p.ptx_coef:
        m.append(KeyMap("--ptx_coef", p.ptx_coef, "ppo.ptx_coef", "needs --pretrain_data", unsure=True))
    skip: list[Unmapped] = []
    if p.reward_source != "rules":
        skip.append(
            Unmapped(
                "ppo.reward_source",
                p.reward_source,
                "lorarl's LoRA reward model is not exported: reward.py holds only the rule rewards",
            )
        )
    skip.append(Unmapped("ppo.vf_coef", p.vf_coef, "OpenRLHF trains the critic with its own optimizer"))
    return m, skip


def openrlhf_mapping(
    recipe: Recipe, paths: dict[str, str], train_rows: int, conversational: bool, label_key: str | None
) -> tuple[list[KeyMap], list[Unmapped]]:
    """``openrlhf.cli.train_ppo_ray`` flags for the recipe (a flag whose value is True is passed bare)."""
    m, skip = _shared_flags(recipe, paths, train_rows, conversational, label_key)
    algo_flags, algo_skip = _grpo_flags(recipe) if recipe.algo == "grpo" else _ppo_flags(recipe)
    return m + algo_flags, skip + algo_skip


# ---------------------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------------------


def launch_arguments(entries: list[KeyMap]) -> list[str]:
    """``--flag value`` per entry: True as a bare flag, False left out, lists as separate words."""
    args = []
    for e in entries:
        if e.value is True:
            args.append(e.engine_key)
        elif e.value is not False:
            value = " ".join(shlex.quote(str(x)) for x in e.value) if isinstance(e.value, list) else shell_word(e.value)
            args.append(f"{e.engine_key} {value}")
    return args


def rows_paragraph(h: HandOff) -> str:
    return (
        f"Rows hold `prompt` and the dataset's columns; `--label_key {h.label_key}` hands "
        "`reward.py:reward_func(queries, prompts, labels)` what it compares with."
    )


def _mapping(h: HandOff) -> tuple[list[KeyMap], list[Unmapped]]:
    label = h.label_key if h.ground_truth or h.has_user_rewards else None
    return openrlhf_mapping(h.recipe, h.paths, len(h.splits["train"]), h.conversational, label)


OPENRLHF = Engine(
    name="openrlhf",
    title="OpenRLHF",
    data_ext="jsonl",
    launcher="openrlhf.cli.train_ppo_ray",
    chat_only=False,
    write_split=_write_split,
    mapping=_mapping,
    launch_arguments=launch_arguments,
    rows_paragraph=rows_paragraph,
    reward_label=lambda h: h.label_key,
)
