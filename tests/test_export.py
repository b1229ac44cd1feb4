"""Export: merged model == adapter on the full-precision base, PEFT adapter folder, verl / OpenRLHF hand-off,
atomic folders and errors, and the NF4-vs-merged gap measurement (tiny model, CPU)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lorarl.config import LoraSettings, ModelConfig, Recipe, RewardSpec, recipe_to_dict
from lorarl.errors import LorarlError
from lorarl.export import export, locate, measure_nf4_gap, reward_module_source

MESSAGES = [
    [{"role": "user", "content": "What is 23 + 45?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 8? Think first."}],
]


def _recipe(model_dir: Path, rewards: list[RewardSpec] | None = None) -> Recipe:
    r = Recipe()
    r.model = ModelConfig(name=str(model_dir), quantization="none", dtype="float32")
    r.lora = LoraSettings(r=8, alpha=16.0)
    r.data.source = "arithmetic"
    r.data.train_size = 24
    r.data.eval_size = 8
    r.rewards = rewards or [
        RewardSpec(name="numeric_match", weight=1.0),
        RewardSpec(name="format", weight=0.5),
        RewardSpec(name="partial_credit", weight=0.25, kwargs={"partial": 0.4}),
    ]
    r.train.steps = 2
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A run directory as `lorarl train` leaves it: recipe.yaml, metrics.jsonl, policy/ and one step checkpoint.
    The policy's LoRA weights are random (B != 0), so merging changes the model."""
    from lorarl.model import SharedBase

    run = tmp_path_factory.mktemp("run")
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    shared.add_adapter("policy", LoraSettings(r=8, alpha=16.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    cp = run / "checkpoints" / "step-000001"
    shared.save_adapter("policy", cp / "policy")
    (cp / "state.json").write_text(json.dumps({"step": 1, "roles": ["policy"]}))
    (cp / "COMPLETE").write_text("1")
    with torch.no_grad():  # the final adapter differs from the step-1 checkpoint
        for p in shared.adapter_parameters("policy"):
            p.mul_(1.5)
    shared.save_adapter("policy", run / "policy")
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(_recipe(tiny_model_dir)), sort_keys=False))
    rows = [{"step": 1, "reward_mean": 0.25, "kl": 0.0}, {"step": 2, "reward_mean": 0.625, "kl": 0.01}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "trunc')
    return run


def _prompt_batch(tok):
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _logits(model, batch) -> torch.Tensor:
    mask = batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos).logits
    return out[mask.bool()]  # [real tokens, V]


@pytest.fixture(scope="module")
def merged_fp32(run_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("exports") / "merged"
    result = export(run_dir, out, fmt="merged", dtype="fp32")
    return out, result


def test_merged_logits_equal_adapter_on_full_precision_base(merged_fp32, run_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, result = merged_fp32
    assert result["format"] == "merged" and result["step"] == 2 and result["dtype"] == "fp32"
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, run_dir / "policy").eval()
    tok = AutoTokenizer.from_pretrained(out)
    batch = _prompt_batch(tok)

    a, b = _logits(merged, batch), _logits(with_adapter, batch)
    assert (a - b).abs().max().item() < 1e-4
    with with_adapter.disable_adapter():
        plain = _logits(with_adapter, batch)
    assert (a - plain).abs().max().item() > 1e-2  # the merge is not a no-op

    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert tok.chat_template
    card = (out / "README.md").read_text()
    assert "reward_mean | 0.625" in card and "numeric_match" in card and "AutoModelForCausalLM" in card
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_merged_loads_with_plain_transformers_only(merged_fp32):
    """A fresh interpreter loads the export with transformers alone: lorarl is never imported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = merged_fp32
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32)\n"
        f"tok = AutoTokenizer.from_pretrained({str(out)!r})\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 2 + 2?'}], add_generation_prompt=True,"
        " return_tensors='pt', return_dict=True)\n"
        "with torch.no_grad():\n"
        "    row = m(**ids).logits[0, -1, :8].tolist()\n"
        "assert not [k for k in sys.modules if k.startswith('lorarl')], 'lorarl was imported'\n"
        "print(json.dumps(row))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        want = m(**ids).logits[0, -1, :8]
    assert torch.allclose(torch.tensor(row), want, atol=1e-5)


def test_merged_bf16_and_adapter_export_load_with_peft(run_dir, tiny_model_dir, tmp_path, merged_fp32):
    from peft import AutoPeftModelForCausalLM
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = tmp_path / "merged-bf16"
    export(run_dir, bf16, fmt="merged")  # default dtype: bf16
    with safe_open(str(bf16 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    out = tmp_path / "adapter"
    result = export(run_dir, out, fmt="adapter")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    assert result["dtype"] is None and "adapter_model.safetensors" in result["files"]
    model = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    batch = _prompt_batch(tok)
    merged = AutoModelForCausalLM.from_pretrained(merged_fp32[0], dtype=torch.float32).eval()
    assert (_logits(model, batch) - _logits(merged, batch)).abs().max().item() < 1e-4
    assert "AutoPeftModelForCausalLM" in (out / "README.md").read_text()


def test_checkpoint_export_and_errors(run_dir, tmp_path):
    out = tmp_path / "cp"
    result = export(run_dir, out, fmt="adapter", checkpoint="step-000001")
    assert result["step"] == 1 and "reward_mean | 0.25" in (out / "README.md").read_text()
    assert locate(run_dir / "checkpoints" / "step-000001").step == 1  # a checkpoint folder works too
    assert locate(run_dir, checkpoint="latest").step == 1

    with pytest.raises(LorarlError, match=f"{out}: already exists; pass --force"):
        export(run_dir, out, fmt="adapter")
    (out / "stale.txt").write_text("old")
    export(run_dir, out, fmt="adapter", force=True)  # replaced as a whole
    assert not (out / "stale.txt").exists() and json.loads((out / "adapter_config.json").read_text())

    empty = tmp_path / "empty"
    empty.mkdir()
    export(run_dir, empty, fmt="adapter")  # an empty folder is not "existing work"

    missing = tmp_path / "no-such-run"
    with pytest.raises(LorarlError, match=f"{missing}: run directory not found"):
        export(missing, tmp_path / "x")
    bare = tmp_path / "bare-run"
    bare.mkdir()
    with pytest.raises(LorarlError, match=f"{bare}: no policy adapter"):
        export(bare, tmp_path / "y")
    with pytest.raises(LorarlError, match="refusing to export over the run itself"):
        export(run_dir, run_dir, fmt="adapter", force=True)
    with pytest.raises(LorarlError, match="no such checkpoint"):
        export(run_dir, tmp_path / "z", checkpoint="step-000009")
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_verl_export_parquet_and_compute_score(run_dir, tmp_path):
    import datasets

    out = tmp_path / "verl"
    result = export(run_dir, out, fmt="verl")
    assert {"data/train.parquet", "data/test.parquet", "reward.py", "verl.yaml", "run_verl.sh"} <= set(result["files"])
    assert "adapter/adapter_config.json" in result["files"]

    ds = datasets.load_dataset("parquet", data_files={"train": str(out / "data" / "train.parquet")})["train"]
    assert len(ds) == 24
    row = ds[0]
    assert row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"].startswith("What is ")
    truth = row["reward_model"]["ground_truth"]
    a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split()
    assert truth == str(int(a) + int(b)) and op == "+"
    assert row["data_source"] == "lorarl/arithmetic" and row["extra_info"]["split"] == "train"

    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('reward', {str(out / 'reward.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"extra = json.loads({json.dumps(json.dumps(row['extra_info']))})\n"
        f"truth = {truth!r}\n"
        "right = mod.compute_score('lorarl/arithmetic', '<think>add</think><answer>' + truth + '</answer>', truth, extra)\n"
        "plain = mod.compute_score('lorarl/arithmetic', 'The answer is ' + truth + '.', truth)\n"
        "wrong = mod.compute_score('lorarl/arithmetic', '<think>add</think><answer>' + str(int(truth) + 1) + '</answer>',"
        " truth, extra)\n"
        "assert not [k for k in sys.modules if k.startswith('lorarl')]\n"
        "print(json.dumps([right, plain, wrong]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    right, plain, wrong = json.loads(proc.stdout.strip().splitlines()[-1])
    # numeric_match 1 * w1 + format 1 * w0.5 + partial_credit 1 * w0.25 / 0 + 0 + 0.25 * 0.4 (well formed, wrong)
    assert right == pytest.approx(1.0 + 0.5 + 0.25)
    assert plain == pytest.approx(1.0 + 0.0 + 0.25)
    assert wrong == pytest.approx(0.0 + 0.5 + 0.25 * 0.4)

    mapping = yaml.safe_load((out / "verl.yaml").read_text())["settings"]
    assert mapping["algorithm.adv_estimator"] == "grpo"
    assert mapping["actor_rollout_ref.rollout.n"] == 8
    assert mapping["actor_rollout_ref.model.lora_rank"] == 8
    assert mapping["custom_reward_function.path"] == str((out / "reward.py").resolve())
    assert mapping["data.train_files"] == str((out / "data" / "train.parquet").resolve())
    assert "UNSURE" in (out / "verl.yaml").read_text()
    script = (out / "run_verl.sh").read_text()
    assert "verl.trainer.main_ppo" in script and "actor_rollout_ref.actor.clip_ratio_high=0.2" in script


def test_openrlhf_export_jsonl_and_reward_func(run_dir, tmp_path):
    import importlib.util

    out = tmp_path / "openrlhf"
    export(run_dir, out, fmt="openrlhf")
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and isinstance(rows[0]["prompt"], list) and isinstance(rows[0]["answer"], str)
    spec = importlib.util.spec_from_file_location("openrlhf_reward", out / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prompt = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    queries = [prompt + "<think>2 plus 3</think><answer>5</answer><|im_end|>", prompt + "It is 6.<|im_end|>"]
    result = mod.reward_func(queries, [prompt, prompt], ["5", "5"])
    assert result["rewards"].tolist() == pytest.approx([1.75, 0.0])
    assert result["extra_logs"]["numeric_match"].tolist() == [1.0, 0.0]
    flags = yaml.safe_load((out / "openrlhf.yaml").read_text())["settings"]
    assert flags["--advantage_estimator"] == "group_norm" and flags["--label_key"] == "answer"
    assert flags["--n_samples_per_prompt"] == 8 and flags["--eps_clip_low_high"] == [0.2, 0.2]
    assert "--apply_chat_template \\" in (out / "run_openrlhf.sh").read_text()


def test_reward_module_is_self_contained_and_imports_user_rewards(tmp_path, tiny_model_dir):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, bonus=0.0, **kw):\n"
        "    return [float('!' in str(c)) + bonus for c in completions]\n"
    )
    (tmp_path / "file_rewards.py").write_text(
        "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    recipe = _recipe(
        tiny_model_dir,
        [
            RewardSpec(name="numeric_match"),
            RewardSpec(name="length_penalty", weight=1.0, kwargs={"max_length": 20, "buffer": 10}),
            RewardSpec(name="my_rewards:shout", weight=2.0, kwargs={"bonus": 0.5}),
            RewardSpec(name=f"{tmp_path / 'file_rewards.py'}:one", weight=0.1),
        ],
    )
    text = reward_module_source(recipe, ground_truth_column="answer", conversational=False)
    assert "lorarl" not in [
        line.split()[1].split(".")[0] for line in text.splitlines() if line.startswith(("import ", "from "))
    ]
    assert "def numeric_match(" in text and "def length_penalty(" in text and "def is_correct(" in text
    assert "def format_reward(" not in text  # only what the recipe uses
    (tmp_path / "reward.py").write_text(text)
    code = (
        "import sys, json\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import reward\n"
        "print(json.dumps(reward.score('7!', '7')))\n"
        "assert not [k for k in sys.modules if k.startswith('lorarl')]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    values = json.loads(proc.stdout.strip().splitlines()[-1])
    assert values["numeric_match"] == 1.0 and values["length_penalty"] == 0.0
    assert values["shout"] == 1.5 and values["one"] == 1.0
    assert math.isclose(values["total"], 1.0 + 0.0 + 2.0 * 1.5 + 0.1)


def test_measure_nf4_gap_tiny_model(run_dir, merged_fp32):
    pytest.importorskip("bitsandbytes")
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in [(12, 30), (45, 11), (7, 8), (60, 21)]
    ]
    result = measure_nf4_gap(run_dir, rows, merged_dir=merged_fp32[0], max_new_tokens=4, device="cpu")
    print("nf4 gap (tiny random model):", json.dumps({k: v for k, v in result.items() if k != "examples"}))
    assert result["prompts"] == 4 and result["tokens_compared"] > 4 * 10
    assert 0.0 < result["logits_mean_abs_diff"] <= result["logits_max_abs_diff"] < 100
    for k in ("top1_agreement", "greedy_agreement", "answer_agreement", "accuracy_nf4", "accuracy_merged"):
        assert 0.0 <= result[k] <= 1.0
    assert result["accuracy_gap"] == pytest.approx(result["accuracy_merged"] - result["accuracy_nf4"])


def test_openrlhf_user_reward_reads_every_column(run_dir, tmp_path, tiny_model_dir):
    """With a user reward (`file.py:function`), OpenRLHF labels carry every column as JSON and the file is copied."""
    import importlib.util

    (tmp_path / "user_rw.py").write_text(
        "def uses_b(prompts, completions, b=None, **kw):\n    return [float(x) / 100 for x in b]\n"
    )
    run = tmp_path / "run2"
    shutil.copytree(run_dir / "policy", run / "policy")
    recipe = _recipe(
        tiny_model_dir, [RewardSpec(name="numeric_match"), RewardSpec(name=f"{tmp_path}/user_rw.py:uses_b")]
    )
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    out = tmp_path / "o"
    result = export(run, out, fmt="openrlhf")
    assert "user_rewards/user_rw.py" in result["files"]
    row = json.loads((out / "data" / "train.jsonl").read_text().splitlines()[0])
    flags = yaml.safe_load((out / "openrlhf.yaml").read_text())["settings"]
    assert flags["--label_key"] == "lorarl_columns"
    spec = importlib.util.spec_from_file_location("user_reward_mod", out / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.reward_func(["p" + f"= {row['answer']}"], ["p"], [row["lorarl_columns"]])
    assert got["rewards"].tolist() == pytest.approx([1.0 + row["b"] / 100])


def test_ppo_mappings(tiny_model_dir):
    from lorarl.export import openrlhf_mapping, verl_mapping

    r = _recipe(tiny_model_dir)
    r.algo = "ppo"
    r.ppo.adaptive_kl = True
    r.ppo.reward_clip = 5.0
    r.ppo.value_clip = None
    paths = {"base": "/b", "adapter": "/a", "reward": "/r.py", "train": "/t.parquet"}
    verl, verl_skip = verl_mapping(r, paths)
    v = {e.engine_key: e.value for e in verl}
    assert v["algorithm.adv_estimator"] == "gae" and v["algorithm.kl_ctrl.type"] == "adaptive"
    assert v["algorithm.lam"] == 0.95 and v["critic.model.lora_rank"] == 16 and v["actor_rollout_ref.rollout.n"] == 1
    assert "ppo.reward_source" in {s.lorarl_key for s in verl_skip}  # the LoRA reward model is not exported
    flags, _ = openrlhf_mapping(r, paths, train_rows=24, conversational=True, label_key="answer")
    f = {e.engine_key: e.value for e in flags}
    assert f["--advantage_estimator"] == "gae" and f["--kl_target"] == 6.0 and f["--reward_clip_range"] == [-5.0, 5.0]


def test_cli_export_and_quantized_base_refused(run_dir, tmp_path, tiny_model_dir, capsys):
    from lorarl.cli import main
    from lorarl.export import load_full_precision_base

    out = tmp_path / "cli-adapter"
    assert main(["export", str(run_dir), "--out", str(out), "--format", "adapter"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["format"] == "adapter" and last["step"] == 2 and last["out"] == str(out)
    assert main(["export", str(run_dir), "--out", str(out), "--format", "adapter"]) == 2
    assert f"{out}: already exists" in capsys.readouterr().err

    quantized = tmp_path / "q"
    quantized.mkdir()
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LorarlError, match="stored quantized"):
        load_full_precision_base(str(quantized))
