"""``lorarl bench agent-turns``: what a 3-turn GRPO step costs against a single-turn step of the same tokens.

Both sides are the real :class:`~lorarl.algos.grpo.GRPO` step (:func:`lorarl.algos.make_algorithm` on a recipe, its
``step`` timed with lorarl's phases, ``time/<phase>``), on the same model, prompts, LoRA and reward, alternating
steps in one process (each side on its own copy of the base, so their adapters and optimizers never meet).

**Why the turns are forced, and how.** A real model under real sampling does not make exactly two tool calls of a
chosen length (the embedded SmolLM2 makes none at all before training), so a bench that waits for the model to call
tools measures whatever lengths it happened to sample and cannot match them with a single-turn step. The turn
*structure* is therefore fixed and everything else is real:

* every token is sampled by the recipe's decode engine (``hf``) with the policy adapter, inside the real turn loop
  (:func:`lorarl.agents.loop.agent_rollout`); the bench's engine (:class:`FixedTurnEngine`) only makes each call
  sample exactly ``L - 1`` tokens (the end-of-turn id is masked for them, transformers' ``min_new_tokens``) and
  then ends the turn with the end-of-turn id, as a stop string would (that one id is not sampled);
* the bench's format (:class:`EveryTurnCalls`) reads every model turn as one call of the bench's tool
  :func:`lookup` with the turn's text as its argument (the real tool call, rendering of the result as the template's
  tool message ids and append); with ``agent.max_turns: 3`` a trajectory is turn 1, tool result, turn 2, tool
  result, turn 3 (whose call is left unanswered at ``max_turns``: the loop marks it truncated, which GRPO only
  counts, ``grpo.mask_truncated`` being off). :func:`lookup` returns a fixed text so every tool message has the same
  ``S`` ids;
* the single-turn step samples ``3 L - 1`` tokens then the end-of-turn id, after a prompt that is the multi-turn
  prompt **plus the same two tool messages** (``P + 2 S`` ids). Both steps then train on sequences of exactly
  ``P + 2 S + 3 L`` ids with ``3 L`` loss tokens per row; the multi-turn side sampled ``3 (L - 1)`` of them, the
  single-turn side ``3 L - 1`` (2 tokens per row apart: the extra forced end-of-turn ids);
* the reward (:func:`text_spread`) is a fixed hash of the final turn's text in ``[0, 1)``: it has spread in every
  group, so every row is trained (lorarl skips rows whose advantage is exactly 0) on both sides.

So the difference between the two steps is what multi-turn costs: three engine calls instead of one, the tool call
and rendering between them, and the prefill of each turn. With ``agent.reuse_kv`` (the default) the engine keeps
every row's keys / values between turns and turn ``k + 1`` prefills only the ids appended since (the tool message
and the ids not fed back yet); with ``--no-reuse-kv`` it prefills the whole ``prompt + trajectory`` of each row again
(only turn 1 shares each prompt's prefill over its group). Reported per side (means over the timed steps, after one
warm-up pair): seconds per step and per phase (``generation``, ``scoring``, ``rewards``, ``training``, ...), the
engine's seconds per call (turn), the generation time outside the engine (tools, parsing, rendering), the context
tokens the engine prefilled and those it reused, and, measured after the steps on the last step's own contexts, the
seconds a full-context prefill of each engine call takes (:func:`prefill_seconds`: what ``--no-reuse-kv`` pays per
turn); ratios are multi / single. The last stdout line is the result as JSON.

    python -m lorarl.bench.agent_turns --steps 3           # = lorarl bench agent-turns --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no busy-waiting OpenMP threads

TURNS = 3
TOOL_REPLY = "result: 42 (from the bench's lookup tool)"


# ---- the bench's tool, reward and format ------------------------------------------------------------------------
def lookup(query: str) -> str:
    """Look a query up (the bench's tool: the same reply every time, so every tool message has the same length).

    Args:
        query: what to look up
    """
    return TOOL_REPLY


def text_spread(prompts, completions, **kwargs) -> list[float]:
    """A reward with spread in every group: ``crc32(text) mod 1000 / 1000`` of each completion's text (TRL's
    signature; a conversational completion is ``[{"role": "assistant", "content": text}]``)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(zlib.crc32(t.encode()) % 1000) / 1000 for t in texts]


class EveryTurnCalls:
    """A tool format that reads every model turn as one call of :func:`lookup` (the turn's text as its query);
    everything else (the prompt, the tool messages) is the wrapped format's."""

    def __init__(self, base) -> None:
        self.base = base
        self.name = f"every-turn-calls({base.name})"

    def parse(self, text: str):
        from lorarl.agents.formats import ParsedTurn, ToolCall

        return ParsedTurn(calls=[ToolCall("lookup", {"query": text[:200]})])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


# ---- the bench's engine -------------------------------------------------------------------------------------------
class _NoEarlyEnd:
    """``shared`` whose ``generate`` never samples an end-of-turn id (``min_new_tokens = max_new_tokens``)."""

    def __init__(self, shared) -> None:
        self._shared = shared

    def generate(self, input_ids, attention_mask, **kwargs):
        kwargs.pop("min_length", None)  # (transformers warns when both are set)
        return self._shared.generate(input_ids, attention_mask, min_new_tokens=kwargs["max_new_tokens"], **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


@dataclass
class EngineCall:
    """One engine call: the contexts it continued (``group`` rows each), the seconds, the ids it sampled."""

    contexts: list[list[int]]
    group: int
    seconds: float
    sampled: int


@dataclass
class FixedTurnEngine:
    """Each call: ``tokens - 1`` ids sampled by ``inner`` (the real engine) with the end-of-turn id masked, then the
    end-of-turn id. Records every call (:class:`EngineCall`)."""

    inner: Any
    tokens: int
    calls: list[EngineCall] = field(default_factory=list)
    name: str = "fixed-turn"

    def sample(self, shared, prompts, group_size, generation, *, max_new_tokens=None, record_logprobs=False, **kw):
        import torch

        from lorarl.errors import LorarlError
        from lorarl.rollout.engines import Sampled

        if (max_new_tokens or generation.max_new_tokens) < self.tokens:
            raise LorarlError(
                f"bench agent-turns: a call allows {max_new_tokens} tokens, the bench needs {self.tokens}"
            )
        sync(shared.device)
        t0 = time.perf_counter()
        out = self.inner.sample(
            _NoEarlyEnd(shared),
            prompts,
            group_size,
            generation,
            max_new_tokens=self.tokens - 1,
            record_logprobs=record_logprobs,
            **kw,
        )
        sync(shared.device)
        ids = out.completion_ids[:, : self.tokens - 1]
        n = ids.shape[0]
        self.calls.append(EngineCall([list(p) for p in prompts], group_size, time.perf_counter() - t0, ids.numel()))
        eos = torch.full((n, 1), shared.eos_ids[0], dtype=torch.long)
        lps = out.sampler_logprobs
        if lps is not None:
            lps = torch.cat([lps[:, : self.tokens - 1], torch.zeros(n, 1)], dim=1)
        return Sampled(torch.cat([ids, eos], dim=1), lps)

    def reusing_kv(self):
        """The inner engine's scope of keys / values kept between calls (:mod:`lorarl.rollout.prefix_kv`)."""
        return self.inner.reusing_kv()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- the recipes and the two algorithms -------------------------------------------------------------------------
def bench_recipe(
    model: str, multi: bool, prompts: int, group: int, turn_tokens: int, dtype: str, reuse_kv: bool = True
) -> Any:
    """The GRPO recipe of one side: the multiplication task's prompts, LoRA r 16, the :func:`text_spread` reward,
    ``turn_tokens`` per turn (multi, 3 turns; keys / values kept between turns unless ``reuse_kv`` is off) or
    ``3 turn_tokens`` (single), one micro-batch."""
    from lorarl.config import recipe_from_dict

    here = "lorarl.bench.agent_turns"
    d: dict[str, Any] = {
        "algo": "grpo",
        "model": {"name": model, "quantization": "none", "dtype": dtype, "gradient_checkpointing": False},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {
            "source": "arithmetic",
            "arithmetic": {"operations": ["*"], "digits": 3, "digits_b": 2, "prompt_template": "What is {a} {op} {b}?"},
            "train_size": 200,
            "seed": 1234,
        },
        "reward": {"functions": [{"name": f"{here}:text_spread"}]},
        "generation": {"max_new_tokens": turn_tokens if multi else TURNS * turn_tokens, "temperature": 1.0},
        "train": {
            "steps": 100,
            "prompts_per_step": prompts,
            "micro_batch_size": prompts * group,
            "learning_rate": 1e-5,
            "seed": 0,
            "save_every": 0,
        },
        "grpo": {"group_size": group, "kl": {"coef": 0.0}, "num_iterations": 1},
    }
    if multi:
        d["agent"] = {
            "tools": [f"{here}:lookup"],
            "max_turns": TURNS,
            "max_tokens_per_turn": turn_tokens,
            "max_total_tokens": 4096,
            "reuse_kv": reuse_kv,
        }
    return recipe_from_dict(d, where="<bench agent-turns>")


@dataclass
class Side:
    """One side of the bench: its algorithm, engine, and what its steps recorded."""

    name: str
    algo: Any
    engine: FixedTurnEngine
    agent: Any = None  # the multi-turn side's resolved agent
    last: Any = None  # the last StepRollout
    steps: list[dict] = field(default_factory=list)


def make_side(name: str, recipe, engine_name: str, tokens: int) -> Side:
    """The real GRPO algorithm on a fresh base, its rollout function given the bench's engine."""
    from lorarl.algos import make_algorithm
    from lorarl.model import SharedBase
    from lorarl.rollout.registry import make_engine

    algo = make_algorithm(recipe, SharedBase.load(recipe.model))
    side = Side(name, algo, FixedTurnEngine(make_engine(engine_name), tokens))
    chosen = algo.rollout_fn

    def rollout_fn(prompt_index, **kw):
        side.last = chosen(prompt_index, engine=side.engine, **kw)
        return side.last

    if hasattr(chosen, "agent"):  # the multi-turn rollout function exposes its agent
        side.agent = chosen.agent
        side.agent.fmt = EveryTurnCalls(side.agent.fmt)
    algo.rollout_fn = rollout_fn
    return side


def timed_step(side: Side, step: int) -> dict:
    """One ``GRPO.step``: wall seconds, phases, engine calls, and the counts read from its trajectories."""
    import torch

    from lorarl.phases import recording

    side.engine.calls = []
    torch.manual_seed(step)
    sync(side.algo.shared.device)
    t0 = time.perf_counter()
    with recording() as phases:
        metrics = side.algo.step(side.algo.batch(step))
    sync(side.algo.shared.device)
    wall = time.perf_counter() - t0
    r = side.last.rollout
    lm = r.loss_mask
    starts = lm & ~torch.nn.functional.pad(lm[:, :-1], (1, 0))  # first token of each run of model tokens
    return {
        "seconds": wall,
        "phases": dict(phases.seconds),
        "engine_seconds": [c.seconds for c in side.engine.calls],
        "engine_sampled": [c.sampled for c in side.engine.calls],
        "turns_per_row": starts.sum(1).tolist(),
        "tool_calls": side.last.metrics.get("agent/tool_calls", 0),
        "loss_tokens": int(lm.sum()),
        "completion_positions": int(r.completion_mask.sum()),  # where the trainer computes logits (tool ids too)
        "sampled_tokens": sum(c.sampled for c in side.engine.calls),
        "sequence_lengths": (r.prompt_mask.sum(1) + r.completion_mask.sum(1)).tolist(),
        "rows": len(r),
        "loss": metrics.get("loss"),
        "prefill_tokens": side.last.metrics.get("agent/prefill_tokens"),
        "kv_reused_tokens": side.last.metrics.get("agent/kv_reused_tokens"),
    }


def prefill_seconds(side: Side, repeats: int = 3) -> list[float]:
    """For each engine call of ``side``'s last step: the best of ``repeats`` timings of a prefill forward of its
    whole contexts with the policy adapter (the unique prompts for a call that shares them over its group, as the
    hf engine prefills them; every row's full context otherwise): what each call costs without kept keys / values."""
    import torch

    from lorarl.model.tokens import pad_left
    from lorarl.rollout.engines import prefill_cache

    shared = side.algo.shared
    out = []
    with torch.no_grad(), shared.role("policy", train=False):
        for call in side.engine.calls:
            ids, mask = pad_left(call.contexts, shared.pad_id)
            best = float("inf")
            for _ in range(repeats):
                sync(shared.device)
                t0 = time.perf_counter()
                prefill_cache(shared, ids, mask)
                sync(shared.device)
                best = min(best, time.perf_counter() - t0)
            out.append(best)
    return out


def summary(steps: list[dict]) -> dict:
    """Means over the timed steps (the warm-up left out by the caller)."""
    mean = statistics.fmean
    names = sorted({k for s in steps for k in s["phases"]})
    gen = mean(s["phases"].get("generation", 0.0) for s in steps)
    engine = mean(sum(s["engine_seconds"]) for s in steps)
    last = steps[-1]
    return {
        "s_per_step": mean(s["seconds"] for s in steps),
        "phases_s": {n: mean(s["phases"].get(n, 0.0) for s in steps) for n in names},
        "engine_s_per_call": [mean(s["engine_seconds"][i] for s in steps) for i in range(len(last["engine_seconds"]))],
        "engine_s": engine,
        "generation_outside_engine_s": gen - engine,
        "turns_per_row": last["turns_per_row"],
        "tool_calls": last["tool_calls"],
        "rows": last["rows"],
        "sampled_tokens": last["sampled_tokens"],
        "loss_tokens": last["loss_tokens"],
        "completion_positions": last["completion_positions"],
        "sequence_lengths": last["sequence_lengths"],
        "prefill_tokens": last.get("prefill_tokens"),
        "kv_reused_tokens": last.get("kv_reused_tokens"),
        "step_seconds": [round(s["seconds"], 3) for s in steps],
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def run(
    model: str = "smollm2-135m",
    steps: int = 3,
    prompts: int = 2,
    group: int = 4,
    turn_tokens: int = 16,
    engine: str = "hf",
    out: Path | None = None,
    reuse_kv: bool = True,
) -> dict:
    """The bench (module docstring): one warm-up pair of steps, then ``steps`` pairs (multi, then single);
    prints the figures; returns the result."""
    import torch

    from lorarl.bench.procs import bench_threads, device_and_dtype, machine_description
    from lorarl.errors import LorarlError

    if steps < 1 or turn_tokens < 2:
        raise LorarlError("bench agent-turns: --steps must be >= 1 and --turn-tokens >= 2")
    torch.set_num_threads(bench_threads())
    _, dtype = device_and_dtype()
    multi = make_side(
        "multi", bench_recipe(model, True, prompts, group, turn_tokens, dtype, reuse_kv), engine, turn_tokens
    )
    single = make_side(
        "single", bench_recipe(model, False, prompts, group, turn_tokens, dtype), engine, TURNS * turn_tokens
    )
    suffix = multi.agent.renderer.tool_suffix_ids([("lookup", TOOL_REPLY)])  # one tool message's ids
    for step in range(1, steps + 2):
        m = timed_step(multi, step)
        r = multi.last.rollout
        for row, i in enumerate(r.prompt_index):  # the single-turn prompt: the same prompt + the two tool messages
            single.algo.prompts.token_ids[i] = r.prompt_ids[row][r.prompt_mask[row]].tolist() + suffix * (TURNS - 1)
        s = timed_step(single, step)
        if step > 1:  # step 1 warms up
            multi.steps.append(m)
            single.steps.append(s)
        print(f"step {step}: multi {m['seconds']:.2f}s single {s['seconds']:.2f}s", flush=True)
    res = {"multi": summary(multi.steps), "single": summary(single.steps)}
    for side, key in ((multi, "multi"), (single, "single")):
        res[key]["prefill_s_per_call"] = prefill_seconds(side)
        res[key]["prefill_s"] = sum(res[key]["prefill_s_per_call"])
    mu, si = res["multi"], res["single"]
    result = {
        "bench": "agent-turns",
        "model": model,
        "settings": {
            "turns": TURNS,
            "turn_tokens": turn_tokens,
            "prompts": prompts,
            "group": group,
            "engine": engine,
            "timed_steps": steps,
            "tool_message_ids": len(suffix),
            "reuse_kv": reuse_kv,
        },
        **res,
        "ratio_step": ratio(mu["s_per_step"], si["s_per_step"]),
        "ratio_generation": ratio(mu["phases_s"].get("generation", 0), si["phases_s"].get("generation", 0)),
        "ratio_training": ratio(mu["phases_s"].get("training", 0), si["phases_s"].get("training", 0)),
        "extra_s": mu["s_per_step"] - si["s_per_step"],
        "extra_prefill_s": mu["prefill_s"] - si["prefill_s"],
        "extra_outside_engine_s": mu["generation_outside_engine_s"] - si["generation_outside_engine_s"],
        "threads": torch.get_num_threads(),
        "machine": machine_description(),
    }
    print(format_table(result), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    """The markdown table of both sides' per-step seconds and their ratio."""
    mu, si = result["multi"], result["single"]
    rows = [("step", mu["s_per_step"], si["s_per_step"])]
    for name in sorted(set(mu["phases_s"]) | set(si["phases_s"])):
        rows.append((f"  {name}", mu["phases_s"].get(name, 0.0), si["phases_s"].get(name, 0.0)))
    rows += [
        ("  engine calls (generation)", mu["engine_s"], si["engine_s"]),
        ("  generation outside the engine", mu["generation_outside_engine_s"], si["generation_outside_engine_s"]),
        ("  full-context prefill forwards (measured after)", mu["prefill_s"], si["prefill_s"]),
    ]
    out = [f"| seconds per step | {TURNS} turns | 1 turn | ratio |", "|---|---|---|---|"]
    for label, a, b in rows:
        out.append(f"| {label} | {a:.3f} | {b:.3f} | {ratio(a, b) if b > 1e-4 else '-'} |")
    per_call = ", ".join(f"{x:.3f}" for x in mu["engine_s_per_call"])
    pre = ", ".join(f"{x:.3f}" for x in mu["prefill_s_per_call"])
    out.append(f"multi-turn engine s per turn: {per_call}; a full-context prefill of each turn: {pre}")
    reuse = "kept between turns" if result["settings"].get("reuse_kv", True) else "not kept (--no-reuse-kv)"
    out.append(
        f"multi-turn keys / values {reuse}: context tokens prefilled {mu.get('prefill_tokens')}, reused "
        f"{mu.get('kv_reused_tokens')}"
    )
    out.append(
        f"turns per row {sorted(set(mu['turns_per_row']))} vs {sorted(set(si['turns_per_row']))}; tool calls "
        f"{mu['tool_calls']}; sampled tokens {mu['sampled_tokens']} vs {si['sampled_tokens']}; loss tokens "
        f"{mu['loss_tokens']} vs {si['loss_tokens']}; sequence lengths {sorted(set(mu['sequence_lengths']))} vs "
        f"{sorted(set(si['sequence_lengths']))}"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lorarl bench agent-turns", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=3, help="timed step pairs after one warm-up pair")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="trajectories per prompt")
    p.add_argument("--turn-tokens", type=int, default=16, help="tokens per model turn (L)")
    p.add_argument("--engine", choices=["hf"], default="hf")
    p.add_argument(
        "--no-reuse-kv",
        action="store_true",
        help="multi-turn side: prefill each turn's whole context (agent.reuse_kv off)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else None
    result = run(a.model, a.steps, a.prompts, a.group, a.turn_tokens, a.engine, out, not a.no_reuse_kv)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
