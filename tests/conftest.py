"""Shared fixtures: a tiny random-init Llama (hidden 64, 2 layers) with the real SmolLM2 tokenizer.

The tokenizer comes from the embedded default model's converted folder (converted once per cache directory).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no busy-waiting OpenMP threads on 2 cores
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Threads: two, or one when pytest-xdist's workers fill the cores (scripts/test.sh starts a worker per core). The tiny
# models gain nothing from a second thread, which then only waits for the core another worker holds: with one,
# tests/test_dpo.py + test_sft.py took 13% less CPU time (49.5 s against 57.4 s, 2 busy cores, 2026-11-28). The
# training runs tests start, in this process (lorarl's loop sets its threads) or in another, read LORARL_THREADS.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= _CORES:
    os.environ.setdefault("LORARL_THREADS", "1")
_THREADS = os.environ.get("LORARL_THREADS", "")
torch.set_num_threads(int(_THREADS) if _THREADS.isdigit() and int(_THREADS) > 0 else max(1, min(2, _CORES)))


def make_tiny_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    from lorarl.bench.synthetic import tiny_llama_folder

    return tiny_llama_folder(folder, seed=seed, hidden=hidden, layers=layers)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct converted folder (converted once)."""
    from lorarl.model.registry import DEFAULT_MODEL, convert_embedded

    return convert_embedded(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture()
def tiny_shared(tiny_model_dir):
    """A SharedBase on the tiny model, fp32 on CPU, no adapters yet."""
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    return SharedBase.load(ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32"))


@pytest.fixture(scope="session")
def engine_site() -> Path:
    """verl and OpenRLHF at the releases the hand-offs support (lorarl.export.engines: verl.CHECKED,
    openrlhf.CHECKED), unpacked for a subprocess's PYTHONPATH (tests/handoff_probes/engine_cache.py: pip download
    --no-deps into $LORARL_CACHE/engine-wheels, reused). Fails, never skips, when the registry cannot be reached."""
    from handoff_probes.engine_cache import EngineFetchError
    from handoff_probes.engine_cache import engine_site as fetch

    from lorarl.export.engines.openrlhf import CHECKED as OPENRLHF_RELEASE
    from lorarl.export.engines.verl import CHECKED as VERL_RELEASE

    try:
        return fetch([f"verl=={VERL_RELEASE}", f"openrlhf=={OPENRLHF_RELEASE}"])
    except EngineFetchError as e:
        pytest.fail(f"the engine releases the hand-off tests check against could not be fetched: {e}", pytrace=False)
