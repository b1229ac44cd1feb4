"""What a sandboxed run may use and what it reports: :class:`SandboxLimits`, :class:`SandboxResult`, the sandbox's
errors, and the translation of limits into resource limits (``RLIMIT_*``) for the code's processes."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Outcome of :func:`~lorarl.sandbox.run_python`.

    returncode: exit code of the code's process, negative for a signal
        (``-9`` when the sandbox killed it), ``None`` if unknown.
    stdout, stderr: output, each capped at ``max_output_bytes`` and decoded
        as UTF-8 with ``errors="replace"``.
    timed_out: the wall-clock deadline passed.
    killed_reason: ``"timeout"``, ``"output_limit"``, ``"cpu_limit"`` (killed
        by ``SIGXCPU``) or ``None``.
    output_truncated: some output was dropped because of the cap.
    wall_seconds: time from start to the end of the process tree.
    isolation: the isolation mode used (see the :mod:`lorarl.sandbox` documentation).
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


def _rlimits(limits: SandboxLimits, nproc: int) -> dict[str, tuple[int, int]]:
    """The code's resource limits as ``{"RLIMIT_NAME": (soft, hard)}``, ``nproc`` processes at most.

    Applied before ``exec`` by the namespace init, or else by the harness as the interpreter starts (no
    ``preexec_fn`` in a multi-threaded trainer).
    """
    mem = limits.memory_mb * 1024 * 1024
    return {
        "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
        "RLIMIT_AS": (mem, mem),
        "RLIMIT_FSIZE": (limits.file_size_mb * 1024 * 1024,) * 2,
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_NOFILE": (limits.max_open_files,) * 2,
        "RLIMIT_CORE": (0, 0),
    }


def _rlimits_spec(rlimits: dict[str, tuple[int, int]]) -> str:
    """``rlimits`` as the harness reads them from its command line: ``"NAME=soft:hard,..."``."""
    return ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in rlimits.items())
