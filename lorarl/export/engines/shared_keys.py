"""Recipe settings the verl and OpenRLHF hand-offs treat alike: those applied in the exported files (the data rows,
``reward.py``) and those neither engine carries over, with the reasons. Each engine's mapping starts from these."""

from __future__ import annotations

from lorarl.config import recipe_to_dict
from lorarl.errors import LorarlError
from lorarl.export.engines.common import HandOff, Mapping, recipe_leaves

# data.* keys that shape the rows lorarl reads: their effect is the exported data files
ROW_KEYS = (
    "data.source",
    "data.subset",
    "data.split",
    "data.columns",
    "data.answer_pattern",
    "data.as_chat",
    "data.train_size",
    "data.seed",
    "data.arithmetic.operations",
    "data.arithmetic.digits",
    "data.arithmetic.digits_b",
    "data.arithmetic.prompt_template",
)
HELD_OUT_KEYS = ("data.eval_source", "data.eval_split", "data.eval_size", "eval.n")


def shared_keys(h: HandOff, m: Mapping, train_file: str, test_file: str) -> None:
    """Add the settings both engines treat alike to ``m``."""
    r = h.recipe
    for key in ROW_KEYS:
        m.apply(key, _get(r, key), f"{train_file}, {test_file}: the rows lorarl reads")
    for key in HELD_OUT_KEYS:
        m.apply(key, _get(r, key), f"{test_file}: the first eval.n held-out rows, as `lorarl eval` uses")
    m.apply("data.system_prompt", r.data.system_prompt, "prepended to each prompt's messages in the data files")
    m.apply("reward.functions", [s.name for s in r.reward.functions], "reward.py (weights and kwargs kept)")
    m.skip(
        "data.verifier",
        r.data.verifier,
        "lorarl's accuracy metric; the engines report reward.py's score on the test split instead",
    )
    _reward_source(h, m)
    m.skip("reward.timeout_s", r.reward.timeout_s, "the engines call reward.py without a time limit")
    m.skip(
        "reward.max_failure_fraction",
        r.reward.max_failure_fraction,
        "reward.py scores a raising reward as missing (like lorarl) but never stops the run",
    )
    m.skip(
        "reward.max_failed_steps",
        r.reward.max_failed_steps,
        "the engines never stop a run for a reward that fails on every row",
    )
    m.skip(
        "model.quantization",
        r.model.quantization,
        "the engines train on bf16 weights; an adapter trained on an NF4 base behaves somewhat differently on the "
        "full-precision one (measure it: python -m lorarl.export.gap)",
    )
    m.skip("model.dtype", r.model.dtype, "the engines compute in bf16 (fp32 master weights)")
    m.skip("model.device", r.model.device, "the engines run on the cluster's GPUs")
    for key in ("model.logprob_chunk_size", "model.logprob_chunk_tokens"):
        m.skip(key, _get(r, key), "lorarl's memory layout; the engines have their own")
    m.skip("generation.engine", r.generation.engine, "the engines sample with vLLM (same distribution: T, top_p)")
    for key in (
        "generation.cuda_graphs",
        "generation.eos_check_every",
        "generation.nf4_kernel",
        "generation.keep_cache",
    ):
        m.skip(key, _get(r, key), "lorarl's decoder; vLLM has its own CUDA graphs and stopping")
    m.skip(
        "generation.batch_size",
        r.generation.batch_size,
        "lorarl's decode batches on one card; vLLM schedules its own batches (max_num_seqs)",
    )
    for key, value in recipe_leaves(recipe_to_dict(r)).items():
        if key.startswith("health."):
            m.skip(key, value, "lorarl's run-health checks; the engines log their own metrics, no such alarms")
    m.skip("train.max_nonfinite_in_row", r.train.max_nonfinite_in_row, "no equivalent: the engines do not stop on NaN")
    m.skip(
        "train.deterministic",
        r.train.deterministic,
        "not mapped: distributed vLLM rollouts are not bit-reproducible; verl / OpenRLHF have no one switch for it",
    )
    if r.agent is not None:
        raise LorarlError(
            "the verl / OpenRLHF hand-offs carry single-turn runs only: this recipe has an agent: section (tools), "
            "whose tool loop the exported configuration would not reproduce"
        )
    m.skip("agent", None, "not set: single-turn rollouts, as the engines run them")
    m.skip("eval.batch_size", r.eval.batch_size, "vLLM schedules the evaluation batch itself")
    m.skip(
        "eval.max_new_tokens",
        r.eval.max_new_tokens,
        "the engines evaluate with the training response length (generation.max_new_tokens)",
    )
    if r.model.init_adapter:
        m.skip(
            "model.init_adapter",
            r.model.init_adapter,
            "lorarl's reference was this adapter, frozen; the engine's reference is said at the KL setting",
        )
    else:
        m.skip("model.init_adapter", None, "not set: lorarl's reference was the base (adapters off)")


def _reward_source(h: HandOff, m: Mapping) -> None:
    r = h.recipe
    if r.reward.source == "rules":
        m.apply("reward.source", "rules", "reward.py")
        m.skip("reward.adapter", r.reward.adapter, "unused with reward.source rules")
        m.skip("reward.model_weight", r.reward.model_weight, "unused with reward.source rules")
        return
    why = (
        "lorarl's LoRA reward model (adapter + score head) is not exported: reward.py scores with reward.functions "
        f"({', '.join(s.name for s in r.reward.functions)}) only"
    )
    m.skip("reward.source", r.reward.source, why)
    m.skip("reward.adapter", r.reward.adapter, why)
    m.skip("reward.model_weight", r.reward.model_weight, why)
    h.notes.append(f"reward.source {r.reward.source}: {why}")


def _get(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# grpo.policy_loss's own settings, by the policy loss that reads them
POLICY_LOSS_SETTINGS = {
    "cispo": ("cispo_eps_max",),
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}


def grpo_policy_loss(g, m: Mapping, engine: str) -> None:
    """``grpo.policy_loss`` and its settings: the hand-offs run the engine's PPO clip; CISPO / SAPO / VESPO are not
    carried over (the engines that have one name its parameters their own way)."""
    if g.policy_loss == "clip":
        m.skip("grpo.policy_loss", "clip", f"PPO's clip: {engine}'s default policy loss, as lorarl's")
    else:
        m.skip("grpo.policy_loss", g.policy_loss, f"not mapped: the hand-off runs {engine}'s PPO clip")
    for loss, keys in POLICY_LOSS_SETTINGS.items():
        for key in keys:
            m.skip(f"grpo.{key}", getattr(g, key), f"read by grpo.policy_loss {loss} only (not mapped)")
