"""``python -m lorarl.export.gap`` (tiny model, CPU): the figures of docs/exporting.md's "NF4 training model vs merged
full-precision export" table — both models' held-out accuracy, their logits' max / mean |diff| and top-1 agreement
on the same tokens, identical greedy completions — by hand, on identical models, on a perturbed adapter against an
independent PEFT computation, and on a real NF4 base; and the table as docs/exporting.md prints it."""

from __future__ import annotations

import json

import pytest
import torch
from export_runs import make_run

from lorarl.export import export
from lorarl.export.gap import gap_table, logit_gap, main, measure_nf4_gap

ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
    for a, b in [(12, 30), (45, 11), (7, 8), (60, 21)]
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict:
    """A run with an all-zero adapter (merging it gives back the base exactly), its merged fp32 export, and a run
    with a random adapter (B != 0)."""
    root = tmp_path_factory.mktemp("gap")
    zero = make_run(root / "zero", tiny_model_dir, scale=0.0)
    export(zero, root / "zero-merged", fmt="merged", dtype="fp32", gate_n=0)
    return {"zero": zero, "base": root / "zero-merged", "random": make_run(root / "random", tiny_model_dir)}


def test_logit_gap_by_hand():
    a = torch.tensor([[[1.0, 2.0], [3.0, 0.0], [100.0, 0.0]]])  # [B=1, T=3, V=2]
    b = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 50.0]]])
    real = torch.tensor([[True, True, False]])  # the last position is pad: its |diff| of 100 must not count
    # |a-b| on real positions: [0, 2], [3, 0] -> max 3, mean 5/4; argmax a [1, 0], b [0, 0] -> 1 of 2 agree
    assert logit_gap(a, b, real) == {
        "tokens_compared": 2,
        "logits_max_abs_diff": 3.0,
        "logits_mean_abs_diff": 1.25,
        "top1_agreement": 0.5,
    }


def test_table_is_the_readme_format():
    """The figures of docs/measurements/nf4_gap_smollm2_135m.json render as docs/exporting.md's rows."""
    result = {
        "training_model": "lorarl SharedBase + policy adapter (nf4 base, cpu)",
        "merged_dtype": "fp32",
        "accuracy_nf4": 0.055,
        "accuracy_merged": 0.24,
        "tokens_compared": 12335,
        "logits_max_abs_diff": 25.871116638183594,
        "logits_mean_abs_diff": 3.189401558910958,
        "top1_agreement": 0.6016214025131739,
        "greedy_agreement": 0.025,
    }
    assert gap_table(result).splitlines() == [
        "| | NF4 base + LoRA (what trained) | merged fp32 export |",
        "|---|---|---|",
        "| held-out accuracy | 5.5% | 24.0% |",
        "| logits on the same 12,335 tokens | max abs diff 25.9, mean 3.19, same top-1 token 60% | |",
        "| identical greedy completions | 2.5% | |",
    ]


def test_identical_models_give_no_gap(runs):
    """The zero adapter on the fp32 base against its merge (the base itself): the same function, bit for bit."""
    r = measure_nf4_gap(runs["zero"], ROWS, merged_dir=runs["base"], max_new_tokens=4, quantization="none")
    assert r["prompts"] == 4 and r["tokens_compared"] > 4 * 4  # prompts plus completions
    # the same function, but not always the same float path: the zero adapter (LoRA B = 0, adapters on) and the bare
    # base took different paths on an AMD EPYC without AVX-512 in the DPO test (2.4e-7, issue 34); a few fp32 ulps of
    # logits below 100 in size stay under 1e-4 (this machine: exactly 0)
    assert r["logits_max_abs_diff"] <= 1e-4 and r["logits_mean_abs_diff"] <= 1e-5 and r["top1_agreement"] == 1.0
    assert r["greedy_agreement"] == 1.0 and r["token_agreement"] == 1.0
    assert r["accuracy_nf4"] == r["accuracy_merged"] is not None and r["accuracy_gap"] == 0.0
    assert r["merged_dtype"] == "fp32"


def test_perturbed_adapter_matches_an_independent_peft_computation(runs, tiny_model_dir):
    """A random adapter on the base against the base: the logits gap equals the one PEFT and plain transformers
    give on the same sequences (each prompt plus the adapted model's one greedy token)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorarl.config import Recipe
    from lorarl.export.gate import gate_prompts
    from lorarl.export.source import locate
    from lorarl.model import load_tokenizer

    r = measure_nf4_gap(runs["random"], ROWS, merged_dir=runs["base"], max_new_tokens=1, quantization="none")
    tok = load_tokenizer(str(tiny_model_dir))
    prompts, _ = gate_prompts(locate(runs["random"]), Recipe(), tok, 4, ROWS)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32), str(runs["random"] / "policy")
    ).eval()
    diffs, top_same, tokens = [], 0, 0
    with torch.no_grad():
        for ids in prompts.token_ids:
            x = torch.tensor([ids])
            nxt = adapted(input_ids=x).logits[0, -1].argmax()
            x = torch.cat([x, nxt.view(1, 1)], dim=1)
            a, b = adapted(input_ids=x).logits[0], base(input_ids=x).logits[0]
            diffs.append((a - b).abs().flatten())
            top_same += int((a.argmax(-1) == b.argmax(-1)).sum())
            tokens += x.shape[1]
    diffs = torch.cat(diffs)
    assert r["tokens_compared"] == tokens
    assert r["logits_max_abs_diff"] > 0.01
    assert r["logits_max_abs_diff"] == pytest.approx(float(diffs.max()), rel=1e-4)
    assert r["logits_mean_abs_diff"] == pytest.approx(float(diffs.mean()), rel=1e-4)
    assert r["top1_agreement"] == top_same / tokens < 1.0


def test_nf4_base_against_its_merge_and_the_command(runs, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "gap.json"
    merged = tmp_path / "merged"
    export(runs["random"], merged, fmt="merged", dtype="fp32", gate_n=0)
    assert (
        main([str(runs["random"]), "--merged", str(merged), "--n", "4", "--max-new-tokens", "4", "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert "nf4 base" in r["training_model"] and r["prompts"] == 4 and r["max_new_tokens"] == 4
    assert r["logits_max_abs_diff"] > r["logits_mean_abs_diff"] > 0.0
    assert 0.0 <= r["top1_agreement"] <= 1.0 and 0.0 <= r["greedy_agreement"] <= 1.0
    assert gap_table(r) in printed and "| | NF4 base + LoRA (what trained) | merged fp32 export |" in printed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the JSON was written atomically
