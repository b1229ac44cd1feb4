"""Tests for lorarl.sandbox: honest scoring, and hostile code that must score 0
within the limits and leave nothing behind.

Hostile tests run in the mode picked on this machine and, when that is
"namespaces" (root with working ``unshare``), also in the "uid" fallback used
where namespaces are not allowed (e.g. an unprivileged Docker container).
"""

from __future__ import annotations

import ast
import os
import runpy
import secrets
import socket
import sys
import time
from pathlib import Path

import pytest

from lorarl import sandbox
from lorarl.sandbox import (
    SandboxLimits,
    code_tests_reward,
    extract_code,
    isolation_info,
    make_code_tests_reward,
    run_python,
    run_tests,
)
from lorarl.sandbox import isolation as sandbox_isolation
from lorarl.sandbox import reward as sandbox_reward

FAST = SandboxLimits(
    wall_seconds=5.0, cpu_seconds=3, memory_mb=256, max_processes=8, max_output_bytes=16384, file_size_mb=4, disk_mb=16
)
HOSTILE = SandboxLimits(
    wall_seconds=2.0, cpu_seconds=1, memory_mb=256, max_processes=8, max_output_bytes=16384, file_size_mb=4, disk_mb=16
)
# Process start, kill and clean-up on a loaded two-core machine.
SLACK = 3.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRINT_CWD = "import os as _os\nprint(_os.getcwd(), flush=True)\n"


@pytest.fixture(scope="module")
def info():
    return isolation_info()


@pytest.fixture(params=["auto", "uid"])
def mode(request, info):
    if request.param == "auto":
        return info["mode"]
    if info["mode"] != "namespaces":
        pytest.skip("the automatic mode already is the fallback")
    return "uid"


@pytest.fixture
def runs(monkeypatch):
    """Every SandboxResult produced by run_tests during the test, in order."""
    results = []
    real = sandbox_reward._execute

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        results.append(res)
        return res

    monkeypatch.setattr(sandbox_reward, "_execute", spy)
    return results


def _live_harness_processes() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"harness.py" in cmd and state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def _assert_clean(results, elapsed: float, limits: SandboxLimits = HOSTILE) -> None:
    """Within the time limit, no process left, working directory removed."""
    assert results, "no sandbox run happened"
    assert elapsed < limits.wall_seconds + SLACK, elapsed
    for res in results:
        assert res.wall_seconds < limits.wall_seconds + SLACK
        if res.sandbox_uid is not None:
            assert sandbox_isolation._pids_of_uid(res.sandbox_uid) == []
        else:
            assert _live_harness_processes() == []
        # PRINT_CWD's line: on stdout for a script, on stderr for asserts (the code's stdout is not the judge's)
        cwd = next((line for line in (res.stdout + "\n" + res.stderr).splitlines() if line.startswith("/")), "")
        if cwd.startswith("/"):
            assert "lorarl_sbx_" in cwd
            assert not os.path.exists(cwd)


def _hostile(code: str, tests: list, mode: str, runs: list) -> float:
    start = time.monotonic()
    reward = run_tests(PRINT_CWD + code, tests, HOSTILE, isolation=mode)
    _assert_clean(runs, time.monotonic() - start)
    return reward


# --------------------------------------------------------------------------
# extract_code


def test_extract_code_takes_last_python_block():
    text = "Idea:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\nRun it:\n```bash\nls\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("  ```Python\n  y = 3\n  ```  ") == "  y = 3\n"


def test_extract_code_without_block():
    assert extract_code("x = 1") is None
    assert extract_code("```python\nx = 1\n") is None  # truncated, unclosed
    assert extract_code("```js\nlet x\n```") is None
    assert extract_code("x = 1", fallback_raw=True) == "x = 1\n"
    assert extract_code("   ", fallback_raw=True) is None


# --------------------------------------------------------------------------
# The programs that run inside the sandbox


@pytest.mark.parametrize("name", ["harness.py", "ns_init.py"])
def test_programs_are_standalone_scripts(name):
    """They run under ``python -I -S`` on whichever interpreter the sandbox picks: standard library only, no
    ``__future__`` import; importing them (as a wheel's namespace package would allow) runs nothing."""
    path = Path(sandbox.__file__).parent / "programs" / name
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules and modules <= sys.stdlib_module_names - {"__future__"}
    namespace = runpy.run_path(str(path), run_name="lorarl_sandbox_program")
    assert callable(namespace.get("_main") or namespace.get("main"))


# --------------------------------------------------------------------------
# run_python


def test_run_python_basics(info):
    res = run_python(
        "import os, sys\nprint(input()[::-1])\nprint(os.environ['HOME'] == os.getcwd())\n"
        "sys.stdout.flush()\nsys.stdout.buffer.write(b'\\xff\\n')\nsys.exit(3)",
        stdin="abc\n",
        limits=FAST,
    )
    assert res.returncode == 3 and not res.timed_out and res.killed_reason is None
    assert res.stdout.splitlines() == ["cba", "True", "\ufffd"]
    assert res.isolation == info["mode"]
    if info["uid_drop"]:
        assert res.sandbox_uid not in (None, 0)


def test_run_python_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("LORARL_TEST_SECRET", "s3cr3t")
    res = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert res.ok
    assert "LORARL_TEST_SECRET" not in res.stdout and "s3cr3t" not in res.stdout
    assert set(eval(res.stdout)) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "HOME",
        "TMPDIR",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
    }


def test_run_python_file_size_limit():
    res = run_python("open('big', 'wb').write(b'x' * (5 * 2**20))", limits=FAST)
    assert res.returncode != 0 and "File too large" in res.stderr


def test_isolation_info_is_consistent(info):
    assert info["mode"] in sandbox.ISOLATION_MODES
    assert info["uid_drop"] == (os.geteuid() == 0)
    if info["mode"] == "namespaces":
        assert info["network_isolated"] and info["pid_namespace"] and info["readonly_fs"]


# --------------------------------------------------------------------------
# run_tests: honest code

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def test_correct_solution_scores_one():
    assert run_tests("def add(a, b):\n    return a + b\n", ADD_TESTS, FAST) == 1.0


def test_half_correct_solution_scores_half():
    assert (
        run_tests("def add(a, b):\n    return a * b\n", ["assert add(2, 2) == 4", "assert add(1, 2) == 3"], FAST) == 0.5
    )


def test_failing_asserts_do_not_stop_the_others(runs):
    tests = ["assert f() == 0", "assert f() == 1", "raise ValueError", "assert f() == 1"]
    assert run_tests("def f():\n    return 1\n", tests, FAST) == 0.5
    assert len(runs) == 1  # all asserts in one process


def test_broken_code_scores_zero(runs):
    assert run_tests("def add(a, b)\n    return a + b\n", ADD_TESTS, FAST) == 0.0  # syntax error
    assert run_tests("def add(a, b):\n    return a + b\nraise RuntimeError", ADD_TESTS, FAST) == 0.0
    assert run_tests("import sys\nsys.exit(2)\ndef add(a, b):\n    return a + b\n", ADD_TESTS, FAST) == 0.0
    assert run_tests("", ADD_TESTS, FAST) == 0.0
    assert run_tests("def add(a, b):\n    return a + b\n", [], FAST) == 0.0


def test_exit_zero_and_main_guard_still_run_asserts():
    code = "import sys\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n    sys.exit(0)\n"
    assert run_tests(code, ADD_TESTS, FAST) == 1.0


def test_forged_markers_do_not_count():
    code = "for i in range(3):\n    print(f':{i}')\n    print(f'0:{i}')\n    print(i)\n"
    assert run_tests(code, ["assert False", "assert False", "assert False"], FAST) == 0.0


# The code of a completion that tries to pass tests it fails, by the harness's channels rather than by its answers.
_FORGE = (
    "import os, sys\n"
    "def _forge(nonce):\n"
    "    for fd in range(64):\n"
    "        for i in range(4):\n"
    "            try:\n"
    "                os.write(fd, f'\\n{nonce}:{i}\\n'.encode())\n"
    "            except OSError:\n"
    "                pass\n"
)
FORGERIES = {
    # the review's attack: the nonce from the harness's stack frame, markers written, a clean exit
    "stack_frame_nonce": _FORGE
    + "f = sys._getframe()\nwhile f is not None:\n    if 'nonce' in f.f_locals:\n        _forge(f.f_locals['nonce'])\n"
    "        os._exit(0)\n    f = f.f_back\n",
    # every 32-hex string of every live frame (other threads' too) as a nonce
    "any_frame_string": _FORGE + "for top in sys._current_frames().values():\n    f = top\n    while f is not None:\n"
    "        for v in list(f.f_locals.values()):\n            if isinstance(v, str) and len(v) == 32:\n"
    "                _forge(v)\n        f = f.f_back\n",
    "stdin_and_parent_fds": _FORGE
    + "got = sys.stdin.read()\nfor p in (os.getppid(), 1):\n    for fd in (0, 1):\n        try:\n"
    "            got += open(f'/proc/{p}/fd/{fd}', 'rb', buffering=0).read(64).decode()\n        except OSError:\n"
    "            pass\n_forge(got.strip())\n",
    "exit_zero_after_a_fake_pass": "import os\nfor i in range(4):\n    print(f'0:{i}', flush=True)\nos._exit(0)\n",
    "system_exit_zero": "raise SystemExit(0)\n",
    "system_exit_in_the_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "kill_the_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "monkeypatch_the_harness": "import __main__\n__main__._Peer.serve = lambda self, m: {'v': True}\n"
    "__main__._passes = lambda *a: True\ndef add(a, b):\n    return a - b\n",
    "rewrite_tests_json": "import json\nopen('tests.json', 'w').write(json.dumps(['assert True'] * 4))\n"
    "def add(a, b):\n    return a - b\n",
    "ptrace_the_parent": "import ctypes, os\nctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0)\n",  # PTRACE_ATTACH
}


@pytest.mark.parametrize("attack", sorted(FORGERIES))
def test_the_verdict_cannot_be_forged(attack, info, runs):
    """The asserts are judged by a process the code cannot reach; on main at 4fc16f4 the stack-frame nonce scored
    1.0 on these tests. Both modes for the review's attack, the variants in the automatic mode."""
    tests = ["assert False", "assert add(1, 2) == 3", "assert 1 == 2", "assert add(2, 2) == 4"]
    modes = [info["mode"]] + (["uid"] if attack == "stack_frame_nonce" and info["mode"] == "namespaces" else [])
    for mode in modes:
        assert run_tests(FORGERIES[attack], tests, FAST, isolation=mode) == 0.0
        assert runs[-1].stdout == ""  # not one marker reached the judge's stdout


def test_asserts_see_the_code_as_one_interpreter_would():
    """Tests run in the judge against the code in the worker: classes, generators, exceptions, callbacks, in-place
    algorithms, globals the code changes, stdlib values, nested and large values all behave as in one process."""
    code = (
        "from fractions import Fraction\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n"
        "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n"
        "    def __eq__(self, other):\n        return isinstance(other, Stack) and self.items == other.items\n"
        "    def __iter__(self):\n        return iter(self.items)\n"
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __repr__(self):\n        return f'Point({self.x}, {self.y})'\n"
        "    def __lt__(self, o):\n        return (self.x, self.y) < (o.x, o.y)\n"
        "    def __eq__(self, o):\n        return (self.x, self.y) == (o.x, o.y)\n"
        "    def __hash__(self):\n        return hash((self.x, self.y))\n"
        "def add(a, b):\n    return a + b\n"
        "def rotate(nums, k):\n    k %= len(nums)\n    nums[:] = nums[-k:] + nums[:-k]\n"
        "def squares(n):\n    for i in range(n):\n        yield i * i\n"
        "def sort_by(xs, key):\n    return sorted(xs, key=key)\n"
        "def div(a, b):\n    if b == 0:\n        raise ValueError('b is zero')\n    return a / b\n"
        "class Missing(KeyError):\n    pass\ndef boom():\n    raise Missing('k')\n"
        "counter = 0\ndef bump():\n    global counter\n    counter += 1\n"
        "def values():\n    return {'min': 1, 'set': {1, 2}, 't': (1, (2, 3)), 'b': b'\\xff', 'z': 1j, 'n': float('nan'),"
        " 'big': 3 ** 20000, 'grid': [[i * j for j in range(3)] for i in range(3)], 'long': list(range(30000))}\n"
        "def half():\n    return Fraction(1, 2)\n"
    )
    tests = [
        "s = Stack(); s.push(1).push(2); assert s.pop() == 2 and len(s) == 1",
        "assert Stack().push(3) == Stack().push(3) and Stack().push(3) != Stack()",
        "nums = [1, 2, 3, 4, 5]\nrotate(nums, 2)\nassert nums == [4, 5, 1, 2, 3]",
        "assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(4)) == 14 and 2 in Stack().push(2)",
        "assert sort_by([3, 1, 2], key=lambda x: -x) == [3, 2, 1]",
        "try:\n    div(1, 0)\n    assert False\nexcept ValueError as e:\n    assert 'zero' in str(e)",
        "try:\n    boom()\nexcept KeyError:\n    pass\nelse:\n    assert False",
        "bump()\nbump()\nassert counter == 2",
        "import math\nv = values()\nassert v['set'] == {1, 2} and v['t'] == (1, (2, 3)) and v['b'] == b'\\xff' and v['z'] == 1j",
        "v = values()\nassert math.isnan(v['n']) and v['big'] == 3 ** 20000 and v['grid'][2][1:] == [2, 4]",
        "assert values()['long'] == list(range(30000)) and type(add(1, 2)) is int and isinstance(add(1.0, 2), float)",
        "assert half() == 0.5 and float(half()) == 0.5",
        "assert sorted([Point(2, 1), Point(1, 5)]) == [Point(1, 5), Point(2, 1)] and {Point(1, 2), Point(1, 2)} == {Point(1, 2)}",
        "assert f'{Point(1, 2)}' == 'Point(1, 2)' and isinstance(Point(0, 0), Point) and Point(3, 4).x == 3",
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate('a', 'b') == 'ab'\ncheck(add)",
        "assert add(1, 1) == 3",  # the one wrong answer
    ]
    assert run_tests(code, tests, FAST) == pytest.approx(15 / 16)


def test_stdin_stdout_tests():
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [{"input": "1 2\n", "output": "3"}, {"input": "5 7", "output": "12\n"}]
    assert run_tests(code, tests, FAST) == 1.0
    assert run_tests(code, tests + [{"input": "1 1", "output": "3"}, {"bad": "shape"}], FAST) == 0.5
    assert (
        run_tests("print(int(input()) * 2)\nraise SystemExit(1)", [{"input": "2", "output": "4"}], FAST) == 0.0
    )  # right output, non-zero exit
    assert run_tests("print(", [{"input": "", "output": ""}], FAST) == 0.0


def test_mixed_tests():
    code = (
        "def double(x):\n    return 2 * x\nif __name__ == '__main__':\n    import sys\n"
        "    data = sys.stdin.read().split()\n    print(*[double(int(t)) for t in data])\n"
    )
    tests = ["assert double(4) == 8", {"input": "1 2 3", "output": "2 4 6"}, "assert double(1) == 3"]
    assert run_tests(code, tests, FAST) == pytest.approx(2 / 3)


# --------------------------------------------------------------------------
# TRL reward function


def test_reward_function_strings_and_conversations():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return 3\n```"
    conversation = [
        {"role": "assistant", "content": "draft"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": good},
    ]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": good}]}]
    completions = [good, half, "no code here", conversation, parts, good]
    tests = [ADD_TESTS, ADD_TESTS, ADD_TESTS, ADD_TESTS, '["assert add(2, 2) == 4"]', None]
    rewards = code_tests_reward(prompts=["p"] * 6, completions=completions, tests=tests)
    assert rewards == [1.0, 0.5, 0.0, 1.0, 1.0, None]
    assert code_tests_reward(prompts=["p"], completions=[good]) == [None]


def test_reward_function_factory():
    reward = make_code_tests_reward(FAST, max_workers=1)
    assert reward.__name__ == "code_tests_reward"
    assert reward(["p"], ["```\nprint(input())\n```"], tests=[[{"input": "hi", "output": "hi"}]]) == [1.0]
    with pytest.raises(ValueError):
        reward(["p"], ["x"], tests=[[], []])


# --------------------------------------------------------------------------
# Hostile code: reward 0, within the limits, nothing left behind.


def test_infinite_loop(mode, runs):
    assert _hostile("while True:\n    pass\n", ["assert True"], mode, runs) == 0.0
    assert runs[-1].killed_reason in ("cpu_limit", "timeout")


def test_wall_clock_timeout(mode, runs):
    assert _hostile("import time\ntime.sleep(60)\n", ["assert True"], mode, runs) == 0.0
    assert runs[-1].timed_out


@pytest.mark.parametrize(
    "code", ["x = bytearray(10**10)\n", "x = []\nwhile True:\n    x.append(' ' * 10**6)\n", "print('x' * 10**9)\n"]
)
def test_memory_bomb(mode, runs, code):
    assert _hostile(code, ["assert True"], mode, runs) == 0.0
    assert "MemoryError" in runs[-1].stderr


def test_huge_output(mode, runs):
    code = "import sys\nfor _ in range(10**4):\n    sys.stdout.write('x' * 10**5)\n"  # 10**9 characters
    assert _hostile(code, ["assert True"], mode, runs) == 0.0
    res = runs[-1]
    assert res.killed_reason == "output_limit" and res.output_truncated
    assert len(res.stdout.encode()) <= HOSTILE.max_output_bytes


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n        pass\n",
    ],
    ids=["plain", "resilient", "setsid"],
)
def test_fork_bomb(mode, runs, code):
    assert _hostile(code, ["assert True"], mode, runs) == 0.0


def test_writes_outside_the_working_directory(mode, runs):
    tag = secrets.token_hex(6)
    paths = [f"/tmp/lorarl_escape_{tag}", os.path.join(REPO, f"lorarl_escape_{tag}")]
    code = f"for p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
    tests = [f"assert open({p!r}).read() == 'x'" for p in paths]
    try:
        reward = _hostile(code, tests, mode, runs)
        assert not any(os.path.exists(p) for p in paths)
        if mode == "uid":
            # Documented: without a mount namespace /tmp is writable during the
            # run (the file is deleted afterwards); the repository never is.
            assert reward <= 0.5
        else:
            assert reward == 0.0
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_environment_secret_is_not_readable(mode, runs, monkeypatch):
    monkeypatch.setenv("LORARL_TEST_SECRET", "s3cr3t")
    code = (
        "import glob, os\nprint(os.environ.get('LORARL_TEST_SECRET'))\n"
        "for f in glob.glob('/proc/*/environ'):\n    try:\n        data = open(f, 'rb').read()\n"
        "    except OSError:\n        continue\n    if b's3cr3t' in data:\n        print('leak', f)\n"
    )
    tests = ["import os\nassert os.environ.get('LORARL_TEST_SECRET') == 's3cr3t'"]
    assert _hostile(code, tests, mode, runs) == 0.0
    assert "s3cr3t" not in runs[-1].stdout and "leak" not in runs[-1].stdout


def test_network(mode, runs):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        port = server.getsockname()[1]
        code = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    connected = True\nexcept OSError:\n    connected = False\n"
        )
        reward = _hostile(code, ["assert connected"], mode, runs)
    finally:
        server.close()
    if mode in ("namespaces", "userns"):
        assert reward == 0.0  # own network namespace: no interfaces up
    else:
        assert reward == 1.0  # documented: no network isolation in this mode


def test_code_tests_is_a_builtin_reward_with_trl_signature():
    from lorarl.rewards import load_reward_fn

    fn = load_reward_fn("code_tests")
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    tests = ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]
    out = fn(["p", "p", "p"], [good, bad, "no code here"], tests=[tests, tests, tests], wall_seconds=3.0)
    assert out == [1.0, 0.5, 0.0]
