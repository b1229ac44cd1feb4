"""Sandboxed execution of generated Python code, and a code-test reward.

The reward runs a completion's code in a separate, resource-limited process
and scores it against test cases::

    from lorarl.sandbox import code_tests_reward
    trainer = GRPOTrainer(..., reward_funcs=[code_tests_reward])

where the dataset has a ``tests`` column holding, per row, a list of tests.
A test is either an assert statement (``"assert add(1, 2) == 3"``) or a
stdin/stdout pair (``{"input": "1 2\\n", "output": "3"}``).

Isolation
---------
Every run gets a fresh temporary working directory (``HOME`` and ``TMPDIR``
point into it), a scrubbed environment (``PATH``, ``LANG``/``LC_ALL``,
``HOME``, ``TMPDIR`` and single-thread settings for numeric libraries, nothing
else) and the interpreter in isolated mode without ``site``
(``python -I -S``: the standard library only).  The process gets resource
limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``,
``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``; set before ``exec`` by the namespace
init, or else by the harness as the interpreter starts, so that no
``preexec_fn`` runs in a multi-threaded trainer), a wall-clock deadline and
an output cap (the process tree is killed when either is exceeded), its own
session and process group, and ``PR_SET_NO_NEW_PRIVS``.  Output is read
through pipes with a deadline, never with ``communicate()``.  On top of
that, the strongest of the following modes that works on the machine is
chosen once, by trial runs (see :func:`isolation_info`):

``"namespaces"`` (root, and ``unshare`` from util-linux works)
    The code runs as a fresh, unprivileged uid/gid picked at random for each
    run (so ``RLIMIT_NPROC`` applies, which it does not to root, and every
    process of the run can be found by its uid), in new network (no
    interfaces up: no network at all), PID, mount, IPC and UTS namespaces.  In
    the mount namespace every mount is made read-only, ``/tmp``, ``/var/tmp``,
    ``/dev/shm`` and ``/run`` are covered by empty read-only tmpfs mounts and
    the working directory is a private tmpfs of ``disk_mb`` megabytes, so the
    code can write nowhere else and cannot fill the disk.  A small init
    process (running as root inside the namespaces) starts the code and
    reports its exit status; when it ends, the kernel kills everything left in
    the PID namespace.
``"uid"`` (root, no namespaces: e.g. an unprivileged Docker container)
    The code runs as a fresh unprivileged uid/gid as above, so the process
    limit applies and root-owned files (the repository, the trainer's files)
    are not writable, but there is network access, and world-writable
    directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``) are
    writable during the run; files the uid left there are deleted afterwards.
``"userns"`` (not root, unprivileged user namespaces work)
    As ``"namespaces"`` but without the uid change (the code runs as the
    calling user, mapped to root inside a user namespace).  The process
    limit counts the caller's own processes too, so it is set to their
    current number plus ``max_processes``.
``"rlimits"`` (not root, no namespaces)
    Resource limits, process-group kill and the temporary directory only:
    the code can read and write what the calling user can, and a process that
    leaves the process group can outlive the run.  Weak; avoid for untrusted
    code.

When running as root, the code must not run as root: if no interpreter is
usable by an unprivileged uid (e.g. ``sys.executable`` lives under
``/root``, mode 700), a world-readable one is looked for (``python3.X``,
then ``python3`` on a standard ``PATH``; override with the environment
variable ``LORARL_SANDBOX_PYTHON``), and :class:`SandboxUnavailable` is
raised if there is none.

After every run, all processes of the run (by uid where there is one, else by
process group) are killed with ``SIGKILL`` and the working directory is
removed.  Zombie processes waiting to be reaped by the system's init are not
counted as leftovers.

Verdicts
--------
A stdin/stdout test is judged from outside (the runner compares what the
code printed and its exit status).  Asserts are judged by a process the
code cannot reach: the harness forks a worker that runs the code, and runs
each test's statements itself, asking the worker for the code's names and
for each operation on the code's objects (plain values cross by value: in
``assert add(1, 2) == 3`` the worker calls ``add``, the judge compares the
int it got).  The judge is non-dumpable, the worker has no capabilities,
and the judge reads the nonce of its pass markers only after the fork, on a
stdout the worker does not hold; so reading the harness's stack frames,
writing to any file descriptor, ``os._exit(0)`` after a fake pass,
``SystemExit(0)``, monkeypatching the harness, rewriting ``tests.json`` or
killing the judge all score as failures (``tests/test_sandbox.py``).  What
a test can do is limited by that: values of other types cross as handles
(a proxy forwards calls, attributes, operators, iteration), a list, dict,
set or bytearray passed to a call is copied back after it, a function the
test passes (``key=lambda x: -x``) is called back, but ``isinstance(obj,
int)`` on a proxy is False and an object of the code is compared by its own
``__eq__`` (a class whose ``__eq__`` always returns True passes ``==``, as
it would in one interpreter; tests that must rule it out compare
``type(r) is int``).  See ``programs/harness.py``.

Caveats: in ``"rlimits"`` mode (the code runs as the calling user) the code
can reach the trainer's own pipes, so even the verdict is not safe there;
in ``"uid"`` mode, file cleanup covers the usual
world-writable directories only; memory is limited per process
(``RLIMIT_AS``), so the worst case is about ``max_processes * memory_mb``;
each stdin/stdout test is one process (about 0.05 s of overhead each here,
but up to ``wall_seconds`` each for code that hangs).

Layout
------
:mod:`~lorarl.sandbox.limits` (limits, results, errors, resource limits),
:mod:`~lorarl.sandbox.isolation` (modes, interpreter, uids, finding and killing
a run's processes, cleanup), :mod:`~lorarl.sandbox.runner` (mode selection,
spawning, reading output with deadlines, :func:`run_python`),
:mod:`~lorarl.sandbox.reward` (:func:`extract_code`, :func:`run_tests`, the
reward), and the two programs that run inside the sandbox as standalone
scripts, never imported: ``programs/harness.py`` (runs the code; judges
the asserts from a second process) and ``programs/ns_init.py`` (the namespace init).
"""

from __future__ import annotations

from lorarl.sandbox.isolation import ISOLATION_MODES as ISOLATION_MODES
from lorarl.sandbox.isolation import _pids_of_uid as _pids_of_uid
from lorarl.sandbox.limits import SandboxError, SandboxLimits, SandboxResult, SandboxUnavailable
from lorarl.sandbox.reward import code_tests_reward, extract_code, make_code_tests_reward, run_tests
from lorarl.sandbox.runner import _execute as _execute
from lorarl.sandbox.runner import isolation_info, run_python

__all__ = [
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "code_tests_reward",
    "extract_code",
    "isolation_info",
    "make_code_tests_reward",
    "run_python",
    "run_tests",
]
