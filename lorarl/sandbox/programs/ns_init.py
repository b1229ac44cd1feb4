"""The namespace init: the first process inside the new namespaces ("namespaces" and "userns" modes).

Run by :mod:`lorarl.sandbox.runner` under ``unshare`` as ``python -I -S -c <this file's text> CONFIG``, as root of
the namespaces (CONFIG: JSON with ``workdir``, ``uid``, ``gid``, ``disk_mb``, ``rlimits``, ``argv``, ``env`` and
``status_fd``); never imported as part of lorarl (importing it runs nothing).  It makes every mount read-only,
covers the usual world-writable directories with empty read-only tmpfs mounts, mounts the working directory as a
private, size-limited tmpfs (keeping the files already in it), then starts the code (``argv``) as the sandbox
uid with the limits and ``PR_SET_NO_NEW_PRIVS``, and reports on ``status_fd``, a line each:
``ready <JSON list of mount points that stayed writable>``, then ``exit <wait status>``, or ``error ...``.

It must run on whichever Python 3 the sandbox picks: standard library only, no ``__future__`` import,
annotations with built-in types only.
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
FLAG_BITS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}
PR_SET_NO_NEW_PRIVS = 38
PR_SET_DUMPABLE = 4
# The usual world-writable places, hidden under empty read-only tmpfs mounts.
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def report(status_fd: int, msg: str) -> None:
    os.write(status_fd, (msg + "\n").encode())


def mount(libc: ctypes.CDLL, src, target: str, fstype, flags: int, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def unescape(path: str) -> str:
    """A mount point as /proc/self/mountinfo writes it (octal escapes) -> the path."""
    return path.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")


def read_files(workdir: str) -> dict:
    """The working directory's files, to be written again into the tmpfs that covers it."""
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    return files


def make_readonly(libc: ctypes.CDLL) -> list:
    """Remount every existing mount read-only (this mount namespace is private); the points that failed."""
    failures = []
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for parts in mounts:
        point = unescape(parts[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in parts[5].split(","):
            flags |= FLAG_BITS.get(opt, 0)
        try:
            mount(libc, None, point, None, flags)
        except OSError:
            failures.append(point)
    return failures


def hide_writable_dirs(libc: ctypes.CDLL, workdir: str) -> None:
    """Empty read-only tmpfs over the usual world-writable places (keeping a mount point for ``workdir``)."""
    hidden = MS_NOSUID | MS_NODEV | MS_NOEXEC
    for d in HIDDEN_DIRS:
        if os.path.islink(d) or not os.path.isdir(d):
            continue
        mount(libc, "tmpfs", d, "tmpfs", hidden, "size=64k,nr_inodes=64,mode=755")
        if workdir.startswith(d + "/"):
            os.makedirs(workdir, mode=0o755, exist_ok=True)
        mount(libc, None, d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | hidden)


def mount_workdir(libc: ctypes.CDLL, cfg: dict, files: dict) -> None:
    """The working directory: a private, size-limited tmpfs holding ``files``, owned by the sandbox uid."""
    workdir, uid, gid = cfg["workdir"], cfg["uid"], cfg["gid"]
    opts = f"size={int(cfg['disk_mb'])}m,nr_inodes=4096,mode=700"
    if uid is not None:
        opts += f",uid={int(uid)},gid={int(gid)}"
    mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        if uid is not None:
            os.chown(path, uid, gid)


def exec_code(libc: ctypes.CDLL, cfg: dict) -> None:
    """In the forked child: exec the code in the working directory as the sandbox uid, with the limits."""
    try:
        os.chdir(cfg["workdir"])
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        uid, gid = cfg["uid"], cfg["gid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as exc:
        try:
            report(cfg["status_fd"], f"error start: {exc!r}")
        finally:
            os._exit(127)


def main(cfg: dict, libc: ctypes.CDLL) -> None:
    """Set up the file system, start the code, reap orphans until it ends and report its wait status."""
    status_fd = cfg["status_fd"]
    workdir = cfg["workdir"]
    # Non-dumpable: in the "userns" mode the code runs as this process's uid, and could else open its /proc/1/fd.
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    files = read_files(workdir)
    failures = make_readonly(libc)
    hide_writable_dirs(libc, workdir)
    mount_workdir(libc, cfg, files)
    report(status_fd, "ready " + json.dumps(failures[:50]))
    pid = os.fork()
    if pid == 0:
        exec_code(libc, cfg)
    # The code's stdin / stdout (its verdict channel) are its own: nothing of the code's uid reaches them here.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            report(status_fd, "error lost child")
            return
        if done == pid:
            report(status_fd, f"exit {status}")
            return


if __name__ == "__main__":
    CFG = json.loads(sys.argv[1])
    os.set_inheritable(CFG["status_fd"], False)
    LIBC = load_libc()
    try:
        main(CFG, LIBC)
    except BaseException as exc:
        report(CFG["status_fd"], f"error setup: {exc!r}")
        sys.exit(1)
