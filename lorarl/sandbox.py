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

Caveats: the asserts of one completion run in the same interpreter as the
code (markers carry a random nonce, but code that inspects the harness could
still forge them); in ``"uid"`` mode, file cleanup covers the usual
world-writable directories only; memory is limited per process
(``RLIMIT_AS``), so the worst case is about ``max_processes * memory_mb``;
each stdin/stdout test is one process (about 0.05 s of overhead each here,
but up to ``wall_seconds`` each for code that hangs).
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import random
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

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

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("namespaces", "uid", "userns", "rlimits")

_STD_PATH = "/usr/local/bin:/usr/bin:/bin"
_UNSHARE_FLAGS = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
# Exit code the harness uses when the code does not compile.
_COMPILE_ERROR_RC = 97


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran)."""


class SandboxUnavailable(SandboxError):
    """No safe way to run code on this machine (e.g. root without a usable interpreter)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one sandboxed run.

    wall_seconds: wall-clock deadline for the whole run (process start
        included, about 0.05 s); the process tree is killed when it passes.
    cpu_seconds: ``RLIMIT_CPU`` per process (SIGXCPU, then SIGKILL one second
        later).
    memory_mb: ``RLIMIT_AS`` (address space) per process.
    max_output_bytes: cap on each of stdout and stderr; the run is killed
        when the code writes more.
    max_processes: ``RLIMIT_NPROC`` for the sandbox uid (threads count).
    file_size_mb: ``RLIMIT_FSIZE``, the largest file the code can write.
    disk_mb: size of the private tmpfs working directory ("namespaces" and
        "userns" modes; elsewhere only ``file_size_mb`` applies).
    max_open_files: ``RLIMIT_NOFILE``.
    """

    wall_seconds: float = 5.0
    cpu_seconds: int = 4
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_processes: int = 16
    file_size_mb: int = 16
    disk_mb: int = 64
    max_open_files: int = 256

    def __post_init__(self) -> None:
        if self.wall_seconds <= 0 or self.cpu_seconds <= 0:
            raise ValueError("wall_seconds and cpu_seconds must be positive")
        if (
            min(
                self.memory_mb,
                self.max_output_bytes,
                self.max_processes,
                self.file_size_mb,
                self.disk_mb,
                self.max_open_files,
            )
            <= 0
        ):
            raise ValueError("limits must be positive")


@dataclass
class SandboxResult:
    """Outcome of :func:`run_python`.

    returncode: exit code of the code's process, negative for a signal
        (``-9`` when the sandbox killed it), ``None`` if unknown.
    stdout, stderr: output, each capped at ``max_output_bytes`` and decoded
        as UTF-8 with ``errors="replace"``.
    timed_out: the wall-clock deadline passed.
    killed_reason: ``"timeout"``, ``"output_limit"``, ``"cpu_limit"`` (killed
        by ``SIGXCPU``) or ``None``.
    output_truncated: some output was dropped because of the cap.
    wall_seconds: time from start to the end of the process tree.
    isolation: the isolation mode used (see the module documentation).
    sandbox_uid: the uid the code ran as, if it was changed.
    readonly_failures: mount points that could not be made read-only
        ("namespaces"/"userns" modes; normally empty).
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str | None = None
    output_truncated: bool = False
    wall_seconds: float = 0.0
    isolation: str = ""
    sandbox_uid: int | None = None
    readonly_failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exited normally with status 0 within the limits."""
        return self.returncode == 0 and self.killed_reason is None


# --------------------------------------------------------------------------
# Code that runs inside the sandbox.

# Applies the resource limits (where no init process did: "uid" and
# "rlimits" modes, so that no preexec_fn is needed in a threaded trainer),
# runs the code, then (in "asserts" mode) every test in its own try block,
# writing "<nonce>:<index>" on a line of its own for each test that passed.
# argv: harness.py MODE RLIMITS NO_NEW_PRIVS, RLIMITS as "NAME=soft:hard,...".
_HARNESS = r"""
import builtins, os, sys

def _limit():
    import resource
    for item in sys.argv[2].split(","):
        name, _, value = item.partition("=")
        soft, _, hard = value.partition(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if sys.argv[3] == "1":
        import ctypes
        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS

def _main():
    _limit()
    builtins.exit = builtins.quit = sys.exit  # normally added by site (-S)
    mode = sys.argv[1]
    nonce = sys.stdin.readline().strip() if mode == "asserts" else ""
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        src = f.read()
    try:
        code = compile(src, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        sys.stderr.write("%s: %s\n" % (type(exc).__name__, exc))
        sys.stderr.flush()
        os._exit(__RC__)
    sys.argv = ["solution.py"]
    g = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins}
    if mode == "script":
        exec(code, g)
        return
    import json, traceback
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    try:
        exec(code, g)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), g)
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
            os.write(1, ("\n%s:%d\n" % (nonce, i)).encode())
        except OSError:
            pass

_main()
""".replace("__RC__", str(_COMPILE_ERROR_RC))

# Init process of the namespaces ("namespaces" and "userns" modes), run by
# the interpreter of the caller as (namespace) root: makes the file system
# read-only, mounts the private working directory, starts the code as the
# sandbox uid with the limits and reports its wait status on a pipe.
_STAGE2 = r"""
import ctypes, json, os, resource, sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
FLAG_BITS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
             "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
PR_SET_NO_NEW_PRIVS = 38

cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]
os.set_inheritable(status_fd, False)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def report(msg):
    os.write(status_fd, (msg + "\n").encode())


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def unescape(path):
    return path.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")


def main():
    workdir, uid, gid = cfg["workdir"], cfg["uid"], cfg["gid"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    # 1. Every existing mount read-only (this mount namespace is private).
    failures = []
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for parts in mounts:
        point = unescape(parts[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in parts[5].split(","):
            flags |= FLAG_BITS.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except OSError:
            failures.append(point)
    # 2. Empty read-only tmpfs over the usual world-writable places.
    hidden = MS_NOSUID | MS_NODEV | MS_NOEXEC
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run"):
        if os.path.islink(d) or not os.path.isdir(d):
            continue
        mount("tmpfs", d, "tmpfs", hidden, "size=64k,nr_inodes=64,mode=755")
        if workdir.startswith(d + "/"):
            os.makedirs(workdir, mode=0o755, exist_ok=True)
        mount(None, d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | hidden)
    # 3. The working directory: a private, size-limited tmpfs.
    opts = "size=%dm,nr_inodes=4096,mode=700" % cfg["disk_mb"]
    if uid is not None:
        opts += ",uid=%d,gid=%d" % (uid, gid)
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        if uid is not None:
            os.chown(path, uid, gid)
    report("ready " + json.dumps(failures[:50]))

    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(workdir)
            for name, (soft, hard) in cfg["rlimits"].items():
                resource.setrlimit(getattr(resource, name), (soft, hard))
            if uid is not None:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
        except BaseException as exc:
            try:
                report("error start: %r" % (exc,))
            finally:
                os._exit(127)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            report("error lost child")
            return
        if done == pid:
            report("exit %d" % status)
            return


try:
    main()
except BaseException as exc:
    report("error setup: %r" % (exc,))
    sys.exit(1)
"""


# --------------------------------------------------------------------------
# Helpers.


def _world_accessible(path: str) -> bool:
    """Whether a uid with no special permissions can reach (and exec or enter) ``path``."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return False
    if not st.st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _python_candidates() -> list[str]:
    override = os.environ.get("LORARL_SANDBOX_PYTHON")
    if override:
        return [override]
    found = [sys.executable] if sys.executable else []
    for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3"):
        path = shutil.which(name, path=_STD_PATH)
        if path:
            found.append(path)
    out: list[str] = []
    for path in found:
        if path not in out:
            out.append(path)
    return out


def _sandbox_python(drop_privileges: bool) -> str | None:
    for path in _python_candidates():
        if not drop_privileges or _world_accessible(path):
            return path
    return None


def _uid_range() -> tuple[int, int]:
    """A range of uids unlikely to belong to anything, inside this user namespace's map."""
    lo, hi = 0x3D000000, 0x3E000000
    try:
        with open("/proc/self/uid_map") as f:
            maps = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        maps = []
    if maps and not any(inside <= lo and hi <= inside + count for inside, _, count in maps):
        # Restricted map (a user-namespaced container): take the top of the largest extent.
        inside, _, count = max(maps, key=lambda m: m[2])
        hi = inside + count - 2  # keep clear of the overflow uid
        lo = max(inside + 1000, hi - 4096)
    return lo, hi


def _uid_in_use(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return bool(_pids_of_uid(uid))


_uid_lock = threading.Lock()
_uids_taken: set[int] = set()


def _allocate_uid() -> int:
    lo, hi = _uid_range()
    rng = random.SystemRandom()
    for _ in range(100):
        uid = rng.randrange(lo, hi)
        with _uid_lock:
            if uid in _uids_taken:
                continue
            _uids_taken.add(uid)
        if not _uid_in_use(uid):
            return uid
        with _uid_lock:
            _uids_taken.discard(uid)
    raise SandboxError("could not find a free uid for the sandbox")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_taken.discard(uid)


def _proc_status(pid: str) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Uid", "State", "PPid"):
                out[key] = value.strip()
    return out


def _pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes with ``uid`` as real, effective or saved uid."""
    pids = []
    want = str(uid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = _proc_status(entry)
        except OSError:
            continue
        if want in st.get("Uid", "").split()[:3] and not st.get("State", "").startswith(("Z", "X")):
            pids.append(int(entry))
    return pids


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _proc_status(entry).get("PPid") == str(pid):
                    kids.append(int(entry))
            except OSError:
                continue
    return kids


def _kill_uid(uid: int, timeout: float = 5.0) -> bool:
    """SIGKILL every process of ``uid`` until none is left; False if some survive."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _remove_files_of_uid(uid: int, dirs: Sequence[str] = _WRITABLE_DIRS) -> list[str]:
    """Delete what ``uid`` created in the usual world-writable directories."""
    removed = []

    def scan(d: str, depth: int) -> None:
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        continue
                removed.append(entry.path)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and depth < 2:
                scan(entry.path, depth + 1)

    for d in dirs:
        if os.path.isdir(d) and not os.path.islink(d):
            scan(d, 0)
    return removed


def _count_own_processes() -> int:
    return len(_pids_of_uid(os.getuid()))


def _workdir_base(drop_privileges: bool) -> str | None:
    if not drop_privileges:
        return None
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(base) and _world_accessible(base):
            return base
    raise SandboxUnavailable("no temporary directory reachable by an unprivileged uid")


def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": _STD_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _rlimits(limits: SandboxLimits, nproc: int) -> dict[str, tuple[int, int]]:
    mem = limits.memory_mb * 1024 * 1024
    return {
        "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
        "RLIMIT_AS": (mem, mem),
        "RLIMIT_FSIZE": (limits.file_size_mb * 1024 * 1024,) * 2,
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_NOFILE": (limits.max_open_files,) * 2,
        "RLIMIT_CORE": (0, 0),
    }


# --------------------------------------------------------------------------
# Mode selection.

_mode_lock = threading.Lock()
_mode_cache: dict[str, object] | None = None


def _candidate_modes() -> list[str]:
    have_unshare = shutil.which("unshare") is not None
    if os.geteuid() == 0:
        return (["namespaces"] if have_unshare else []) + ["uid"]
    return (["userns"] if have_unshare else []) + ["rlimits"]


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
                ns = mode in ("namespaces", "userns")
                _mode_cache = {
                    "mode": mode,
                    "root": os.geteuid() == 0,
                    "python": _sandbox_python(mode in ("namespaces", "uid")),
                    "uid_drop": mode in ("namespaces", "uid"),
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
    if mode not in ISOLATION_MODES:
        raise ValueError(f"unknown isolation mode {mode!r}")
    root = os.geteuid() == 0
    if mode in ("namespaces", "uid") and not root:
        raise SandboxUnavailable(f"isolation mode {mode!r} needs root")
    if root and mode in ("userns", "rlimits"):
        raise SandboxUnavailable("refusing to run untrusted code as root without a uid change")
    drop = mode in ("namespaces", "uid")
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
    env = _scrubbed_env(workdir)
    nproc = limits.max_processes
    if mode in ("userns", "rlimits"):
        nproc += _count_own_processes()
    rlimits = _rlimits(limits, nproc)
    spec = ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in rlimits.items())
    code_argv = [python, "-I", "-S", "harness.py", harness_mode, spec, "1" if mode in ("uid", "rlimits") else "0"]
    status_r = status_w = None
    popen_kwargs: dict = {}
    if mode in ("namespaces", "userns"):
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
        stage2_python = sys.executable if sys.executable and mode == "namespaces" else python
        argv = [shutil.which("unshare") or "unshare", *flags, stage2_python, "-I", "-S", "-c", _STAGE2, json.dumps(cfg)]
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

    def kill_all() -> None:
        # The code's processes first (by uid, or the namespace's init, which
        # takes the whole PID namespace with it), then give unshare a moment
        # to reap its child (else it is left a zombie for the system's init),
        # then whatever is left in the process group.
        if uid is not None:
            _kill_uid(uid)
        if mode == "userns":
            for child in _children_of(proc.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except OSError:
                    pass
        if mode in ("namespaces", "userns"):
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass

    try:
        out, err, truncated, killed_reason = _pump(
            proc, stdin.encode("utf-8", "surrogatepass"), limits, start, kill_all
        )
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
        ready = [s for s in status if s.startswith("ready ")]
        errors = [s for s in status if s.startswith("error ")]
        exits = [s for s in status if s.startswith("exit ")]
        if ready:
            readonly_failures = json.loads(ready[0][6:])
        if errors:
            raise SandboxError(f"sandbox setup failed: {errors[0]}; stderr: {err[-500:]!r}")
        if exits:
            returncode = os.waitstatus_to_exitcode(int(exits[0].split()[1]))
        elif killed_reason is not None:
            returncode = -signal.SIGKILL
        elif not ready:
            raise SandboxError(f"sandbox did not start (rc={proc.returncode}); stderr: {err[-500:]!r}")
        else:  # init killed from outside, e.g. by the OOM killer
            returncode = None
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


def _read_all(fd: int) -> bytes:
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


def _pump(
    proc: subprocess.Popen, data: bytes, limits: SandboxLimits, start: float, kill_all
) -> tuple[bytes, bytes, bool, str | None]:
    """Feed stdin and collect capped stdout/stderr until the tree ends or a limit hits.

    Returns (stdout, stderr, truncated, killed_reason).
    """
    cap = limits.max_output_bytes
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    reading = {out_fd, err_fd}
    truncated = False
    killed_reason = None
    deadline = start + limits.wall_seconds
    drain_until = None  # after a kill: stop waiting for EOF at this time
    exited = False
    view = memoryview(data)
    sel = selectors.DefaultSelector()

    def stop(reason: str | None) -> None:
        nonlocal killed_reason, drain_until
        if killed_reason is None and drain_until is None:
            killed_reason = reason
            kill_all()
            drain_until = time.monotonic() + 1.0

    try:
        for fd in reading:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if len(view):
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while reading:
            now = time.monotonic()
            if drain_until is not None:
                if now >= drain_until:
                    break
            elif now >= deadline:
                stop("timeout")
                continue
            elif not exited and proc.poll() is not None:
                exited = True
                exit_grace = now + 0.2
            elif exited and now >= exit_grace:
                # The code's process ended but something it started holds the pipes.
                stop(None)
                continue
            limit = drain_until if drain_until is not None else deadline
            if exited and drain_until is None:
                limit = min(limit, exit_grace)
            for key, _ in sel.select(timeout=max(0.0, min(limit - now, 0.05))):
                fd = key.fd
                if fd == in_fd:
                    try:
                        n = os.write(fd, view[:65536])
                    except OSError:  # BrokenPipeError: the code stopped reading
                        n = len(view)
                    view = view[n:]
                    if not len(view):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    reading.discard(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if len(chunk) > room:
                    buf += chunk[: max(room, 0)]
                    truncated = True
                    stop("output_limit")
                else:
                    buf += chunk
        if drain_until is None:
            # Output closed; the code may still be running (it closed its
            # stdout), so wait for it within the deadline.
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop("timeout")
    finally:
        sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), truncated, killed_reason


# --------------------------------------------------------------------------
# Scoring.

_FENCE_LANGS = ("", "python", "py", "python3")


def extract_code(completion: str, *, fallback_raw: bool = False) -> str | None:
    """The last fenced Python block of ``completion``.

    Takes the last closed ```` ``` ```` block whose info string is ``python``,
    ``py``, ``python3`` or empty (blocks in other languages are skipped).
    Without such a block returns ``None``: the raw text is *not* run, unless
    ``fallback_raw=True`` (then the stripped text, or ``None`` if empty).
    An unclosed final fence (a truncated generation) does not count.
    """
    if not isinstance(completion, str):
        return None
    blocks: list[str] = []
    lines = completion.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = (stripped[3:].split() or [""])[0].lower()
            for j in range(i + 1, len(lines)):
                if lines[j].strip() == "```":
                    if lang in _FENCE_LANGS:
                        blocks.append("\n".join(lines[i + 1 : j]) + "\n")
                    i = j
                    break
            else:
                break  # unclosed fence
        i += 1
    if blocks:
        return blocks[-1]
    if fallback_raw and completion.strip():
        return completion.strip() + "\n"
    return None


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _io_test(test: object) -> tuple[str, str] | None:
    if isinstance(test, Mapping) and "input" in test and "output" in test:
        inp, out = test["input"], test["output"]
        if isinstance(inp, str) and isinstance(out, str):
            return inp, out
    return None


def run_tests(
    code: str, tests: Sequence[object], limits: SandboxLimits = SandboxLimits(), *, isolation: str | None = None
) -> float:
    """Fraction of ``tests`` that ``code`` passes, in [0, 1].

    ``tests`` holds assert statements (strings) and/or ``{"input": str,
    "output": str}`` pairs.  All asserts run in one sandboxed process: the
    code first (as ``__main__``; an exception or a non-zero ``sys.exit`` in
    it fails every assert), then each assert on its own, so a failing one
    does not stop the others; asserts that passed before a timeout still
    count.  Each pair runs the code as a script with ``input`` on stdin and
    passes if it exits with status 0 within the limits and its stdout equals
    ``output`` after stripping (surrounding whitespace, and trailing spaces of
    each line).  Entries of any other shape count as failed.  A code that
    does not compile, or a sandbox failure (logged), gives 0.0.
    """
    tests = list(tests)
    if not tests or not isinstance(code, str):
        return 0.0
    mode = isolation or isolation_info()["mode"]
    asserts = [t for t in tests if isinstance(t, str)]
    pairs = [p for p in map(_io_test, tests) if p is not None]
    passed = 0
    try:
        if asserts:
            nonce = secrets.token_hex(16)
            res = _execute(
                {"solution.py": code, "tests.json": json.dumps(asserts)}, "asserts", nonce + "\n", limits, mode
            )
            if res.returncode == _COMPILE_ERROR_RC:
                return 0.0
            seen = set()
            prefix = nonce + ":"
            for line in res.stdout.splitlines():
                if line.startswith(prefix) and line[len(prefix) :].isdigit():
                    seen.add(int(line[len(prefix) :]))
            passed += len(seen & set(range(len(asserts))))
        for inp, expected in pairs:
            res = _execute({"solution.py": code}, "script", inp, limits, mode)
            if res.returncode == _COMPILE_ERROR_RC:
                return 0.0
            if res.ok and _normalize_output(res.stdout) == _normalize_output(expected):
                passed += 1
    except SandboxUnavailable:
        raise
    except SandboxError as exc:
        logger.warning("sandbox failure, scoring 0: %s", exc)
        return 0.0
    return passed / len(tests)


def _completion_text(completion: object) -> str | None:
    """Text of a completion: a string, or the last assistant message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, Sequence):
        for message in reversed(completion):
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
                    return "".join(
                        part.get("text", "")
                        for part in content
                        if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                    )
                return None
    return None


def _row_tests(tests: object) -> list | None:
    if tests is None:
        return None
    if isinstance(tests, str):  # a JSON-encoded list, or one assert
        try:
            decoded = json.loads(tests)
        except ValueError:
            return [tests]
        return decoded if isinstance(decoded, list) else [tests]
    if isinstance(tests, Mapping):
        return [tests]
    return list(tests)


def make_code_tests_reward(
    limits: SandboxLimits | None = None,
    *,
    max_workers: int | None = None,
    fallback_raw: bool = False,
    isolation: str | None = None,
):
    """Build a TRL reward function (see :func:`code_tests_reward`) with these settings.

    ``max_workers`` completions are scored in parallel (default
    ``min(4, os.cpu_count())``).
    """
    limits = limits or SandboxLimits()
    workers = max_workers or min(4, os.cpu_count() or 1)

    def code_tests_reward(prompts=None, completions=None, tests=None, **kwargs) -> list[float | None]:
        """Pass fraction of each completion's last fenced Python block on its row's tests.

        ``completions`` are strings or conversations (lists of ``{"role",
        "content"}`` messages; the last assistant message is used).  ``tests``
        is the dataset column: one list of tests per row (or a JSON string of
        one).  A completion without a code block scores 0.0; a row without
        tests (``None`` or empty) gets ``None`` (TRL then ignores this reward
        for it).
        """
        completions = list(completions or [])
        if tests is None:
            return [None] * len(completions)
        rows = list(tests)
        if len(rows) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows of tests")

        def score(i: int) -> float | None:
            row = _row_tests(rows[i])
            if not row:
                return None
            text = _completion_text(completions[i])
            code = extract_code(text, fallback_raw=fallback_raw) if text is not None else None
            if code is None:
                return 0.0
            return run_tests(code, row, limits, isolation=isolation)

        if workers <= 1 or len(completions) <= 1:
            return [score(i) for i in range(len(completions))]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(score, range(len(completions))))

    return code_tests_reward


#: The reward with default limits: ``code_tests_reward(prompts, completions, tests=..., **kwargs)``.
code_tests_reward = make_code_tests_reward()
