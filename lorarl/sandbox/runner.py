"""Running code in the sandbox: picking the isolation mode by trial runs (:func:`isolation_info`), preparing the
working directory, starting the harness (under the namespace init where there is one), feeding stdin and reading
capped output with a deadline, killing what is left and turning it all into a :class:`SandboxResult`.

The two programs that run inside the sandbox (``programs/harness.py`` and ``programs/ns_init.py``) are read
from the package as text: the harness is copied into the working directory (readable by the sandbox uid), the
init is passed with ``-c``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import resources

from lorarl.sandbox.isolation import (
    _NAMESPACE_MODES,
    _UID_DROP_MODES,
    _UNSHARE_FLAGS,
    _allocate_uid,
    _candidate_modes,
    _check_mode,
    _children_of,
    _count_own_processes,
    _kill_uid,
    _release_uid,
    _remove_files_of_uid,
    _sandbox_python,
    _scrubbed_env,
    _sigkill,
    _workdir_base,
)
from lorarl.sandbox.limits import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    _rlimits,
    _rlimits_spec,
)

logger = logging.getLogger(__name__)


def _program(name: str) -> str:
    """The text of ``programs/<name>``, a standalone program for the sandbox's interpreter (never imported)."""
    return (resources.files(__package__) / "programs" / name).read_text(encoding="utf-8")


_HARNESS = _program("harness.py")
_NS_INIT = _program("ns_init.py")
# Exit code the harness uses when the code does not compile.
_COMPILE_ERROR_RC = 97


# --------------------------------------------------------------------------
# Mode selection.

_mode_lock = threading.Lock()
_mode_cache: dict[str, object] | None = None


def isolation_info() -> dict[str, object]:
    """Which isolation mode is used here, found once by trial runs (cached).

    Returns a dict with ``mode``, ``root``, ``python`` (interpreter the code
    runs with), ``network_isolated``, ``pid_namespace``, ``readonly_fs`` and
    ``uid_drop``.  Raises :class:`SandboxUnavailable` if nothing safe works.
    """
    global _mode_cache
    with _mode_lock:
        if _mode_cache is not None:
            return dict(_mode_cache)
        probe = SandboxLimits(wall_seconds=10.0, cpu_seconds=5, memory_mb=512)
        errors = []
        for mode in _candidate_modes():
            try:
                res = _execute({"solution.py": "print('ok')"}, "script", "", probe, mode)
            except SandboxError as exc:
                errors.append(f"{mode}: {exc}")
                continue
            if res.ok and res.stdout.strip() == "ok":
                ns = mode in _NAMESPACE_MODES
                _mode_cache = {
                    "mode": mode,
                    "root": os.geteuid() == 0,
                    "python": _sandbox_python(mode in _UID_DROP_MODES),
                    "uid_drop": mode in _UID_DROP_MODES,
                    "network_isolated": ns,
                    "pid_namespace": ns,
                    "readonly_fs": ns and not res.readonly_failures,
                    "readonly_failures": res.readonly_failures,
                }
                logger.info("sandbox isolation: %s", _mode_cache)
                return dict(_mode_cache)
            errors.append(f"{mode}: rc={res.returncode} stderr={res.stderr[-300:]!r}")
        raise SandboxUnavailable("no sandbox mode works here: " + "; ".join(errors))


# --------------------------------------------------------------------------
# Running.


def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    *,
    isolation: str | None = None,
) -> SandboxResult:
    """Run ``code`` as a script (``__name__ == "__main__"``) in the sandbox.

    ``isolation`` forces a mode (one of ``ISOLATION_MODES``, mainly for
    tests); by default the one from :func:`isolation_info` is used.  Raises
    :class:`SandboxError` when the sandbox itself fails.
    """
    return _execute({"solution.py": code}, "script", stdin, limits, isolation or isolation_info()["mode"])


def _execute(files: dict[str, str], harness_mode: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """One run of the harness (``harness_mode`` ``"script"`` or ``"asserts"``) on ``files`` in a fresh working
    directory, in isolation ``mode``; the working directory and the uid are released afterwards."""
    _check_mode(mode)
    drop = mode in _UID_DROP_MODES
    python = _sandbox_python(drop)
    if python is None:
        raise SandboxUnavailable("no Python interpreter usable by an unprivileged uid (set LORARL_SANDBOX_PYTHON)")
    base = _workdir_base(mode == "uid")
    uid = _allocate_uid() if drop else None
    try:
        workdir = tempfile.mkdtemp(prefix="lorarl_sbx_", dir=base)
    except BaseException:
        if uid is not None:
            _release_uid(uid)
        raise
    try:
        for name, text in {**files, "harness.py": _HARNESS}.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
        if mode == "uid":
            for name in os.listdir(workdir):
                os.chown(os.path.join(workdir, name), uid, uid)
            os.chown(workdir, uid, uid)
        return _spawn_and_collect(python, workdir, harness_mode, stdin, limits, mode, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if os.path.exists(workdir):
            logger.warning("sandbox: could not remove %s", workdir)
        if uid is not None:
            _release_uid(uid)


def _spawn_and_collect(
    python: str, workdir: str, harness_mode: str, stdin: str, limits: SandboxLimits, mode: str, uid: int | None
) -> SandboxResult:
    """Start the run, feed and read it within the limits, kill everything left of it; its result."""
    proc, status_r, start = _launch(python, workdir, harness_mode, limits, mode, uid)
    kill_all = functools.partial(_kill_run, proc, mode, uid)
    try:
        out, err, truncated, killed_reason = _Pump(
            proc, stdin.encode("utf-8", "surrogatepass"), limits, start, kill_all
        ).run()
    finally:
        kill_all()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox: process %d did not exit after SIGKILL", proc.pid)
        if uid is not None and not _kill_uid(uid):
            logger.warning("sandbox: processes of uid %d survived", uid)
        status = _read_all(status_r).decode("utf-8", "replace").splitlines() if status_r is not None else []
    wall = time.monotonic() - start

    returncode: int | None = proc.returncode
    readonly_failures: list[str] = []
    if status_r is not None:
        returncode, readonly_failures = _init_outcome(status, proc.returncode, killed_reason, err)
    if killed_reason is None and returncode == -signal.SIGXCPU:
        killed_reason = "cpu_limit"
    if uid is not None and (mode == "uid" or readonly_failures):
        removed = _remove_files_of_uid(uid)
        if removed:
            logger.info("sandbox: removed files written outside the working directory: %s", removed)
    return SandboxResult(
        returncode=returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        timed_out=killed_reason == "timeout",
        killed_reason=killed_reason,
        output_truncated=truncated,
        wall_seconds=wall,
        isolation=mode,
        sandbox_uid=uid,
        readonly_failures=readonly_failures,
    )


def _launch(
    python: str, workdir: str, harness_mode: str, limits: SandboxLimits, mode: str, uid: int | None
) -> tuple[subprocess.Popen, int | None, float]:
    """Start the harness in its own session, under ``unshare`` and the namespace init in the namespace modes.

    Returns the process, the read end of the init's status pipe (``None`` without an init) and the start time.
    """
    env = _scrubbed_env(workdir)
    nproc = limits.max_processes + (harness_mode == "asserts")  # the judge beside the code's process
    if mode not in _UID_DROP_MODES:  # the caller's own processes count too
        nproc += _count_own_processes()
    rlimits = _rlimits(limits, nproc)
    no_new_privs = "0" if mode in _NAMESPACE_MODES else "1"  # else the init sets it
    spec = _rlimits_spec(rlimits)
    code_argv = [python, "-I", "-S", "harness.py", harness_mode, spec, no_new_privs, str(_COMPILE_ERROR_RC)]
    status_r = status_w = None
    popen_kwargs: dict = {}
    if mode in _NAMESPACE_MODES:
        status_r, status_w = os.pipe()
        cfg = {
            "workdir": workdir,
            "uid": uid,
            "gid": uid,
            "disk_mb": limits.disk_mb,
            "rlimits": rlimits,
            "argv": code_argv,
            "env": env,
            "status_fd": status_w,
        }
        flags = (["--user", "--map-root-user"] if mode == "userns" else []) + _UNSHARE_FLAGS
        init_python = sys.executable if sys.executable and mode == "namespaces" else python
        argv = [shutil.which("unshare") or "unshare", *flags, init_python, "-I", "-S", "-c", _NS_INIT, json.dumps(cfg)]
        popen_kwargs["pass_fds"] = (status_w,)
    else:
        argv = code_argv  # the harness applies the limits itself
        if mode == "uid":
            popen_kwargs.update(user=uid, group=uid, extra_groups=[])

    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            **popen_kwargs,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        if status_r is not None:
            os.close(status_r)
            os.close(status_w)
        raise SandboxError(f"could not start the sandbox: {exc}") from exc
    if status_w is not None:
        os.close(status_w)
    return proc, status_r, start


def _kill_run(proc: subprocess.Popen, mode: str, uid: int | None) -> None:
    """SIGKILL every process of the run.

    The code's processes first (by uid, or the namespace's init, which takes the whole PID namespace with it),
    then give unshare a moment to reap its child (else it is left a zombie for the system's init), then whatever
    is left in the process group.
    """
    if uid is not None:
        _kill_uid(uid)
    if mode == "userns":
        _sigkill(_children_of(proc.pid))
    if mode in _NAMESPACE_MODES:
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _init_outcome(
    status: list[str], proc_returncode: int | None, killed_reason: str | None, err: bytes
) -> tuple[int | None, list[str]]:
    """The code's return code and the mounts left writable, from the namespace init's status lines.

    Raises :class:`SandboxError` when the init reported an error or never got ready.
    """
    ready = [s for s in status if s.startswith("ready ")]
    errors = [s for s in status if s.startswith("error ")]
    exits = [s for s in status if s.startswith("exit ")]
    readonly_failures: list[str] = json.loads(ready[0][6:]) if ready else []
    if errors:
        raise SandboxError(f"sandbox setup failed: {errors[0]}; stderr: {err[-500:]!r}")
    if exits:
        return os.waitstatus_to_exitcode(int(exits[0].split()[1])), readonly_failures
    if killed_reason is not None:
        return -signal.SIGKILL, readonly_failures
    if not ready:
        raise SandboxError(f"sandbox did not start (rc={proc_returncode}); stderr: {err[-500:]!r}")
    return None, readonly_failures  # init killed from outside, e.g. by the OOM killer


def _read_all(fd: int) -> bytes:
    """What is buffered in pipe ``fd`` (without waiting for more); closes it."""
    chunks = []
    try:
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


class _Pump:
    """Feeds stdin and collects capped stdout/stderr until the process tree ends or a limit hits.

    Output is read through the pipes with a deadline (never ``communicate()``): past ``wall_seconds`` from
    ``start``, or once either stream passes ``max_output_bytes``, ``kill_all`` is called and what is still
    buffered is drained for at most a second.  When the code's process has ended but something it started
    still holds the pipes, the tree is killed 0.2 s later.
    """

    def __init__(
        self, proc: subprocess.Popen, data: bytes, limits: SandboxLimits, start: float, kill_all: Callable[[], None]
    ) -> None:
        self.proc = proc
        self.kill_all = kill_all
        self.cap = limits.max_output_bytes
        self.deadline = start + limits.wall_seconds
        self.out_fd, self.err_fd, self.in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
        self.bufs = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.reading = {self.out_fd, self.err_fd}
        self.view = memoryview(data)
        self.truncated = False
        self.killed_reason: str | None = None
        self.drain_until: float | None = None  # after a kill: stop waiting for EOF at this time
        self.sel = selectors.DefaultSelector()

    def run(self) -> tuple[bytes, bytes, bool, str | None]:
        """Returns (stdout, stderr, truncated, killed_reason)."""
        try:
            for fd in self.reading:
                os.set_blocking(fd, False)
                self.sel.register(fd, selectors.EVENT_READ)
            if len(self.view):
                os.set_blocking(self.in_fd, False)
                self.sel.register(self.in_fd, selectors.EVENT_WRITE)
            else:
                self.proc.stdin.close()
            self._loop()
            if self.drain_until is None:
                # Output closed; the code may still be running (it closed its
                # stdout), so wait for it within the deadline.
                try:
                    self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._stop("timeout")
        finally:
            self.sel.close()
            for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        return bytes(self.bufs[self.out_fd]), bytes(self.bufs[self.err_fd]), self.truncated, self.killed_reason

    def _stop(self, reason: str | None) -> None:
        """Kill the tree (once) for ``reason`` and start draining."""
        if self.killed_reason is None and self.drain_until is None:
            self.killed_reason = reason
            self.kill_all()
            self.drain_until = time.monotonic() + 1.0

    def _loop(self) -> None:
        exited = False
        exit_grace = 0.0
        while self.reading:
            now = time.monotonic()
            if self.drain_until is not None:
                if now >= self.drain_until:
                    break
            elif now >= self.deadline:
                self._stop("timeout")
                continue
            elif not exited and self.proc.poll() is not None:
                exited = True
                exit_grace = now + 0.2
            elif exited and now >= exit_grace:
                # The code's process ended but something it started holds the pipes.
                self._stop(None)
                continue
            limit = self.drain_until if self.drain_until is not None else self.deadline
            if exited and self.drain_until is None:
                limit = min(limit, exit_grace)
            for key, _ in self.sel.select(timeout=max(0.0, min(limit - now, 0.05))):
                if key.fd == self.in_fd:
                    self._write_stdin()
                else:
                    self._read(key.fd)

    def _write_stdin(self) -> None:
        try:
            n = os.write(self.in_fd, self.view[:65536])
        except OSError:  # BrokenPipeError: the code stopped reading
            n = len(self.view)
        self.view = self.view[n:]
        if not len(self.view):
            self.sel.unregister(self.in_fd)
            self.proc.stdin.close()

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(fd)
            self.reading.discard(fd)
            return
        buf = self.bufs[fd]
        room = self.cap - len(buf)
        if len(chunk) > room:
            buf += chunk[: max(room, 0)]
            self.truncated = True
            self._stop("output_limit")
        else:
            buf += chunk
