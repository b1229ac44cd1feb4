"""The verl / OpenRLHF hand-offs, checked by the engines' own code (CPU, no Ray, no GPU).

The released packages (verl 0.9.1, OpenRLHF 0.11.2: ``engine_site`` in conftest) run in subprocesses
(``tests/handoff_probes``): the launch scripts are run as a user would, with ``PYTHON`` standing in for the engine's
interpreter so that the exact argv they would exec is recorded; then verl's ``main_ppo.main`` (Hydra composition in
struct mode, ``validate_config``, its config classes) and OpenRLHF's ``train_ppo_ray`` ``__main__`` block (its
argparse parser and checks) run on those argvs up to the first Ray call. Also: the data files, ``reward.py`` against
lorarl's own reward functions (a process that cannot import lorarl), every recipe key accounted for, the scripts'
errors.
"""

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
from lorarl.export import export, reward_module_source
from lorarl.export.engines.common import recipe_leaves

PROBES = Path(__file__).parent / "handoff_probes"
GPU_COUNTS = (1, 2, 4, 8)
RULES = [
    RewardSpec(name="numeric_match", weight=1.0),
    RewardSpec(name="format", weight=0.5),
    RewardSpec(name="partial_credit", weight=0.25, kwargs={"partial": 0.4}),
]
BLOCK_LORARL = (  # prepended to code run "without lorarl": importing it fails
    "import sys\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'lorarl': raise ImportError('lorarl is blocked here')\n"
    "sys.meta_path.insert(0, _Block())\n"
)


def _recipe(model_dir: Path, algo: str, functions: list[RewardSpec] | None = None) -> Recipe:
    r = Recipe(algo=algo)
    r.model = ModelConfig(name=str(model_dir), quantization="none", dtype="float32")
    r.lora = LoraSettings(r=8, alpha=16.0)
    r.data.train_size, r.data.eval_size, r.eval.n = 40, 12, 10
    r.reward.functions = list(functions or RULES)
    r.train.steps, r.train.warmup_steps, r.train.lr_scheduler = 5, 1, "cosine"
    if algo == "grpo":
        r.train.prompts_per_step, r.train.micro_batch_size = 8, 16
    else:
        r.train.prompts_per_step, r.train.micro_batch_size = 16, 4
        r.ppo.minibatch_size = 8
        r.ppo.kl.adaptive, r.ppo.kl.target, r.ppo.kl.horizon = True, 4.0, 500
        r.ppo.score.normalize, r.ppo.score.clip, r.ppo.score.no_eos_penalty = False, 5.0, -2.0
        r.ppo.critic.learning_rate = 2e-4
    return r


def _make_run(folder: Path, recipe: Recipe) -> Path:
    """A run directory as `lorarl train` leaves it: recipe.yaml, metrics.jsonl, policy/ (random LoRA, B != 0)."""
    from lorarl.model import SharedBase

    shared = SharedBase.load(recipe.model)
    shared.add_adapter("policy", recipe.lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in shared.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    shared.save_adapter("policy", folder / "policy")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 5, "reward_mean": 0.5, "completion_len": 12.5}) + "\n")
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model_dir) -> dict[tuple[str, str], Path]:
    """The GRPO and PPO runs exported for verl and for OpenRLHF."""
    root = tmp_path_factory.mktemp("handoff")
    out = {}
    for algo in ("grpo", "ppo"):
        run = _make_run(root / f"run-{algo}", _recipe(tiny_model_dir, algo))
        for engine in ("verl", "openrlhf"):
            export(run, root / f"{engine}-{algo}", fmt=engine)
            out[engine, algo] = root / f"{engine}-{algo}"
    return out


def _launch(script: Path, site: Path, record: Path, *args: str, env: dict | None = None):
    """Run a launch script as a user would; its `python -m ENGINE ...` is recorded into ``record``."""
    wrapper = record.parent / "python-recorder.sh"
    if not wrapper.exists():
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{PROBES / "record_python.py"}" "$@"\n')
        wrapper.chmod(0o755)
    env = {**os.environ, "PYTHON": str(wrapper), "LORARL_RECORD": str(record), "PYTHONPATH": str(site), **(env or {})}
    # from a temporary folder: the scripts default their output to $PWD/verl-run (never the repository)
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=120, cwd=record.parent
    )


def _argvs(exports, engine: str, site: Path, tmp: Path) -> list[list[str]]:
    """Each export's recorded argv for 1, 2, 4 and 8 GPUs (GRPO then PPO), then the negative cases."""
    record = tmp / f"{engine}.jsonl"
    for algo in ("grpo", "ppo"):
        for g in GPU_COUNTS:
            proc = _launch(
                exports[engine, algo] / f"run_{engine}.sh", site, record, "--gpus", str(g), "--out", str(tmp)
            )
            assert proc.returncode == 0, proc.stderr
    bad = {
        "verl": [  # an unknown key; a schedule verl's optimizer class refuses; GPUs verl's batch check refuses
            ["--", "actor_rollout_ref.actor.optim.warmup_style_typo=cosine"],
            ["--", "actor_rollout_ref.actor.optim.lr_scheduler_type=linear"],
            ["--", "trainer.n_gpus_per_node=3"],
        ],
        "openrlhf": [  # a flag of OpenRLHF < 0.10; one rollout micro-batch for 8 actor GPUs
            ["--", "--pretrain", "/x"],
            ["--", "--rollout.micro_batch_size", "64"],
        ],
    }[engine]
    for extra in bad:
        proc = _launch(exports[engine, "grpo"] / f"run_{engine}.sh", site, record, "--gpus", "8", *extra)
        assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.fixture(scope="module")
def probed(exports, engine_site, tmp_path_factory) -> dict[str, list[dict]]:
    """verl's and OpenRLHF's own code run on the recorded argvs (both probes at once)."""
    tmp = tmp_path_factory.mktemp("probes")
    procs = {}
    for engine in ("verl", "openrlhf"):
        argvs = tmp / f"{engine}-argv.jsonl"
        argvs.write_text("".join(json.dumps(a) + "\n" for a in _argvs(exports, engine, engine_site, tmp)))
        env = {**os.environ, "PYTHONPATH": str(engine_site), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, str(PROBES / f"{engine}_probe.py"), str(argvs), str(tmp / f"{engine}.json")]
        procs[engine] = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = {}
    for engine, proc in procs.items():
        log = proc.communicate(timeout=600)[0].decode(errors="replace")
        assert proc.returncode == 0, log[-3000:]
        out[engine] = json.loads((tmp / f"{engine}.json").read_text())
    return out


def _split_ok(samples: int, gpus: int, micro: int) -> bool:
    """Every GPU gets the same whole number of samples, in whole micro-batches."""
    return samples % gpus == 0 and (samples // gpus) % micro == 0


def test_verl_accepts_the_launch_config(probed, exports, tiny_model_dir):
    results = probed["verl"]
    assert len(results) == 11
    for algo, group in (("grpo", results[:4]), ("ppo", results[4:8])):
        folder = exports["verl", algo].resolve()
        for g, res in zip(GPU_COUNTS, group):
            assert res["reached"] and res["error"] is None, res["error"]
            assert "[validate_config] All configuration checks passed" in res["stdout"]
            assert len(res["validated"]) == 3  # AlgoConfig, HFModelConfig, RolloutConfig built
            c = res["config"]
            a, t = c["actor_rollout_ref"], c["trainer"]
            assert t["n_gpus_per_node"] == g and a["rollout"]["tensor_model_parallel_size"] == 1
            samples = 64 if algo == "grpo" else 8  # per optimizer step: 8 prompts x 8 / 8 responses
            micro = a["actor"]["ppo_micro_batch_size_per_gpu"]
            assert micro == ({1: 16, 2: 16, 4: 16, 8: 8}[g] if algo == "grpo" else {1: 4, 2: 4, 4: 2, 8: 1}[g])
            assert _split_ok(samples, g, micro) and a["rollout"]["log_prob_micro_batch_size_per_gpu"] == micro
            assert a["model"]["lora_adapter_path"] == str(folder / "adapter")
            assert a["model"]["path"] == str(Path(tiny_model_dir).resolve()) and a["model"]["lora_rank"] == 8
            assert c["data"]["train_files"] == str(folder / "data" / "train.parquet")
            assert c["reward"]["custom_reward_function"]["path"] == str(folder / "reward.py")
            optim = a["actor"]["optim"]
            assert (optim["lr_scheduler_type"], optim["lr_warmup_steps"], optim["min_lr_ratio"]) == ("cosine", 1, 0.0)
            assert optim["warmup_style"] is None and optim["clip_grad"] == 1.0
            assert t["logger"] == ["console", "tensorboard"] and t["total_training_steps"] == 5
            assert (t["total_epochs"], t["save_freq"], t["test_freq"], t["val_before_train"]) == (5, 5, 5, True)
            if algo == "ppo":
                assert c["algorithm"]["adv_estimator"] == "gae" and c["algorithm"]["use_kl_in_reward"]
                assert c["algorithm"]["kl_ctrl"] == {**c["algorithm"]["kl_ctrl"], "type": "adaptive", "horizon": 500}
                assert c["algorithm"]["kl_ctrl"]["target_kl"] == pytest.approx(4.0 / 12.5)  # per token
                assert (a["actor"]["clip_ratio_low"], a["actor"]["clip_ratio_high"], a["rollout"]["n"]) == (0.2, 0.2, 1)
                critic = c["critic"]
                assert critic["optim"]["lr"] == 2e-4 and critic["optim"]["clip_grad"] == 10  # 1.0 / vf_coef 0.1
                assert critic["ppo_micro_batch_size_per_gpu"] == micro and critic["cliprange_value"] == 0.2
            else:
                assert c["algorithm"]["adv_estimator"] == "grpo" and a["rollout"]["n"] == 8
                assert a["actor"]["loss_agg_mode"] == "seq-mean-token-mean" and not a["actor"]["use_kl_loss"]


def test_verl_own_checks_reject_bad_settings(probed):
    unknown, schedule, gpus = probed["verl"][8:]
    assert not unknown["reached"] and "Key 'warmup_style_typo' is not in struct" in unknown["error"]
    assert not schedule["reached"] and "target 'verl.workers.config.optimizer.FSDPOptimizerConfig'" in schedule["error"]
    assert not gpus["reached"] and "must be divisible by minimal possible batch size (3)" in gpus["error"]


def test_openrlhf_parses_the_launch_command(probed, exports):
    results = probed["openrlhf"]
    assert len(results) == 10
    for algo, group in (("grpo", results[:4]), ("ppo", results[4:8])):
        folder = exports["openrlhf", algo].resolve()
        for g, res in zip(GPU_COUNTS, group):
            assert res["reached"] and res["error"] is None, res["error"]
            a = res["args"]
            n, prompts = a["rollout"]["n_samples_per_prompt"], a["rollout"]["batch_size"]
            train_batch, micro, rmicro = (
                a["train"]["batch_size"],
                a["train"]["micro_batch_size"],
                a["rollout"]["micro_batch_size"],
            )
            assert a["actor"]["num_gpus_per_node"] == g and a["ref"]["num_gpus_per_node"] == g
            assert a["train"]["colocate_all"] and a["vllm"]["num_engines"] * a["vllm"]["tensor_parallel_size"] == g
            assert train_batch % (micro * g) == 0  # DeepSpeed: micro x accumulation x world
            assert _split_ok(n * prompts, g, rmicro) and (n * prompts // rmicro) % g == 0  # equal chunks per rank
            assert (n * prompts // g) % micro == 0
            rows = (folder / "data" / "train.jsonl").read_text().splitlines()
            assert len(rows) == 5 * prompts and a["train"]["num_episodes"] == 1  # exactly train.steps steps
            # OpenRLHF's scheduler (ppo_trainer.prepare_datasets, deepspeed.py): ceil(max_steps x ratio) warm-up updates
            max_steps = len(rows) * n // train_batch * a["train"]["num_episodes"] * a["train"]["max_epochs"]
            updates_per_step = n * prompts // train_batch * a["train"]["max_epochs"]
            assert max_steps == 5 * updates_per_step
            assert math.ceil(max_steps * a["actor"]["lr_warmup_ratio"]) == 1 * updates_per_step
            assert a["actor"]["lr_scheduler"] == "cosine" and a["actor"]["model_name_or_path"] == str(folder / "model")
            assert a["ds"]["lora"]["rank"] == 0 and a["ds"]["lora"]["target_modules"] == "all-linear"  # full weights
            assert a["reward"]["remote_url"] == [str(folder / "reward.py")] and a["eval"]["temperature"] == 0.0
            if algo == "grpo":
                assert a["algo"]["advantage"]["estimator"] == "group_norm" and a["algo"]["kl"]["init_coef"] == 0.0
                assert a["actor"]["eps_clip_low_high"] == [0.2, 0.2] and a["reward"]["clip_range"] == [-1e9, 1e9]
            else:
                assert a["algo"]["advantage"]["estimator"] == "gae" and a["algo"]["kl"]["target"] == 0.32
                assert a["reward"]["clip_range"] == [-5.0, 5.0] and a["reward"]["stop_properly_penalty_coef"] == -2.0
                assert a["critic"]["max_norm"] == 10 and a["critic"]["num_gpus_per_node"] == g


def test_openrlhf_own_checks_reject_bad_settings(probed):
    old_flag, micro = probed["openrlhf"][8:]
    assert not old_flag["reached"] and "unrecognized arguments: --pretrain" in old_flag["error"]
    assert not micro["reached"] and "number of sample batches must be greater than or equal" in micro["error"]


def test_launch_scripts_explain_what_is_wrong(exports, engine_site, tmp_path):
    record = tmp_path / "r.jsonl"
    verl = exports["verl", "grpo"] / "run_verl.sh"
    err = _launch(verl, engine_site, record, "--gpus", "3").stderr.strip()
    assert err == (
        "run_verl.sh: samples per step (train.prompts_per_step 8 x grpo.group_size 8) (64) cannot be split evenly "
        "over 3 GPUs (1 node(s) x 3); total GPU counts that work: 1 2 4 8 16 32 64"
    )
    err = _launch(verl, engine_site, record, "--vllm-tp", "3").stderr.strip()
    assert err == "run_verl.sh: --vllm-tp 3 does not divide the 8 GPUs"
    assert _launch(verl, engine_site, record, "--gpus", "two").stderr.strip().endswith("got 'two'")
    assert "unknown option '--gpu'" in _launch(verl, engine_site, record, "--gpu", "8").stderr
    fake = tmp_path / "old"
    (fake / "verl-0.8.0.dist-info").mkdir(parents=True)
    (fake / "verl-0.8.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.8.0\n")
    proc = _launch(verl, fake, record)
    assert proc.returncode == 2 and "verl 0.8.0 is installed; this hand-off was written for verl 0.9.x" in proc.stderr
    proc = _launch(exports["openrlhf", "grpo"] / "run_openrlhf.sh", tmp_path / "none", record)
    assert "openrlhf is not installed" in proc.stderr and "pip install 'openrlhf==0.11.2'" in proc.stderr
    moved = tmp_path / "moved"  # the export copied elsewhere: paths follow the script's folder
    shutil.copytree(exports["openrlhf", "grpo"], moved)
    proc = _launch(moved / "run_openrlhf.sh", engine_site, record, "--gpus", "2")
    assert proc.returncode == 0 and f"{moved}/reward.py" in record.read_text()
    shutil.rmtree(moved / "model")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    proc = _launch(moved / "run_openrlhf.sh", engine_site, tmp_path / "r2.jsonl", "--gpus", "2", env=env)
    assert proc.returncode == 0, proc.stderr  # lorarl on PATH remade model/ from adapter/
    assert (moved / "model" / "config.json").is_file()


def test_every_recipe_key_is_accounted_for(exports, tiny_model_dir):
    for (engine, algo), folder in exports.items():
        mapping = yaml.safe_load((folder / f"{engine}.yaml").read_text())
        text = (folder / f"{engine}.yaml").read_text()
        covered = set(mapping["applied_in_files"]) | set(mapping["not_mapped"])
        covered |= {k.strip() for line in text.splitlines() if "# <- " in line for k in _lorarl_keys(line)}
        leaves = set(recipe_leaves(recipe_to_dict(_recipe(tiny_model_dir, algo))))
        assert leaves - covered == set(), (engine, algo)
    verl = yaml.safe_load((exports["verl", "grpo"] / "verl.yaml").read_text())
    assert "warmup_style" not in str(verl) and "actor_rollout_ref.actor.grad_clip" not in verl["settings"]
    assert "algo" not in yaml.safe_load((exports["openrlhf", "ppo"] / "openrlhf.yaml").read_text())["not_mapped"]


def _lorarl_keys(line: str) -> list[str]:
    return line.split("# <- ", 1)[1].split(";")[0].split(" / ")


def _lorarl_totals(recipe: Recipe, rows: list[dict], completions: list[str]) -> list[float]:
    from lorarl.rewards import RewardScorer, trl_completions

    scores = RewardScorer(recipe.reward.functions)(
        [r["prompt"] for r in rows], trl_completions(completions, True), {"answer": [r["answer"] for r in rows]}
    )
    return [0.0 if math.isnan(x) else x for x in scores.total.tolist()]


def test_reward_py_matches_lorarl_rewards(exports, tiny_model_dir):
    """reward.py (verl's compute_score, OpenRLHF's reward_func) gives lorarl's totals, in a process without lorarl."""
    from transformers import AutoTokenizer

    rows, completions = [], []
    for line in (exports["openrlhf", "grpo"] / "data" / "test.jsonl").read_text().splitlines()[:5]:
        row = json.loads(line)
        a = row["answer"]
        for c in (
            f"<think>add</think><answer>{a}</answer>",
            f"So it is {a}.",
            f"<think>x</think><answer>{a}1</answer>",
            "",
            f"{a} {int(a) + 1}",
            f" <think>sum</think> <answer> {a} </answer> ",
        ):
            rows.append(row)
            completions.append(c)
    want = _lorarl_totals(_recipe(tiny_model_dir, "grpo"), rows, completions)
    assert len(set(want)) >= 4  # the completions exercise the rewards
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    job = {"completions": completions, "rows": rows, "prompts": prompts, "eos": tok.eos_token}
    code = BLOCK_LORARL + (
        "import importlib.util, json\n"
        "def load(path):\n"
        "    spec = importlib.util.spec_from_file_location('reward', path)\n"
        "    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m\n"
        "job = json.loads(sys.stdin.read())\n"
        f"verl = load({str(exports['verl', 'grpo'] / 'reward.py')!r})\n"
        f"orl = load({str(exports['openrlhf', 'grpo'] / 'reward.py')!r})\n"
        "v = [verl.compute_score(data_source='lorarl/arithmetic', solution_str=c, ground_truth=r['answer'],\n"
        "      extra_info={'lorarl_columns': json.dumps(r)}) for c, r in zip(job['completions'], job['rows'])]\n"
        "q = [p + c + job['eos'] for p, c in zip(job['prompts'], job['completions'])]\n"
        "o = [orl.reward_func([x], [p], [r['answer']])['rewards'].tolist()[0]\n"
        "     for x, p, r in zip(q, job['prompts'], job['rows'])]\n"
        "print(json.dumps([v, o]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True, cwd="/", timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    verl_values, openrlhf_values = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verl_values == pytest.approx(want, abs=1e-6)
    assert openrlhf_values == pytest.approx(want, abs=1e-6)


def test_verl_rows(exports):
    import datasets

    folder = exports["verl", "grpo"]
    ds = datasets.load_dataset("parquet", data_files={"train": str(folder / "data" / "train.parquet")})["train"]
    assert (
        len(ds) == 40
        and len(datasets.load_dataset("parquet", data_files=str(folder / "data" / "test.parquet"))["train"]) == 10
    )
    row = ds[0]
    a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split()
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b)) and op == "+"
    assert row["data_source"] == "lorarl/arithmetic" and json.loads(row["extra_info"]["lorarl_columns"])["answer"]
    assert (folder / "adapter" / "adapter_model.safetensors").is_file() and not (folder / "model").exists()


def test_openrlhf_rows_and_merged_model(exports, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = exports["openrlhf", "ppo"]
    rows = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 16 and isinstance(rows[0]["prompt"], list) and isinstance(rows[0]["answer"], str)
    assert rows[0]["datasource"] == "lorarl/arithmetic" and len({r["prompt"][-1]["content"] for r in rows}) == 40
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.dtype == torch.bfloat16  # the merged policy, not the base
    w = "model.layers.0.self_attn.q_proj.weight"
    assert (model.state_dict()[w].float() - base.state_dict()[w]).abs().max() > 1e-3


def test_reward_module_self_contained_and_user_rewards(tmp_path, tiny_model_dir):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, bonus=0.0, **kw):\n    return [float('!' in str(c)) + bonus for c in completions]\n"
    )
    (tmp_path / "file_rewards.py").write_text(
        "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    recipe = _recipe(
        tiny_model_dir,
        "grpo",
        [
            RewardSpec(name="numeric_match"),
            RewardSpec(name="length_penalty", weight=1.0, kwargs={"max_length": 20, "buffer": 10}),
            RewardSpec(name="my_rewards:shout", weight=2.0, kwargs={"bonus": 0.5}),
            RewardSpec(name=f"{tmp_path / 'file_rewards.py'}:one", weight=0.1),
        ],
    )
    text = reward_module_source(recipe, ground_truth_column="answer", conversational=False)
    assert "def numeric_match(" in text and "def length_penalty(" in text and "def format_reward(" not in text
    (tmp_path / "reward.py").write_text(text)
    code = (
        BLOCK_LORARL
        + f"sys.path.insert(0, {str(tmp_path)!r})\nimport json, reward\nprint(json.dumps(reward.score('7!', '7')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    values = json.loads(proc.stdout.strip().splitlines()[-1])
    assert values["numeric_match"] == 1.0 and values["length_penalty"] == 0.0 and values["shout"] == 1.5
    assert math.isclose(values["total"], 1.0 + 0.0 + 2.0 * 1.5 + 0.1)


def test_openrlhf_user_reward_reads_every_column(tmp_path, tiny_model_dir):
    """With a user reward (`file.py:function`), OpenRLHF labels carry every column as JSON and the file is copied."""
    import importlib.util

    (tmp_path / "user_rw.py").write_text(
        "def uses_b(prompts, completions, b=None, **kw):\n    return [float(x) / 100 for x in b]\n"
    )
    recipe = _recipe(
        tiny_model_dir, "grpo", [RewardSpec(name="numeric_match"), RewardSpec(name=f"{tmp_path}/user_rw.py:uses_b")]
    )
    out = tmp_path / "o"
    result = export(_make_run(tmp_path / "run", recipe), out, fmt="openrlhf")
    assert "user_rewards/user_rw.py" in result["files"]
    row = json.loads((out / "data" / "train.jsonl").read_text().splitlines()[0])
    assert "--data.label_key lorarl_columns" in (out / "run_openrlhf.sh").read_text()
    spec = importlib.util.spec_from_file_location("user_reward_mod", out / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.reward_func(["p" + f"= {row['answer']}"], ["p"], [row["lorarl_columns"]])
    assert got["rewards"].tolist() == pytest.approx([1.0 + row["b"] / 100])


def test_inlined_constants_follow_every_name_an_assignment_binds():
    """reward.py's inliner (lorarl.export.rewards_file): `A, B = ...` binds A and B (answers.py's tags: the exported
    file raised NameError in every built-in reward when only `A = ...` was followed); `D[k] = v` binds nothing."""
    import ast

    from lorarl.export.rewards_file import _bound_names

    def names(src):
        return _bound_names(ast.parse(src).body[0].targets[0])

    assert names("A = 1") == ["A"] and names("A, (B, *C) = x") == ["A", "B", "C"] and names("[D, E] = x") == ["D", "E"]
    assert names("D[k] = v") == [] and names("obj.attr = v") == []
