#!/usr/bin/env bash
# Set up and run the whole test suite (pytest). Installs Debian's chromium for the browser test when
# possible (root + apt-get); the browser test skips with a reason only where chromium cannot be installed.
# Installs the exact releases of constraints.txt (what CI ran); LORARL_NEWEST=1 bash scripts/test.sh runs the suite
# on the newest releases pyproject.toml's ranges admit (docs/reproducibility.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "scripts/test.sh: could not install chromium; the browser test will skip"
fi
# one pytest worker per core, up to 4 (LORARL_TEST_WORKERS=N to choose; 0 runs in this process); a file's tests stay
# on one worker (--dist loadfile: module fixtures are built once); timings in docs/testing.md.
workers=${LORARL_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
python -m pytest -q -p no:cacheprovider --durations=15 -n "$workers" --dist loadfile "$@"
