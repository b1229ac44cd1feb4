"""``lorarl bench gpu --part kernel`` (lorarl.bench.kernel_tiles): the candidate tiles, the bytes of the bound and
the per-layer sums by hand; one projection swept under Triton's interpreter on the CPU; a tiling whose output
differs from the default's stops the sweep."""

from __future__ import annotations

import doctest
import os

import pytest
import torch

from lorarl.bench import kernel_tiles as kt


@pytest.fixture(autouse=True, scope="module")
def eager_bitsandbytes():
    """bitsandbytes' CPU path through torch.compile costs ~20 s per new shape on 2 cores; eager runs the same
    function (as in tests/test_kernels_nf4.py, once for the module)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):  # (monkeypatch's undo would delete the config entry)
        yield


def test_docstring_examples():
    assert doctest.testmod(kt).failed == 0


def test_candidates_keep_the_default_first_and_whole_k_steps():
    for m, n, k in [(1, 4096, 4096), (16, 1024, 4096), (64, 14336, 4096), (16, 4096, 14336), (2, 64, 512)]:
        c = kt.candidates(m, n, k, 132)
        assert c[0] == kt.launch_config(m, n, k, 132) and len(set(c)) == len(c)
        assert all(bm == c[0][0] and bk * split <= k for bm, _, bk, split in c[1:])
    assert len(kt.candidates(1, 4096, 512, 132)) == 1 + 3 * (3 + 2) - 1  # 512: BLOCK_K 128 x 1-4, 256 x 1-2


def test_bound_bytes_and_layer_sums_by_hand():
    assert kt.nf4_bytes(1024, 4096, nested=False) == 1024 * 4096 // 2 + 4 * 65536
    assert kt.nf4_bytes(64, 64) == 2048 + 64 + 4  # 64 blocks: 64 one-byte scales, one fp32 second-level scale
    rows = [
        {"count": 2, "default": {"ms": 1.0}, "best": {"ms": 0.5}, "bnb_ms": 3.0, "bound_ms": 0.25},
        {"count": 1, "default": {"ms": 2.0}, "best": {"ms": 2.0}, "bnb_ms": 4.0, "bound_ms": 1.0},
    ]
    assert kt.layer_sums(rows) == {"default_ms": 4.0, "best_ms": 3.0, "bnb_ms": 10.0, "bound_ms": 1.5}
    timings = [{"config": [16, 64, 256, 4], "ms": 0.3}, {"config": [16, 128, 256, 2], "ms": 0.2}]
    assert kt.best_row(timings) == {"default": timings[0], "best": timings[1], "default_over_best": 1.5}


def _small_grid(monkeypatch):
    monkeypatch.setattr(kt, "BLOCK_N", (32, 64))
    monkeypatch.setattr(kt, "BLOCK_K", (128,))
    monkeypatch.setattr(kt, "SPLIT_K", (1, 2))


def test_one_projection_swept_under_the_interpreter(monkeypatch):
    """W [96 x 512], 2 rows: the default (16, 64, 256, 2) and four tilings, each checked against the default's
    output and timed; the row's best is one of them, the bound is its bytes over the bandwidth given."""
    _small_grid(monkeypatch)
    with kt.interpreter(True):
        (row,) = kt.bench_projection("x", 96, 512, 2, [2], torch.device("cpu"), 1, 1e9)
    assert os.environ.get("TRITON_INTERPRET") is None
    configs = [tuple(t["config"]) for t in row["timings"]]
    assert configs == [(16, 64, 256, 2), (16, 32, 128, 1), (16, 32, 128, 2), (16, 64, 128, 1), (16, 64, 128, 2)]
    assert row["best"] in row["timings"] and row["default"] == row["timings"][0]
    assert row["bound_ms"] == pytest.approx(1000 * kt.nf4_bytes(96, 512) / 1e9, rel=1e-3)
    assert row["bnb_ms"] > 0 and row["best_over_bound"] > 0
    assert row["copies"] == 1 and row["timing"] == ["interpreter"]  # (CUDA: copies_for's and cuda_graph)


def test_a_tiling_that_computes_something_else_stops_the_sweep(monkeypatch):
    from lorarl.kernels import nf4_matmul as module

    _small_grid(monkeypatch)
    real = module.nf4_matmul

    def wrong_when_split(x, weight, bias=None, config=None):
        y = real(x, weight, bias, config)
        return y * 1.5 if config is not None and config[3] == 1 else y

    monkeypatch.setattr(module, "nf4_matmul", wrong_when_split)
    with kt.interpreter(True), pytest.raises(RuntimeError, match=r"tiles \(16, 32, 128, 1\): relative error"):
        kt.bench_projection("x", 96, 512, 1, [2], torch.device("cpu"), 1, 1e9)
