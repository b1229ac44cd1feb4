"""The workbench end to end through the real page (issue 25's "Must show"): headless Chromium drives ``lorarl chat``
with its Train / Watch / Chat / Export tabs over a fresh runs folder, on the tiny random-init model.

Train: the quickstart recipe (recipes/grpo_arithmetic.yaml) with a wrong field value first (the loader's line shows
next to the field, nothing launches), then a 2-step run launched on the tiny model (the model dropdown offers the
chat's base folder). Watch: the run's state and curves as it trains; Stop during step 1 (the run saves a checkpoint
of step 1 and exits), Resume (it trains step 2 and finishes), a second launch refused while one trains. Chat: the
run's final adapter appears in the panes; it answers beside the base; two votes, and a 👍 and a 👎 on one answer each.
Retrain: DPO on the two votes from the run's adapter, watched to its end; KTO on the votes and the two single-answer
votes (six rows), watched to its end. Export: a merged export of the run, and the fidelity gate's figures.

Every step is real: ``lorarl train`` subprocesses, the run folder's files, the exported folder. Set
``LORARL_WORKBENCH_SCREENSHOTS=DIR`` to save a screenshot of each tab there (scripts/workbench_screenshots.py).
Needs Chromium (see tests/test_chat_browser.py); skips, saying why, only when none is installed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from test_chat_browser import CHROMIUM_ARGS, _free_port, _pick, _set_number, chromium_path

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = "grpo_arithmetic.yaml"
LONG = 120_000  # ms: a subprocess loading the model and training on 2 busy cores


@pytest.fixture(scope="module")
def workbench(tmp_path_factory, tiny_model_dir):
    """``lorarl chat`` with the workbench on 127.0.0.1, the tiny model as the chat's base, an empty runs folder."""
    from lorarl.chat import launch
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    runs = tmp_path_factory.mktemp("workbench") / "runs"
    runs.mkdir()
    cfg = ModelConfig(name=str(tiny_model_dir), quantization="none", dtype="float32", gradient_checkpointing=False)
    shared = SharedBase.load(cfg)
    demo = launch(
        runs,
        host="127.0.0.1",
        port=_free_port(),
        shared=shared,
        prevent_thread_lock=True,
        quiet=True,
        workbench=True,
        recipe_dirs=[REPO / "recipes"],
    )
    try:
        yield demo.local_url, runs, demo.lorarl_session.workbench
    finally:
        runner = demo.lorarl_session.workbench.runner
        live = runner.own_live()
        if live is not None:  # a failed test leaves no training process behind (SIGTERM: it ends after its step)
            runner.stop(live)
        demo.close()


# ---- page helpers -----------------------------------------------------------------------------------------------
def _text(page, sel: str) -> str:
    return page.evaluate("(sel) => document.querySelector(sel)?.innerText || ''", sel)


def _wait_text(page, sel: str, want: str, timeout: int = 60_000) -> str:
    page.wait_for_function(
        "([sel, want]) => (document.querySelector(sel)?.innerText || '').includes(want)",
        arg=[sel, want],
        timeout=timeout,
    )
    return _text(page, sel)


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _choose(page, elem_id: str, label: str) -> None:
    """Pick the option of dropdown ``#elem_id`` whose label contains ``label``."""
    page.click(f"#{elem_id} input")
    page.locator("ul[role=listbox] li[role=option]", has_text=label).first.click()
    page.wait_for_function(
        "([sel, want]) => document.querySelector(sel).value.includes(want)", arg=[f"#{elem_id} input", label]
    )


def _field(page, key: str):
    """The text box of the Train tab's field ``key`` (its label ends with ``(key)``)."""
    block = page.locator("[id^='wb-field-']:not([id^='wb-field-error'])", has_text=f"({key})")
    return block.locator("textarea, input").first


def _set_field(page, key: str, value: str) -> None:
    box = _field(page, key)
    box.fill(value)
    box.blur()


def _field_error(page, key: str) -> str:
    idx = page.locator("[id^='wb-field-']:not([id^='wb-field-error'])", has_text=f"({key})").first.get_attribute("id")
    return _text(page, f"#wb-field-error-{idx.rsplit('-', 1)[1]}")


def _shot(page, name: str) -> None:
    folder = os.environ.get("LORARL_WORKBENCH_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"workbench_{name}.png"), full_page=True)


def _metrics_steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.is_file() else []


# ---- the test ---------------------------------------------------------------------------------------------------
def test_launch_watch_stop_resume_chat_vote_retrain_export(workbench, tiny_model_dir):
    app_url, runs, wb = workbench
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
            page.wait_for_selector("#wb-recipe input", timeout=60_000)
            _train(page, runs, tiny_model_dir)
            _watch_stop_resume(page, runs)
            _chat_and_vote(page, runs)
            _retrain(page, runs)
            _export(page, runs)
        except Exception:
            shot = runs.parent / "failure.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"the page when the test failed: {shot}")
            raise
        finally:
            ctx.close()
    # No wall-clock bound on the whole walk (it took 441 s on a loaded 2-core AMD EPYC, issue 34): every wait above
    # has its own timeout (Playwright's 30 s default, LONG for a subprocess that loads the model and trains), so a
    # hang fails at the step that hangs, and a slow machine is not a failure.


def _train(page, runs: Path, tiny_model_dir: Path) -> None:
    """The quickstart recipe: its header; a refused field; the tiny 2-step run launched."""
    _choose(page, "wb-recipe", QUICKSTART)
    assert "GRPO quickstart" in _wait_text(page, "#wb-recipe-header", "GRPO quickstart")
    _wait_text(page, "#wb-plan", "plan:")
    # a value the loader refuses: its line next to the field, and nothing launched
    _set_field(page, "train.steps", "two")
    page.fill("#wb-run-name textarea, #wb-run-name input", "refused")
    page.click("#wb-launch")
    _wait_text(page, "#wb-train-status", "not launched")
    assert "train.steps must be int" in _field_error(page, "train.steps")
    assert not (runs / "refused").exists()
    # the run: the tiny model (the chat's base, offered by the model dropdown), 2 steps, long enough completions
    # (96 tokens) and a held-out evaluation after each step, so that step 1 lasts a few seconds
    _choose(page, "wb-model", str(tiny_model_dir))
    for key, value in (("train.steps", "2"), ("grpo.group_size", "4"), ("generation.max_new_tokens", "96")):
        _set_field(page, key, value)
    _set_field(page, "eval.every", "1")
    page.click("#wb-check")
    page.wait_for_function("() => !(document.querySelector('#wb-train-status')?.innerText || '').includes('not')")
    page.fill("#wb-run-name textarea, #wb-run-name input", "quick")
    _shot(page, "train")
    page.click("#wb-launch")
    _wait_text(page, "#wb-state", "quick")  # launched: the page moved to Watch, on the new run


def _watch_stop_resume(page, runs: Path) -> None:
    """Watch follows the run; Stop during step 1 -> checkpoint of step 1 (or, while step 1 generates, the step
    abandoned at step 0); a second launch refused; Resume -> 2/2."""
    run = runs / "quick"
    _wait_text(page, "#wb-state", "running", timeout=LONG)  # the loop began step 1
    page.click("#wb-stop")
    _wait_text(page, "#wb-watch-status", "asked run quick to stop")
    _wait_text(page, "#wb-state", "stopped", timeout=LONG)
    assert not (run / "policy").exists()
    if json.loads((run / "state.json").read_text())["step"] == 0:
        # the SIGTERM came while step 1 generated: the step was abandoned (tests/test_stop_generation.py)
        assert _metrics_steps(run) == [] and not (run / "checkpoints").exists()
    else:  # it came once step 1 had generated: the step finished and was saved
        assert _metrics_steps(run) == [1]
        assert (run / "checkpoints" / "step-000001").is_dir()
        assert "step 1/2" in _wait_text(page, "#wb-progress", "step 1/2")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert _plot_points(page, "reward", 1) == [f"step: 1; value: {rows[0]['reward']:g}"]
        assert _plot_points(page, "held-out accuracy", 1)[0].startswith("step: 1; value: ")
    # resume (enabled once the stopped process has exited); while it trains, a second launch is refused naming it
    page.wait_for_selector("#wb-resume:not([disabled])", timeout=30_000)
    page.click("#wb-resume")
    _wait_text(page, "#wb-watch-status", "resumed quick")
    _tab(page, "Train")
    page.fill("#wb-run-name textarea, #wb-run-name input", "second")
    page.click("#wb-launch")
    assert "run quick is training now" in _wait_text(page, "#wb-train-status", "training now")
    assert not (runs / "second").exists()
    _tab(page, "Watch")
    _wait_text(page, "#wb-state", "finished", timeout=LONG)
    assert _metrics_steps(run) == [1, 2]
    assert (run / "policy" / "adapter_config.json").is_file()
    _wait_text(page, "#wb-progress", "step 2/2")
    assert [p.split(";")[0] for p in _plot_points(page, "reward", 2)] == ["step: 1", "step: 2"]
    page.wait_for_function("() => !document.querySelector('#wb-state').innerText.includes('exiting')")
    _shot(page, "watch")


def _plot_points(page, label: str, n: int) -> list[str]:
    """Wait until the curve titled ``label`` draws ``n`` points; their labels (vega's SVG point marks,
    ``step: 1; value: 0.25``)."""
    from lorarl.app.layout import PLOTS

    js = f"#wb-plot-{PLOTS.index(label)} g.hover_marks path[aria-label^='step:']"
    page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length === n", arg=[js, n], timeout=30_000)
    return page.evaluate("(sel) => [...document.querySelectorAll(sel)].map(p => p.getAttribute('aria-label'))", js)


def _chat_and_vote(page, runs: Path) -> None:
    """The run's final adapter shows in a pane without a restart; it answers beside the base; two votes saved."""
    _tab(page, "Chat")
    page.wait_for_selector("#pick-1 input", timeout=30_000)
    _pick(page, 0, "base")
    _pick(page, 1, "quick · final")
    _set_number(page, "temperature", "1")
    _set_number(page, "max_new", "12")
    for prompt, vote in (("What is 12 + 30?", "#vote-right"), ("What is 7 + 5?", "#vote-left")):
        page.click("#clear")  # one prompt per preference pair: the panes' earlier turns must not differ
        _wait_text(page, "#status", "cleared")
        page.fill("#prompt textarea", prompt)
        page.click("#send")  # the status line says "done: ..." once both panes answered
        _wait_text(page, "#status", "done:")
        page.click(vote)
        _wait_text(page, "#status", "saved vote")
    # 👍 / 👎 under one pane each: its answer alone is a KTO row (prompt, completion, label)
    for button, what in (("#up-1", "pane 2 👍"), ("#down-0", "pane 1 👎")):
        page.click(button)
        _wait_text(page, "#status", what)
    rated = [json.loads(line) for line in (runs / "preferences_unpaired.jsonl").read_text().splitlines()]
    assert [(r["model"], r["label"]) for r in rated] == [("quick/policy", True), ("base", False)]
    assert rated[0]["prompt"][-1] == {"role": "user", "content": "What is 7 + 5?"}
    pairs = [json.loads(line) for line in (runs / "preferences.jsonl").read_text().splitlines()]
    assert len(pairs) == 2
    assert {(p["chosen_model"], p["rejected_model"]) for p in pairs} == {
        ("quick/policy", "base"),
        ("base", "quick/policy"),
    }
    _tab(page, "Watch")
    _tab(page, "Chat")  # the votes line refreshes when the tab is shown
    votes = _wait_text(page, "#wb-votes", "usable")
    assert "2 usable preference pair(s)" in votes and "2 single-answer vote(s) (1 👍, 1 👎: KTO only)" in votes
    _shot(page, "chat")


def _retrain(page, runs: Path) -> None:
    """DPO on the two votes from the run's adapter: a new run that Watch follows to its end."""
    _choose(page, "wb-start", "quick · final")
    page.click("#wb-dpo")
    status = _wait_text(page, "#wb-retrain-status", "launched")
    name = re.search(r"launched (\S+):", status).group(1)
    assert name.startswith("dpo-votes-")
    _wait_text(page, "#wb-state", name)  # the Watch tab shows the new run
    _wait_text(page, "#wb-state", "finished", timeout=LONG)
    recipe = (runs / name / "recipe.yaml").read_text()
    # trained from the run's adapter on the copy of the votes taken at launch (RUN/votes.jsonl)
    snapshot = runs / name / "votes.jsonl"
    assert str(snapshot.resolve()) in recipe and "quick/policy" in recipe
    assert snapshot.read_text() == (runs / "preferences.jsonl").read_text()
    assert (runs / name / "policy" / "adapter_config.json").is_file()
    # KTO on the same votes beside DPO: the pairs unpaired (4 rows) and the two single-answer votes, one step of 6
    page.wait_for_function("() => !document.querySelector('#wb-state').innerText.includes('exiting')")  # one run
    _tab(page, "Chat")  # the launch moved the page to Watch; the starting checkpoint stays picked
    assert "quick · final" in page.input_value("#wb-start input")
    page.click("#wb-kto")
    status = _wait_text(page, "#wb-retrain-status", "kto on the votes")
    name = re.search(r"launched (\S+):", status).group(1)
    assert name.startswith("kto-votes-")
    _wait_text(page, "#wb-state", name)
    _wait_text(page, "#wb-state", "finished", timeout=LONG)
    snapshot = runs / name / "votes.jsonl"
    both = (runs / "preferences.jsonl").read_text() + (runs / "preferences_unpaired.jsonl").read_text()
    assert snapshot.read_text() == both and "quick/policy" in (runs / name / "recipe.yaml").read_text()
    (row,) = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and "kl" in row and "rewards/chosen" in row and "rewards/rejected" in row
    assert (runs / name / "policy" / "adapter_config.json").is_file()


def _export(page, runs: Path) -> None:
    """A merged export of the run; the gate's figures on the page match its gate.json."""
    _tab(page, "Export")
    _choose(page, "wb-export-pick", "quick · final")
    page.fill("#wb-export-name textarea, #wb-export-name input", "quick-merged")
    page.click("#wb-export")
    _wait_text(page, "#wb-export-status", "exported", timeout=LONG)
    summary = _wait_text(page, "#wb-gate-summary", "greedy agreement")
    out = runs / "exports" / "quick-merged"
    gate = json.loads((out / "gate.json").read_text())
    assert f"({gate['agreed']}/{gate['prompts']})" in summary
    table = _text(page, "#wb-gate")
    assert "greedy_agreement" in table and f"{gate['greedy_agreement']:.4g}" in table
    assert (out / "config.json").is_file()
    _shot(page, "export")
