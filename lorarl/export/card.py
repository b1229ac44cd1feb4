"""The model card (``README.md``) in every export folder: what it holds, how to load it, the metrics at the exported
step, the run's ``eval.json`` and the full recipe, so the folder explains itself without the run beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lorarl.config import recipe_to_dict
from lorarl.export.source import RunSource

# Hub ids of the embedded models (for the model card's ``base_model`` field; the weights come from the cache folder).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}

WHAT = {
    "merged": "the policy LoRA adapter merged into the full-precision base, saved in {dtype}",
    "adapter": "the policy LoRA adapter (PEFT format)",
    "gguf": "the policy LoRA adapter merged into the full-precision base, converted by llama.cpp's converter into one "
    "GGUF file ({quant}) with an Ollama Modelfile",
    "verl": "a hand-off to continue the run on verl",
    "openrlhf": "a hand-off to continue the run on OpenRLHF",
}


def fmt_value(v: Any) -> str:
    """A metric value for the card's table: floats to 6 significant digits, strings as they are, the rest as JSON."""
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v) if not isinstance(v, str) else v


def _front_matter(src: RunSource, fmt: str, algo: str, model_name: str) -> list[str]:
    """The YAML header the Hugging Face hub reads (library, tags, ``base_model`` when it is a hub model)."""
    hub = HUB_IDS.get(model_name) or (model_name if not Path(model_name).expanduser().exists() else None)
    library = {"merged": "transformers", "adapter": "peft", "gguf": "gguf"}.get(fmt, "peft")
    tags = ["lorarl", algo, "lora", "reinforcement-learning"] + (["merged"] if fmt in ("merged", "gguf") else [])
    tags += ["gguf", "llama.cpp", "ollama"] if fmt == "gguf" else []
    front: dict[str, Any] = {"library_name": library, "tags": tags}
    if hub:
        front["base_model"] = hub
    return ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]


def ollama_name(src: RunSource) -> str:
    """A model name for ``ollama create``: the run directory's name, lower case, ``[a-z0-9._-]`` only."""
    raw = (src.run_dir.name if src.run_dir else src.adapter_dir.name) or "lorarl"
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in raw.lower()).strip("-.")
    return f"lorarl-{name or 'model'}"


def _how_to_run_gguf(src: RunSource, info: dict) -> list[str]:
    """llama.cpp, llama-cpp-python and Ollama commands for the GGUF file, with this folder's absolute path."""
    folder = Path(info.get("out") or "PATH/TO/THIS/FOLDER").resolve()
    gguf = Path(info["gguf"]).name
    lines = [
        "",
        "## How to run it",
        "",
        "Ollama (the Modelfile holds the chat template, the stop tokens and the run's sampling parameters):",
        "",
        "```bash",
        f"ollama create {ollama_name(src)} -f {folder / 'Modelfile'}",
        f'ollama run {ollama_name(src)} "What is 23 + 45? Reply with only the number."',
        "```",
        "",
        "llama.cpp and llama-cpp-python (the chat template is in the file's metadata):",
        "",
        "```bash",
        f"llama-cli -m {folder / gguf} -cnv",
        "```",
        "",
        "```python",
        "from llama_cpp import Llama",
        "",
        f'llm = Llama(model_path="{folder / gguf}")',
        'print(llm.create_chat_completion([{"role": "user", "content": "What is 23 + 45?"}], temperature=0))',
        "```",
        "",
        f"LM Studio: import `{gguf}` (`lms import {folder / gguf}`).",
    ]
    if info.get("quantizer"):
        lines += ["", f"Quantized to {info['quant']} by {info['quantizer']} from an f16 GGUF."]
    if info.get("modelfile", {}).get("template") is None:
        lines += ["", "The Modelfile has no TEMPLATE: Ollama takes the chat template from the GGUF's metadata."]
    return lines


def _how_to_load(src: RunSource, fmt: str, info: dict) -> list[str]:
    """The "How to load it" section: plain transformers for a merged model, peft for an adapter, llama.cpp /
    Ollama for a GGUF."""
    if fmt == "gguf":
        return _how_to_run_gguf(src, info)
    lines = ["", "## How to load it", ""]
    if fmt == "merged":
        return lines + [
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
    sub = "" if fmt == "adapter" else "adapter/"
    return lines + [
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


def _tool_use(src: RunSource, fmt: str, info: dict) -> list[str]:
    """The "Tool use" section of a run that trained with tools (:mod:`lorarl.export.tools`); none otherwise."""
    if src.recipe is None or src.recipe.agent is None:
        return []
    from transformers import AutoTokenizer

    from lorarl.export.tools import card_lines, tool_use

    tok = AutoTokenizer.from_pretrained(src.base_path, trust_remote_code=src.trust_remote_code)
    use = tool_use(src, tok)
    return card_lines(use, info.get("modelfile") if fmt == "gguf" else None) if use else []


def _run_sections(src: RunSource, info: dict) -> list[str]:
    """Metrics at the exported step, ``eval.json``, the recipe and the notes."""
    lines = ["", "## Metrics at the exported step", ""]
    if src.metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {fmt_value(v)} |" for k, v in src.metrics.items()]
    else:
        lines.append("(no metrics.jsonl row for this step)")
    if src.eval:
        lines += ["", "## Evaluation (eval.json)", "", "```json", json.dumps(src.eval, indent=2, sort_keys=True), "```"]
    lines += ["", "## Recipe", ""]
    if src.recipe is not None:
        lines += ["```yaml", yaml.safe_dump(recipe_to_dict(src.recipe), sort_keys=False).rstrip(), "```"]
    else:
        lines.append("(no recipe.yaml found beside the adapter)")
    if src.notes or info.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in src.notes + info.get("notes", [])]
    return lines


def model_card(src: RunSource, fmt: str, dtype: str, info: dict | None = None) -> str:
    """The export's README.md: what it is, how to load it, the metrics at the exported step, the recipe.

    ``info`` is what the format's writer returned: ``base`` (the adapter's base path), ``notes``, and for the
    hand-offs ``card`` (their own section's lines).
    """
    info = info or {}
    recipe = src.recipe
    algo = recipe.algo if recipe else "unknown"
    model_name = recipe.model.name if recipe else src.base_path
    lines = _front_matter(src, fmt, algo, model_name)
    step = f"step {src.step}" if src.step is not None else "the final step"
    lines += [
        f"# lorarl {algo} export ({fmt})",
        "",
        f"This folder holds {WHAT[fmt].format(dtype=dtype, quant=info.get('quant'))}, from {step} of a lorarl run.",
        "",
        f"- run: `{src.run_dir}`" if src.run_dir else "- run: (adapter folder exported on its own)",
        f"- adapter: `{src.adapter_dir}`",
        f"- base model: `{model_name}` (weights loaded from `{src.base_path}`)",
    ]
    merge = (
        "- merged into the base reloaded in fp32 (never into the 4-bit NF4 weights used during training, which "
        "would re-quantize the LoRA delta)"
    )
    if fmt == "merged":
        lines.append(merge + "; `config.json` carries no quantization_config")
    elif fmt == "gguf":
        lines.append(
            f"{merge}, saved in {info.get('merged_dtype')} and converted by llama.cpp's `{info.get('converter')}`"
        )
    lines += _how_to_load(src, fmt, info)
    lines += _tool_use(src, fmt, info)
    if fmt in ("verl", "openrlhf"):
        lines += ["", *info.get("card", [])]
    if info.get("gate"):
        from lorarl.export.gate import card_section

        lines += card_section(info["gate"])
    elif fmt in ("merged", "adapter", "gguf"):
        lines += [
            "",
            "## Fidelity gate",
            "",
            "Skipped (`--gate-n 0`): this export was not compared with the training model.",
        ]
    lines += _run_sections(src, info)
    return "\n".join(lines) + "\n"
