"""SFT on language-modeling (``text``) rows and packing (issue 40).

* ``text`` rows are tokenized as TRL 1.16's ``SFTTrainer`` prepares them (its own ``_prepare_dataset`` on a stub:
  the EOS appended, every token a label), and lorarl's packed rows are TRL's (``pack_dataset``: bfd, bfd_split,
  wrapped), segments included.
* Packed training equals unpacked training on the same rows: the loss and every LoRA gradient of one step over all
  the examples, packed and unpacked, against each example's own forward of the full logits computed here
  (activation checkpointing on, and off in the sliding-window Gemma-2 / Gemma-3).
* A YAML recipe (``sft.packing``, a column mapped to ``text``) trains through ``lorarl train`` and text rows through
  ``lorarl.train``; bad text rows are named.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from test_families import FAMILIES, family_dirs  # noqa: F401  (the tiny model of each family)
from test_sft_prefix import sft_with_lora_moved

from lorarl.algos.sft import SFT, packed_sft_loss, sft_loss
from lorarl.config import DataConfig, recipe_from_dict
from lorarl.data.packing import pack_batch, pack_examples, pack_sft, pack_targets, segment_positions
from lorarl.data.sft import load_sft
from lorarl.errors import DataError
from lorarl.model import SharedBase
from lorarl.runs import read_metrics

T, F = True, False
REVIEWS = [
    "A quiet, patient film that trusts its audience.",
    "Terrible. I walked out after forty minutes.",
    "The first hour is gripping: a small fishing town, a missing boat, and a sheriff who knows more than he says.",
    "Funny, warm and far too long.",
    "Beautiful to look at, empty inside. The soundtrack is the best thing in it, and the ending drags on.",
    "Two hours of people shouting in corridors.",
    "Loud, dumb and fun.",
    "Solid, forgettable entertainment with a cast that clearly enjoyed themselves.",
]


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from lorarl.model import load_tokenizer

    return load_tokenizer(str(default_model_dir))


# ---- by hand --------------------------------------------------------------------------------------------------------


def test_segments_and_targets_by_hand():
    assert segment_positions([3, 1, 2]) == [0, 1, 2, 0, 0, 1]
    # a segment's first token is no target; labels off stay off
    assert pack_targets([T, T, T, F, T], [3, 2]) == [T, T, F, T]
    assert pack_targets([F, F, T, T, T], [5]) == [F, T, T, T]
    ids, pos, tgt = pack_batch(pack_examples([[1, 2, 3], [4, 5], [6]], [[F, T, T], [T, T], [T]], 4), [0, 1], 0)
    assert ids.tolist() == [[1, 2, 3, 6], [4, 5, 0, 0]]  # best fit: [6] fills the first row
    assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]  # padding: position 0, its own segment
    assert tgt.tolist() == [[T, T, F], [T, F, F]]


def test_strategies_lay_out_rows_as_trl_documents():
    ids, labels = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]], [[T] * 5, [T] * 2, [T] * 3, [T]]
    bfd_split = pack_examples(ids, labels, 4, "bfd_split")  # TRL's pack_dataset docstring example
    assert bfd_split.ids == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert bfd_split.seq_lengths == [[4], [3, 1], [2, 1]]
    wrapped = pack_examples(ids, labels, 4, "wrapped")
    assert wrapped.ids == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]] and wrapped.seq_lengths == [[4], [4], [3]]
    with pytest.raises(ValueError, match="packing strategy must be one of"):
        pack_examples(ids, labels, 4, "greedy")


# ---- text rows and packs are TRL's ------------------------------------------------------------------------------


def _trl_prepared(tok, rows, max_length, packing, strategy="bfd"):
    """TRL 1.16's own dataset preparation (``SFTTrainer._prepare_dataset``, called on a stub trainer)."""
    import datasets
    import trl

    args = trl.SFTConfig(
        output_dir="unused", use_cpu=True, max_length=max_length, packing=packing, packing_strategy=strategy
    )
    stub = types.SimpleNamespace(_tokenizer=tok, completion_only_loss=False, chat_template=None)
    datasets.disable_progress_bars()
    try:
        prepared = trl.SFTTrainer._prepare_dataset(
            stub, datasets.Dataset.from_list(rows), tok, args, packing, None, "x"
        )
    finally:
        datasets.enable_progress_bars()
    return prepared[:]


def test_text_rows_are_tokenized_and_labelled_as_trl_does(tok):
    rows = [{"text": t} for t in REVIEWS] + [{"text": "Ends with EOS already<|im_end|>"}]
    data = load_sft(DataConfig(source="x"), tok, 2, 64, rows=rows)
    trl_rows = _trl_prepared(tok, rows, 64, packing=False)
    assert [p + c for p, c in zip(data.prompt_ids, data.completion_ids)] == trl_rows["input_ids"]
    assert trl_rows["labels"] == trl_rows["input_ids"]  # TRL: every token a label
    assert all(len(p) == 1 for p in data.prompt_ids)  # lorarl: every token after the first is a target
    assert data.completion_ids[-1].count(tok.eos_token_id) == 1  # an EOS already there is not doubled


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packed_rows_are_trls(tok, strategy):
    rows = [{"text": t} for t in REVIEWS * 3]
    length = 32 if strategy == "bfd" else 16  # bfd keeps whole rows (the longest here: 26 tokens); others split
    data = load_sft(DataConfig(source="x"), tok, 2, length, rows=rows, long_rows=strategy != "bfd")
    packs = pack_sft(data, length, strategy)
    want = _trl_prepared(tok, rows, length, packing=True, strategy=strategy)
    assert packs.ids == want["input_ids"] and max(len(r) for r in packs.ids) <= length
    assert packs.seq_lengths == want.get("seq_lengths", [[len(r)] for r in want["input_ids"]])
    # every token of every review is in exactly one row, and the targets are the unpacked rows' (bfd: whole rows)
    assert sorted(t for r in packs.ids for t in r) == sorted(t for r in want["input_ids"] for t in r)
    if strategy == "bfd":
        assert packs.targets(list(range(len(packs)))) == sum(len(c) for c in data.completion_ids)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "   "}, "row 1: column 'text' is empty"),
        ({"text": 5}, "row 1: column 'text' must be a string, got int"),
        ({"text": "word " * 40}, "row 1: column 'text' has 42 tokens, more than sft.max_length=32"),
    ],
)
def test_bad_text_rows_are_named(tok, row, message):
    with pytest.raises(DataError, match=message):
        load_sft(DataConfig(source="x"), tok, 2, 32, rows=[{"text": "fine"}, row])


def test_a_long_text_row_is_kept_where_packing_splits_it(tok):
    data = load_sft(DataConfig(source="x"), tok, 2, 32, rows=[{"text": "word " * 40}], long_rows=True)
    packs = pack_sft(data, 32, "bfd_split")
    assert [len(r) for r in packs.ids] == [32, 10] and packs.seq_lengths == [[32], [10]]


# ---- packed training equals unpacked training -------------------------------------------------------------------

MIXED = [{"text": t} for t in REVIEWS] + [
    {"prompt": "Rate the film: ", "completion": "Four stars, a solid evening."},
    {"prompt": [{"role": "user", "content": "One word for it?"}], "completion": "Gripping."},
]


def _sft(model_dir, checkpointing=False, rows=MIXED, **sft):
    recipe = recipe_from_dict(
        {
            "algo": "sft",
            "model": {
                "name": str(model_dir),
                "quantization": "none",
                "dtype": "float32",
                "gradient_checkpointing": checkpointing,
            },
            "lora": {"r": 8, "alpha": 16},
            "data": {"source": "python:rows"},
            "sft": {"batch_size": 4, "max_length": 64, **sft},
            "train": {"steps": 2, "micro_batch_size": 4},
        }
    )
    from lorarl.inmemory import register

    register("rows", rows)
    return recipe


def _per_example_nll(shared: SharedBase, data) -> torch.Tensor:
    """Independently of both paths: each example alone, the model's own full logits, log_softmax, the NLL of the
    tokens its row trains (a text row: every token after the first; else the completion), / their number."""
    total, count = 0.0, 0
    for p, c in zip(data.prompt_ids, data.completion_ids):
        ids = torch.tensor([p + c])
        logits = shared.module(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, len(p) - 1 : -1], -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        total, count = total - lp.sum(), count + len(c)
    return total / count


def _loss_and_grads(algo: SFT, compute) -> tuple[float, list[torch.Tensor]]:
    for p in algo.policy.params:
        p.grad = None
    with algo.shared.role("policy", train=True, dropout=True):
        loss = compute()
        loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in algo.policy.params]


def _check_packed_equals_unpacked(model_dir, checkpointing: bool, rows=MIXED, unpacked: bool = True):
    algo = sft_with_lora_moved(_sft(model_dir, checkpointing, rows, packing=True, max_length=48))
    shared, data, packs = algo.shared, algo.data, algo.packs
    assert len(packs) < len(data) and any(len(s) > 1 for s in packs.seq_lengths)  # rows do hold several examples
    everything = list(range(len(data)))
    total = packs.targets(list(range(len(packs))))
    assert total == sum(len(c) for c in data.completion_ids)  # packing trains exactly the unpacked tokens
    want, want_g = _loss_and_grads(algo, lambda: _per_example_nll(shared, data))
    packed, packed_g = _loss_and_grads(algo, lambda: packed_sft_loss(shared, packs, total, list(range(len(packs))))[0])
    assert packed == pytest.approx(want, rel=1e-5)
    assert all(g.abs().sum() > 0 for g in want_g)
    for a, b in zip(packed_g, want_g):  # float32 sums in another order: within 1e-5 of the gradient's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    if unpacked:  # the unpacked path (padded rows) agrees as well
        unpacked, unpacked_g = _loss_and_grads(algo, lambda: sft_loss(shared, data, total, everything)[0])
        assert unpacked == pytest.approx(want, rel=1e-5)
        for a, b in zip(unpacked_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_packed_loss_and_gradients_equal_unpacked(tiny_model_dir):
    _check_packed_equals_unpacked(tiny_model_dir, checkpointing=True)  # the GPU's default; the families: off


# llama: the test above (activation checkpointing on). Every family hands its position ids to transformers' mask
# builder; the ones whose mask differs are Gemma-2 and Gemma-3, with a sliding 8-token window every other layer that
# must stay inside a segment (activation checkpointing off here). All nine families passed this check and the one
# above on 2026-11-28 (a family costs 3-6 s on 2 cores: the suite runs the sliding-window two).
PACKING_FAMILIES = ["gemma2", "gemma3"]


@pytest.mark.parametrize("name", PACKING_FAMILIES)
def test_packing_keeps_examples_apart_in_every_family(name, family_dirs):  # noqa: F811
    """Each family builds its attention mask from the restarting position ids: packed = each example alone."""
    assert name in FAMILIES
    _check_packed_equals_unpacked(family_dirs(name), checkpointing=False, rows=MIXED[2:6] + MIXED[-1:], unpacked=False)


# ---- a run ------------------------------------------------------------------------------------------------------


def test_yaml_recipe_and_the_python_api_train_packed_text_rows(tiny_model_dir, tmp_path):
    """The two doors: a YAML recipe (``sft.packing``, a ``review`` column mapped to ``text``) through ``lorarl
    train``, and :func:`lorarl.train` with an in-memory dataset of text rows."""
    import lorarl
    from lorarl.cli import main

    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps({"review": t, "stars": 3}) + "\n" for t in REVIEWS * 2))
    (tmp_path / "sft.yaml").write_text(
        f"algo: sft\nmodel: {{name: {tiny_model_dir}, quantization: none, dtype: float32}}\n"
        f"data: {{source: {data}, columns: {{text: review}}}}\nlora: {{r: 8, alpha: 16}}\n"
        "sft: {batch_size: 2, max_length: 64, packing: true, packing_strategy: bfd}\n"
        "train: {steps: 2, micro_batch_size: 2, learning_rate: 0.01}\n"
    )
    assert main(["train", str(tmp_path / "sft.yaml"), "--out", str(tmp_path / "run")]) == 0
    rows = read_metrics(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["examples"] == 16 and summary["packed_rows"] < 16 and summary["steps"] == 2
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["completion_tokens"] <= 2 * 63 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]

    from datasets import Dataset

    run = lorarl.train(
        {
            "algo": "sft",
            "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
            "sft": {"packing": True, "max_length": 64, "batch_size": 2},
            "train": {"steps": 1},
        },
        tmp_path / "api",
        train_dataset=Dataset.from_list([{"text": t} for t in REVIEWS]),
        progress=False,
    )
    assert run.summary["examples"] == len(REVIEWS) and 1 <= run.summary["packed_rows"] < len(REVIEWS)


def test_packing_with_an_attention_implementation_lorarl_cannot_pack_is_one_line():
    from lorarl.errors import LorarlError
    from lorarl.model.logprobs import packed_logprobs

    shared = types.SimpleNamespace(attn_implementation="flash_attention_2")
    with pytest.raises(LorarlError, match=r"^sft.packing: the base runs attention implementation 'flash_attention_2'"):
        packed_logprobs(shared, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_bench_counts_the_padding_each_setup_runs():
    """lorarl.bench.sft_packing's forward-token count: per micro-batch, its rows x its widest row."""
    from lorarl.bench.sft_packing import padded_tokens
    from lorarl.data.packing import Packs

    data = types.SimpleNamespace(prompt_ids=[[1], [1], [1, 2]], completion_ids=[[5] * 9, [5] * 3, [5] * 2])
    unpacked = types.SimpleNamespace(packs=None, data=data, mbs=2)
    assert padded_tokens(unpacked, [0, 1, 2]) == 2 * (1 + 9) + 1 * (2 + 2)  # micro-batches [0, 1] and [2]
    packs = Packs([[1] * 10, [2] * 4], [[T] * 10, [T] * 4], [[6, 4], [4]], 10)
    assert padded_tokens(types.SimpleNamespace(packs=packs, mbs=2), [0, 1]) == 2 * 10
