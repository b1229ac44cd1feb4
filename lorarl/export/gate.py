"""The fidelity gate: does the exported artefact, run by its own runtime, behave like the model that trained?

On ``n`` held-out prompts of the run (the recipe's held-out split; its training prompts when it has none), the
training model (:class:`.runtimes.TrainingRuntime`: the policy adapter on the training base, NF4 where the recipe
trains NF4 on this device) and the export (:func:`.runtimes.export_runtime`: merged in transformers, adapter in PEFT,
GGUF in llama.cpp) each decode greedily from the same prompt token ids. Measured:

- ``greedy_agreement``: the fraction of prompts whose two completions decode to the identical text. A completion is
  the generated ids up to and including the first EOS id (at most ``max_new_tokens``), decoded with the export's
  tokenizer with special tokens dropped: which EOS id ended it does not count, every other character does
  (whitespace included, nothing stripped). ``token_agreement`` is the stricter figure: identical ids, EOS included.
- ``accuracy_trained`` / ``accuracy_export`` / ``accuracy_delta``: the task's own verifier
  (:func:`lorarl.tasks.accuracy`) on each model's completions, when the prompts carry answers.
- ``logprob_mean_abs_delta`` / ``logprob_max_abs_delta``: ``|log p_train(t) - log p_export(t)|`` over every token
  ``t`` of the training model's greedy completions, each model teacher-forced on the same ids (temperature 1);
  ``top1_agreement``: the fraction of those positions where both models' argmax token is the same.
- a run with an ``agent`` section (tools): each model runs the run's prompt format, tools and greedy turn loop
  (:mod:`.agent_gate`); a completion is then the whole trajectory (turns and tool messages), accuracy is the final
  answer's, the log-probs are those of the training model's trajectory, and ``agent`` holds each model's turn and
  tool-call counts;
- for a GGUF in llama.cpp, ``tokenizer_agreement``: the fraction of prompt texts the GGUF's own tokenizer turns into
  exactly the ids the training tokenizer made (what a llama.cpp / Ollama user's prompt becomes).

:func:`run_gate` returns the report (written as ``gate.json`` and a model-card section by the export);
:func:`check_gate` fails an export below a minimum agreement (``--gate``), and the default only warns.
Standalone: ``python -m lorarl.export.gate RUN_DIR EXPORT [--format gguf] [--n 64]`` prints the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lorarl.config import Recipe
from lorarl.errors import LorarlError
from lorarl.export.source import RunSource, locate

DEFAULT_N = 64
WARN_BELOW = 0.95  # without --gate, an agreement below this prints a warning (and is noted in the card)
EXAMPLES = 3  # disagreeing prompts kept in the report


def gate_prompts(src: RunSource, recipe: Recipe, tok: Any, n: int, rows: list | None = None) -> tuple[Any, str]:
    """The first ``n`` held-out prompts of the run (a :class:`lorarl.data.PromptSet`) and where they came from;
    ``rows`` (strings, chat-message lists or rows with ``prompt`` and ``answer``) replace them when given."""
    from lorarl.data import PromptSet, encode_prompt, load_prompts, prompt_text

    if rows is not None:
        rows = [dict(r) if isinstance(r, dict) else {"prompt": r} for r in rows]
        texts = [prompt_text(r["prompt"], tok, recipe.data.system_prompt, i) for i, r in enumerate(rows)]
        ids = [encode_prompt(t, tok, templated=not isinstance(r["prompt"], str)) for t, r in zip(texts, rows)]
        return PromptSet(rows=rows, texts=texts, token_ids=ids, source="given"), "prompts given by the caller"

    from lorarl.evaluate import prompt_data

    try:  # DPO: the task's held-out prompts (dpo.task_source), else the prompts of its preference pairs
        data = prompt_data(recipe)
    except LorarlError:
        data = recipe.data
    size = max(n, data.eval_size)
    try:
        prompts = load_prompts(data, tok, "eval", size=size, recipe_path=src.recipe_path)
        where = "held-out split"
    except LorarlError:
        prompts = load_prompts(data, tok, "train", size=max(n, data.train_size), recipe_path=src.recipe_path)
        where = "training split (the recipe has no held-out split)"
    if src.recipe is None:
        where += " of the default recipe (no recipe.yaml beside the adapter)"
    return prompts, where


def _tally(texts_a: list[str], texts_b: list[str], ids_a: list, ids_b: list) -> dict:
    n = len(texts_a)
    same = [a == b for a, b in zip(texts_a, texts_b)]
    return {
        "greedy_agreement": sum(same) / n,
        "agreed": sum(same),
        "token_agreement": sum(a == b for a, b in zip(ids_a, ids_b)) / n,
    }


def _logprob_deltas(train: tuple, export: tuple) -> dict:
    """Mean / max |delta log-prob| and the argmax agreement over every scored position."""
    deltas, top_same, count = [], 0, 0
    for lp_a, lp_b, top_a, top_b in zip(train[0], export[0], train[1], export[1]):
        deltas += [abs(a - b) for a, b in zip(lp_a, lp_b)]
        top_same += sum(a == b for a, b in zip(top_a, top_b))
        count += len(top_a)
    return {
        "tokens_compared": count,
        "logprob_mean_abs_delta": sum(deltas) / len(deltas) if deltas else 0.0,
        "logprob_max_abs_delta": max(deltas, default=0.0),
        "top1_agreement": top_same / count if count else 1.0,
    }


def _accuracy(recipe: Recipe, prompts: Any, texts: dict[str, list[str]]) -> dict:
    from lorarl.tasks import accuracy

    cols = prompts.columns(list(range(len(texts["trained"]))))
    acc = {k: accuracy(recipe, v, cols) for k, v in texts.items()}
    if acc["trained"] is None or acc["export"] is None:
        return {"accuracy_trained": None, "accuracy_export": None, "accuracy_delta": None}
    return {
        "accuracy_trained": acc["trained"],
        "accuracy_export": acc["export"],
        "accuracy_delta": acc["export"] - acc["trained"],
    }


def _tokenizer_agreement(runtime: Any, prompts: Any, n: int) -> float | None:
    tokenize = getattr(runtime, "tokenize", None)
    if tokenize is None:
        return None
    return sum(tokenize(prompts.texts[i]) == prompts.token_ids[i] for i in range(n)) / n


def _compare(
    src: RunSource, recipe: Recipe, reference: Any, make_export: Any, n: int, max_new: int | None, rows: list | None
) -> dict:
    """The report's figures: ``reference`` (a loaded runtime, closed here before the export loads) against the
    runtime ``make_export(eos_ids, pad_id, n_ctx)`` returns, on the first ``n`` prompts of the run."""
    turns, agent = None, {}  # an agent run: both models run its prompt format, tools and turn loop (.agent_gate)
    try:
        tok = reference.tokenizer
        prompts, where = gate_prompts(src, recipe, tok, n, rows)
        k = min(n, len(prompts))
        ids = prompts.token_ids[:k]
        max_new = max_new or recipe.eval.max_new_tokens or recipe.generation.max_new_tokens
        if recipe.agent is not None:
            from lorarl.export.agent_gate import AgentTurns, LoopBase

            base = LoopBase(tok, reference.eos_ids, reference.pad_id)
            turns = AgentTurns(recipe, prompts.rows[:k], base, max_new)
            ids, ref_ids, ref_answers, agent["trained"] = turns.run(reference)
        else:
            ref_ids = reference.greedy(ids, max_new)
        ref_scores = reference.score(ids, ref_ids)
        eos_ids, pad_id, ref_name = reference.eos_ids, reference.pad_id, reference.name
    finally:
        reference.close()
    exp = make_export(eos_ids, pad_id, max(len(p) for p in ids) + (turns.max_total_tokens if turns else max_new) + 8)
    try:
        if turns is not None:
            _, export_ids, export_answers, agent["export"] = turns.run(exp)
        else:
            export_ids = exp.greedy(ids, max_new)
        export_scores = exp.score(ids, ref_ids)
        tok_agree = _tokenizer_agreement(exp, prompts, k)
        export_name = exp.name
    finally:
        exp.close()
    texts = {
        "trained": [tok.decode(c, skip_special_tokens=True) for c in ref_ids],
        "export": [tok.decode(c, skip_special_tokens=True) for c in export_ids],
    }
    answers = {"trained": ref_answers, "export": export_answers} if turns is not None else texts
    return {
        "training_model": ref_name,
        "export_runtime": export_name,
        "prompts": k,
        "prompt_source": where,
        "max_new_tokens": max_new,
        "agent": agent or None,  # the loop's metrics per model (turns, tool calls, ...), or None without an agent
        **_tally(texts["trained"], texts["export"], ref_ids, export_ids),
        **_accuracy(recipe, prompts, answers),
        **_logprob_deltas(ref_scores, export_scores),
        "tokenizer_agreement": tok_agree,
        "disagreements": [
            {"prompt": prompts.texts[i], "trained": texts["trained"][i], "export": texts["export"][i]}
            for i in range(k)
            if texts["trained"][i] != texts["export"][i]
        ][:EXAMPLES],
    }


def run_gate(
    src: RunSource,
    fmt: str,
    artefact: str | os.PathLike,
    *,
    n: int = DEFAULT_N,
    quant: str | None = None,
    device: Any = None,
    max_new_tokens: int | None = None,
    train_quantization: str | None = None,
    runtime: str | None = None,
    batch_size: int = 16,
    reference: str | os.PathLike | None = None,
    prompts: list | None = None,
) -> dict:
    """Compare the training model with the export at ``artefact`` (a merged or adapter folder, a ``.gguf`` file) on
    ``n`` held-out prompts; returns the report (see the module docstring). ``train_quantization`` overrides the
    recipe's ``model.quantization`` for the training model (``nf4`` for a GPU-trained run gated on a CPU).
    ``reference``: a merged export folder to compare against instead of the training model (e.g. a GGUF against
    the merged model it came from); the report's ``training_model`` then names it. ``prompts``: rows to use instead
    of the run's held-out prompts (see :func:`gate_prompts`)."""
    from lorarl.export.runtimes import TrainingRuntime, export_runtime, reference_runtime

    if n < 1:
        raise LorarlError(f"--gate-n must be >= 1, got {n}")
    t0 = time.perf_counter()
    recipe = src.recipe or Recipe()
    print(gate_start_line(fmt, n, recipe.agent is not None), file=sys.stderr, flush=True)
    if reference is None:
        ref = TrainingRuntime(src, recipe, device, train_quantization, batch_size)
    else:
        ref = reference_runtime(Path(reference), device, batch_size)

    def make_export(eos_ids: list[int], pad_id: int, n_ctx: int) -> Any:
        return export_runtime(
            fmt, Path(artefact), eos_ids, pad_id, device=device, runtime=runtime, n_ctx=n_ctx, batch_size=batch_size
        )

    report = {"format": fmt, "quant": quant, **_compare(src, recipe, ref, make_export, n, max_new_tokens, prompts)}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def gate_start_line(fmt: str, n: int, agent: bool) -> str:
    """The line the gate prints as it starts: what it runs and how to make it shorter. It decodes and scores every
    prompt in both models, which is most of an export's time on a CPU (an agent run's 8-prompt gate of a bf16
    merged export: 204 s on 2 CPU cores, gate.json's seconds; docs/export.md)."""
    what = "turn loop (tools called)" if agent else "completion"
    return (
        f"lorarl: fidelity gate: the {fmt} export and the training model each decode (greedy {what}) and score up to "
        f"{n} held-out prompts (--gate-n N to change, 0 skips the gate)"
    )


def summary_line(report: dict) -> str:
    """One line: agreement, accuracies and log-prob deltas of a gate report."""
    what = report["format"] + (f" {report['quant']}" if report.get("quant") else "")
    acc = ""
    if report.get("accuracy_trained") is not None:
        acc = f"; accuracy {report['accuracy_export']:.1%} export vs {report['accuracy_trained']:.1%} trained"
    return (
        f"greedy agreement {report['greedy_agreement']:.1%} ({report['agreed']}/{report['prompts']}) for {what} "
        f"({report['export_runtime']}) vs the training model on {report['prompts']} prompts{acc}; "
        f"|delta log-prob| mean {report['logprob_mean_abs_delta']:.4f}, max {report['logprob_max_abs_delta']:.4f}"
    )


def check_gate(report: dict, minimum: float | None, out: Path) -> list[str]:
    """``minimum`` set: a LorarlError when the agreement is below it (the export is not written). Not set: a
    warning (returned as notes, printed on stderr) below :data:`WARN_BELOW`."""
    agreement = report["greedy_agreement"]
    report["threshold"] = minimum
    report["passed"] = None if minimum is None else agreement >= minimum
    if minimum is not None and agreement < minimum:
        raise LorarlError(
            f"fidelity gate failed: {summary_line(report)}; below --gate {minimum:g}, so nothing was written to {out}"
        )
    if minimum is None and agreement < WARN_BELOW:
        note = f"fidelity gate warning: {summary_line(report)} (below {WARN_BELOW:g}; --gate sets a minimum)"
        print(f"lorarl: warning: {note}", file=sys.stderr, flush=True)
        return [note]
    return []


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def card_section(report: dict) -> list[str]:
    """The model card's "Fidelity gate" section."""
    gate = (
        f"not set (warns below {WARN_BELOW:.0%})"
        if report.get("threshold") is None
        else (f"minimum agreement {report['threshold']:g}: passed")
    )
    rows = [
        (
            "greedy agreement (identical completion text)",
            f"{_pct(report['greedy_agreement'])} ({report['agreed']}/{report['prompts']})",
        ),
        ("identical token ids (EOS included)", _pct(report["token_agreement"])),
        (
            "accuracy: training model / export",
            f"{_pct(report['accuracy_trained'])} / {_pct(report['accuracy_export'])}",
        ),
        (
            "mean / max abs delta log-prob",
            f"{report['logprob_mean_abs_delta']:.4f} / "
            f"{report['logprob_max_abs_delta']:.4f} over {report['tokens_compared']} tokens",
        ),
        ("same argmax token", _pct(report["top1_agreement"])),
    ]
    if report.get("tokenizer_agreement") is not None:
        rows.append(("GGUF tokenizer gives the training prompt ids", _pct(report["tokenizer_agreement"])))
    lines = [
        "",
        "## Fidelity gate",
        "",
        f"The export run by **{report['export_runtime']}** against the model as it trained "
        f"(**{report['training_model']}**), greedy, on {report['prompts']} prompts of the run's {report['prompt_source']} "
        f"(at most {report['max_new_tokens']} new tokens). Gate: {gate}. Full report: `gate.json`.",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if report.get("disagreements"):
        lines += ["", f"Where they differ (first {EXAMPLES}; the prompt's last 80 characters):", ""]
    for d in report.get("disagreements", []):
        lines.append(f"- prompt `…{d['prompt'][-80:]!r}`: trained `{d['trained']!r}`, export `{d['export']!r}`")
    return lines


def write_report(report: dict, folder: Path) -> None:
    (folder / "gate.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export.gate RUN_DIR EXPORT``: print the gate report of an existing export as JSON."""
    p = argparse.ArgumentParser(prog="python -m lorarl.export.gate", description=main.__doc__)
    p.add_argument("run")
    p.add_argument("export", help="a merged or adapter export folder, or a .gguf file")
    p.add_argument("--format", choices=["merged", "adapter", "gguf"], default=None, help="default: from the path")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--n", type=int, default=DEFAULT_N)
    p.add_argument("--train-quantization", choices=["none", "nf4"], default=None)
    p.add_argument("--runtime", choices=["llama.cpp", "transformers"], default=None, help="for a GGUF")
    p.add_argument("--device", default=None)
    p.add_argument("--quant", default=None, help="the GGUF's type, for the report (default: from the file name)")
    p.add_argument("--reference", default=None, help="a merged export to compare with instead of the training model")
    p.add_argument("--max-new-tokens", type=int, default=None)
    args = p.parse_args(argv)
    path = Path(args.export)
    fmt = args.format or (
        "gguf" if path.suffix == ".gguf" else "adapter" if (path / "adapter_config.json").is_file() else "merged"
    )
    quant = args.quant or (path.stem.removeprefix("model-") if fmt == "gguf" else None)
    try:
        src = locate(args.run, args.checkpoint)
        report = run_gate(
            src,
            fmt,
            path,
            n=args.n,
            quant=quant,
            device=args.device,
            train_quantization=args.train_quantization,
            runtime=args.runtime,
            reference=args.reference,
            max_new_tokens=args.max_new_tokens,
        )
    except LorarlError as e:
        print(f"lorarl: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
