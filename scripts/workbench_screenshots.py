"""Screenshots of the workbench's four tabs for docs/workbench.md, taken on a real run: the quickstart's finished
run (``bash scripts/quickstart.sh`` writes ``runs/grpo-arithmetic`` with its held-out evaluations before and after).

    OMP_WAIT_POLICY=PASSIVE python scripts/workbench_screenshots.py [--runs runs] [--run grpo-arithmetic]
        [--out docs/images]

Starts ``lorarl chat`` on the runs folder (the embedded SmolLM2-135M-Instruct, the runs' base) and drives it in
headless Chromium at 1400 px: Train as a first visit shows it (the quickstart recipe and its cost), Watch on the run
(its result line and curves), Chat (the base and the run's adapter answering the same held-out-style question,
greedy), Export (a merged export of the run into ``RUNS/exports/RUN-final-merged``, replaced if there, with the
fidelity gate's figures). Writes OUT/workbench_{train,watch,chat,export}.png, each reduced to a 256-colour palette
(the page's flat colours survive it). Needs Chromium, as tests/test_workbench_browser.py does. Casts no vote.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TABS = ("train", "watch", "chat", "export")
QUESTION = "What is 47 + 38? Reply with only the number."


def shrink(path: Path) -> int:
    """Re-save ``path`` as a 256-colour PNG; returns its new size in bytes."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    return path.stat().st_size


def drive(page, run: str, out: Path) -> None:
    """The four tabs, each photographed once it shows what it is for."""
    from test_chat_browser import _pick, _set_number
    from test_workbench_browser import _choose, _tab, _wait_text

    def shot(name: str) -> None:
        page.wait_for_timeout(1500)  # the last update painted
        page.screenshot(path=str(out / f"workbench_{name}.png"), full_page=True)

    _wait_text(page, "#wb-plan", "Cost on this machine", timeout=120_000)
    page.fill("#wb-run-name textarea, #wb-run-name input", "my-first-run")
    page.click("#wb-check")
    _wait_text(page, "#wb-train-status", "ok:")
    shot("train")
    _tab(page, "Watch")
    _choose(page, "wb-run", run)
    _wait_text(page, "#wb-result", "Result", timeout=60_000)
    shot("watch")
    _tab(page, "Chat")
    page.wait_for_selector("#pick-1 input", timeout=60_000)
    _pick(page, 0, "base")
    _pick(page, 1, f"{run} · final")
    _set_number(page, "temperature", "0")
    _set_number(page, "max_new", "24")
    page.fill("#prompt textarea", QUESTION)
    page.click("#send")
    _wait_text(page, "#status", "done:", timeout=300_000)
    shot("chat")
    _tab(page, "Export")
    _choose(page, "wb-export-pick", f"{run} · final")
    page.check("#wb-export-force input")  # a second take replaces the first
    page.click("#wb-export")
    _wait_text(page, "#wb-export-status", "exported", timeout=900_000)
    shot("export")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=str(REPO / "runs"), help="the runs folder holding the finished run")
    ap.add_argument("--run", default="grpo-arithmetic", help="the finished run to show (its folder's name)")
    ap.add_argument("--out", default=str(REPO / "docs" / "images"), help="folder for the PNG files")
    args = ap.parse_args(argv)
    runs, out = Path(args.runs).resolve(), Path(args.out).resolve()
    if not (runs / args.run / "policy").is_dir():
        print(f"{runs / args.run}: no finished run there (bash scripts/quickstart.sh writes one)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright
    from test_chat_browser import CHROMIUM_ARGS, _free_port, chromium_path

    from lorarl.chat import launch

    exe = chromium_path()
    if exe is None:
        print("Chromium is not installed (apt-get install -y chromium, or set LORARL_CHROMIUM)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    demo = launch(runs, host="127.0.0.1", port=_free_port(), prevent_thread_lock=True, quiet=True, workbench=True)
    try:
        with sync_playwright() as pw, tempfile.TemporaryDirectory(prefix="lorarl-chromium-") as profile:
            ctx = pw.chromium.launch_persistent_context(
                profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900}
            )
            page = ctx.new_page()
            page.set_default_timeout(120_000)
            page.goto(demo.local_url, wait_until="domcontentloaded")
            page.wait_for_selector("#wb-recipe input", timeout=120_000)
            drive(page, args.run, out)
            ctx.close()
    finally:
        demo.close()
    for tab in TABS:
        path = out / f"workbench_{tab}.png"
        print(f"{path}: {shrink(path) / 1000:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
