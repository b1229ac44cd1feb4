#!/usr/bin/env python
"""Validate the memory planner (lorarl.plan) against measured peaks: one GRPO step and one PPO step per model.

The code lives in :mod:`lorarl.bench.plan_validation` (also run by ``lorarl bench gpu --part plan``); this script
keeps the command documented in docs/memory_planner.md working::

    PYTHONUNBUFFERED=1 python scripts/validate_plan_gpu.py            # writes $OUT/validate_plan.json
    python scripts/validate_plan_gpu.py --device cpu --models tiny --quantization none   # CPU smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lorarl.bench.plan_validation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
