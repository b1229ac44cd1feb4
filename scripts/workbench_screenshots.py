"""Screenshots of the workbench's four tabs for docs/workbench.md, taken during a real run of the end-to-end browser
test (tests/test_workbench_browser.py: a 2-step GRPO run of the quickstart recipe on the tiny random-init model,
stopped, resumed, chatted with, voted on, retrained with DPO, exported).

    OMP_WAIT_POLICY=PASSIVE python scripts/workbench_screenshots.py [--out docs/images]

Writes OUT/workbench_{train,watch,chat,export}.png, each reduced to a 256-colour palette (the page's flat colours
survive it) so that each stays under ~200 KB. Needs Chromium, as the test does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABS = ("train", "watch", "chat", "export")


def shrink(path: Path) -> int:
    """Re-save ``path`` as a 256-colour PNG; returns its new size in bytes."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "images"), help="folder for the PNG files")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    os.environ["LORARL_WORKBENCH_SCREENSHOTS"] = str(out)
    import pytest

    code = pytest.main(["-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_workbench_browser.py")])
    if code != 0:
        print("the end-to-end test failed; no screenshots kept", file=sys.stderr)
        return int(code)
    for tab in TABS:
        path = out / f"workbench_{tab}.png"
        print(f"{path}: {shrink(path) / 1000:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
