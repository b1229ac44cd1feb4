"""SFT: the cold-start data (worked solutions in the R1 format), SFT rows in TRL's formats rendered exactly as RL
prompts, the completion-only loss (by hand, micro-batch invariant), a tiny run that learns, resume, export, bad rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_grpo import peaky_model_dir  # noqa: F401  (the tiny model with x10 embeddings: learnable logits)

from lorarl.algos.loop import train
from lorarl.algos.sft import SFT, completion_dft, completion_nll, example_batch
from lorarl.cli import main
from lorarl.config import DataConfig, ModelConfig, recipe_from_dict
from lorarl.data import load_prompts
from lorarl.data.sft import load_sft
from lorarl.errors import DataError
from lorarl.model import SharedBase
from lorarl.model.tokens import end_of_turn_id
from lorarl.rewards.answers import is_correct
from lorarl.rewards.builtins import format_reward, numeric_match
from lorarl.rollout import generate_rollout
from lorarl.runs import read_metrics
from lorarl.tasks.arithmetic import (
    addition_steps,
    all_problems,
    make_problems,
    make_worked_examples,
    multiplication_steps,
    split_of,
    subtraction_steps,
    worked_solution,
)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))


# ---- cold-start data ----------------------------------------------------------------------------------------------


def test_worked_solutions_by_hand():
    assert subtraction_steps(47, 38) == ["ones: 17-8=9, borrow 1", "tens: 4-1-3=0"]
    assert subtraction_steps(100, 1) == ["ones: 10-1=9, borrow 1", "tens: 10-1-0=9, borrow 1", "hundreds: 1-1-0=0"]
    assert subtraction_steps(58, 23) == ["ones: 8-3=5", "tens: 5-2=3"]
    assert addition_steps(47, 38) == ["ones: 7+8=15, carry 1", "tens: 4+3+1=8"]
    assert addition_steps(99, 99) == ["ones: 9+9=18, carry 1", "tens: 9+9+1=19, carry 1"]
    assert multiplication_steps(47, 38) == ["47*8=376", "47*30=1410", "376+1410=1786"]
    assert multiplication_steps(30, 20) == ["30*20=600"]
    assert worked_solution(47, "-", 38) == (
        "<think>ones: 17-8=9, borrow 1. tens: 4-1-3=0. So 47-38=9.</think>\n<answer>9</answer>"
    )
    with pytest.raises(ValueError, match="a >= b"):
        subtraction_steps(3, 5)


def test_every_worked_solution_is_right_and_in_the_format_the_format_reward_checks():
    problems = all_problems(["+", "-", "*"], 2)
    texts = [worked_solution(a, op, b) for a, op, b in problems]
    answers = [str({"+": a + b, "-": a - b, "*": a * b}[op]) for a, op, b in problems]
    assert format_reward(None, texts) == [1.0] * len(texts)
    assert numeric_match(None, texts, answer=answers) == [1.0] * len(texts)
    # each column's digit is the result's digit (the think part is right, not only the answer)
    for a, b in [(p[0], p[2]) for p in problems if p[1] == "-"]:
        digits = [int(step.split("=")[1].split(",")[0]) for step in subtraction_steps(a, b)]
        assert int("".join(map(str, reversed(digits)))) == a - b
    assert format_reward(None, ["9", "<think></think><answer>9</answer>", "<answer>9</answer>"]) == [0.0] * 3


def test_cold_start_rows_are_training_problems_with_the_rl_prompt():
    rows = make_worked_examples(300, seed=1234, operations=["-"], template="What is {a} {op} {b}?")
    held_out = {(r["a"], r["b"]) for r in make_problems("eval", 200, seed=1234, operations=["-"])}
    assert all(split_of(r["a"], "-", r["b"], 1234) == "train" for r in rows)
    assert not held_out & {(r["a"], r["b"]) for r in rows}
    rl = make_problems("train", 300, seed=1234, operations=["-"])
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in rl]  # exactly the RL prompts, same order
    for r in rows:
        (msg,) = r["completion"]
        assert msg["role"] == "assistant" and is_correct(msg["content"], r["answer"])


# ---- SFT rows -----------------------------------------------------------------------------------------------------


def test_sft_rows_in_every_trl_format_render_like_rl_prompts(tok, tmp_path):
    eos = end_of_turn_id(None, tok)
    q = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = [
        {"prompt": q, "completion": [{"role": "assistant", "content": "5"}], "answer": "5"},
        {"prompt": q, "completion": "5"},
        {"messages": q + [{"role": "assistant", "content": "5"}]},
        {"prompt": "2 + 3 =", "completion": " 5"},
    ]
    data = load_sft(DataConfig(source="x", system_prompt="Be brief."), tok, eos, 128, rows=rows)
    # the RL path (a prompt file read by load_prompts) gives the same prompt tokens
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": q}) + "\n")
    rl = load_prompts(DataConfig(source=str(tmp_path / "p.jsonl"), system_prompt="Be brief."), tok, "train")
    assert data.prompt_ids[0] == data.prompt_ids[1] == data.prompt_ids[2] == rl.token_ids[0]
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + q, tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(data.prompt_ids[0]) == text and text.endswith("<|im_start|>assistant\n")
    five = tok("5", add_special_tokens=False)["input_ids"]
    assert data.completion_ids[0] == data.completion_ids[1] == data.completion_ids[2] == five + [eos]
    assert tok.decode([eos]) == "<|im_end|>"  # SmolLM2 ends an assistant turn (and a rollout) with it
    assert data.prompt_ids[3] == tok("2 + 3 =")["input_ids"]  # a plain-text prompt is used as is


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "2 + 3 ="}, "row 1: column 'completion' is missing"),
        ({"prompt": "2 + 3 =", "completion": "  "}, "row 1: column 'completion' is empty"),
        ({"prompt": "2 + 3 =", "completion": [{"role": "user", "content": "5"}]}, "must be an assistant message"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 1: column 'messages' must list"),
        (
            {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]},
            "must end with an assistant message",
        ),
        ({"completion": "5"}, "row 1: column 'prompt' is missing"),
    ],
)
def test_bad_sft_rows_are_named(tok, row, message):
    good = {"prompt": "1 + 1 =", "completion": " 2"}
    with pytest.raises(DataError, match=message):
        load_sft(DataConfig(source="x"), tok, 2, 128, rows=[good, row])
    skipped = load_sft(DataConfig(source="x", on_bad_row="skip"), tok, 2, 128, rows=[good, row])
    assert len(skipped) == 1 and skipped.skipped[0][0] == 1


def test_too_long_rows_and_no_usable_rows(tok):
    with pytest.raises(DataError, match=r"more than sft.max_length=4"):
        load_sft(DataConfig(source="x"), tok, 2, 4, rows=[{"prompt": "1 + 1 =", "completion": " 2 and more"}])
    with pytest.raises(DataError, match="no usable SFT rows"):
        load_sft(DataConfig(source="x", on_bad_row="skip"), tok, 2, 128, rows=[{"prompt": "x"}])


# ---- the loss -----------------------------------------------------------------------------------------------------


def test_completion_nll_by_hand():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    assert float(completion_nll(lp, mask, 3)) == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    # two micro-batches' shares sum to the batch loss
    assert float(completion_nll(lp[:1], mask[:1], 3) + completion_nll(lp[1:], mask[1:], 3)) == pytest.approx(2.0)


def test_completion_dft_by_hand():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss = completion_dft(lp, mask, 3)
    e = math.exp
    assert float(loss) == pytest.approx((e(-1) + 2 * e(-2) + 3 * e(-3)) / 3)  # 0.262637
    loss.backward()  # d/dlogp = -p m / N: the probability is held constant (stop-gradient)
    want = [[-e(-1) / 3, -e(-2) / 3], [-e(-3) / 3, 0.0]]
    assert torch.allclose(lp.grad, torch.tensor(want))


def test_completion_dft_equals_trls_sft_compute_loss():
    """TRL 1.16's ``SFTTrainer.compute_loss`` with ``loss_type="dft"``, run on a stub trainer whose model returns
    given per-token log-probs (its fused-LM-head outputs: zero on ignored positions): the same loss and gradient."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl import SFTTrainer

    torch.manual_seed(0)
    logp = -torch.rand(3, 7) * 4
    mask = torch.rand(3, 7) > 0.3
    ours_in, trl_in = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours = completion_dft(ours_in, mask, int(mask.sum()))
    ours.backward()

    def model(**inputs):
        assert inputs["fused_lm_head"] is True
        zeros = torch.zeros(3, 7)
        return SimpleNamespace(log_probs=trl_in * mask, label_mask=mask, entropy=zeros, is_top1=zeros.bool())

    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        aux_loss_enabled=False,
        accelerator=SimpleNamespace(parallelism_config=None, gather_for_metrics=lambda t: t),
        compute_loss_func=None,
        label_smoother=None,
        args=SimpleNamespace(loss_type="dft", average_tokens_across_devices=False),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    theirs = SFTTrainer.compute_loss(stub, model, {"input_ids": torch.zeros(3, 7), "attention_mask": torch.ones(3, 7)})
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert torch.allclose(ours_in.grad, trl_in.grad, atol=1e-7)
    stub.args.loss_type = "nll"  # and TRL's nll is completion_nll
    theirs_nll = SFTTrainer.compute_loss(
        stub, model, {"input_ids": torch.zeros(3, 7), "attention_mask": torch.ones(3, 7)}
    )
    assert float(completion_nll(logp, mask, int(mask.sum()))) == pytest.approx(float(theirs_nll), rel=1e-6)


def sft_recipe(model_dir, **sections):
    data = {
        "algo": "sft",
        "model": {"name": str(model_dir), "quantization": "none", "dtype": "float32", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_size": 8, "eval_size": 4, "arithmetic": {"operations": ["-"]}},
        "generation": {"max_new_tokens": 8},
        "sft": {"batch_size": 4},
        "train": {"steps": 4, "learning_rate": 1e-2, "micro_batch_size": 4, "seed": 0},
        "eval": {"n": 4, "batch_size": 4},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # kept the gradient
def test_loss_only_on_completion_tokens_and_micro_batches_do_not_change_the_gradient(tiny_model_dir):
    grads = []
    for mbs in (4, 1):
        shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
        torch.manual_seed(0)
        algo = SFT(sft_recipe(tiny_model_dir, train={"micro_batch_size": mbs}), shared)
        with torch.no_grad():  # a non-zero LoRA B so the gradient reaches every LoRA matrix
            for p in algo.policy.params:
                p.add_(torch.randn_like(p) * 0.01)
        algo.policy.optimizer.step = lambda: None  # keep the gradient, take no step
        algo.policy.optimizer.zero_grad = lambda set_to_none=True: None
        row = algo.step(algo.batch(1))
        grads.append([p.grad.clone() for p in algo.policy.params])
        if mbs == 4:  # the logged loss is the token-mean NLL of the completions, computed directly
            b = example_batch(algo.data, algo.batch(1).rows, shared.pad_id)
            ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
            att = torch.cat([b.prompt_mask, b.completion_mask], 1).long()
            pos = (att.cumsum(-1) - 1).clamp(min=0)  # left-padded prompts: positions count real tokens only
            with torch.no_grad(), shared.role("policy"):
                logits = shared.module(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
            P = b.prompt_ids.shape[1]
            lp = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, b.completion_ids[..., None])[..., 0]
            want = -(lp * b.completion_mask).sum() / b.completion_mask.sum()
            assert row["loss"] == pytest.approx(float(want), rel=1e-4)
            assert row["completion_tokens"] == int(b.completion_mask.sum())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_dft_step_logs_the_dft_loss_of_the_policys_own_logits(tiny_model_dir):
    """sft.loss_type dft: the logged loss is -(1/N) sum m sg(p) log p from the model's full logits, no perplexity."""
    shared = SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))
    torch.manual_seed(0)
    algo = SFT(sft_recipe(tiny_model_dir, sft={"loss_type": "dft"}), shared)
    b = example_batch(algo.data, algo.batch(1).rows, shared.pad_id)
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    att = torch.cat([b.prompt_mask, b.completion_mask], 1).long()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), shared.role("policy"):  # before the step: the loss is the step's starting point
        logits = shared.module(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    P = b.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, b.completion_ids[..., None])[..., 0]
    want = -(lp * lp.exp() * b.completion_mask).sum() / b.completion_mask.sum()
    row = algo.step(algo.batch(1))
    assert row["loss"] == pytest.approx(float(want), rel=1e-4) and row["perplexity"] is None
    nll = -(lp * b.completion_mask).sum() / b.completion_mask.sum()
    assert float(want) < float(nll)  # each token's NLL weighted by its probability (< 1)


def test_tiny_sft_learns_resumes_bit_identically_and_exports(peaky_model_dir, tmp_path):  # noqa: F811
    target = "The answer is 7."
    data = tmp_path / "sft.jsonl"
    pairs = [(20, 13), (30, 23), (45, 38), (17, 10), (99, 92), (57, 50), (68, 61), (80, 73)]
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {a} - {b}?", "completion": target}) + "\n" for a, b in pairs)
    )
    recipe = sft_recipe(
        peaky_model_dir, data={"source": str(data)}, train={"steps": 30, "save_every": 10}, sft={"epochs": 100}
    )
    result = train(recipe, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.3 * first, (first, last)
    assert result["examples"] == 8 and result["policy"].endswith("policy")
    # greedy decoding of an unseen prompt now starts with the completion it was taught
    shared = SharedBase.load(recipe.model)
    shared.add_adapter("policy", init_from=tmp_path / "run" / "policy", trainable=False)
    prompt = shared.tokenizer("What is 64 - 57?")["input_ids"]
    out = generate_rollout(shared, [prompt], recipe.generation, role="policy", greedy=True, max_new_tokens=8)
    assert out.completions[0].startswith(target), out.completions
    # stopped after step 10, resumed: bit-identical adapter and losses
    train(recipe, tmp_path / "split", max_steps=10)
    train(recipe, tmp_path / "split", resume=True)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "run" / "policy" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "split" / "policy" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["loss"] for r in read_metrics(tmp_path / "split")] == [r["loss"] for r in rows]
    # sft.epochs bounds the run: 8 examples, batch 4, 1 epoch -> 2 steps
    one_epoch = sft_recipe(peaky_model_dir, data={"source": str(data)}, train={"steps": 50})
    assert train(one_epoch, tmp_path / "epoch")["steps"] == 2
    # batches run on across epochs: 8 examples, batch 6, 2 epochs = 16 examples -> 3 steps (not 2 x ceil(8 / 6))
    two_epochs = sft_recipe(
        peaky_model_dir, data={"source": str(data)}, train={"steps": 50}, sft={"batch_size": 6, "epochs": 2}
    )
    assert train(two_epochs, tmp_path / "epochs2")["steps"] == 3
    # the run exports like an RL run
    from lorarl.export import export

    export(str(tmp_path / "run"), str(tmp_path / "export"), fmt="adapter", dtype="fp32")
    assert (tmp_path / "export" / "adapter_config.json").is_file()


def test_cli_sft_row_without_completion_is_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "completion": " 2"}) + "\n" + json.dumps({"prompt": "2 + 2 ="}))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        f"algo: sft\nmodel: {{name: {tiny_model_dir}, quantization: none, dtype: float32}}\n"
        f"data: {{source: {data}}}\ntrain: {{steps: 1}}\n"
    )
    assert main(["train", str(recipe), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"lorarl: error: {data}: row 1: column 'completion' is missing (an SFT row needs prompt + completion, or "
        "messages ending with the assistant's answer) (set data.on_bad_row: skip to drop bad rows)"
    )
    assert not (tmp_path / "run" / "policy").exists()
