"""Export a run: a merged model, the policy adapter, or a hand-off to verl / OpenRLHF.

``lorarl export RUN_DIR --out DIR --format merged|adapter|verl|openrlhf [--dtype bf16|fp16|fp32] [--force]``

- ``merged``: the base reloaded in full precision (fp32, on the CPU; never the NF4 weights the run trained on:
  merging a LoRA delta into 4-bit layers re-quantizes it and corrupts the outputs), the policy LoRA merged in, cast
  to ``--dtype`` and saved as safetensors with the tokenizer, chat template and generation config. Plain
  ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it; no lorarl import is needed.
- ``adapter``: the policy adapter in PEFT format; ``base_model_name_or_path`` is the folder the base was loaded from
  (the converted default model's cache folder, or the user's model folder), so ``peft.AutoPeftModelForCausalLM``
  / ``PeftModel.from_pretrained`` load it with plain transformers.
- ``verl`` / ``openrlhf``: what a run needs to continue on those distributed engines: the recipe's prompts (verl
  parquet / OpenRLHF JSONL), a self-contained ``reward.py`` with the recipe's rule rewards behind verl's
  ``compute_score`` and OpenRLHF's ``reward_func``, the adapter, a YAML file mapping the recipe's keys to the
  engine's keys, and a launch script.

Every export folder holds a model card ``README.md`` (the recipe, the metrics at the exported step, how to load it).
Exports are atomic: written into a temporary folder beside ``--out`` and renamed into place; replacing an existing
folder needs ``force``.

:func:`measure_nf4_gap` measures what merging into a full-precision base changes compared with the NF4 model the run
trained with: logit differences and greedy-answer agreement on sample prompts.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import inspect
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorarl.checkpoint import MARKER, STEP_RE, latest_checkpoint
from lorarl.config import Recipe, load_recipe, recipe_to_dict
from lorarl.errors import LorarlError

FORMATS = ("merged", "adapter", "verl", "openrlhf")
DTYPES = ("bf16", "fp16", "fp32")
POLICY = "policy"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

# Hub ids of the embedded models (for the model card's ``base_model`` field; the weights come from the cache folder).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def _torch_dtype(name: str):
    import torch

    try:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    except KeyError:
        raise LorarlError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


# ---------------------------------------------------------------------------------------------------------------
# Finding what to export
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunSource:
    """What an export reads: the adapter folder, the run it belongs to, its recipe, step and metrics."""

    adapter_dir: Path
    run_dir: Path | None
    checkpoint_dir: Path | None
    step: int | None
    recipe: Recipe | None
    recipe_path: Path | None
    base_path: str
    metrics: dict | None = None
    eval: dict | None = None
    notes: list[str] = field(default_factory=list)


def _read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _metrics_at(rows: list[dict], step: int | None) -> dict | None:
    """The metrics row of ``step`` (the last row when ``step`` is None; else the last row at or before it)."""
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        return None
    if step is None:
        return rows[-1]
    before = [r for r in rows if r["step"] <= step]
    return before[-1] if before else None


def _checkpoint_folder(run: Path, name: str) -> Path:
    root = run / "checkpoints"
    if name == "latest":
        cp = latest_checkpoint(run)
        if cp is None:
            raise LorarlError(f"{root}: no complete checkpoint")
        return cp
    if name.isdigit():
        name = f"step-{int(name):06d}"
    cp = root / name
    if not cp.is_dir():
        have = sorted(p.name for p in root.glob("step-*")) if root.is_dir() else []
        raise LorarlError(f"{cp}: no such checkpoint (have: {', '.join(have) or 'none'})")
    if not (cp / MARKER).is_file():
        raise LorarlError(f"{cp}: incomplete checkpoint (no {MARKER} file); pick another with --checkpoint")
    return cp


def locate(run: str | os.PathLike, checkpoint: str | None = None) -> RunSource:
    """Find the policy adapter, recipe, step and metrics for ``run``.

    ``run`` is a run directory (its final ``policy/`` adapter, or ``checkpoints/<checkpoint>/policy`` when
    ``checkpoint`` is given: ``step-000040``, ``40`` or ``latest``), a checkpoint folder inside it, or a PEFT adapter
    folder. A run without a final adapter (stopped early) falls back to its newest complete checkpoint.
    """
    run = Path(run).expanduser()
    if not run.exists():
        raise LorarlError(f"{run}: run directory not found")
    if not run.is_dir():
        raise LorarlError(f"{run}: not a directory (expected a run directory)")
    notes: list[str] = []
    cp: Path | None = None
    run_dir: Path | None
    if (run / "adapter_config.json").is_file():  # an adapter folder
        adapter = run
        if STEP_RE.match(run.parent.name):
            cp = run.parent
            run_dir = cp.parent.parent if cp.parent.name == "checkpoints" else None
        else:
            run_dir = run.parent if (run.parent / "recipe.yaml").is_file() else None
    elif STEP_RE.match(run.name) or (run / MARKER).is_file():  # a checkpoint folder
        if checkpoint:
            raise LorarlError(f"{run}: is a checkpoint already; --checkpoint applies to a run directory")
        cp = run
        adapter = run / POLICY
        run_dir = run.parent.parent if run.parent.name == "checkpoints" else None
    else:  # a run directory
        run_dir = run
        if checkpoint:
            cp = _checkpoint_folder(run, checkpoint)
            adapter = cp / POLICY
        elif (run / POLICY).is_dir():
            adapter = run / POLICY
        else:
            cp = latest_checkpoint(run)
            if cp is None:
                raise LorarlError(
                    f"{run}: no policy adapter (expected {run / POLICY}/ or a complete checkpoint under "
                    f"{run / 'checkpoints'}/)"
                )
            adapter = cp / POLICY
            notes.append(f"the run has no final adapter; exported its newest checkpoint {cp.name}")
    missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
    if missing:
        raise LorarlError(f"{adapter}: no policy adapter there (missing {', '.join(missing)})")

    recipe_path = None
    for candidate in ([cp / "recipe.yaml"] if cp else []) + ([run_dir / "recipe.yaml"] if run_dir else []):
        if candidate.is_file():
            recipe_path = candidate
            break
    recipe = load_recipe(recipe_path) if recipe_path else None

    step = None
    if cp is not None:
        state = cp / "state.json"
        if state.is_file():
            step = json.loads(state.read_text()).get("step")
        if step is None:
            m = STEP_RE.match(cp.name)
            step = int(m.group(1)) if m else None
    metric_rows = _read_metrics(run_dir / "metrics.jsonl") if run_dir else []
    metrics = _metrics_at(metric_rows, step)
    if step is None and metrics is not None:
        step = metrics.get("step")
    ev = None
    if run_dir and (run_dir / "eval.json").is_file() and cp is None:
        try:
            ev = json.loads((run_dir / "eval.json").read_text())
        except json.JSONDecodeError:
            notes.append(f"{run_dir / 'eval.json'} is not valid JSON; left out of the model card")
    return RunSource(
        adapter_dir=adapter,
        run_dir=run_dir,
        checkpoint_dir=cp,
        step=step,
        recipe=recipe,
        recipe_path=recipe_path,
        base_path=_base_path(recipe, adapter),
        metrics=metrics,
        eval=ev,
        notes=notes,
    )


def _base_path(recipe: Recipe | None, adapter: Path) -> str:
    """What ``from_pretrained`` takes for the base: the recipe's model resolved (the embedded default is converted
    into its cache folder once), else the adapter's ``base_model_name_or_path``."""
    from lorarl.model.registry import resolve_model

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    base = cfg.get("base_model_name_or_path")
    if recipe is not None:
        try:
            return resolve_model(recipe.model.name)
        except LorarlError:
            # e.g. a relative model.name read from another working directory: the folder the run loaded still works
            if base and (Path(base) / "config.json").is_file():
                return base
            raise
    if not base:
        raise LorarlError(f"{adapter}: no recipe.yaml beside it and no base_model_name_or_path in adapter_config.json")
    return base


# ---------------------------------------------------------------------------------------------------------------
# Atomic output folder
# ---------------------------------------------------------------------------------------------------------------


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def _check_out(out: Path, force: bool, src: RunSource) -> None:
    for protected in filter(None, [src.run_dir, src.adapter_dir]):
        if _is_within(protected, out):
            raise LorarlError(f"{out}: refusing to export over the run itself ({protected} is inside it)")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise LorarlError(f"{out}: already exists; pass --force to replace it")


def _commit(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished temp folder to ``out`` (replacing an existing one only with ``force``)."""
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not force:
            raise LorarlError(f"{out}: already exists; pass --force to replace it")
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "x")
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


# ---------------------------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------------------------


def export(
    run: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "merged",
    dtype: str = "bf16",
    force: bool = False,
    checkpoint: str | None = None,
) -> dict:
    """Export ``run``'s policy to ``out`` in format ``fmt``; returns a summary (what ``lorarl export`` prints).

    Raises :class:`LorarlError` for a missing run, a run without a policy adapter, or an existing ``out`` without
    ``force``. ``dtype`` applies to the merged weights; adapters keep the precision they were trained in.
    """
    if fmt not in FORMATS:
        raise LorarlError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    _torch_dtype(dtype)
    src = locate(run, checkpoint)
    out = Path(out).expanduser()
    _check_out(out, force, src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if fmt == "merged":
            info = _write_merged(src, tmp, dtype)
        elif fmt == "adapter":
            info = _write_adapter(src, tmp)
        else:
            info = _write_engine(src, tmp, out, fmt)
        (tmp / "README.md").write_text(model_card(src, fmt, dtype, info), encoding="utf-8")
        _commit(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {
        "format": fmt,
        "out": str(out),
        "run": str(src.run_dir) if src.run_dir else None,
        "adapter": str(src.adapter_dir),
        "step": src.step,
        "base_model": src.base_path,
        "dtype": dtype if fmt == "merged" else None,
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "notes": src.notes + info.get("notes", []),
    }


# ---------------------------------------------------------------------------------------------------------------
# merged / adapter
# ---------------------------------------------------------------------------------------------------------------


def _trust_remote_code(src: RunSource) -> bool:
    return bool(src.recipe and src.recipe.model.trust_remote_code)


def load_full_precision_base(base_path: str, trust_remote_code: bool = False):
    """The base in fp32 on the CPU, refusing a checkpoint that is stored quantized (nothing to merge into)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise LorarlError(f"base model {base_path}: cannot load ({e})") from None
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise LorarlError(
            f"base model {base_path}: stored quantized ({method}); a "
            f"merge needs the full-precision weights: point model.name at the unquantized model"
        )
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=trust_remote_code)


def merge_adapter(base_path: str, adapter_dir: str | os.PathLike, trust_remote_code: bool = False):
    """Full-precision base + LoRA adapter -> one plain transformers model (fp32), the adapter merged in."""
    from peft import PeftModel

    base = load_full_precision_base(base_path, trust_remote_code)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    merged = peft_model.merge_and_unload(safe_merge=True)
    if getattr(merged.config, "quantization_config", None) is not None:
        del merged.config.quantization_config
    merged.config.use_cache = True
    merged.eval()
    return merged


def _export_tokenizer(src: RunSource, folder: Path):
    from lorarl.model import load_tokenizer

    tok = load_tokenizer(src.base_path, _trust_remote_code(src))
    tok.save_pretrained(str(folder))
    return tok


def _write_merged(src: RunSource, folder: Path, dtype: str) -> dict:
    from transformers import GenerationConfig

    merged = merge_adapter(src.base_path, src.adapter_dir, _trust_remote_code(src))
    merged = merged.to(_torch_dtype(dtype))
    tok = _export_tokenizer(src, folder)
    gen_file = Path(src.base_path) / "generation_config.json"
    if gen_file.is_file():
        gen = GenerationConfig.from_pretrained(src.base_path)
    else:
        gen = merged.generation_config or GenerationConfig.from_model_config(merged.config)
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tok.eos_token_id
    merged.generation_config = gen
    merged.save_pretrained(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" in cfg:  # never ship a quantization_config with full-precision weights
        del cfg["quantization_config"]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    notes = []
    if not getattr(tok, "chat_template", None):
        notes.append("the base tokenizer has no chat template; none was exported")
    del merged
    gc.collect()
    return {"notes": notes}


def _write_adapter(src: RunSource, folder: Path, with_tokenizer: bool = True) -> dict:
    """The policy adapter as a PEFT folder whose base_model_name_or_path is ``src.base_path`` (absolute if local)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src.adapter_dir / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    cfg = json.loads((src.adapter_dir / "adapter_config.json").read_text())
    base = src.base_path
    if Path(base).expanduser().exists():
        base = str(Path(base).expanduser().resolve())
    cfg["base_model_name_or_path"] = base
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if with_tokenizer:
        _export_tokenizer(src, folder)
    notes = []
    if Path(base).exists():
        notes.append(f"base_model_name_or_path is a local folder ({base}); on another machine, pass the base there")
    return {"notes": notes, "base": base}


# ---------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v) if not isinstance(v, str) else v


def model_card(src: RunSource, fmt: str, dtype: str, info: dict | None = None) -> str:
    """The export's README.md: what it is, how to load it, the metrics at the exported step, the recipe."""
    info = info or {}
    recipe = src.recipe
    algo = recipe.algo if recipe else "unknown"
    model_name = recipe.model.name if recipe else src.base_path
    hub = HUB_IDS.get(model_name) or (model_name if not Path(model_name).expanduser().exists() else None)
    library = {"merged": "transformers", "adapter": "peft"}.get(fmt, "peft")
    tags = ["lorarl", algo, "lora", "reinforcement-learning"] + (["merged"] if fmt == "merged" else [])
    front = {"library_name": library, "tags": tags}
    if hub:
        front["base_model"] = hub
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    what = {
        "merged": f"the policy LoRA adapter merged into the full-precision base, saved in {dtype}",
        "adapter": "the policy LoRA adapter (PEFT format)",
        "verl": "a hand-off to continue the run on verl",
        "openrlhf": "a hand-off to continue the run on OpenRLHF",
    }[fmt]
    step = f"step {src.step}" if src.step is not None else "the final step"
    lines += [
        f"# lorarl {algo} export ({fmt})",
        "",
        f"This folder holds {what}, from {step} of a lorarl run.",
        "",
        f"- run: `{src.run_dir}`" if src.run_dir else "- run: (adapter folder exported on its own)",
        f"- adapter: `{src.adapter_dir}`",
        f"- base model: `{model_name}` (weights loaded from `{src.base_path}`)",
    ]
    if fmt == "merged":
        lines.append(
            "- merged into the base reloaded in fp32 (never into the 4-bit NF4 weights used during training, which "
            "would re-quantize the LoRA delta); `config.json` carries no quantization_config"
        )
    lines += ["", "## How to load it", ""]
    if fmt == "merged":
        lines += [
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'model = AutoModelForCausalLM.from_pretrained("PATH/TO/THIS/FOLDER")',
            'tok = AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER")',
            'messages = [{"role": "user", "content": "What is 23 + 45?"}]',
            'ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)',
            "out = model.generate(**ids, max_new_tokens=64, do_sample=False)",
            'print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))',
            "```",
            "",
            "No lorarl import is needed. vLLM / SGLang serve the folder as is.",
        ]
    else:
        sub = "" if fmt == "adapter" else "adapter/"
        lines += [
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("PATH/TO/THIS/FOLDER/{sub}")',
            f'tok = AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER/{sub}")',
            "```",
            "",
            f"`{sub}adapter_config.json` names the base as `{info.get('base', src.base_path)}`. On another machine, "
            "load the base yourself and attach the adapter: "
            '`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "PATH/TO/THIS/FOLDER/'
            f'{sub}")`.',
        ]
    if fmt in ("verl", "openrlhf"):
        lines += ["", *info.get("card", [])]
    lines += ["", "## Metrics at the exported step", ""]
    if src.metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt_value(v)} |" for k, v in src.metrics.items()]
    else:
        lines.append("(no metrics.jsonl row for this step)")
    if src.eval:
        lines += ["", "## Evaluation (eval.json)", "", "```json", json.dumps(src.eval, indent=2, sort_keys=True), "```"]
    lines += ["", "## Recipe", ""]
    if recipe is not None:
        lines += ["```yaml", yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip(), "```"]
    else:
        lines.append("(no recipe.yaml found beside the adapter)")
    if src.notes or info.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in src.notes + info.get("notes", [])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# verl / OpenRLHF hand-off: data
# ---------------------------------------------------------------------------------------------------------------

GROUND_TRUTH_CANDIDATES = ("answer", "ground_truth", "solution", "label", "target")


def _ground_truth_column(rows: list[dict]) -> str | None:
    """The column the rule rewards compare with: ``answer`` (what every built-in reads), else a usual name."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    return next((c for c in GROUND_TRUTH_CANDIDATES if c in keys), None)


def _messages(prompt: Any, system_prompt: str | None) -> list[dict]:
    """A row's prompt as chat messages, with ``data.system_prompt`` prepended as lorarl does."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _split_rows(recipe: Recipe) -> dict[str, list[dict]]:
    from lorarl.data import read_rows

    out = {"train": read_rows(recipe.data, "train")[0]}
    try:
        out["test"] = read_rows(recipe.data, "eval")[0]
    except LorarlError:  # no held-out source: train only
        pass
    return out


def _verl_rows(rows: list[dict], split: str, data_source: str, gt: str | None, system_prompt: str | None) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        messages = _messages(row["prompt"], system_prompt)
        columns = {k: _jsonable(v) for k, v in row.items() if k != "prompt"}
        truth = row.get(gt) if gt else None
        out.append(
            {
                "data_source": data_source,
                "prompt": messages,
                "ability": "lorarl",
                "reward_model": {"style": "rule", "ground_truth": None if truth is None else str(truth)},
                "extra_info": {
                    "split": split,
                    "index": i,
                    # every column of the lorarl row (and its prompt), for the reward functions: JSON, so rows of
                    # any shape fit one parquet schema
                    "lorarl_columns": json.dumps({"prompt": _jsonable(row["prompt"]), **columns}, ensure_ascii=False),
                },
            }
        )
    return out


def _write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def _openrlhf_rows(
    rows: list[dict], gt: str | None, system_prompt: str | None, conversational: bool, with_columns: bool
) -> list[dict]:
    out = []
    for row in rows:
        columns = {k: _jsonable(v) for k, v in row.items() if k != "prompt"}
        prompt = _messages(row["prompt"], system_prompt) if conversational else row["prompt"]
        item = {"prompt": prompt, **columns}
        if gt:
            item[gt] = None if row.get(gt) is None else str(row.get(gt))
        if with_columns:  # the --label_key column when user rewards may read any column
            item["lorarl_columns"] = json.dumps({"prompt": _jsonable(row["prompt"]), **columns}, ensure_ascii=False)
        out.append(item)
    return out


def _write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# verl / OpenRLHF hand-off: a self-contained reward.py
# ---------------------------------------------------------------------------------------------------------------


class _Names(ast.NodeVisitor):
    """Names a definition reads at run time (annotations are skipped: with postponed evaluation they never run)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        self.names.add(node.id)

    def visit_arg(self, node: ast.arg) -> None:  # parameter annotations
        return

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for d in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)


def inline_source(functions: list, module=None) -> tuple[list[str], list[str]]:
    """The source needed to run ``functions`` (defined in ``module``) without importing that module.

    Returns ``(imports, definitions)``: the import statements and the top-level definitions (functions and
    constants) that the functions use, transitively, in source order. Raises LorarlError if they need a name that
    comes from a ``lorarl`` import (it could not run without lorarl).
    """
    module = module or inspect.getmodule(functions[0])
    source = inspect.getsource(module)
    tree = ast.parse(source)
    lines = source.splitlines()
    defs: dict[str, ast.stmt] = {}
    imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                imports[bound] = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                imports[a.asname or a.name] = f"from {'.' * node.level}{node.module or ''} import {a.name}" + (
                    f" as {a.asname}" if a.asname else ""
                )
    needed: set[str] = set()
    needed_imports: set[str] = set()
    todo = [fn.__name__ for fn in functions]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        if name in defs:
            needed.add(name)
            visitor = _Names()
            visitor.visit(defs[name])
            todo.extend(n for n in visitor.names if n not in needed)
        elif name in imports:
            stmt = imports[name]
            if " lorarl" in stmt or stmt.startswith("from ."):
                raise LorarlError(f"cannot inline {name!r} for reward.py: it comes from `{stmt}`")
            needed_imports.add(stmt)
    nodes = sorted({id(defs[n]): defs[n] for n in needed}.values(), key=lambda n: n.lineno)
    chunks = []
    for node in nodes:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        chunks.append("\n".join(lines[start - 1 : node.end_lineno]))
    return sorted(needed_imports), chunks


def _user_reward_file(name: str, recipe: Recipe) -> Path | None:
    module_name = name.rpartition(":")[0]
    if not module_name.endswith(".py"):
        return None
    candidates = [Path(module_name).expanduser()]
    if recipe.source_path:
        candidates.append(Path(recipe.source_path).parent / module_name)
    return next((p for p in candidates if p.is_file()), None)


def reward_module_source(
    recipe: Recipe,
    *,
    ground_truth_column: str | None = "answer",
    conversational: bool = True,
    strip_suffixes: list[str] | None = None,
    user_files: dict[str, str] | None = None,
    openrlhf_label: str = "answer",
) -> str:
    """The text of a self-contained ``reward.py`` scoring completions like ``recipe.rewards`` does in lorarl.

    Built-in rewards are copied from :mod:`lorarl.rewards` (with the helpers and constants they use); user rewards
    (``module:function``) are imported by name, and ``file.py:function`` from ``user_files[name]`` (a path relative
    to reward.py) or the original path. Exposes ``score`` (all values), verl's ``compute_score`` and OpenRLHF's
    ``reward_func``.
    """
    from lorarl import __version__, rewards

    user_files = user_files or {}
    builtins = [rewards.BUILTIN_REWARDS[s.name] for s in recipe.rewards if s.name in rewards.BUILTIN_REWARDS]
    builtins = list(dict.fromkeys(builtins))
    imports, definitions = inline_source(builtins, rewards) if builtins else ([], [])
    names = rewards._metric_names(recipe.rewards)
    table, user_loads = [], []
    for i, (spec, metric) in enumerate(zip(recipe.rewards, names)):
        if spec.name in rewards.BUILTIN_REWARDS:
            fn = rewards.BUILTIN_REWARDS[spec.name].__name__
        else:
            fn = f"_user_reward_{i}"
            module_name, _, attr = spec.name.rpartition(":")
            if module_name.endswith(".py"):
                path = user_files.get(spec.name, module_name)
                user_loads.append(f"{fn} = _load_file_function({path!r}, {attr!r})")
            else:
                user_loads.append(f"{fn} = getattr(importlib.import_module({module_name!r}), {attr!r})")
        table.append(f"    ({metric!r}, {fn}, {float(spec.weight)!r}, {dict(spec.kwargs)!r}),")
    header_imports = sorted(
        set(imports) | {"import importlib", "import importlib.util", "import json", "import os", "import sys"}
    )
    parts = [
        f'''"""Rule rewards of a lorarl recipe, for verl and OpenRLHF. Self-contained: no lorarl import.

Generated by lorarl {__version__} (`lorarl export --format verl|openrlhf`). The built-in reward functions below are
copied from lorarl.rewards; user rewards (module:function) are imported by name, so their module must be importable
where this file runs.

- verl:     custom_reward_function.path=reward.py custom_reward_function.name=compute_score
            compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float
- OpenRLHF: --remote_rm_url reward.py
            reward_func(queries, prompts, labels) -> {{"rewards", "scores", "extra_logs"}}
- anywhere: score(completion, ground_truth, prompt=None, columns=None) -> {{reward name: value, "total": value}}

Like lorarl, the total is the weighted sum of the rewards that returned a value (None: "does not apply"); a reward
that raises counts as missing. Unlike lorarl, there are no token ids here: `length_penalty` measures characters.
"""

from __future__ import annotations
''',
        "\n".join(header_imports),
        "",
        f"CONVERSATIONAL = {conversational!r}  # completions are passed as [{{'role': 'assistant', 'content': text}}] (TRL)",
        f"GROUND_TRUTH_COLUMN = {ground_truth_column!r}  # the dataset column ground_truth / labels stand for",
        f"OPENRLHF_LABEL = {openrlhf_label!r}  # 'lorarl_columns': OpenRLHF labels are JSON rows of every column",
        f"STRIP_SUFFIXES = {list(strip_suffixes or [])!r}  # special tokens left at the end of decoded text",
        "",
        "# " + "-" * 113,
        "# Built-in rewards (copied from lorarl.rewards)",
        "# " + "-" * 113,
        "",
        _join_definitions(definitions) if definitions else "# (none used by this recipe)",
        "",
        "",
        "# " + "-" * 113,
        "# User rewards (imported by name)",
        "# " + "-" * 113,
        "",
        *([_FILE_LOADER, "", ""] if any("_load_file_function" in u for u in user_loads) else []),
        "\n".join(user_loads) if user_loads else "# (none in this recipe)",
        "",
        "# (metric name, function, weight, kwargs from the recipe)",
        "REWARDS = [",
        *table,
        "]",
        "",
        _SCORING_TEMPLATE,
    ]
    return "\n".join(parts)


def _join_definitions(chunks: list[str]) -> str:
    """Top-level definitions as source: functions two blank lines apart, consecutive constants together."""
    out = ""
    for i, chunk in enumerate(chunks):
        if i:
            is_def = chunk.lstrip().startswith(("def ", "async def ", "class ", "@"))
            was_def = chunks[i - 1].lstrip().startswith(("def ", "async def ", "class ", "@"))
            out += "\n\n\n" if is_def or was_def else "\n"
        out += chunk
    return out


_FILE_LOADER = '''
def _load_file_function(path, attr):
    """``attr`` of the Python file ``path`` (relative paths: beside this file first, then the working directory)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    path = here if os.path.isfile(here) else path
    spec = importlib.util.spec_from_file_location("lorarl_user_rewards_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attr)
'''.strip()

_SCORING_TEMPLATE = '''
# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


def _strip(text):
    text = "" if text is None else str(text)
    changed = True
    while changed:
        changed = False
        text = text.rstrip()
        for s in STRIP_SUFFIXES:
            if s and text.endswith(s):
                text, changed = text[: -len(s)], True
    return text


def score(completion, ground_truth=None, prompt=None, columns=None):
    """Every reward's value for one completion and the weighted ``total`` (None where a reward does not apply)."""
    cols = dict(columns or {})
    cols.pop("prompt", None)
    if GROUND_TRUTH_COLUMN is not None and (ground_truth is not None or GROUND_TRUTH_COLUMN not in cols):
        cols[GROUND_TRUTH_COLUMN] = ground_truth
    text = _strip(completion)
    completions = [[{"role": "assistant", "content": text}]] if CONVERSATIONAL else [text]
    batch = {k: [v] for k, v in cols.items()}
    values, total, any_value = {}, 0.0, False
    for name, fn, weight, kwargs in REWARDS:
        try:
            value = fn(prompts=[prompt], completions=completions, **{**kwargs, **batch})[0]
        except Exception as e:  # like lorarl: a failing reward is a missing value, not a crash
            print(f"reward.py: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            value = None
        if hasattr(value, "item"):
            value = value.item()
        values[name] = None if value is None else float(value)
        if value is not None and value == value:  # not NaN
            total += weight * float(value)
            any_value = True
    values["total"] = total if any_value else None
    return values


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's custom reward function: the weighted total for one response (0.0 when no reward applies)."""
    cols = {}
    if isinstance(extra_info, dict) and extra_info.get("lorarl_columns"):
        cols = json.loads(extra_info["lorarl_columns"])
    prompt = cols.get("prompt")
    result = score(solution_str, ground_truth, prompt=prompt, columns=cols)
    return 0.0 if result["total"] is None else float(result["total"])


def reward_func(queries, prompts, labels=None, **kwargs):
    """OpenRLHF's reward function. ``queries`` are prompt + response texts, ``prompts`` the prompt texts and
    ``labels`` the --label_key column."""
    import torch

    labels = list(labels) if labels is not None else [None] * len(queries)
    totals, logs = [], {name: [] for name, _, _, _ in REWARDS}
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        cols, truth = {}, label
        if OPENRLHF_LABEL == "lorarl_columns" and isinstance(label, str):
            cols = json.loads(label)
            truth = cols.get(GROUND_TRUTH_COLUMN) if GROUND_TRUTH_COLUMN else None
        result = score(response, truth, prompt=prompt, columns=cols)
        totals.append(0.0 if result["total"] is None else result["total"])
        for name in logs:
            logs[name].append(float("nan") if result[name] is None else result[name])
    rewards = torch.tensor(totals, dtype=torch.float32)
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {name: torch.tensor(v, dtype=torch.float32) for name, v in logs.items()},
    }
'''.strip()


# ---------------------------------------------------------------------------------------------------------------
# verl / OpenRLHF hand-off: key mapping
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class KeyMap:
    """One engine setting: its key and value, the lorarl recipe key it comes from, and a note (``unsure`` marks keys
    that could not be checked against every version of the engine)."""

    engine_key: str
    value: Any
    lorarl_key: str = ""
    note: str = ""
    unsure: bool = False


@dataclass
class Unmapped:
    lorarl_key: str
    value: Any
    note: str


LOSS_AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_sum_norm": "seq-mean-token-sum-norm",
}


def _num(x: float) -> int | float:
    """16.0 -> 16 (an int-typed engine key rejects "16.0"); 0.5 stays 0.5."""
    return int(x) if float(x).is_integer() else x


def _target_modules(tm) -> Any:
    return tm if isinstance(tm, str) else list(tm)


def verl_mapping(recipe: Recipe, paths: dict[str, str]) -> tuple[list[KeyMap], list[Unmapped]]:
    """verl ``main_ppo`` overrides for the recipe (``paths``: train/test parquet, reward.py, adapter, base)."""
    r, g, t, m = recipe, recipe.grpo, recipe.train, []
    skip: list[Unmapped] = []
    m += [
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
        KeyMap("actor_rollout_ref.model.lora_alpha", _num(r.lora.alpha), "lora.alpha"),
        KeyMap("actor_rollout_ref.model.target_modules", _target_modules(r.lora.target_modules), "lora.target_modules"),
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
    if r.algo == "grpo":
        m += [
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
        if g.kl_estimator != "k3":
            skip.append(Unmapped("grpo.kl_estimator", g.kl_estimator, "verl's low_var_kl is plain (clipped) k3"))
        skip.append(Unmapped("grpo.unbiased_std", g.unbiased_std, "verl uses torch.std (unbiased)"))
        if g.mask_truncated:
            skip.append(
                Unmapped("grpo.mask_truncated", True, "no single verl key; see verl's DAPO recipe (overlong filtering)")
            )
        if g.ref_refresh_every:
            skip.append(Unmapped("grpo.ref_refresh_every", g.ref_refresh_every, "no verl equivalent"))
    else:
        p = r.ppo
        m += [
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
            KeyMap("critic.model.lora_alpha", _num(p.critic_lora.alpha), "ppo.critic_lora.alpha"),
            KeyMap(
                "critic.model.target_modules",
                _target_modules(p.critic_lora.target_modules),
                "ppo.critic_lora.target_modules",
            ),
            KeyMap("critic.optim.lr", t.learning_rate, "train.learning_rate"),
            KeyMap("critic.cliprange_value", p.value_clip if p.value_clip is not None else 1e9, "ppo.value_clip"),
            KeyMap("critic.grad_clip", t.max_grad_norm, "train.max_grad_norm"),
        ]
        skip.append(
            Unmapped("ppo.vf_coef", p.vf_coef, "verl trains the critic with its own optimizer (no shared loss)")
        )
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
    return sorted(m, key=lambda e: e.engine_key), skip


def openrlhf_mapping(
    recipe: Recipe, paths: dict[str, str], train_rows: int, conversational: bool, label_key: str | None
) -> tuple[list[KeyMap], list[Unmapped]]:
    """``openrlhf.cli.train_ppo_ray`` flags for the recipe (a flag whose value is True is passed bare)."""
    r, g, t = recipe, recipe.grpo, recipe.train
    skip: list[Unmapped] = []
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
        KeyMap("--target_modules", _target_modules(r.lora.target_modules), "lora.target_modules"),
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
    if r.generation.top_k:
        skip.append(Unmapped("generation.top_k", r.generation.top_k, "OpenRLHF's PPO CLI has no top_k flag"))
    skip.append(
        Unmapped(
            "(policy adapter)",
            paths["adapter"],
            "OpenRLHF starts a fresh LoRA: merge the trained one with `lorarl export --format merged` and pass that folder as --pretrain",
        )
    )
    if r.algo == "grpo":
        dr = g.std_scaling == "none" and g.loss_reduction == "seq_sum_norm"
        m += [
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
            skip.append(
                Unmapped(
                    "grpo.loss_reduction",
                    g.loss_reduction,
                    "OpenRLHF averages over tokens",
                )
            )
        if g.mask_truncated:
            skip.append(Unmapped("grpo.mask_truncated", True, "no OpenRLHF equivalent"))
    else:
        p = r.ppo
        m += [
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


def _yaml_scalar(v: Any) -> str:
    return (
        json.dumps(v)
        if isinstance(v, (list, dict, bool)) or v is None
        else yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
    )


def mapping_yaml(engine: str, run_label: str, entries: list[KeyMap], skipped: list[Unmapped], command: str) -> str:
    """The mapping file: engine key: value, each commented with the lorarl key it comes from."""
    lines = [
        f"# lorarl -> {engine}: settings for continuing {run_label} on {engine}.",
        f"# Generated by `lorarl export --format {engine}`. Launch: {command}",
        "# Each line: <engine key>: <value>  # <- <lorarl recipe key>; notes. Keys marked UNSURE were written from",
        f"# {engine}'s documentation of some versions and could not be checked against yours: check them first.",
        f"engine: {engine}",
        "settings:",
    ]
    for e in entries:
        note = "; ".join(
            filter(None, [f"<- {e.lorarl_key}" if e.lorarl_key else "", e.note, "UNSURE" if e.unsure else ""])
        )
        lines.append(f"  {json.dumps(e.engine_key)}: {_yaml_scalar(e.value)}" + (f"  # {note}" if note else ""))
    lines.append("not_mapped:  # recipe settings with no equivalent; the engine's default applies")
    if not skipped:
        lines[-1] = "not_mapped: {}"
    for s in skipped:
        lines.append(f"  {json.dumps(s.lorarl_key)}: {_yaml_scalar(s.value)}  # {s.note}")
    return "\n".join(lines) + "\n"


def _shell_value(v: Any, hydra: bool) -> str:
    import shlex

    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, list):
        return (
            shlex.quote("[" + ",".join(str(x) for x in v) + "]") if hydra else " ".join(shlex.quote(str(x)) for x in v)
        )
    return shlex.quote(str(v))


def launch_script(engine: str, entries: list[KeyMap]) -> str:
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by lorarl export --format {engine}; see the mapping YAML beside it.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
    ]
    if engine == "verl":
        lines.append("python3 -m verl.trainer.main_ppo \\")
        args = [f"    {e.engine_key}={_shell_value(e.value, hydra=True)}" for e in entries]
    else:
        lines.append("python3 -m openrlhf.cli.train_ppo_ray \\")
        args = []
        for e in entries:
            if e.value is True:
                args.append(f"    {e.engine_key}")
            elif e.value is not False:
                args.append(f"    {e.engine_key} {_shell_value(e.value, hydra=False)}")
    return "\n".join(lines) + "\n" + " \\\n".join(args) + ' \\\n    "$@"\n'


def _strip_suffixes(tok) -> list[str]:
    found = []
    for t in (tok.eos_token, tok.pad_token, "<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>"):
        if t and t not in found:
            found.append(t)
    return found


def _write_engine(src: RunSource, folder: Path, out: Path, engine: str) -> dict:
    """verl / OpenRLHF hand-off: data, reward.py, adapter, mapping YAML and launch script."""
    from lorarl.rewards import BUILTIN_REWARDS

    if src.recipe is None:
        raise LorarlError(
            f"{src.adapter_dir}: no recipe.yaml in the run; the {engine} hand-off needs its data and rewards"
        )
    recipe = src.recipe
    if recipe.algo == "reward_model":
        raise LorarlError(f"{src.run_dir}: a reward-model run has no policy to continue on {engine}")
    final = out.resolve()
    info = _write_adapter(src, folder / "adapter")
    notes = list(info["notes"])
    splits = _split_rows(recipe)
    all_rows = [r for rows in splits.values() for r in rows]
    gt = _ground_truth_column(all_rows)
    conversational = any(not isinstance(r.get("prompt"), str) for r in all_rows) or engine == "verl"
    if any(isinstance(r.get("prompt"), str) for r in all_rows) and engine == "verl":
        notes.append("plain-text prompts were wrapped as one user message (verl applies the chat template)")
    source = recipe.data.source
    data_source = "lorarl/arithmetic" if source == "arithmetic" else f"lorarl/{Path(source).stem}"
    paths = {"base": info["base"], "adapter": str(final / "adapter"), "reward": str(final / "reward.py")}
    user = [s.name for s in recipe.rewards if s.name not in BUILTIN_REWARDS]
    label_key = "lorarl_columns" if user or not gt else gt
    if engine == "verl":
        for split, rows in splits.items():
            _write_parquet(
                _verl_rows(rows, split, data_source, gt, recipe.data.system_prompt),
                folder / "data" / f"{split}.parquet",
            )
            paths[split] = str(final / "data" / f"{split}.parquet")
    else:
        for split, rows in splits.items():
            _write_jsonl(
                _openrlhf_rows(rows, gt, recipe.data.system_prompt, conversational, label_key == "lorarl_columns"),
                folder / "data" / f"{split}.jsonl",
            )
            paths[split] = str(final / "data" / f"{split}.jsonl")
    user_files = {}
    for name in user:
        f = _user_reward_file(name, recipe)
        if f is not None:
            (folder / "user_rewards").mkdir(exist_ok=True)
            shutil.copy2(f, folder / "user_rewards" / f.name)
            user_files[name] = f"user_rewards/{f.name}"
        elif name.rpartition(":")[0].endswith(".py"):
            notes.append(f"reward {name}: file not found at export; reward.py loads it from that path")
        else:
            notes.append(f"reward {name}: reward.py imports its module by name; install it where {engine} runs")
    from lorarl.model import load_tokenizer

    tok = load_tokenizer(src.base_path, _trust_remote_code(src))
    text = reward_module_source(
        recipe,
        ground_truth_column=gt,
        conversational=conversational,
        strip_suffixes=_strip_suffixes(tok),
        user_files=user_files,
        openrlhf_label=label_key if engine == "openrlhf" else "answer",
    )
    compile(text, "reward.py", "exec")  # a broken generated file fails here, not on the cluster
    (folder / "reward.py").write_text(text, encoding="utf-8")
    if engine == "verl":
        entries, skipped = verl_mapping(recipe, paths)
    else:
        entries, skipped = openrlhf_mapping(
            recipe, paths, len(splits["train"]), conversational, label_key if gt or user else None
        )
    script = f"run_{engine}.sh"
    run_label = f"the lorarl run {src.run_dir or src.adapter_dir}" + (
        f" (step {src.step})" if src.step is not None else ""
    )
    (folder / f"{engine}.yaml").write_text(
        mapping_yaml(engine, run_label, entries, skipped, f"bash {script}"), encoding="utf-8"
    )
    (folder / script).write_text(launch_script(engine, entries), encoding="utf-8")
    os.chmod(folder / script, 0o755)
    for s in skipped:
        if s.lorarl_key in ("ppo.reward_source",):
            notes.append(s.note)
    card = _engine_card(engine, entries, skipped, splits, gt, label_key, script)
    return {"notes": notes, "base": info["base"], "card": card}


def _engine_card(engine, entries, skipped, splits, gt, label_key, script) -> list[str]:
    data_ext = "parquet" if engine == "verl" else "jsonl"
    counts = ", ".join(f"`data/{k}.{data_ext}` ({len(v)} rows)" for k, v in splits.items())
    lines = ["## Continue on " + ("verl" if engine == "verl" else "OpenRLHF"), ""]
    lines.append(
        f"Files: {counts}; `reward.py` (self-contained rule rewards); `adapter/` (the trained policy LoRA); "
        f"`{engine}.yaml` (recipe key -> {engine} key); `{script}` (the launch command)."
    )
    lines.append("")
    if engine == "verl":
        lines.append(
            "Rows follow verl's format: `prompt` (chat messages), `data_source`, `reward_model.ground_truth` "
            f"(the `{gt}` column), `extra_info` (split, index and every lorarl column as JSON). "
            "`reward.py:compute_score(data_source, solution_str, ground_truth, extra_info)` returns the recipe's "
            "weighted reward."
        )
    else:
        lines.append(
            f"Rows hold `prompt` and the dataset's columns; `--label_key {label_key}` hands "
            "`reward.py:reward_func(queries, prompts, labels)` what it compares with."
        )
    lines += ["", f"| lorarl key | {engine} key | value |", "|---|---|---|"]
    for e in entries:
        mark = " (unsure)" if e.unsure else ""
        lines.append(f"| {e.lorarl_key or '-'} | `{e.engine_key}`{mark} | `{_yaml_scalar(e.value)}` |")
    if skipped:
        lines += ["", "Not mapped (the engine's default applies):", ""]
        lines += [f"- `{s.lorarl_key}` = `{_yaml_scalar(s.value)}`: {s.note}" for s in skipped]
    return lines


# ---------------------------------------------------------------------------------------------------------------
# NF4 training model vs merged full-precision export
# ---------------------------------------------------------------------------------------------------------------


def _prompt_rows(prompts, recipe: Recipe, n: int) -> list[dict]:
    if prompts is None:
        from lorarl.data import read_rows

        try:
            rows = read_rows(recipe.data, "eval", size=n)[0]
        except LorarlError:
            rows = read_rows(recipe.data, "train", size=n)[0]
        return rows[:n]
    out = []
    for p in prompts:
        out.append(dict(p) if isinstance(p, dict) else {"prompt": p})
    return out


def _logits(model, ids, mask):
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()


def _completion_ids(generated, prompt_width: int, eos_ids: set[int]) -> list[list[int]]:
    out = []
    for row in generated[:, prompt_width:].tolist():
        ids = []
        for t in row:
            ids.append(t)
            if t in eos_ids:
                break
        out.append(ids)
    return out


def measure_nf4_gap(
    run_dir: str | os.PathLike,
    prompts: list | None = None,
    *,
    checkpoint: str | None = None,
    merged_dir: str | os.PathLike | None = None,
    n: int = 32,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    device=None,
    merged_dtype: str = "fp32",
) -> dict:
    """The gap between the model a run trained (NF4 base + policy LoRA, as :class:`SharedBase` loads it) and its
    merged full-precision export, on sample prompts.

    ``prompts``: strings, chat-message lists or rows with ``prompt`` (and ``answer`` for accuracy); None takes ``n``
    rows of the recipe's held-out split. ``merged_dir``: an existing merged export (None: merged now into a temp
    folder, in fp32). Both models generate greedily from each prompt; the logits of both are compared on the same
    token sequences (each prompt plus the NF4 model's completion, pad positions left out).

    Returns ``logits_max_abs_diff`` / ``logits_mean_abs_diff`` (over all real positions and the vocabulary),
    ``top1_agreement`` (same argmax token), ``greedy_agreement`` (identical greedy completions), and with answers
    ``accuracy_nf4`` / ``accuracy_merged`` / ``accuracy_gap`` / ``answer_agreement`` (same extracted final answer).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from lorarl.data import encode_prompt, prompt_text
    from lorarl.model import SharedBase, pick_device, resolve_dtype
    from lorarl.model.tokens import pad_left
    from lorarl.rewards import extract_answer, is_correct

    src = locate(run_dir, checkpoint)
    recipe = src.recipe or Recipe()
    device = torch.device(device) if device is not None else pick_device()
    max_new_tokens = max_new_tokens or recipe.generation.max_new_tokens
    rows = _prompt_rows(prompts, recipe, n)
    if not rows:
        raise LorarlError("measure_nf4_gap: no prompts")

    mcfg = dataclasses.replace(recipe.model, name=src.base_path, quantization="nf4", gradient_checkpointing=False)
    shared = SharedBase.load(mcfg, device)
    shared.add_adapter(POLICY, init_from=src.adapter_dir, trainable=False)
    tok = shared.tokenizer
    tmp = None
    try:
        if merged_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="lorarl-merged-"))
            _write_merged(src, tmp, "fp32")
            merged_dir = tmp
        merged = (
            AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=_torch_dtype(merged_dtype)).to(device).eval()
        )

        texts = [prompt_text(r["prompt"], tok, recipe.data.system_prompt, i) for i, r in enumerate(rows)]
        prompt_ids = [encode_prompt(t, tok, templated=not isinstance(r["prompt"], str)) for t, r in zip(texts, rows)]
        eos = tok.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        max_abs, abs_sum, count, top1_same, total_tokens = 0.0, 0.0, 0, 0, 0
        completions = {"nf4": [], "merged": []}
        gen_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": tok.pad_token_id}
        for s in range(0, len(rows), batch_size):
            ids, mask = pad_left(prompt_ids[s : s + batch_size], tok.pad_token_id)
            mask = mask.long()
            ids, mask = ids.to(device), mask.to(device)
            with torch.no_grad():
                with shared.role(POLICY):
                    out_nf4 = shared.generate(ids, mask, **gen_kwargs)
                out_merged = merged.generate(input_ids=ids, attention_mask=mask, use_cache=True, **gen_kwargs)
                c_nf4 = _completion_ids(out_nf4, ids.shape[1], eos_ids)
                c_merged = _completion_ids(out_merged, ids.shape[1], eos_ids)
                completions["nf4"] += c_nf4
                completions["merged"] += c_merged
                full = [p + c for p, c in zip(prompt_ids[s : s + batch_size], c_nf4)]
                fids, fmask = pad_left(full, tok.pad_token_id)
                fmask = fmask.long()
                fids, fmask = fids.to(device), fmask.to(device)
                with shared.role(POLICY):
                    a = _logits(shared.module, fids, fmask)
                b = _logits(merged, fids, fmask)
                real = fmask.bool()
                diff = (a - b).abs()[real]  # [tokens, V]
                max_abs = max(max_abs, float(diff.max()))
                abs_sum += float(diff.sum())
                count += diff.numel()
                top1_same += int((a.argmax(-1) == b.argmax(-1))[real].sum())
                total_tokens += int(real.sum())
                del a, b, diff
        n_rows = len(rows)
        decoded = {k: [tok.decode(c, skip_special_tokens=True) for c in v] for k, v in completions.items()}
        result = {
            "prompts": n_rows,
            "tokens_compared": total_tokens,
            "device": str(device),
            "nf4_compute_dtype": str(resolve_dtype(mcfg, device)).replace("torch.", ""),
            "merged_dtype": merged_dtype,
            "max_new_tokens": max_new_tokens,
            "logits_max_abs_diff": max_abs,
            "logits_mean_abs_diff": abs_sum / max(count, 1),
            "top1_agreement": top1_same / max(total_tokens, 1),
            "greedy_agreement": sum(a == b for a, b in zip(completions["nf4"], completions["merged"])) / n_rows,
            "answer_agreement": sum(
                extract_answer(a) == extract_answer(b) for a, b in zip(decoded["nf4"], decoded["merged"])
            )
            / n_rows,
            "examples": [
                {"prompt": texts[i], "nf4": decoded["nf4"][i], "merged": decoded["merged"][i]}
                for i in range(min(3, n_rows))
            ],
        }
        answers = [r.get("answer") for r in rows]
        if any(a is not None for a in answers):
            scored = [(c_n, c_m, a) for c_n, c_m, a in zip(decoded["nf4"], decoded["merged"], answers) if a is not None]
            acc_nf4 = sum(is_correct(c, a) for c, _, a in scored) / len(scored)
            acc_merged = sum(is_correct(c, a) for _, c, a in scored) / len(scored)
            result.update(
                {"accuracy_nf4": acc_nf4, "accuracy_merged": acc_merged, "accuracy_gap": acc_merged - acc_nf4}
            )
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        del shared
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """``python -m lorarl.export gap RUN_DIR [--n 64] [--merged DIR] ...``: print measure_nf4_gap's JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m lorarl.export", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gap", help="NF4 training model vs merged full-precision export")
    g.add_argument("run")
    g.add_argument("--checkpoint", default=None)
    g.add_argument("--merged", default=None, help="an existing merged export (default: merge now, fp32)")
    g.add_argument("--merged-dtype", choices=list(DTYPES), default="fp32")
    g.add_argument("--n", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--device", default=None)
    args = p.parse_args(argv)
    result = measure_nf4_gap(
        args.run,
        checkpoint=args.checkpoint,
        merged_dir=args.merged,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        device=args.device,
        merged_dtype=args.merged_dtype,
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
