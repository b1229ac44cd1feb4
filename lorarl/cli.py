"""``lorarl`` command line: models, recipes, train, pipeline, eval, chat, export, bench, plan.

User errors (recipe, data, files) print one line and exit with code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import os

# On shared or small CPU machines OpenMP's default busy-waiting threads spin against each other (measured 8-17x
# slower rollouts on 2 busy cores); passive waiting costs nothing on an idle machine. Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from lorarl.errors import LorarlError  # noqa: E402


def _print_json_last(result: dict) -> None:
    """The last stdout line of eval / bench is one JSON object (scripts parse it)."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True), flush=True)


def cmd_models(args) -> int:
    from lorarl.model.registry import convert_embedded, list_models

    if args.convert:
        convert_embedded(args.convert, force=args.force)
    rows = list_models()
    if args.json:
        _print_json_last({"models": rows})
        return 0
    for r in rows:
        state = "converted" if r["converted"] else ("installed" if r["installed"] else "missing")
        star = " (default)" if r["default"] else ""
        print(f"{r['name']}{star}  [{state}]  {r['description']}")
        print(f"    {r['path']}")
    print("Also usable as model.name: any local transformers folder, or a hub name where the network allows.")
    return 0


def cmd_recipes(args) -> int:
    from lorarl.config import yaml_load
    from lorarl.config.shipped import shipped_recipes, shipped_recipes_dir, summary

    recipes = shipped_recipes()
    if args.json:
        _print_json_last({"folder": str(shipped_recipes_dir()), "recipes": {n: str(p) for n, p in recipes.items()}})
        return 0
    if not recipes:
        raise LorarlError(f"no shipped recipes in {shipped_recipes_dir()} (a broken install?)")
    width = max(map(len, recipes))
    print(f"Shipped recipes ({shipped_recipes_dir()}): lorarl train NAME --out DIR (a pipeline: lorarl pipeline NAME)")
    for name, path in recipes.items():
        data = yaml_load(path.read_text(encoding="utf-8"))
        tag = "pipeline: " if isinstance(data, dict) and "stages" in data else ""
        print(f"  {name:<{width}}  {tag}{summary(path)}")
    return 0


def cmd_train(args) -> int:
    from lorarl.algos.loop import check_max_steps
    from lorarl.api import refuse_pipeline_recipe
    from lorarl.config import load_recipe

    refuse_pipeline_recipe(args.recipe)
    check_max_steps(args.max_steps)
    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.save_every is not None:
        overrides.append(f"train.save_every={args.save_every}")
    recipe = load_recipe(args.recipe, overrides)
    from lorarl.api import prepare_run_dir  # the checks lorarl.train makes too

    out = prepare_run_dir(recipe, args.out, resume=args.resume, force=args.force)
    from lorarl.algos.loop import train

    result = train(recipe, str(out), resume=args.resume, max_steps=args.max_steps)
    if isinstance(result, dict):
        _print_json_last(result)
    return 0


def cmd_pipeline(args) -> int:
    from lorarl.pipeline import load_pipeline, run_pipeline

    pipe = load_pipeline(args.recipe, args.out, list(args.overrides))
    result = run_pipeline(pipe, args.out, resume=args.resume, force=args.force)
    print(result.pop("table"), flush=True)
    _print_json_last(result)
    return 0


def cmd_eval(args) -> int:
    from lorarl.api import evaluate_recipe  # what lorarl.evaluate and Run.evaluate call too
    from lorarl.config import load_recipe

    result = evaluate_recipe(load_recipe(args.recipe, list(args.overrides)), args.checkpoint, n=args.n)
    _print_json_last(result)
    return 0


def cmd_export(args) -> int:
    from lorarl.export import export

    result = export(
        args.run,
        args.out,
        fmt=args.format,
        dtype=args.dtype,
        force=args.force,
        checkpoint=args.checkpoint,
        quant=args.quant,
        gate=args.gate,
        gate_n=args.gate_n,
    )
    _print_json_last(result)
    return 0


def cmd_chat(args) -> int:
    from lorarl.chat import launch

    launch(
        runs_dir=args.runs,
        host=args.host,
        port=args.port,
        model=args.model,
        share=False,
        workbench=not args.chat_only,
        recipe_dirs=args.recipes,
    )
    return 0


def cmd_doctor(args) -> int:
    from lorarl.doctor import diagnose, format_report

    report = diagnose(args.run)
    print(format_report(report))
    _print_json_last(report)
    return 0


def cmd_bench(args) -> int:
    from lorarl.bench import run_bench

    if args.which == "gpu":  # every GPU measurement into one folder (lorarl.bench.gpu)
        from lorarl.bench.gpu import run_gpu_bench

        result = run_gpu_bench(out=args.out, parts=args.part, force=args.force, smoke=args.smoke, quick=args.quick)
        _print_json_last(result)
        return 1 if result["failed"] else 0
    if args.which == "agent-turns":  # a 3-turn GRPO step vs a single-turn one of the same tokens (issue 23)
        from pathlib import Path

        from lorarl.bench.agent_turns import run as run_agent_turns

        _print_json_last(run_agent_turns(args.model, args.steps, out=Path(args.out) if args.out else None))
        return 0
    if args.which == "judge":  # LLM judge vs numeric_match, and its cost per GRPO step (lorarl.bench.judge)
        from pathlib import Path

        from lorarl.bench.judge import run as run_judge_bench

        result = run_judge_bench(Path(args.out or "runs/bench_judge"), model=args.model, steps=args.steps)
        _print_json_last(result)
        return 0
    options = {k: getattr(args, k) for k in ("shapes", "batches", "new_tokens", "repeats", "profile")}
    result = run_bench(args.which, steps=args.steps, model=args.model, out=args.out, rollout_options=options)
    _print_json_last(result)
    return 0


def cmd_env(args) -> int:
    from lorarl.env_report import collect, format_report

    env = collect()
    print(format_report(env), flush=True)
    if args.json:
        _print_json_last(env)
    return 0


def cmd_plan(args) -> int:
    from lorarl.plan import plan_recipe

    result = plan_recipe(
        args.recipe, budget_gb=args.budget_gb, model_config=args.model_config, overrides=list(args.overrides)
    )
    _print_json_last(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorarl", description="Parameter-efficient RL fine-tuning on one GPU.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list the models lorarl can use offline")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.add_argument("--convert", metavar="NAME", help="convert an embedded model into the cache now (if not yet)")
    m.add_argument("--force", action="store_true", help="with --convert: convert again even if converted")
    m.set_defaults(func=cmd_models)

    r = sub.add_parser("recipes", help="list the shipped recipes (train / eval / plan / pipeline take their names)")
    r.add_argument("--json", action="store_true", help="print one JSON object: the folder and each recipe's file")
    r.set_defaults(func=cmd_recipes)

    t = sub.add_parser("train", help="train with a recipe (GRPO, PPO, reward model, SFT, rejection sampling)")
    t.add_argument("recipe", help="recipe YAML file, or a shipped recipe's name (lorarl recipes)")
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    t.add_argument("--seed", type=int, default=None, help="overrides train.seed")
    t.add_argument("--save-every", type=int, default=None, help="overrides train.save_every (step checkpoints)")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    t.add_argument("--force", action="store_true", help="delete a non-empty --out and start over")
    t.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    t.set_defaults(func=cmd_train)

    pp = sub.add_parser("pipeline", help="run a pipeline recipe's stages in order (SFT, rejection sampling, RL, ...)")
    pp.add_argument("recipe", help="pipeline recipe YAML file (with `stages:`) or a shipped one's name")
    pp.add_argument("--out", required=True, help="output directory (one run directory per stage)")
    pp.add_argument("--resume", action="store_true", help="continue: finished stages are kept, the current one resumes")
    pp.add_argument("--force", action="store_true", help="delete a non-empty --out and start over")
    pp.add_argument("overrides", nargs="*", help="STAGE.section.key=value (or defaults. / evaluation.) overrides")
    pp.set_defaults(func=cmd_pipeline)

    e = sub.add_parser("eval", help="evaluate a checkpoint (or the base) on the recipe's held-out set")
    e.add_argument("recipe", help="recipe YAML file or a shipped recipe's name")
    e.add_argument("--checkpoint", required=True, help="'base', a run directory, or an adapter folder")
    e.add_argument("--n", type=int, default=None, help="number of held-out examples (default eval.n)")
    e.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="export a run: merged model, adapter, GGUF + Ollama, or verl / OpenRLHF hand-off")
    x.add_argument("run", help="run directory (or a checkpoint folder inside it)")
    x.add_argument("--out", required=True, help="export folder (written atomically)")
    x.add_argument("--format", choices=["merged", "adapter", "gguf", "verl", "openrlhf"], default="merged")
    x.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="merged weights (default bf16; gguf: fp32)"
    )
    x.add_argument("--quant", default="f16", help="GGUF type: f16, bf16, q8_0 or q4_k_m (default f16)")
    x.add_argument(
        "--gate", type=float, default=None, metavar="MIN", help="fail the export below this greedy agreement (0-1)"
    )
    x.add_argument("--gate-n", type=int, default=64, help="held-out prompts the fidelity gate compares on (0 skips it)")
    x.add_argument(
        "--checkpoint", default=None, help="a step checkpoint name (step-NNNNNN) instead of the final adapter"
    )
    x.add_argument("--force", action="store_true", help="replace an existing export folder")
    x.set_defaults(func=cmd_export)

    c = sub.add_parser("chat", help="chat with the base and trained checkpoints side by side (Gradio)")
    c.add_argument("--runs", default="runs", help="directory of runs and exports to offer")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=7860)
    c.add_argument("--model", default=None, help="base model (default: the runs' base, else the embedded default)")
    c.add_argument(
        "--recipes",
        action="append",
        default=None,
        help="a folder of recipes the Train tab offers besides the shipped ones (repeatable)",
    )
    c.add_argument("--chat-only", action="store_true", help="only the chat, without the Train / Watch / Export tabs")
    c.set_defaults(func=cmd_chat)

    dr = sub.add_parser("doctor", help="a health report of a run (reward, accuracy, KL, entropy, length, warnings)")
    dr.add_argument("run", help="run directory")
    dr.set_defaults(func=cmd_doctor)

    b = sub.add_parser("bench", help="side-by-side benchmarks")
    b.add_argument("which", choices=["grpo-vs-trl", "ppo-memory", "rollout", "gpu", "judge", "agent-turns"])
    b.add_argument("--part", action="append", default=None, help="gpu: run only this part (repeatable; default all)")
    b.add_argument("--force", action="store_true", help="gpu: run parts again even if their JSON exists")
    b.add_argument("--smoke", action="store_true", help="gpu: tiny shapes on any device (a temp folder by default)")
    b.add_argument("--quick", action="store_true", help="gpu: fewer shapes / steps / repeats (about 9 min on an H100)")
    b.add_argument("--steps", type=int, default=5)
    b.add_argument(
        "--shapes",
        default=None,
        help="rollout: random-init NF4 shapes (CUDA default: llama-3.1-8b,qwen2.5-7b,qwen2.5-1.5b)",
    )
    b.add_argument("--batches", default="1,16,64", help="rollout: decode batch sizes")
    b.add_argument("--new-tokens", type=int, default=64, help="rollout: tokens decoded per measurement")
    b.add_argument("--repeats", type=int, default=3, help="rollout: measurements per engine and batch")
    b.add_argument("--profile", action="store_true", help="rollout: a torch profiler summary of one decode step")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--out", default=None, help="folder for the raw per-engine results")
    b.set_defaults(func=cmd_bench)

    ev = sub.add_parser("env", help="versions, devices, CUDA, NF4 kernels, the embedded model: for a bug report")
    ev.add_argument("--json", action="store_true", help="also print the report as one JSON object (last line)")
    ev.set_defaults(func=cmd_env)

    pl = sub.add_parser("plan", help="predict peak GPU memory of a recipe and pick micro-batch sizes")
    pl.add_argument("recipe", help="recipe YAML file or a shipped recipe's name")
    pl.add_argument("--budget-gb", type=float, default=24.0)
    pl.add_argument("--model-config", default=None, help="a config.json path or a known model name (e.g. llama-3.1-8b)")
    pl.add_argument("overrides", nargs="*")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    # recipe overrides (section.key=value) may come before or after the options
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args) or 0
    except LorarlError as e:
        if args.debug:
            traceback.print_exc()
        print(f"lorarl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lorarl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
