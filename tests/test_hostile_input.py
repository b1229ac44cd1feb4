"""Hostile input (issue 34, items 2, 3, 5, 6, 7, 9): each attack reproduced and refused with one clear line (exit 2 on
the CLI, a LorarlError / a counted failure in Python) within a bounded time. An attack that could hold the interpreter
lock (a huge integer power, a quadratic regex) runs in a child interpreter killed past its bound, so a regression
fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from lorarl import runstate
from lorarl.config import load_recipe, recipe_from_dict, yaml_load
from lorarl.config.loader import MAX_YAML_NODES, expanded_size
from lorarl.errors import MAX_ERROR_CHARS, LorarlError, RecipeError, quote
from lorarl.health import HealthMonitor, nonfinite_weights_error

ROOT = Path(__file__).resolve().parents[1]
ARITH = str(ROOT / "recipes" / "grpo_arithmetic.yaml")


def run_bounded(code: str, seconds: float) -> str:
    """``code`` in a fresh interpreter killed past ``seconds`` (TimeoutExpired fails the test); its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=seconds, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def cli(*args: str, seconds: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorarl.cli", *args], capture_output=True, text=True, timeout=seconds, cwd=ROOT
    )


@contextmanager
def deadline(seconds: float):
    """Fail (not hang) a test whose Python code runs past ``seconds`` (SIGALRM; main thread)."""

    def on_alarm(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def alias_bomb(levels: int, width: int = 9) -> str:
    """The billion-laughs recipe: level k is a list of ``width`` aliases of level k-1 (width**levels values)."""
    lines = ["algo: grpo", "x0: &x0 [" + ", ".join(["lol"] * width) + "]"]
    for k in range(1, levels + 1):
        lines.append(f"x{k}: &x{k} [" + ", ".join([f"*x{k - 1}"] * width) + "]")
    lines.append(f"train:\n  steps: *x{levels}")
    return "\n".join(lines) + "\n"


# ---- 2. YAML alias bombs, error lines that quote megabytes ---------------------------------------------------------


def test_expanded_size_counts_aliases_as_their_expansion():
    # the docstring's example: 1 (top mapping) + 2 keys + 3 ([1, 2]) + 7 ([*x, *x]: 1 + 3 + 3) = 13
    assert expanded_size(yaml.compose("a: &x [1, 2]\nb: [*x, *x]\n")) == 13
    # a 3-level bomb of width 3: x0 = [lol, lol, lol] holds 1 + 3 values, level k 1 + 3 * size(k-1)
    text = alias_bomb(3, width=3)
    x0, x1, x2, x3 = 4, 13, 40, 121
    train = 1 + 1 + x3  # {steps: *x3}
    assert expanded_size(yaml.compose(text)) == 1 + 6 + 1 + x0 + x1 + x2 + x3 + train == 309  # top, 6 keys, "grpo"
    assert yaml_load(text)["x3"][0][0][0] == ["lol"] * 3  # within the bound it loads as before


def test_alias_bomb_recipe_is_refused_at_once_on_the_cli(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(9))  # 1.1 KB; expanded: 9**9 = 387,420,489 strings (55 s and 1.2 GB at 8 levels)
    assert len(bomb.read_bytes()) < 1_200
    t0 = time.monotonic()
    proc = cli("plan", str(bomb), seconds=20)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"lorarl: error: {bomb}: line ") and f"more than {MAX_YAML_NODES} values" in line
    recursive = tmp_path / "loop.yaml"
    recursive.write_text("algo: grpo\ntrain: &t\n  steps: 3\n  again: *t\n")  # a mapping holding itself
    proc = cli("plan", str(recursive), seconds=20)
    assert proc.returncode == 2 and "an alias refers to a collection that holds it" in proc.stderr


def test_an_override_quoted_in_an_error_is_capped():
    # a ~300-character override whose aliases expand to 7**11 values: refused, the line quotes at most ~80 chars
    inner = "&a [1,1,1,1,1,1,1]," + ",".join(
        f"&{chr(98 + k)} [" + ",".join([f"*{chr(97 + k)}"] * 7) + "]" for k in range(10)
    )
    override = f"train.steps=[{inner}]"
    assert 250 < len(override) < 320
    with deadline(10), pytest.raises(RecipeError) as e:
        load_recipe(ARITH, [override])
    assert len(str(e.value)) < 300 and "alias bomb" in str(e.value)
    # a long plain value: the error quotes 80 of its characters, not 500 KB
    with deadline(10), pytest.raises(RecipeError) as e:
        load_recipe(ARITH, ["train.steps=" + "x" * 500_000])
    assert len(str(e.value)) < 400 and str(e.value).startswith(f"{ARITH}: train.steps must be int, got 'xxx")
    # the one place every error line passes: LorarlError caps whatever a message holds
    assert len(str(LorarlError("y" * 10**6))) == MAX_ERROR_CHARS + len("... [cut: 1000000 characters in all]")
    assert quote(10**5000) == "an integer of about 5001 digits"  # no str() of it (Python refuses past 4,300 digits)
    assert quote([[[[["deep"]]]]] * 50) == "[[[[...]]], [[[...]]], [[[...]]], [[[...]]], [[[...]]], [[[...]]], ...]"


def test_a_duplicate_key_is_refused_naming_it_and_both_lines(tmp_path):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text("algo: grpo\ntrain:\n  steps: 3\ngeneration:\n  max_new_tokens: 8\ntrain:\n  seed: 1\n")
    proc = cli("plan", str(recipe))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"lorarl: error: {recipe}: line 6 unreadable YAML (key 'train' is written twice in one mapping (first on "
        "line 2); the second would replace the first)"
    )
    assert yaml_load("a: 1\n<<: {b: 2}\nb: 3\n") == {"a": 1, "b": 3}  # a merge key may be overridden, as YAML says


def test_pipeline_recipes_bound_aliases_too(tmp_path):
    from lorarl.pipeline.spec import load_pipeline

    spec = tmp_path / "pipe.yaml"
    spec.write_text(alias_bomb(9).replace("algo: grpo\n", "stages: []\n"))
    with deadline(10), pytest.raises(LorarlError, match="alias bomb"):
        load_pipeline(spec, tmp_path / "out")


# ---- 5 / 6. non-finite and absurd numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.learning_rate=.inf", "train.learning_rate must be a finite number, got inf"),
        ("train.learning_rate=.nan", "train.learning_rate must be a finite number, got nan"),
        ("train.learning_rate=1e300", "train.learning_rate must be a number of at most 1e+12 in size, got 1e+300"),
        ("train.learning_rate=5", "train.learning_rate must be <= 1 (an AdamW step of 1 per weight)"),
        ("reward.functions=[{name: numeric_match, weight: .nan}]", "reward.functions[0].weight must be a finite"),
        ("train.seed=100000000000000000000000", "train.seed must be an int of at most 2147483647 in size, got 1"),
        ("train.seed=1e23", "train.seed must be int, got 1e+23"),
        ("grpo.group_size=1e20", "grpo.group_size must be int, got 1e+20"),
        ("grpo.group_size=100000000", "train.prompts_per_step x grpo.group_size = 800000000 completions per step"),
        ("train.prompts_per_step=1000000000", "train.prompts_per_step must be in [1, 65536]"),
        ("generation.max_new_tokens=1000000000000", "generation.max_new_tokens must be an int of at most"),
        ("generation.max_new_tokens=1000000", "generation.max_new_tokens must be in [1, 131072]"),
        (
            "generation.max_new_tokens=131072",
            "train.prompts_per_step x grpo.group_size x generation.max_new_tokens = 68157440 tokens sampled per step",
        ),
    ],
)
def test_absurd_and_non_finite_numbers_get_one_line(override, line):
    with deadline(10), pytest.raises(RecipeError) as e:
        load_recipe(ARITH, [override, "train.prompts_per_step=65"] if "131072" in override else [override])
    assert str(e.value).startswith(f"{ARITH}: ") and line in str(e.value) and "\n" not in str(e.value)


def test_absurd_numbers_exit_2_on_the_cli():
    proc = cli("plan", ARITH, "train.learning_rate=.inf", "train.seed=100000000000000000000000")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "finite number" in proc.stderr


@pytest.mark.parametrize("row", ['{"prompt": "p", "answer": ' + "9" * 5000 + "}", '{"prompt": ' + "[" * 100_000])
def test_a_data_row_with_a_huge_number_or_deep_brackets_is_one_line(tmp_path, row):
    from lorarl.data.files import read_jsonl
    from lorarl.errors import DataError

    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "ok", "answer": "1"}\n' + row + ("]" * 100_000 + "}" if "[[" in row else "") + "\n")
    with deadline(10), pytest.raises(DataError) as e:
        read_jsonl(f)
    assert str(e.value).startswith(f"{f}: line 2 (row 1) cannot be read (")
    assert ("nested too deeply" if "[[" in row else "4300 digits") in str(e.value)


def test_non_finite_weights_after_a_step_stop_the_run():
    good, bad = torch.zeros(2, 3), torch.tensor([[1.0, float("inf")], [float("nan"), 0.0]])
    assert nonfinite_weights_error([good]) is None
    assert nonfinite_weights_error([good, bad]).startswith("2 of 10 trained weights are NaN or inf after the update")
    monitor = HealthMonitor(learning_after=0, start_weights=[good.clone()])
    assert monitor.check(1, {}, [good]) == []
    with pytest.raises(LorarlError, match=r"^step 4: 2 of 10 trained weights are NaN or inf"):
        monitor.check(4, {}, [good, bad])


def test_a_run_whose_weights_overflow_crashes_with_its_line(tiny_model_dir, tmp_path, monkeypatch):
    """The issue's run exited 0 with every adapter weight inf (train.learning_rate: .inf, now refused at load). An
    overflow that gets past the load checks (here: injected after step 2's update) stops the run: LorarlError, state
    crashed, no final adapters."""
    from lorarl.algos.grpo import GRPO
    from lorarl.algos.loop import train

    real = GRPO.step

    def step(self, batch):
        out = real(self, batch)
        if batch.step == 2:
            with torch.no_grad():
                self.shared.trainable_parameters(self.outputs[0])[0].fill_(float("inf"))
        return out

    monkeypatch.setattr(GRPO, "step", step)
    recipe = recipe_from_dict(
        {
            "model": {"name": str(tiny_model_dir), "quantization": "none", "dtype": "float32"},
            "lora": {"r": 2, "alpha": 4},
            "data": {"train_size": 8, "eval_size": 2},
            "generation": {"max_new_tokens": 4},
            "train": {"steps": 3, "prompts_per_step": 1, "micro_batch_size": 4, "report_to": []},
            "grpo": {"group_size": 2},
            "health": {"parity_every": 0},
            "eval": {"every": 0, "n": 1},
        }
    )
    with deadline(120), pytest.raises(LorarlError, match=r"^step 2: \d+ of \d+ trained weights are NaN or inf"):
        train(recipe, tmp_path / "run")
    state = runstate.read_state(tmp_path / "run")
    assert state["state"] == "crashed" and state["error"].startswith("LorarlError: step 2: ")
    assert not (tmp_path / "run" / "policy").exists()


# ---- 3. the calculator's results, the tool timeout off the main thread ----------------------------------------------


def test_calculator_bounds_every_intermediate_result_on_any_thread():
    out = run_bounded(
        """
        import time
        from concurrent.futures import ThreadPoolExecutor
        from lorarl.agents.builtins import calculator
        from lorarl.agents.tools import Tool, call_tool, tool_schema
        tools = {"calculator": Tool("calculator", calculator, tool_schema(calculator, "calculator"))}
        with ThreadPoolExecutor(1) as pool:  # off the main thread, as the chat and tool_workers > 1 call it
            for e in ["(9**9999)**999", "(9**9999)**9999", "2**9999*2**9999*2**9999*2**9999*2**9999", "9**9999",
                      "1/2**9999", "-" * 490 + "1", "12*(3+4)", "1/3+1/7"]:
                t0 = time.monotonic()
                r = pool.submit(call_tool, tools, "calculator", {"expression": e}, 5.0).result()
                print(round(time.monotonic() - t0, 1), r.error or r.text)
        """,
        seconds=30,
    )
    rows = out.splitlines()
    assert all(float(r.split()[0]) < 1.0 for r in rows), out
    cut = "calculator: an intermediate result would have more than 40000 bits (about 12,000 digits)"
    digits = "calculator: result has more than 4000 digits"
    assert [r.split(" ", 1)[1] for r in rows] == [cut, cut, cut, digits, digits, "1", "84", "10/21"]


def test_tool_timeout_stops_python_code_on_a_worker_thread():
    from lorarl.agents.tools import Tool, call_tool, tool_schema

    ticks = [0]

    def spin(n: int) -> str:
        """Loop for ever.

        Args:
            n: ignored
        """
        while True:
            ticks[0] += 1

    tools = {"spin": Tool("spin", spin, tool_schema(spin, "spin"))}
    before = {t.ident for t in threading.enumerate()}
    with deadline(20), ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        result = pool.submit(call_tool, tools, "spin", {"n": 1}, 0.3).result()
        assert time.monotonic() - t0 < 2.0
        assert result.error == "spin: timed out after 0.3 s" and json.loads(result.text) == {"error": result.error}
        time.sleep(0.2)
        seen = ticks[0]
        time.sleep(0.3)
        assert ticks[0] == seen  # the helper thread was stopped, not left spinning
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "lorarl-tool-call"]


# ---- 7. the tool-call parser ---------------------------------------------------------------------------------------


def test_parser_counts_hostile_calls_as_malformed_in_linear_time():
    out = run_bounded(
        """
        import time
        from lorarl.agents.formats import make_format
        texts = {
            "brackets": "<tool_call>" + "[" * 1000 + "</tool_call>",
            "brackets_open": "<tool_call>" + "[" * 1000,
            "unclosed": "<tool_call>" * 4000,
            "unclosed_big": "<tool_call>x" * 100_000,
            "many": '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 1000,
            "digits": '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>",
            "llama": '{"name": "f", "parameters": ' + "[" * 100_000,
        }
        for key, text in texts.items():
            for fmt in ("hermes", "llama3_json"):
                t0 = time.monotonic()
                p = make_format(fmt, None).parse(text)
                print(key, fmt, round(time.monotonic() - t0, 2), len(p.calls), len(p.malformed), p.malformed[:1])
        """,
        seconds=30,
    )
    rows = {tuple(r.split(" ")[:2]): r for r in out.splitlines()}
    assert all(float(r.split(" ")[2]) < 1.0 for r in rows.values()), out

    def hermes(key: str) -> str:
        return rows[(key, "hermes")]

    assert "0 1 ['not JSON (JSON nested deeper than 64 brackets): [[[[" in hermes("brackets")
    assert "0 1 ['<tool_call> without </tool_call>: <tool_call>[[[" in hermes("brackets_open")
    assert "0 1 ['<tool_call> without </tool_call>: <tool_call><tool_call>" in hermes("unclosed")
    assert " 0 1 " in hermes("unclosed_big")
    assert "32 1 ['more than 32 calls in one turn: <tool_call>" in hermes("many")
    assert "0 1 ['not JSON (Exceeds the limit (4300 digits)" in hermes("digits")
    assert "0 1 ['not JSON (JSON nested deeper than 64 brackets)" in rows[("llama", "llama3_json")]


def test_parser_still_reads_ordinary_calls():
    from lorarl.agents.formats import parse_llama_json, parse_tagged

    p = parse_tagged('a <tool_call>{"name": "f", "arguments": {"x": [1, {"y": "[["}]}}</tool_call> b <tool_call>{')
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"x": [1, {"y": "[["}]})]
    assert p.content == "a  b" and p.malformed == ["<tool_call> without </tool_call>: <tool_call>{"]
    p = parse_tagged('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{} x</tool_call>')
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"x": 2})]
    assert p.malformed == ["not JSON (Extra data: 'x'): {} x"]
    p = parse_llama_json('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert [c.name for c in p.calls] == ["f", "g"] and not p.malformed


# ---- 9. the remote reward's whole-request deadline -----------------------------------------------------------------


@pytest.fixture()
def trickler():
    """A server that answers a POST with a valid HTTP head, then one byte of its body every 0.1 s (for 20 s)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=trickle, args=(conn,), daemon=True, name="trickler-conn").start()

    def trickle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            body = b"[" + b"1.0, " * 199 + b"1.0]"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(min(len(body), 200)):
                if stop.is_set():
                    return
                try:
                    conn.sendall(body[i : i + 1])
                except OSError:
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=serve, daemon=True, name="trickler")
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    stop.set()
    thread.join(5)
    sock.close()


def test_remote_reward_deadline_covers_the_whole_request(trickler):
    from lorarl.config import RewardSpec
    from lorarl.config.rewards import RemoteRewardConfig
    from lorarl.rewards.scorer import RewardScorer

    cfg = RemoteRewardConfig(url=trickler, timeout_s=0.5, retries=1, backoff_s=0.0)
    scorer = RewardScorer([RewardSpec(name="remote", remote=cfg)], timeout_s=0)  # reward.timeout_s 0: no outer limit
    before = {t.ident for t in threading.enumerate()}
    with deadline(20):
        t0 = time.monotonic()
        s = scorer(["p"] * 200, ["c"] * 200, {})
        took = time.monotonic() - t0
    assert took < 2.5  # 2 attempts x 0.5 s (each socket read came within 0.1 s: a per-read limit never fired)
    assert s.failures["remote"] == f"RemoteRewardError: {trickler}: no answer within 0.5 s (after 2 attempts)"
    assert all(math.isnan(v) for v in s.per_function[:, 0].tolist())
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and not t.name.startswith("trickler")]
    assert leaked == []  # no thread left blocked on the stalled server
