"""On-policy distillation (algo: distill): the generalized JSD against hand-computed values and against TRL 1.16's own
code (the GKD trainer's ``generalized_jsd_loss`` and the DistillationTrainer's chunked loss, gradients included), the
chunked computation against the unchunked one, the teacher in both forms (a second model folder, an adapter on the
one base), the tokenizer check, a run through YAML, through ``lorarl.train`` (resumed bit-identically) and through
``lorarl.trl`` (TRL's quick start unchanged), and the planner's terms against hand computations and a measured step.
"""

from __future__ import annotations

import json
import math
import runpy
import shutil
from pathlib import Path

import pytest
import test_trl_dropin
import torch

from lorarl.core.distillation import generalized_jsd
from lorarl.core.losses import reduce_loss
from lorarl.errors import LorarlError
from lorarl.model.chunked import chunked_divergence

REPO = Path(__file__).resolve().parents[1]
terse_model_dir = test_trl_dropin.terse_model_dir  # the fixture: a tiny model that ends every reply at once
TRL_METRICS = [  # TRL's DistillationTrainer logs these (plus transformers' loss / grad_norm / learning_rate)
    "loss",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "grad_norm",
    "learning_rate",
    "step_time",
]


# ---- the loss ---------------------------------------------------------------------------------------------------


def test_generalized_jsd_by_hand():
    """p_S = [0.5, 0.5], p_T = [0.8, 0.2]: forward KL, reverse KL and the JSD written out."""
    s = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[math.log(4.0), 0.0]])
    forward = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    reverse = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    m = [0.65, 0.35]
    jsd = 0.5 * (0.8 * math.log(0.8 / m[0]) + 0.2 * math.log(0.2 / m[1])) + 0.5 * (
        0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    )
    assert (round(forward, 6), round(reverse, 6), round(jsd, 6)) == (0.192745, 0.223144, 0.050672)
    for beta, want in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
        assert float(generalized_jsd(s, t, beta)) == pytest.approx(want, abs=1e-6)
    # temperature 2 softens both: p_S stays uniform, p_T = [2/3, 1/3]
    soft = 0.5 * math.log(0.5 / (2 / 3)) + 0.5 * math.log(0.5 / (1 / 3))
    assert float(generalized_jsd(s, t, 1.0, temperature=2.0)) == pytest.approx(soft, abs=1e-6)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, 1.5)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_equals_trls_gkd_loss(beta, temperature):
    """TRL's GKDTrainer.generalized_jsd_loss (the formula DistillationTrainer's kernel implements) on random logits,
    padding positions labelled -100: lorarl's per-token divergence reduced as the token mean over the mask."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    torch.manual_seed(0)
    s = torch.randn(3, 5, 17, dtype=torch.float64) * 3
    t = torch.randn(3, 5, 17, dtype=torch.float64) * 3
    labels = torch.randint(0, 17, (3, 5))
    labels[0, 3:] = -100
    labels[2, 1:] = -100
    mask = labels != -100
    ours = (generalized_jsd(s, t, beta, temperature).double() * mask).sum() / mask.sum()
    theirs = GKDTrainer.generalized_jsd_loss(s.float(), t.float(), labels=labels, beta=beta, temperature=temperature)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_loss_and_gradients_equal_trls_distillation_trainer(beta):
    """TRL 1.16's DistillationTrainer loss (``_chunked_divergence_loss``: both models' hidden states and heads, the
    token sum over the completion mask divided by its count, and the summed student entropy) against lorarl's
    chunked divergence reduced by token mean: the loss, the entropy and the gradients of the student's hidden
    states and head."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    torch.manual_seed(1)
    B, T, H, V = 3, 7, 8, 41
    h_s = torch.randn(B, T, H, dtype=torch.float32)
    h_t = torch.randn(B, T, H, dtype=torch.float32)
    w_s = torch.randn(V, H, dtype=torch.float32)
    w_t = torch.randn(V, H, dtype=torch.float32)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False

    hs1, ws1 = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    loss_trl, ent_sum, n = _chunked_divergence_loss(hs1, h_t, ws1, w_t, mask.long(), beta, temperature=0.8)
    loss_trl.backward()

    hs2, ws2 = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    head_s, head_t = _Head(ws2), _Head(w_t)
    div, ent = chunked_divergence(hs2, head_s, h_t, head_t, beta, 0.8, chunk_size=3)
    loss = reduce_loss(
        div, mask, "token_mean", total_rows=B, total_sequences=B, total_tokens=int(mask.sum()), max_len=T
    )
    loss.backward()
    assert int(n) == int(mask.sum())
    assert float(loss.detach()) == pytest.approx(float(loss_trl.detach()), rel=1e-5)
    assert float(ent[mask].sum()) == pytest.approx(float(ent_sum), rel=1e-5)
    # both compute in fp32 (TRL's tiles always do), in a different order: rounding apart
    torch.testing.assert_close(hs2.grad, hs1.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws2.grad, ws1.grad, rtol=1e-4, atol=1e-6)


class _Head(torch.nn.Module):
    """``h @ w.T``: an output projection over a given weight (the tests' heads)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.T


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_divergence_equals_unchunked_values_and_gradients(beta):
    """A chunk of positions at a time (1, 3, or all; a chunk bounded by tokens) equals one pass over the full
    ``[B, T, V]`` logits of both models, values and the gradients of the student's hidden states and head."""
    torch.manual_seed(2)
    B, T, H, V = 2, 9, 6, 23
    h_s, h_t = torch.randn(B, T, H), torch.randn(B, T, H)
    w_s, w_t = torch.randn(V, H), torch.randn(V, H)

    def run(**chunking):
        hs, ws = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
        if chunking:
            div, _ = chunked_divergence(hs, _Head(ws), h_t, _Head(w_t), beta, 1.3, **chunking)
        else:
            div = generalized_jsd(hs @ ws.T, h_t @ w_t.T, beta, 1.3)
        (div * torch.linspace(0.5, 2.0, T)).sum().backward()
        return div.detach(), hs.grad, ws.grad

    want = run()
    for chunking in ({"chunk_size": 1}, {"chunk_size": 3}, {"chunk_size": 64}, {"chunk_size": 64, "chunk_tokens": 4}):
        got = run(**chunking)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_banned_tokens_and_unequal_vocab_widths():
    """A -inf logit (a token of probability 0 in either model) gives a finite divergence; heads of different widths
    are compared over their common columns (a head padded past the tokenizer)."""
    s = torch.tensor([[0.0, 1.0, -math.inf]])
    t = torch.tensor([[0.5, -math.inf, 0.0]])
    for beta in (0.0, 0.5, 1.0):
        assert torch.isfinite(generalized_jsd(s, t, beta)).all()
    wide = torch.tensor([[0.0, 1.0, 2.0, 7.0]])
    assert float(generalized_jsd(wide, t[:, :3].nan_to_num(neginf=-1.0), 1.0)) == pytest.approx(
        float(generalized_jsd(wide[:, :3], t[:, :3].nan_to_num(neginf=-1.0), 1.0))
    )


def test_divergence_chunk_memory_is_what_the_planner_counts():
    """The planner's per-element bytes of a divergence chunk's backward (lorarl.plan.distill), re-measured: the
    profiler's CPU allocation peak of one chunk forward + backward, per ``[row, position, vocab]`` element."""
    from torch.profiler import ProfilerActivity, profile

    from lorarl.bench.memory import allocation_curve
    from lorarl.plan.distill import DIVERGENCE_BYTES_JSD, DIVERGENCE_BYTES_KL

    B, c, V, H = 2, 8, 8192, 16
    for beta, extra in ((1.0, DIVERGENCE_BYTES_KL), (0.5, DIVERGENCE_BYTES_JSD)):
        head_s, head_t = (torch.nn.Linear(H, V, bias=False).requires_grad_(False) for _ in range(2))
        hs, ht = torch.randn(B, c, H, requires_grad=True), torch.randn(B, c, H)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            div, _ = chunked_divergence(hs, head_s, ht, head_t, beta, 1.0, chunk_size=c)
            div.sum().backward()
        per_element = max(allocation_curve(prof)[1]) / (B * c * V)
        assert per_element == pytest.approx(2 * 4 + extra, abs=1.0), (beta, per_element)


# ---- the teacher ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A second tiny random model (another seed) with the same tokenizer: a teacher folder."""
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


@pytest.fixture(scope="module")
def teacher_adapter_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA adapter folder on the tiny base with random weights (a fresh adapter's B is zero: the base itself)."""
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    sb = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    torch.manual_seed(5)
    sb.add_adapter("policy", LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.add_(torch.randn_like(p) * 0.5)
    return sb.save_adapter("policy", tmp_path_factory.mktemp("adapter-teacher") / "policy")


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tiny_shared, teacher_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from lorarl.model.teacher import load_teacher

    other = tmp_path / "other-tokenizer"
    shutil.copytree(teacher_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-student>"])
    tok.save_pretrained(other)
    with pytest.raises(LorarlError) as err:
        load_teacher(str(other), tiny_shared)
    line = str(err.value)
    assert "\n" not in line and str(other) in line and str(tiny_shared.cfg.name) in line
    assert line.startswith("distill.teacher: ") and "different tokenizers" in line and "tokens" in line
    for missing in (tmp_path / "no-such-teacher", "runs/no-such-run"):
        with pytest.raises(LorarlError) as err:
            load_teacher(str(missing), tiny_shared)
        assert "\n" not in str(err.value) and str(err.value).startswith(f"distill.teacher: {missing} is not a model")
    tiny_shared.add_adapter("policy")
    assert load_teacher(str(teacher_model_dir), tiny_shared).kind == "model"  # the same tokenizer loads


def test_teacher_kinds_and_the_output_head_rule(tiny_shared, teacher_adapter_dir, tmp_path):
    """A PEFT folder (or a run folder holding policy/) is an adapter on the one base; one that adapts lm_head, or a
    student LoRA that does, is refused."""
    from lorarl.model.teacher import adapter_folder, adapts_head, load_teacher

    assert adapter_folder(str(teacher_adapter_dir.parent)) == teacher_adapter_dir
    assert adapter_folder(str(tmp_path)) is None
    assert adapts_head(["q_proj", "lm_head"]) and adapts_head("all-linear", ["lm_head"])
    assert not adapts_head("all-linear") and not adapts_head(["q_proj", "v_proj"])
    tiny_shared.add_adapter("policy")
    teacher = load_teacher(str(teacher_adapter_dir.parent), tiny_shared)
    assert (teacher.kind, teacher.role, teacher.shared) == ("adapter", "teacher", tiny_shared)
    bad = tmp_path / "head-adapter"
    shutil.copytree(teacher_adapter_dir, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(LorarlError, match="adapts the output head"):
        load_teacher(str(bad), tiny_shared)


# ---- runs -------------------------------------------------------------------------------------------------------


def _sections(student: Path, teacher: str, **train) -> dict:
    return {
        "algo": "distill",
        "model": {"name": str(student), "quantization": "none", "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"source": "arithmetic", "train_size": 32, "eval_size": 8},
        "generation": {"max_new_tokens": 6},
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 2, "learning_rate": 2e-2, **train},
        "distill": {"teacher": teacher, "beta": 0.5},
        "eval": {"n": 4, "batch_size": 4},
    }


def test_a_distill_recipe_trains_through_yaml_with_a_second_model(tiny_model_dir, teacher_model_dir, tmp_path):
    """A YAML recipe through lorarl.train (the run loop `lorarl train` runs) with a second-model teacher."""
    import yaml

    import lorarl

    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(_sections(tiny_model_dir, str(teacher_model_dir))))
    lorarl.train(str(path), tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    missing = [m for m in TRL_METRICS if m not in rows[0]]
    assert not missing, missing
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert rows[1]["num_tokens"] > rows[0]["num_tokens"] > 0
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # parity: the student samples what it scores
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["teacher_kind"], summary["beta"]) == ("model", 0.5)
    assert (tmp_path / "run" / "policy" / "adapter_model.safetensors").is_file()
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert samples and all(s["divergence"] >= 0 for s in samples)


def test_the_student_moves_toward_the_teacher(tiny_model_dir, teacher_adapter_dir):
    """Steps of the real algorithm lower the divergence to the teacher on a fixed set of the student's samples (the
    teacher: a random LoRA adapter on the same base, which the student's adapter can represent)."""
    from lorarl.algos import make_algorithm
    from lorarl.algos.distill import distill_loss
    from lorarl.api import load_recipe
    from lorarl.bench.memory import run_step
    from lorarl.core.losses import batch_totals
    from lorarl.model import SharedBase
    from lorarl.rollout import generate_rollout

    recipe = load_recipe(_sections(tiny_model_dir, str(teacher_adapter_dir), steps=6, learning_rate=5e-2))
    shared = SharedBase.load(recipe.model)
    algo = make_algorithm(recipe, shared)
    torch.manual_seed(0)
    fixed = generate_rollout(shared, [algo.prompts.token_ids[i] for i in range(8)], recipe.generation, role="policy")
    rows = torch.arange(len(fixed))

    def divergence() -> float:
        with torch.no_grad():
            loss, _ = distill_loss(
                rows,
                shared=shared,
                teacher=algo.teacher,
                rollout=fixed,
                beta=0.5,
                temperature=1.0,
                totals=batch_totals(fixed.completion_mask),
                row_divergence=torch.zeros(len(fixed)),
            )
        return float(loss)

    before = divergence()
    losses = [run_step(algo, step)[0]["loss"] for step in range(1, 7)]
    after = divergence()
    # (a random tiny model's distributions are near uniform, so the divergence is small in nats; it falls by 44%)
    assert before > 1e-3 and after < 0.7 * before, (before, after, losses)


def test_lorarl_train_with_an_adapter_teacher_resumes_bit_identically(tiny_model_dir, teacher_adapter_dir, tmp_path):
    from safetensors.torch import load_file

    import lorarl

    sections = _sections(tiny_model_dir, str(teacher_adapter_dir.parent), save_every=1)
    whole = lorarl.train(sections, tmp_path / "whole", progress=False)
    assert whole.summary["teacher_kind"] == "adapter" and len(whole.metrics) == 2
    lorarl.train(sections, tmp_path / "parts", max_steps=1, progress=False)
    resumed = lorarl.train(sections, tmp_path / "parts", resume=True, progress=False)
    assert resumed.summary["steps_this_run"] == 1
    a = load_file(str(tmp_path / "whole" / "policy" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "policy" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["num_tokens"] for r in whole.metrics] == [r["num_tokens"] for r in resumed.metrics]


def _gsm8k_folder(folder: Path) -> Path:
    """A local dataset folder with openai/gsm8k's fields and its ``main`` configuration."""
    (folder / "main").mkdir(parents=True)
    rows = [{"question": f"What is {a} + 3?", "answer": f"#### {a + 3}"} for a in range(4)]
    (folder / "main" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    return folder


def test_trl_distillation_quickstart_runs_unchanged(terse_model_dir, teacher_model_dir, tmp_path, monkeypatch):
    """TRL's documented quick start (examples/trl_quickstarts/distillation.py, only the import changed): one step on a
    tiny student that ends every reply at once (TRL's default is 8 completions of up to 512 tokens) with a tiny
    teacher model and a local copy of gsm8k's fields; TRL's metric names, the saved adapter."""
    monkeypatch.setenv("QUICKSTART_MODEL", str(terse_model_dir))
    monkeypatch.setenv("QUICKSTART_TEACHER", str(teacher_model_dir))
    monkeypatch.setenv("QUICKSTART_DATA", str(_gsm8k_folder(tmp_path / "gsm8k")))
    monkeypatch.setenv("LORARL_TRL_MAX_STEPS", "1")
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(REPO / "examples" / "trl_quickstarts" / "distillation.py"), run_name="__main__")
    run = tmp_path / "results" / "distill-qwen-gsm8k"
    assert (run / "adapter_model.safetensors").is_file() and (run / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    missing = [m for m in TRL_METRICS if m not in rows[0]]
    assert not missing, missing
    trainer = scope["trainer"]
    assert trainer.recipe["distill"] == {"teacher": str(teacher_model_dir), "beta": 1.0}
    assert trainer.recipe["train"]["prompts_per_step"] == 8 and trainer.state.log_history == rows


def test_trl_distillation_trainer_with_an_adapter_teacher(tiny_model_dir, teacher_adapter_dir, tmp_path):
    from peft import LoraConfig
    from trl import DistillationConfig as TRLConfig

    from lorarl.trl import DistillationConfig, DistillationTrainer
    from lorarl.trl.fields import Refused

    assert DistillationConfig is TRLConfig
    args = DistillationConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, bf16=False, beta=0.0
    )
    args.max_completion_length, args.learning_rate, args.temperature = 6, 1e-3, 0.9
    trainer = DistillationTrainer(
        model=str(tiny_model_dir),
        teacher_model=str(teacher_adapter_dir),
        args=args,
        train_dataset=[{"prompt": [{"role": "user", "content": "What is 2 + 2?"}]}] * 4,
        peft_config=LoraConfig(r=4, lora_alpha=8),
    )
    assert trainer.recipe["distill"] == {"teacher": str(teacher_adapter_dir), "beta": 0.0}
    assert trainer.recipe["generation"] == {"max_new_tokens": 6, "temperature": 0.9}
    out = trainer.train()
    assert out.global_step == 1 and trainer.run.summary["teacher_kind"] == "adapter"
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    with pytest.raises(LorarlError, match="needs a teacher"):
        DistillationTrainer(model=str(tiny_model_dir), args=args, train_dataset=[{"prompt": "hi"}] * 2)
    args.top_p = 0.9
    with pytest.raises(Refused, match=r"^DistillationConfig.top_p=0.9: "):
        DistillationTrainer(model=str(tiny_model_dir), teacher_model="x", args=args, train_dataset=[{"prompt": "hi"}])


# ---- the plan ---------------------------------------------------------------------------------------------------


def test_plan_counts_the_teacher(tmp_path, capsys):
    """A second-model teacher's weights (its own shape, the base's quantization), or a frozen adapter sized like the
    policy's; the training phase's teacher forward and divergence chunk by hand; ``lorarl plan`` prints them."""
    from lorarl.cli import main
    from lorarl.config import recipe_from_dict
    from lorarl.plan import estimate_memory, model_shape, recipe_settings
    from lorarl.plan.distill import divergence_chunk_bytes
    from lorarl.plan.terms import base_weight_bytes, dequantized_weight_bytes, layer_forward_bytes

    def recipe(teacher: str, beta: float = 1.0):
        return recipe_from_dict(
            {
                "algo": "distill",
                "model": {"name": "qwen2.5-0.5b"},
                "generation": {"max_new_tokens": 128},
                "train": {"prompts_per_step": 16, "micro_batch_size": 4},
                "distill": {"teacher": teacher, "beta": beta},
            }
        )

    student, big = model_shape("qwen2.5-0.5b"), model_shape("qwen2.5-7b")
    s = recipe_settings(recipe("qwen2.5-7b"), device_type="cuda")
    assert (s.algo, s.teacher, s.teacher_model, s.group_size, s.kl_coef) == ("distill", "model", "qwen2.5-7b", 1, 0.0)
    est = estimate_memory(student, s)
    weights = base_weight_bytes(big, "nf4", 2, True)
    persistent = est["breakdown"]["persistent"]
    assert persistent["teacher_base_linear_weights"] == int(weights["base_linear_weights"])
    assert persistent["teacher_base_other_weights"] == int(weights["base_other_weights"])
    training = estimate_memory(student, s)["phases"]["training"]
    moments = {m: sum(v.values()) for m, v in _training_moments(student, s).items()}
    T = s.prompt_len + 128
    assert _training_moments(student, s)["teacher_forward"] == {
        "teacher_hidden_states": 2 * 4 * T * big.hidden_size * 2,
        "teacher_layer_forward": layer_forward_bytes(big, 2, 4 * T, False, dequantized_weight_bytes(big, "nf4", 2)),
        "attention_mask": 4 * T * T,
    }
    logits = _training_moments(student, s)["logits"]
    vocab = min(student.vocab_size, big.vocab_size)
    assert logits["divergence_chunk"] == divergence_chunk_bytes(vocab, 4, 128, 2, 1.0) == 4 * 128 * vocab * 28
    assert logits["teacher_hidden"] == 4 * 128 * big.hidden_size * 2
    assert training == sum(est["breakdown"]["persistent"].values()) + max(moments.values())
    jsd = _training_moments(student, recipe_settings(recipe("qwen2.5-7b", 0.5), device_type="cuda"))["logits"]
    assert jsd["divergence_chunk"] == 4 * 128 * vocab * 44
    # model.quantization auto on a 24 GB card: the 0.5B student in bf16, the 7B teacher in NF4, as each loads
    on_card = recipe_settings(recipe("qwen2.5-7b"), device_type="cuda", shape=student, budget_bytes=24e9)
    assert (on_card.quantization, on_card.teacher_quantization) == ("none", "nf4")
    card = estimate_memory(student, on_card)["breakdown"]["persistent"]
    assert card["teacher_base_linear_weights"] == int(weights["base_linear_weights"])
    assert card["base_linear_weights"] == int(base_weight_bytes(student, "none", 2, True)["base_linear_weights"])

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    sa = recipe_settings(recipe(str(adapter)), device_type="cuda")
    est_a = estimate_memory(student, sa)
    assert sa.teacher == "adapter"
    assert est_a["breakdown"]["persistent"]["lora_teacher_frozen"] == 4 * est_a["params"]["lora_policy"]
    assert "teacher_base_linear_weights" not in est_a["breakdown"]["persistent"]

    path = tmp_path / "distill.yaml"
    path.write_text(json.dumps({**_sections(Path("qwen2.5-0.5b"), "qwen2.5-7b"), "model": {"name": "qwen2.5-0.5b"}}))
    assert main(["plan", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    printed = json.loads(lines[-1])["breakdown_gb"]
    assert printed["persistent"]["teacher_base_linear_weights"] > 3  # Qwen2.5-7B's NF4 projections: ~3.6 GB
    assert "divergence_chunk" in printed["training"] or "teacher_hidden_states" in printed["training"]
    assert any("teacher" in line for line in lines[:-1])


def _training_moments(shape, s):
    from lorarl.plan.distill import distill_training_moments
    from lorarl.plan.settings import step_sizes

    return distill_training_moments(shape, s, step_sizes(shape, s))


def test_a_real_step_on_the_cpu_stays_under_the_plan_and_close_to_it(tiny_model_dir, teacher_model_dir):
    """The real distillation step (a second-model teacher) on the tiny models, its training phase's tensor peak read
    by the profiler (lorarl.bench.memory, as the planner's other validations), against the planner: within 5% below
    and 35% above, as the SFT and reward-model steps are held."""
    from lorarl.algos import make_algorithm
    from lorarl.api import load_recipe
    from lorarl.bench.memory import PhasePeaks, run_step, tensor_bytes
    from lorarl.model import SharedBase
    from lorarl.plan import estimate_memory, model_shape, recipe_settings

    sections = _sections(tiny_model_dir, str(teacher_model_dir), micro_batch_size=4)
    sections["generation"]["max_new_tokens"] = 16
    recipe = load_recipe(sections, ["model.logprob_chunk_size=8"])
    shared = SharedBase.load(recipe.model)
    algo = make_algorithm(recipe, shared)
    run_step(algo, 1)  # AdamW states exist from here on, as in a long run
    meter = PhasePeaks(shared.device, lambda: tensor_bytes([shared, algo.teacher.shared], algo.optimizers.values()))
    metrics, _ = run_step(algo, 2, meter)
    shape = model_shape(tiny_model_dir)
    s = recipe_settings(recipe, device_type="cpu", shape=shape)
    s.prompt_len = max(len(algo.prompts.token_ids[i]) for i in algo.batch(2).prompt_index)
    s.max_new_tokens = int(metrics["completions/max_length"])
    predicted = estimate_memory(shape, s)["phases"]["training"]
    ratio = predicted / meter.peaks["training"]
    assert 0.95 <= ratio <= 1.35, (predicted, meter.peaks["training"])


def test_the_workbench_train_tab_offers_the_distillation_recipe():
    """The Train tab lists recipes/distill_arithmetic.yaml with its teacher and beta as fields (GRPO's group size
    left out), and its plan line names the teacher when it has not been exported yet."""
    from lorarl.app.recipes import fields_for, list_recipes, plan_line

    recipe = REPO / "recipes" / "distill_arithmetic.yaml"
    assert str(recipe) in [c.path for c in list_recipes([REPO / "recipes"], REPO / "no-runs")]
    keys = [f.key for f in fields_for(recipe)]
    assert "distill.teacher" in keys and "distill.beta" in keys and "grpo.group_size" not in keys
    assert "distill.teacher" not in [f.key for f in fields_for(REPO / "recipes" / "grpo_arithmetic.yaml")]
    line = plan_line(recipe, ["distill.teacher=/no/such/teacher"])
    assert (
        line.startswith("plan: distill.teacher /no/such/teacher: its shape cannot be read offline") and "\n" not in line
    )
