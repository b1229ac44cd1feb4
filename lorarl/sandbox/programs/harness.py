"""The harness: the program that runs a completion's code inside the sandbox (standard library only).

Copied as ``harness.py`` into the run's working directory (next to ``solution.py`` and, for asserts,
``tests.json``) and run as ``python -I -S harness.py MODE RLIMITS NO_NEW_PRIVS COMPILE_ERROR_RC`` by
:mod:`lorarl.sandbox.runner`; never imported as part of lorarl (importing it runs nothing).

MODE: ``script`` runs ``solution.py`` as ``__main__``; ``asserts`` runs it, then every test of ``tests.json``
in its own try block, writing ``<nonce>:<index>`` on a line of its own for each test that passed (the nonce is
the first line of stdin).
RLIMITS: ``"RLIMIT_NAME=soft:hard,..."``, applied first (where no namespace init did already: "uid" and
"rlimits" modes, so that the trainer needs no ``preexec_fn``).
NO_NEW_PRIVS: ``"1"`` to set ``PR_SET_NO_NEW_PRIVS`` (where no namespace init did).
COMPILE_ERROR_RC: the exit status when ``solution.py`` does not compile.

It must run on whichever Python 3 the sandbox picks, under ``-I -S``: standard library only, no ``__future__``
import (that would be one more module in the code's interpreter), annotations with built-in types only.
"""

import builtins
import os
import sys


def _limit() -> None:
    import resource

    for item in sys.argv[2].split(","):
        name, _, value = item.partition("=")
        soft, _, hard = value.partition(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if sys.argv[3] == "1":
        import ctypes

        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def _run_tests(code: object, g: dict, nonce: str) -> None:
    import json
    import traceback

    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    try:
        exec(code, g)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), g)
        except BaseException:
            try:
                traceback.print_exc(limit=2)
            except BaseException:
                pass
            continue
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        try:
            os.write(1, f"\n{nonce}:{i}\n".encode())
        except OSError:
            pass


def _main() -> None:
    _limit()
    builtins.exit = builtins.quit = sys.exit  # normally added by site (-S)
    mode = sys.argv[1]
    compile_error_rc = int(sys.argv[4])
    nonce = sys.stdin.readline().strip() if mode == "asserts" else ""
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        src = f.read()
    try:
        code = compile(src, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(compile_error_rc)
    sys.argv = ["solution.py"]
    g = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins}
    if mode == "script":
        exec(code, g)
        return
    _run_tests(code, g, nonce)


if __name__ == "__main__":
    _main()
