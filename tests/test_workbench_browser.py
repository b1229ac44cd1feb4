"""The workbench end to end through the real page (issues 25 and 43): headless Chromium drives ``lorarl chat`` with
its Train / Watch / Chat / Export tabs over a fresh runs folder, on the tiny random-init model, at 1400 px and, on
each tab once it is filled, at 900 px, and asserts what the page says.

Train: the first visit opens on the quickstart recipe (marked ★ start here) with its cost block (the header's
measured figures, a time estimate) and a truthful eval.every label; a wrong field value (Check says "not ready",
names the field, shows the loader's line in red beside it; Launch starts nothing), a run name Launch would refuse
(Check refuses it too); PPO, whose reward adapter is a field on the page: Check catches the missing adapter; then a
2-step run launched after Check says "ok". Watch: the running step's phase inside the step (RUN/step.json); Stop
(its line says what it will do; the state line then says what it did, checked against the run's files); Resume (it
names the run folder), a second launch refused while one trains; the finished run's result line (its held-out
evaluations and total time, checked against metrics.jsonl) and why the empty curves are empty; the log tail; the
completions table (the user's turn, no chat template). Chat: the run's final adapter in a pane beside the base; the
votes line counts each vote as it is cast, a 👍 and a 👎 on one answer each (KTO rows) too. Retrain: DPO on the two
votes, watched to its end; KTO on the votes and the two single-answer votes (six rows), watched to its end. Export:
the newest run (the KTO one) picked, an empty name (the default said), the line while it runs, the gate's verdict;
the same name again is refused until "replace" is ticked, then replaced.

Every step is real: ``lorarl train`` subprocesses, the run folder's files, the exported folder. Needs Chromium (see
tests/test_chat_browser.py); skips, saying why, only when none is installed. The docs' screenshots come from a real
run instead (scripts/workbench_screenshots.py).
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
LONG = 300_000  # ms: a subprocess loading the model and training a step (106 s seen on 2 cores at load 13)
WIDE, NARROW = 1400, 900  # the page's widths under test (px)
RED = "rgb(192, 57, 43)"  # .field-error (lorarl/app/layout.py)


@pytest.fixture(scope="module")
def workbench(tmp_path_factory, tiny_model_dir):
    """``lorarl chat`` with the workbench on 127.0.0.1, the tiny model as the chat's base, an empty runs folder; the
    app works in a fresh folder (a recipe's relative adapter path, PPO's runs/reward_model, leads nowhere)."""
    from lorarl.chat import launch
    from lorarl.config import ModelConfig
    from lorarl.model import SharedBase

    root = tmp_path_factory.mktemp("workbench")
    runs = root / "runs"
    runs.mkdir()
    cwd = os.getcwd()
    os.chdir(root)
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
        os.chdir(cwd)


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


def _field_block(page, key: str):
    return page.locator("[id^='wb-field-']:not([id^='wb-field-error'])", has_text=f"({key})").first


def _field(page, key: str):
    """The text box of the Train tab's field ``key`` (its label ends with ``(key)``)."""
    return _field_block(page, key).locator("textarea, input").first


def _set_field(page, key: str, value: str) -> None:
    box = _field(page, key)
    box.fill(value)
    box.blur()


def _field_error_sel(page, key: str) -> str:
    return f"#wb-field-error-{_field_block(page, key).get_attribute('id').rsplit('-', 1)[1]}"


def _color(page, sel: str) -> str:
    """The computed colour of the text inside ``sel`` (its first paragraph)."""
    return page.evaluate(
        "(sel) => getComputedStyle(document.querySelector(sel + ' p') || document.querySelector(sel)).color", sel
    )


def _metrics(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def _narrow(page, check) -> None:
    """At 900 px: ``check(page)``, then back to 1400 px."""
    page.set_viewport_size({"width": NARROW, "height": 1000})
    try:
        page.wait_for_timeout(300)  # the layout settles
        check(page)
    finally:
        page.set_viewport_size({"width": WIDE, "height": 1000})


def _fits(page, sel: str) -> bool:
    """Nothing of ``sel`` is cut: its content is no wider than its box."""
    return page.evaluate(
        "(sel) => [...document.querySelectorAll(sel)].every(e => e.offsetParent === null || e.scrollWidth <= e.clientWidth + 1)",
        sel,
    )


def _broken_words(page, sel: str) -> list[str]:
    """The one-word cells of ``sel`` whose text the browser broke over two lines (``ste / p``)."""
    return page.evaluate(
        r"""(sel) => [...document.querySelectorAll(sel)].filter(c => {
             const text = c.innerText.trim();
             if (!text || /\s/.test(text)) return false;
             const r = document.createRange(); r.selectNodeContents(c);
             return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size > 1;
           }).map(c => c.innerText.trim())""",
        sel,
    )


# ---- the test ---------------------------------------------------------------------------------------------------
def test_launch_watch_stop_resume_chat_vote_retrain_export(workbench, tiny_model_dir):
    app_url, runs, wb = workbench
    exe = chromium_path()
    if exe is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium, or set LORARL_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory(prefix="lorarl-chromium-") as profile:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS, viewport={"width": WIDE, "height": 1000}
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
    """First visit: the quickstart, its cost and fields; refusals named; PPO's missing reward adapter caught by Check;
    the tiny 2-step run launched once Check says ok."""
    # the first visit opens on the quickstart, marked as the place to start, with its header and cost
    assert "GRPO quickstart" in _wait_text(page, "#wb-recipe-header", "GRPO quickstart")
    assert page.input_value("#wb-recipe input").startswith("★ start here: grpo_arithmetic.yaml")
    cost = _wait_text(page, "#wb-plan", "Cost on this machine")
    assert "memory: 5.2 GB peak RSS measured on cpu" in cost and "time: about 8m40s for 40 steps" in cost
    assert "(0: no held-out evaluation during training)" in _text(page, "#tab-train")  # eval.every's true label
    # a value the loader refuses: Check says not ready naming it, its line beside it in red; Launch starts nothing
    _set_field(page, "train.steps", "two")
    page.click("#wb-check")
    assert "not ready: train.steps: " in _wait_text(page, "#wb-train-status", "not ready")
    error = _field_error_sel(page, "train.steps")
    assert "train.steps must be int" in _text(page, error) and _color(page, error) == RED
    page.fill("#wb-run-name textarea, #wb-run-name input", "refused")
    page.click("#wb-launch")
    _wait_text(page, "#wb-train-status", "not launched")
    assert not (runs / "refused").exists()
    # a run name Launch would refuse: Check refuses it too
    _set_field(page, "train.steps", "2")
    page.fill("#wb-run-name textarea, #wb-run-name input", "exports")
    page.click("#wb-check")
    assert "run name 'exports' is taken" in _wait_text(page, "#wb-train-status", "not ready")
    # PPO: its reward adapter is a field; Check catches the missing one (Launch would crash in set-up)
    _choose(page, "wb-recipe", "ppo.yaml")
    _wait_text(page, "#wb-recipe-header", "PPO")
    assert page.input_value("#wb-adapter-0 input") == "runs/reward_model (the recipe's)"
    page.click("#wb-check")
    status = _wait_text(page, "#wb-train-status", "reward.adapter")
    assert "not ready" in status and "reward adapter runs/reward_model: no such folder" in status
    assert "no such folder" in _text(page, "#wb-adapter-error-0") and _color(page, "#wb-adapter-error-0") == RED
    # the run: the quickstart on the tiny model (the chat's base, offered by the model dropdown), 2 steps, long
    # enough completions (96 tokens) and a held-out evaluation after each step, so that step 1 lasts a few seconds
    _choose(page, "wb-recipe", QUICKSTART)
    _wait_text(page, "#wb-recipe-header", "GRPO quickstart")
    _choose(page, "wb-model", str(tiny_model_dir))
    for key, value in (("train.steps", "2"), ("grpo.group_size", "4"), ("generation.max_new_tokens", "96")):
        _set_field(page, key, value)
    _set_field(page, "eval.every", "1")
    page.fill("#wb-run-name textarea, #wb-run-name input", "quick")
    page.click("#wb-check")
    assert "ready to launch quick (lorarl train" in _wait_text(page, "#wb-train-status", "ok:")
    cost = _text(page, "#wb-plan")  # measured at the recipe's sizes: the page says these changes change it
    assert "time: about 0m26s for 2 steps" in cost and "grpo.group_size" in cost and "change the step's size" in cost

    def narrow(page) -> None:  # 900 px: the header wraps, no field label is cut
        assert _fits(page, "#wb-recipe-header pre") and _fits(page, "#tab-train [data-testid='block-info']")

    _narrow(page, narrow)
    page.click("#wb-launch")
    _wait_text(page, "#wb-state", "quick")  # launched: the page moved to Watch, on the new run


def _watch_stop_resume(page, runs: Path) -> None:
    """Watch follows the run inside its step; Stop says what it will do, then the state line what it did (checked
    against the files); a second launch refused; Resume -> 2/2; the finished run's result, empty curves' reasons."""
    run = runs / "quick"
    _wait_text(page, "#wb-state", "running", timeout=LONG)  # the loop began step 1
    _wait_text(page, "#wb-progress", "now step 1: ")  # inside the step: its phase (RUN/step.json)
    page.click("#wb-stop")
    said = _wait_text(page, "#wb-watch-status", "asked run quick to stop: ")
    assert re.search(r"it was generating step 1|it was past generation in step 1|if step 1 is still generating", said)
    _wait_text(page, "#wb-state", "stopped", timeout=LONG)
    state = _wait_text(page, "#wb-state", "Stop came")
    assert not (run / "policy").exists()
    abandoned = json.loads((run / "state.json").read_text())["step"] == 0
    if abandoned:
        # the SIGTERM came while step 1 generated: the step was abandoned, and the page says so
        assert [r["step"] for r in _metrics(run)] == [] and not (run / "checkpoints").exists()
        assert "Stop came while step 1 generated: the step was abandoned" in state
    else:  # it came once step 1 had generated: the step finished and was saved
        assert [r["step"] for r in _metrics(run)] == [1] and (run / "checkpoints" / "step-000001").is_dir()
        assert "Stop came during step 1: it finished and a checkpoint of step 1 was saved" in state
        assert "step 1/2" in _wait_text(page, "#wb-progress", "step 1/2")
    # resume (enabled once the stopped process has exited); while it trains, a second launch is refused naming it
    page.wait_for_selector("#wb-resume:not([disabled])", timeout=30_000)
    page.click("#wb-resume")
    resumed = _wait_text(page, "#wb-watch-status", "resumed quick:")
    assert f"--out {run} --resume" in resumed and "--out RUN " not in resumed
    _tab(page, "Train")
    page.fill("#wb-run-name textarea, #wb-run-name input", "second")
    page.click("#wb-launch")
    assert "run quick is training now" in _wait_text(page, "#wb-train-status", "training now")
    assert not (runs / "second").exists()
    _tab(page, "Watch")
    _wait_text(page, "#wb-state", "finished", timeout=LONG)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and (run / "policy" / "adapter_config.json").is_file()
    _wait_text(page, "#wb-progress", "step 2/2")
    assert [p.split(";")[0] for p in _plot_points(page, "reward", 2)] == ["step: 1", "step: 2"]
    page.wait_for_function("() => !document.querySelector('#wb-state').innerText.includes('exiting')")
    # the result at the top: the held-out evaluations of steps 1 and 2 and the total time, as metrics.jsonl has them
    result = _wait_text(page, "#wb-result", "Result")
    first, last = rows[0]["eval/accuracy"], rows[1]["eval/accuracy"]
    assert f"held-out eval/accuracy: {first:.1%} at step 1 → {last:.1%} at step 2 (2 evaluations)" in result
    from lorarl.app.results import format_seconds

    if abandoned:  # the resumed process trained both steps: its wall time, model loading included
        wall = json.loads((run / "summary.json").read_text())["wall_s"]
        assert f"total time {format_seconds(wall)} (one process, model loading included)" in result
    else:  # two processes trained a step each: their steps and evaluations
        total = sum(r["step_time"] + r.get("time/evaluation", 0.0) for r in rows)
        assert f"total time {format_seconds(total)} in steps and evaluations" in result
    # an empty curve says why: no KL (the quickstart's kl.coef is 0)
    assert _text(page, "#wb-plot-note-2") == "empty: not computed: grpo.kl.coef is 0 (the reference model never runs)"
    assert all(re.fullmatch(r"\d+", x) for x in _axis_labels(page, "reward"))  # whole steps on the axis
    log = page.input_value("#wb-log textarea").splitlines()  # the log tail: train.log's last lines
    assert log and log[-1] in (run / "train.log").read_text()
    table = _text(page, "#wb-completions")
    assert "user turn" in table and "What is" in table and "<|im_start|>" not in table

    def narrow(page) -> None:  # 900 px: the table's headers keep whole words, the run selector stays readable
        assert _broken_words(page, "#wb-completions thead th .header") == []
        assert page.evaluate("() => document.querySelector('#wb-run').offsetWidth") >= 300

    _narrow(page, narrow)


def _plot_points(page, label: str, n: int) -> list[str]:
    """Wait until the curve titled ``label`` draws ``n`` points; their labels (vega's SVG point marks,
    ``step: 1; value: 0.25``)."""
    from lorarl.app.layout import PLOTS

    js = f"#wb-plot-{PLOTS.index(label)} g.hover_marks path[aria-label^='step:']"
    page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length === n", arg=[js, n], timeout=30_000)
    return page.evaluate("(sel) => [...document.querySelectorAll(sel)].map(p => p.getAttribute('aria-label'))", js)


def _axis_labels(page, label: str) -> list[str]:
    """The x axis's tick labels of the curve titled ``label``."""
    from lorarl.app.layout import PLOTS

    sel = f"#wb-plot-{PLOTS.index(label)} g[aria-label^='X-axis'] g.role-axis-label text"
    return page.evaluate("(sel) => [...document.querySelectorAll(sel)].map(t => t.textContent)", sel)


def _chat_and_vote(page, runs: Path) -> None:
    """The run's final adapter shows in a pane without a restart; it answers beside the base; each vote counts on
    the retrain line as it is cast."""
    _tab(page, "Chat")
    page.wait_for_selector("#pick-1 input", timeout=30_000)
    assert "no votes yet" in _wait_text(page, "#wb-votes", "no votes yet")
    _pick(page, 0, "base")
    _pick(page, 1, "quick · final")
    _wait_text(page, "#status", "ready: quick · final")  # the adapter is loaded (else its line may follow Clear's)
    _set_number(page, "temperature", "1")
    _set_number(page, "max_new", "12")
    for n, (prompt, vote) in enumerate((("What is 12 + 30?", "#vote-right"), ("What is 7 + 5?", "#vote-left")), 1):
        page.click("#clear")  # one prompt per preference pair: the panes' earlier turns must not differ
        _wait_text(page, "#status", "cleared")
        page.fill("#prompt textarea", prompt)
        page.click("#send")  # the status line says "done: ..." once both panes answered
        _wait_text(page, "#status", "done:")
        page.click(vote)
        _wait_text(page, "#status", "saved vote")
        assert f"{n} usable preference pair(s)" in _wait_text(page, "#wb-votes", f"{n} usable")  # no reload
    # 👍 / 👎 under one pane each: its answer alone is a KTO row (prompt, completion, label)
    for button, what in (("#up-1", "pane 2 👍"), ("#down-0", "pane 1 👎")):
        page.click(button)
        _wait_text(page, "#status", what)
    rated = [json.loads(line) for line in (runs / "preferences_unpaired.jsonl").read_text().splitlines()]
    assert [(r["model"], r["label"]) for r in rated] == [("quick/policy", True), ("base", False)]
    assert rated[0]["prompt"][-1] == {"role": "user", "content": "What is 7 + 5?"}
    pairs = [json.loads(line) for line in (runs / "preferences.jsonl").read_text().splitlines()]
    assert {(p["chosen_model"], p["rejected_model"]) for p in pairs} == {
        ("quick/policy", "base"),
        ("base", "quick/policy"),
    }
    # the votes line counted the single-answer votes as they were cast (no reload)
    votes = _wait_text(page, "#wb-votes", "2 single-answer")
    assert "2 usable preference pair(s)" in votes and "2 single-answer vote(s) (1 👍, 1 👎: KTO only)" in votes


def _retrain(page, runs: Path) -> None:
    """DPO on the two votes from the run's adapter: a new run that Watch follows to its end; then KTO on the same
    votes and the two single-answer ones."""
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
    page.wait_for_function(  # one run at a time: the DPO run's process has exited
        "() => !document.querySelector('#wb-state').innerText.includes('exiting')", timeout=LONG
    )
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
    """The newest run's final adapter picked on arrival; an empty name (the default said); the line while it runs;
    the gate's verdict, matching gate.json; the same name refused until "replace" is ticked, then replaced."""
    _tab(page, "Export")
    page.wait_for_function("() => document.querySelector('#wb-export-pick input').value.includes('kto-votes-')")
    _choose(page, "wb-export-pick", "quick · final")
    # a minimum the tiny random model's export always meets (its near-uniform logits flip greedy ties): the verdict
    # is shown either way; the page's default, 0.95, is lorarl export's warning line
    assert page.input_value("#wb-export-minimum input") == "0.95"
    page.fill("#wb-export-minimum input", "0")
    page.click("#wb-export")
    running = _wait_text(page, "#wb-export-status", "exporting quick/policy as merged")
    assert "RUNS/exports/quick-final-merged (the default name: the name box was empty)" in running
    assert page.is_disabled("#wb-export")  # a second click cannot start a second export
    assert _wait_text(page, "#wb-export-status", "xported quick", timeout=LONG).startswith("exported quick/policy")
    out = runs / "exports" / "quick-final-merged"
    gate = json.loads((out / "gate.json").read_text())
    summary = _wait_text(page, "#wb-gate-summary", "greedy agreement")
    assert f"({gate['agreed']}/{gate['prompts']})" in summary
    assert f"passed: greedy agreement {gate['greedy_agreement']:.1%} ≥ minimum 0%" in summary
    table = _text(page, "#wb-gate")
    assert f"{gate['greedy_agreement']:.4g}" in table and "verdict" in table and "None" not in table
    assert (out / "config.json").is_file()
    # the same (default) name again: refused, naming the option; ticked, the export replaces it
    before = (out / "gate.json").stat().st_mtime_ns
    page.click("#wb-export")
    assert "tick “Replace an existing export of that name”" in _wait_text(page, "#wb-export-status", "already exists")
    page.check("#wb-export-force input")
    page.click("#wb-export")
    assert _wait_text(page, "#wb-export-status", "xported quick", timeout=LONG).startswith("exported quick/policy")
    assert (out / "gate.json").stat().st_mtime_ns != before
