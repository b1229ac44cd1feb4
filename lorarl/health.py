"""Health checks that make the silent failures of RL fine-tuning loud on the step they happen, each logged in
``metrics.jsonl`` (``health/...``) and each with an off switch in the recipe's ``health`` section:

* **generator / trainer parity** (``health.parity_every``): on step 1 and every N steps the rollout records the
  log-prob the sampler drew each token with, and the policy scores a few rows exactly as the update does (train
  mode, dropout off, the training forward path). Above ``health.parity_tolerance`` (mean |delta| nats per token;
  by default set by the model's precision, :data:`PARITY_TOLERANCE`) the run stops, saying what differs: a stale
  adapter, a logits processor, a kernel difference -- unless ``grpo.tis`` / ``ppo.tis`` (``mode: auto``, the
  default) trains through it with truncated importance sampling (:mod:`lorarl.algos.tis`), which is then a warning.
* **the adapter is learning** (``health.learning_after``): after N steps that updated, the trained adapter must
  have moved (a fresh LoRA's B matrices start at 0); if not, a loud warning with the likely causes.
* **no signal** (``health.no_signal_steps``): when most groups have zero reward spread N steps in a row, GRPO
  (and RLOO, whose leave-one-out advantages are then 0) learns nothing; a warning says what to change.
* **reward hacking / length drift** (``health.alarm_window``, ``health.length_drift``): training reward rising
  while held-out accuracy falls over the last evaluations (``eval.every``), or completion length far from where
  it started.
* **preferred answers losing likelihood** (``health.chosen_falling_steps``; DPO, KTO): ``rewards/chosen`` below 0
  step after step -- the policy makes the chosen / desirable answers less likely than the reference does and wins
  its loss by pushing the rejected ones down faster (likelihood displacement, Razin et al. 2024, arXiv:2410.08847;
  plain DPO's collapse to a bare wrong number on the arithmetic pairs at lr 2e-3 kept 0.98 preference accuracy).

:func:`parity_metrics` is called by the algorithms (it needs the rollout); :class:`HealthMonitor` by the run loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lorarl.errors import LorarlError

PARITY_MEAN, PARITY_MAX = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"
TIS_ACTIVE = "sampling/tis_active"  # 1 while the update corrects a sampler / trainer mismatch (lorarl.algos.tis)

# health.parity_tolerance when the recipe leaves it null: mean |delta log-prob| per token (nats) by the precision the
# base runs in. Sampler and trainer compute the same function with differently shaped kernels (one token with a KV
# cache vs the whole sequence), so they differ by rounding. Measured on CPU (docs/grpo_options.md; SmolLM2-135M,
# 64 completions): fp32 8.6e-6 (max 3.1e-5); bf16 with HF generate 0.037 (max 0.34; the bf16 forward itself is 0.041
# from fp32); fp16 8.1e-6 (fp16 itself 0.0049 from fp32). fp32: 1e-3, ~100x its noise; bf16: 0.1, ~2.7x its noise;
# fp16: 0.05, ~10x its own rounding; NF4 computes in bf16: bf16's. GPU kernels (cuBLAS, flash attention) are not
# measured here: `lorarl bench gpu` reports the gap of a GPU run.
PARITY_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05, "nf4": 0.1}


def base_precision(recipe, device_type: str) -> str:
    """The precision ``recipe.model`` runs in on ``device_type``: ``nf4``, or its dtype (``auto``: NF4 and bf16 on
    CUDA, fp32 without quantization on CPU). A key of :data:`PARITY_TOLERANCE`."""
    m, cuda = recipe.model, device_type == "cuda"
    quant = ("nf4" if cuda else "none") if m.quantization == "auto" else m.quantization
    dtype = ("bfloat16" if cuda else "float32") if m.dtype == "auto" else m.dtype
    return "nf4" if quant == "nf4" else dtype


def parity_tolerance(recipe, device_type: str) -> float:
    """``health.parity_tolerance``, or when null the :data:`PARITY_TOLERANCE` of :func:`base_precision`."""
    if recipe.health.parity_tolerance is not None:
        return recipe.health.parity_tolerance
    return PARITY_TOLERANCE[base_precision(recipe, device_type)]


def graph_fallback_warning(row: dict) -> str | None:
    """A warning when the fast engine could not capture its decode step as a CUDA graph and decoded eagerly (the
    same tokens, slower): from the ``rollout/graph_capture_failures`` / ``rollout/eager_fallbacks`` counters the run
    loop logs (:func:`lorarl.rollout.fast.engine_metrics`)."""
    failures, eager = row.get("rollout/graph_capture_failures") or 0, row.get("rollout/eager_fallbacks") or 0
    if not failures and not eager:
        return None
    reason = row.get("rollout/graph_capture_error")
    return (
        f"CUDA graphs: {failures} capture(s) failed, {eager} decode batch(es) ran eagerly (same tokens, slower)"
        + (f"; last error: {reason}" if reason else "")
        + ". Run `lorarl bench rollout` to see which shapes fail, or set generation.cuda_graphs: false"
    )


def parity_due(every: int, step: int) -> bool:
    """Whether step ``step`` checks generator / trainer parity: step 1 and every ``every`` steps (0: never)."""
    return every > 0 and (step == 1 or step % every == 0)


def logprob_gap(sampler: Tensor, trainer: Tensor, mask: Tensor) -> dict[str, float]:
    """``{mean_abs, max_abs, tokens}`` of ``|sampler - trainer|`` over the masked tokens (both ``[N, T]`` log-probs
    of the same sampled tokens).

    Example: sampler ``[[-1.0, -2.0]]``, trainer ``[[-1.1, -2.0]]``, mask all -> ``mean_abs 0.05, max_abs 0.1``.
    """
    m = mask.bool()
    d = (sampler.float() - trainer.float()).abs()[m]
    if d.numel() == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0, "tokens": 0}
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.numel())}


@torch.no_grad()
def parity_metrics(shared, rollout, role: str, temperature: float, rows: int) -> dict[str, float]:
    """Score the first ``rows`` rows of ``rollout`` with ``role`` exactly as the update's forward does (train mode,
    dropout off, the same log-prob path) and compare with the log-probs the sampler recorded.
    Returns TRL's ``sampling/sampling_logp_difference/mean`` and ``.../max`` (the same quantity) and
    ``health/parity_tokens``."""
    from lorarl.model.logprobs import completion_logprobs

    if rollout.sampler_logprobs is None:
        raise ValueError("the rollout recorded no sampler log-probs (generate_rollout(..., record_sampler=True))")
    sub = rollout.select(slice(0, min(rows, len(rollout))))
    with shared.role(role, train=True):
        lp, _ = completion_logprobs(shared, sub, temperature)
    gap = logprob_gap(sub.sampler_logprobs.to(lp.device), lp, sub.loss_mask.to(lp.device))  # model tokens
    return {
        "sampling/sampling_logp_difference/mean": gap["mean_abs"],
        "sampling/sampling_logp_difference/max": gap["max_abs"],
        "health/parity_tokens": gap["tokens"],
    }


def parity_failure(mean_abs: float, max_abs: float, tolerance: float) -> str | None:
    """The message that stops a run whose sampler and trainer disagree (None when within ``tolerance``)."""
    if not mean_abs > tolerance:
        return None
    return (
        f"generator / trainer parity failed: the log-probs the sampler drew tokens with and those the update "
        f"computes differ by {mean_abs:.4f} nats per token on average (max {max_abs:.3f}; health.parity_tolerance="
        f"{tolerance:g}). The update would optimise a distribution that did not generate the data. Likely causes: "
        "the generator runs a stale or different adapter; a logits processor the trainer does not apply; a kernel "
        "or precision difference between decoding and the training forward (compare generation.engine: hf). To "
        "train through a precision difference, set grpo.tis.mode (ppo.tis.mode): always (truncated importance "
        "sampling); health.parity_every: 0 runs anyway without a check."
    )


def nonfinite_weights_error(params: list[Tensor]) -> str | None:
    """Why the trained weights cannot be kept, or None: ``n`` of ``N`` entries NaN or inf (a step of
    ``train.learning_rate`` large enough to overflow; the non-finite-gradient guard only sees gradients). Example:
    one tensor ``[1.0, inf]`` -> ``"1 of 2 trained weights are NaN or inf after the update; ..."``."""
    bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    if not bad:
        return None
    total = sum(p.numel() for p in params)
    return (
        f"{bad} of {total} trained weights are NaN or inf after the update; the run stops (lower train.learning_rate; "
        "the newest checkpoint holds the last finite adapter)"
    )


@dataclass
class HealthMonitor:
    """Watches the metric rows of a run (and the trained adapter's weights); returns warnings, raises on failure."""

    parity_tolerance: float = 0.05
    learning_after: int = 5
    no_signal_steps: int = 5
    no_signal_fraction: float = 0.9
    alarm_window: int = 3
    length_drift: float = 2.0
    chosen_falling_steps: int = 5
    start_weights: list[Tensor] | None = None
    updated_steps: int = 0
    no_signal_run: int = 0
    falling_run: int = 0
    warned: set[str] = field(default_factory=set)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train reward, held-out accuracy)
    rewards_since_eval: list[float] = field(default_factory=list)
    first_lengths: list[float] = field(default_factory=list)

    @classmethod
    def from_recipe(cls, recipe, params: list[Tensor]) -> HealthMonitor:
        h = recipe.health
        return cls(
            parity_tolerance=parity_tolerance(recipe, params[0].device.type if params else "cpu"),
            learning_after=h.learning_after,
            no_signal_steps=h.no_signal_steps,
            no_signal_fraction=h.no_signal_fraction,
            alarm_window=h.alarm_window,
            length_drift=h.length_drift,
            chosen_falling_steps=h.chosen_falling_steps,
            start_weights=[p.detach().clone() for p in params],
        )

    def check(self, step: int, row: dict, params: list[Tensor]) -> list[str]:
        """Check one step's metrics; add ``health/...`` values to ``row``; return new warnings (each said once).
        Trained weights that are NaN or inf after the step stop the run (:func:`nonfinite_weights_error`)."""
        msg = nonfinite_weights_error(params)
        if msg:
            raise LorarlError(f"step {step}: {msg}")
        corrected = None
        if PARITY_MEAN in row:
            msg = parity_failure(row[PARITY_MEAN], row[PARITY_MAX], self.parity_tolerance)
            if msg and not row.get(TIS_ACTIVE):
                raise LorarlError(f"step {step}: {msg}")
            if msg:  # the algorithm trains through it with truncated importance sampling (tis.mode auto / always)
                corrected = (
                    f"parity corrected: the sampler's log-probs differ from the trainer's by {row[PARITY_MEAN]:.4f} "
                    f"nats per token (tolerance {self.parity_tolerance:g}); the update is weighted by truncated "
                    "importance sampling (sampling/importance_sampling_ratio/*). If the gap keeps growing, look for a "
                    "stale adapter or a logits processor the trainer does not apply"
                )
        checks = (self._learning(step, row, params), self._no_signal(row), self._drift(row), self._falling(row))
        warnings = [w for w in checks if w]
        warnings += [corrected] if corrected else []
        warnings += [w for w in (graph_fallback_warning(row),) if w]
        warnings += self._hacking(step, row)
        fresh = [w for w in warnings if w.split(":")[0] not in self.warned]
        self.warned |= {w.split(":")[0] for w in fresh}
        if fresh:
            row["health/warning"] = " | ".join(fresh)
        return fresh

    def _learning(self, step: int, row: dict, params: list[Tensor]) -> str | None:
        """The adapter moved at all? Checked once, after ``learning_after`` steps that ran an update."""
        if self.learning_after <= 0 or not self.start_weights:
            return None
        if row.get("updates", row.get("trained_rows", 1)):
            self.updated_steps += 1
        moved = math.sqrt(sum(float((p.detach() - s).pow(2).sum()) for p, s in zip(params, self.start_weights)))
        row["health/adapter_delta"] = moved
        if self.updated_steps < self.learning_after or moved > 0:
            return None
        grad = row.get("grad_norm", row.get("policy_grad_norm"))
        return (
            f"adapter not learning: after {self.updated_steps} steps with updates the trained adapter has not moved "
            f"(weight change 0, last gradient norm {grad}). Likely causes: train.learning_rate too small or 0 after "
            "the schedule; lora.target_modules matching no layer; every group with equal rewards (zero advantage)"
        )

    def _no_signal(self, row: dict) -> str | None:
        frac = row.get("frac_reward_zero_std")
        if self.no_signal_steps <= 0 or frac is None:
            return None
        self.no_signal_run = self.no_signal_run + 1 if frac >= self.no_signal_fraction else 0
        if self.no_signal_run < self.no_signal_steps:
            return None
        return (
            f"no signal: {frac:.0%} of the groups had zero reward spread for {self.no_signal_run} steps in a row, so "
            "GRPO / RLOO have nothing to learn from. Change: a larger grpo.group_size (rloo.group_size); a higher "
            "generation.temperature; an easier task or an SFT cold start (lorarl pipeline); a partial-credit reward "
            "(partial_credit, format)"
        )

    def _falling(self, row: dict) -> str | None:
        """DPO / KTO: the preferred answers' implicit reward below 0 for ``chosen_falling_steps`` steps in a row."""
        chosen = row.get("rewards/chosen")
        if self.chosen_falling_steps <= 0 or not isinstance(chosen, (int, float)) or not math.isfinite(chosen):
            return None
        self.falling_run = self.falling_run + 1 if chosen < 0 else 0
        if self.falling_run < self.chosen_falling_steps:
            return None
        return (
            f"chosen falling: rewards/chosen (beta x the preferred / desirable answers' log-ratio to the reference) has "
            f"been below 0 for {self.falling_run} steps in a row ({chosen:.3f} now): the policy makes those answers "
            "LESS likely than the reference does and wins its loss by pushing the rejected ones down faster. If the "
            "held-out task accuracy falls, lower train.learning_rate, raise the beta, or keep the preferred answers "
            "up: DPO dpo.loss_type [sigmoid, sft]; KTO a larger kto.desirable_weight"
        )

    def _drift(self, row: dict) -> str | None:
        length = row.get("completions/mean_length")
        if self.length_drift <= 0 or length is None:
            return None
        if len(self.first_lengths) < 5:
            self.first_lengths.append(float(length))
            return None
        start = sum(self.first_lengths) / len(self.first_lengths)
        ratio = float(length) / max(start, 1e-9)
        row["health/length_ratio"] = ratio
        if 1 / self.length_drift <= ratio <= self.length_drift:
            return None
        return (
            f"length drift: mean completion length {length:.1f} tokens is {ratio:.2f}x the first steps' {start:.1f} "
            f"(health.length_drift={self.length_drift:g}); check for reward hacking through length"
        )

    def _hacking(self, step: int, row: dict) -> list[str]:
        reward = row.get("reward")
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            self.rewards_since_eval.append(float(reward))
        acc = row.get("eval/accuracy")
        if self.alarm_window <= 1 or acc is None or not self.rewards_since_eval:
            return []
        mean_reward = sum(self.rewards_since_eval) / len(self.rewards_since_eval)  # training reward since last eval
        self.rewards_since_eval = []
        self.evals.append((step, mean_reward, float(acc)))
        window = self.evals[-self.alarm_window :]
        if len(window) < self.alarm_window:
            return []
        reward_up = window[-1][1] > window[0][1]
        acc_down = all(b[2] < a[2] for a, b in zip(window, window[1:]))
        if not (reward_up and acc_down):
            return []
        return [
            f"reward hacking?: training reward rose {window[0][1]:.3f} -> {window[-1][1]:.3f} while held-out "
            f"accuracy fell {window[0][2]:.3f} -> {window[-1][2]:.3f} over the last {len(window)} evaluations "
            f"(steps {window[0][0]}-{window[-1][0]}); look at the completions (lorarl chat) and the reward"
        ]

    def state_dict(self) -> dict:
        """What a resumed run needs to keep warning as an uninterrupted one would (the weights' starting point is
        not kept: the run loop builds the monitor from the seeded set-up's weights, before the checkpoint loads)."""
        return {
            "updated_steps": self.updated_steps,
            "no_signal_run": self.no_signal_run,
            "falling_run": self.falling_run,
            "warned": sorted(self.warned),
            "evals": [list(e) for e in self.evals],
            "rewards_since_eval": self.rewards_since_eval,
            "first_lengths": self.first_lengths,
        }

    def load_state_dict(self, state: dict) -> None:
        self.updated_steps, self.no_signal_run = int(state["updated_steps"]), int(state["no_signal_run"])
        self.falling_run = int(state.get("falling_run", 0))  # (checkpoints written before the check have none)
        self.warned = set(state["warned"])
        self.evals = [tuple(e) for e in state["evals"]]
        self.rewards_since_eval = list(state["rewards_since_eval"])
        self.first_lengths = list(state["first_lengths"])
        if self.updated_steps >= self.learning_after:
            self.warned.add("adapter not learning")  # checked before the interruption
