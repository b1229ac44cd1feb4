"""End to end through the real UI: headless Chromium (Debian's ``chromium`` package, driven by Playwright with its
executable path) opens ``lorarl chat``, picks the base in one pane and a trained adapter in the other, sends a
prompt, and sees two answers stream in that differ.

Needs ``apt-get install -y chromium`` (``/usr/bin/chromium``; or set ``LORARL_CHROMIUM``). Skips, saying why, only
when no Chromium executable exists.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Records every text each pane's last answer bubble shows, as the DOM changes (to see the answers stream).
OBSERVE_JS = """
() => {
  window.__paneTexts = [[], []];
  const read = () => {
    for (let i = 0; i < 2; i++) {
      const bots = document.querySelectorAll(`#chat-${i} [data-testid="bot"]`);
      if (!bots.length) continue;
      const text = bots[bots.length - 1].innerText.trim();
      const seen = window.__paneTexts[i];
      if (seen[seen.length - 1] !== text) seen.push(text);
    }
  };
  new MutationObserver(read).observe(document.body, {subtree: true, childList: true, characterData: true});
}
"""


def chromium_path() -> str | None:
    for candidate in (os.environ.get("LORARL_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_model_dir):
    """``lorarl chat`` on 127.0.0.1 over a runs dir with one run whose adapter is strongly perturbed."""
    from lorarl.chat import launch
    from lorarl.config import LoraSettings, ModelConfig
    from lorarl.model import SharedBase

    def load():
        cfg = ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
        return SharedBase.load(cfg)

    runs = tmp_path_factory.mktemp("browser") / "runs"
    sb = load()
    sb.add_adapter("policy", LoraSettings(r=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in sb.adapter_parameters("policy"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    sb.save_adapter("policy", runs / "demo" / "policy")
    (runs / "demo" / "recipe.yaml").write_text(yaml.safe_dump({"algo": "grpo", "model": {"name": str(tiny_model_dir)}}))

    shared = load()
    # ~25 ms per decoding step, so that even on a fast machine the answers take long enough to be seen streaming
    shared.base.register_forward_pre_hook(lambda module, args: time.sleep(0.025))
    demo = launch(runs, host="127.0.0.1", port=_free_port(), shared=shared, prevent_thread_lock=True, quiet=True)
    try:
        yield demo.local_url, runs
    finally:
        demo.close()


def _pick(page, pane: int, label: str) -> None:
    page.click(f"#pick-{pane} input")
    page.locator("ul[role=listbox] li[role=option]", has_text=label).first.click()
    page.wait_for_function(
        "([sel, want]) => document.querySelector(sel).value.startsWith(want)", arg=[f"#pick-{pane} input", label]
    )


def _set_number(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(value)
    box.press("Enter")
    box.blur()


def test_two_panes_stream_different_answers(app):
    app_url, runs = app
    exe = chromium_path()
    if exe is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium, or set LORARL_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory(prefix="lorarl-chromium-") as profile:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000}
        )
        try:
            page = ctx.new_page()
            page.goto(app_url, wait_until="domcontentloaded")
            page.wait_for_selector("#pick-1 input", timeout=60_000)
            _pick(page, 0, "base")
            _pick(page, 1, "demo · final")
            # sampling with a fixed seed: the tiny random base's greedy answer is only blank lines
            _set_number(page, "temperature", "1")
            _set_number(page, "top_p", "1")
            _set_number(page, "max_new", "24")
            page.evaluate(OBSERVE_JS)
            page.fill("#prompt textarea", "What is 2 + 2?")
            page.click("#send")
            page.wait_for_function(
                "() => (document.querySelector('#status')?.innerText || '').includes('done:')", timeout=60_000
            )
            time.sleep(0.3)  # the last DOM update after the final event
            finals = [page.locator(f"#chat-{i} [data-testid='bot']").last.inner_text().strip() for i in range(2)]
            seen = page.evaluate("() => window.__paneTexts")
            page.click("#vote-right")  # the adapter's answer is better: saved as a preference pair
            page.wait_for_function(
                "() => (document.querySelector('#status')?.innerText || '').includes('saved vote')", timeout=30_000
            )
        finally:
            ctx.close()

    assert all(finals), f"an answer is empty: {finals}"
    assert finals[0] != finals[1], "the base and the adapter answered the same"
    for i in range(2):
        shown = [t for t in seen[i] if t and t != "…"]
        assert shown[-1] == finals[i]
        assert len(shown) >= 2, f"pane {i} did not stream (texts shown: {shown})"
        assert any(finals[i].startswith(t) and t != finals[i] for t in shown), f"pane {i}: no partial answer shown"
    (pair,) = [json.loads(line) for line in (runs / "preferences.jsonl").read_text().splitlines()]
    assert pair["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert pair["chosen"][0]["role"] == "assistant" and pair["chosen"][0]["content"].strip()
    assert pair["chosen"] != pair["rejected"]
    assert (pair["chosen_model"], pair["rejected_model"]) == ("demo/policy", "base")
