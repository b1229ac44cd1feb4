#!/usr/bin/env bash
# The main job on the embedded default: GRPO on 2-digit arithmetic, then held-out accuracy before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
RUN=${RUN:-runs/grpo-arithmetic}
lorarl train recipes/grpo_arithmetic.yaml --out "$RUN" --force "$@"
echo "== base model (same prompt, greedy, held-out) =="
lorarl eval recipes/grpo_arithmetic.yaml --checkpoint base | tail -n 1 | tee "$RUN/eval_base.json"
echo "== after GRPO =="
lorarl eval recipes/grpo_arithmetic.yaml --checkpoint "$RUN" | tail -n 1 | tee "$RUN/eval_trained.json"
echo "metrics: $RUN/metrics.jsonl  plot: $RUN/plot.png  adapter: $RUN/policy  chat: lorarl chat --runs runs"
