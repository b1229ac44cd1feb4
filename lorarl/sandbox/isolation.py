"""How a run is isolated, apart from running it: the isolation modes and what each needs, the interpreter and
working directory an unprivileged uid can use, the scrubbed environment, fresh sandbox uids, and finding,
killing and cleaning up after the processes of a run (through ``/proc``)."""

from __future__ import annotations

import grp
import os
import pwd
import random
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence

from lorarl.sandbox.limits import SandboxError, SandboxUnavailable

ISOLATION_MODES = ("namespaces", "uid", "userns", "rlimits")
# Modes where the code runs as a fresh unprivileged uid (the caller is root).
_UID_DROP_MODES = ("namespaces", "uid")
# Modes where the code runs in new namespaces under a namespace init.
_NAMESPACE_MODES = ("namespaces", "userns")

_STD_PATH = "/usr/local/bin:/usr/bin:/bin"
_UNSHARE_FLAGS = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
# The usual world-writable directories, cleaned of a uid's files after a run without a mount namespace.
_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _candidate_modes() -> list[str]:
    """The modes worth a trial run here, strongest first."""
    have_unshare = shutil.which("unshare") is not None
    if os.geteuid() == 0:
        return (["namespaces"] if have_unshare else []) + ["uid"]
    return (["userns"] if have_unshare else []) + ["rlimits"]


def _check_mode(mode: str) -> None:
    """Raise unless ``mode`` can run here: a known mode, root for a uid change, never untrusted code as root."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"unknown isolation mode {mode!r}")
    root = os.geteuid() == 0
    if mode in _UID_DROP_MODES and not root:
        raise SandboxUnavailable(f"isolation mode {mode!r} needs root")
    if root and mode not in _UID_DROP_MODES:
        raise SandboxUnavailable("refusing to run untrusted code as root without a uid change")


# --------------------------------------------------------------------------
# What the unprivileged uid can reach.


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
    """Interpreters to run the code with, preferred first: ``LORARL_SANDBOX_PYTHON`` alone if set, else ours,
    then ``python3.X`` and ``python3`` on a standard ``PATH``."""
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
    """The first candidate interpreter the code's uid can run (any, without a uid change)."""
    for path in _python_candidates():
        if not drop_privileges or _world_accessible(path):
            return path
    return None


def _workdir_base(drop_privileges: bool) -> str | None:
    """Where to create the working directory: the default temporary directory (``None``), or with a uid change
    (and no private tmpfs over it) the first temporary directory the uid can enter."""
    if not drop_privileges:
        return None
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(base) and _world_accessible(base):
            return base
    raise SandboxUnavailable("no temporary directory reachable by an unprivileged uid")


def _scrubbed_env(workdir: str) -> dict[str, str]:
    """The code's whole environment: a standard ``PATH``, UTF-8 locale, ``HOME``/``TMPDIR`` in the working
    directory, single-threaded numeric libraries."""
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


# --------------------------------------------------------------------------
# Sandbox uids.


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
    """``uid`` names a user or group, or owns a live process."""
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
    """A random unused uid (also the gid), reserved against concurrent runs until :func:`_release_uid`."""
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


# --------------------------------------------------------------------------
# Processes and files of a run.


def _proc_status(pid: str) -> dict[str, str]:
    """The ``Uid``, ``State`` and ``PPid`` lines of ``/proc/<pid>/status``."""
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


def _count_own_processes() -> int:
    return len(_pids_of_uid(os.getuid()))


def _children_of(pid: int) -> list[int]:
    """The child processes of ``pid``."""
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


def _sigkill(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids``, ignoring those already gone (or not ours to kill)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_uid(uid: int, timeout: float = 5.0) -> bool:
    """SIGKILL every process of ``uid`` until none is left; False if some survive."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids_of_uid(uid)
        if not pids:
            return True
        _sigkill(pids)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


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
