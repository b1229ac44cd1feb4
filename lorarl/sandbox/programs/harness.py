"""The harness: the program that runs a completion's code inside the sandbox (standard library only).

Copied as ``harness.py`` into the run's working directory (next to ``solution.py`` and, for asserts,
``tests.json``) and run as ``python -I -S harness.py MODE RLIMITS NO_NEW_PRIVS COMPILE_ERROR_RC`` by
:mod:`lorarl.sandbox.runner`; never imported as part of lorarl (importing it runs nothing).

MODE ``script`` runs ``solution.py`` as ``__main__``; the runner judges what it prints and its exit status.
MODE ``asserts`` judges the tests of ``tests.json`` (strings of Python statements) in a process the code cannot
reach (the "Verdicts" section of :mod:`lorarl.sandbox`): this process, the judge, reads the tests, makes itself
non-dumpable and forks the worker, which drops its capabilities, runs the code and answers requests over two pipes;
only then the judge reads the nonce (stdin's first line). It runs each test's statements itself, proxies
(:class:`_Remote`) standing for the code's objects, and writes ``<nonce>:<index>`` on its stdout (not the worker's)
for each test whose statements all ran without an exception. Plain data (``None``, ``bool``, ``int``, ``float``,
``complex``, ``str``, ``bytes``, ``bytearray``, ``slice``, and lists, tuples, dicts and sets of them; exact types)
crosses by value, every other object as a handle; containers passed to a call are copied back after it.

RLIMITS: ``"RLIMIT_NAME=soft:hard,..."``, applied first (where no namespace init did already: "uid" and "rlimits"
modes, so that the trainer needs no ``preexec_fn``). NO_NEW_PRIVS: ``"1"`` to set ``PR_SET_NO_NEW_PRIVS`` (where no
namespace init did). COMPILE_ERROR_RC: the exit status when ``solution.py`` does not compile.

It must run on whichever Python 3 (3.8 or newer) the sandbox picks, under ``-I -S``: standard library only, no
``__future__`` import (that would be one more module in the code's interpreter), annotations with built-in types only.
"""

import builtins
import os
import sys

MAX_MESSAGE = 64 * 1024 * 1024  # bytes of one message between judge and worker (more: the connection is dropped)
MAX_ITEMS = 2000000  # values one reply carries by value (a larger value crosses as a handle)
MAX_DEPTH = 64  # nesting carried by value (deeper containers cross as handles)
MAX_NESTING = 32  # requests in flight at once (a callback that calls back ...)
# Operations a worker may not ask of the judge's own objects: reading or setting attributes would reach the judge's
# globals (a function's __globals__, a generator's gi_frame) and with them its verdicts.
DENIED_TO_WORKER = ("getattr", "setattr", "delattr", "names", "enter", "exit")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _limit() -> None:
    import resource

    for item in sys.argv[2].split(","):
        name, _, value = item.partition("=")
        soft, _, hard = value.partition(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if sys.argv[3] == "1":
        import ctypes

        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


# ---- values and operations across the two processes -------------------------------------------------------------


def _operations() -> dict:
    """What a request's ``q`` names (but ``call`` and ``names``): ``name -> function(target, *args)``."""
    import math
    import operator as o

    binary = {n: getattr(o, n) for n in "add sub mul truediv floordiv mod lshift rshift xor matmul".split()}
    binary.update({"and": o.and_, "or": o.or_, "pow": pow, "divmod": divmod})
    ops = dict(binary)
    for name, fn in binary.items():
        ops["r" + name] = (lambda f: lambda x, y: f(y, x))(fn)
        if hasattr(o, "i" + name):
            ops["i" + name] = getattr(o, "i" + name)
    ops.update({n: getattr(o, n) for n in "eq ne lt le gt ge neg pos invert index contains getitem setitem".split()})
    ops.update({n: getattr(builtins, n) for n in "abs int float complex round len bool hash repr str".split()})
    ops.update({n: getattr(builtins, n) for n in "format iter next reversed getattr setattr delattr".split()})
    ops.update({n: getattr(math, n) for n in ("trunc", "floor", "ceil")})
    ops.update({"delitem": o.delitem, "enter": lambda x: type(x).__enter__(x)})
    ops.update({"exit": lambda x, *exc_info: type(x).__exit__(x, None, None, None)})
    ops.update({"instancecheck": lambda c, x: isinstance(x, c), "subclasscheck": lambda c, x: issubclass(x, c)})
    return ops


OPERATIONS = _operations()


class _Broken(BaseException):
    """The connection to the other process is gone (it ended, or sent what is not a message)."""


class _Remote:
    """A proxy for an object of the other process: every operation on it (``__getattr__``, ``__call__``,
    ``__add__``, ... one method per entry of :data:`OPERATIONS`) is a request there."""

    __slots__ = ("_lorarl_peer", "_lorarl_id")

    def __init__(self, peer, ident: int) -> None:
        object.__setattr__(self, "_lorarl_peer", peer)
        object.__setattr__(self, "_lorarl_id", ident)

    def __call__(self, *args, **kwargs):
        return self._lorarl_peer.call(self, args, kwargs)


def _forward(op: str):
    def method(self, *args):
        return self._lorarl_peer.ask(op, self, *args)

    method.__name__ = f"__{op}__"
    return method


for _op in OPERATIONS:
    setattr(_Remote, f"__{_op}__", _forward(_op))


def _hashable_plain(value, depth: int = 0) -> bool:
    """Can ``value`` be a set member or dict key by value (plain, no code of either side runs to hash it)?"""
    if type(value) in _SCALARS:
        return True
    if type(value) in (tuple, frozenset) and depth < MAX_DEPTH:
        return all(_hashable_plain(x, depth + 1) for x in value)
    return False


def _error_reply(exc: BaseException) -> dict:
    """An exception as a reply: the built-in classes in its MRO (the other side raises the first it can) and its text."""
    names = [c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c]
    try:
        text = str(exc)[:2000]
    except BaseException:
        text = ""
    return {"x": names, "m": text}


def _raise_remote(reply: dict) -> None:
    names, text = reply.get("x"), reply.get("m")
    text = text if isinstance(text, str) else ""
    for name in names if isinstance(names, list) else []:
        cls = getattr(builtins, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            try:
                exc = cls(text)
            except Exception:  # a class that wants other arguments: try its base
                continue
            raise exc
    raise RuntimeError(text)


class _Peer:
    """One end of the connection: a JSON message per line; its own objects exported by handle, the other side's
    held as :class:`_Remote` proxies. ``judge``: this end serves the worker's requests only on what the worker may
    ask of the judge's objects (:data:`DENIED_TO_WORKER`). ``namespace``: the worker's globals (``names`` requests)."""

    def __init__(self, rfd: int, wfd: int, judge: bool, namespace=None) -> None:
        self.rfd, self.wfd, self.judge, self.namespace = rfd, wfd, judge, namespace
        self.own = {}
        self.buf = bytearray()
        self.depth = 0
        self.broken = False

    # -- encoding
    def encode(self, value):
        budget = [MAX_ITEMS]
        try:
            return self._enc(value, 0, budget)
        except OverflowError:  # more than MAX_ITEMS values: the whole value crosses as a handle
            return self._export(value)

    def _export(self, value) -> dict:
        self.own[len(self.own)] = value
        return {"h": len(self.own) - 1}

    def _enc(self, v, depth: int, budget: list):
        budget[0] -= 1
        if budget[0] < 0:
            raise OverflowError
        t = type(v)
        if v is None or t is bool or t is str or t is float:
            return v
        if t is int:
            return v if v.bit_length() <= 14000 else {"i": hex(v)}  # JSON ints up to ~4,200 digits
        if t is complex:
            return {"c": [v.real, v.imag]}
        if t is bytes or t is bytearray:
            return {"b" if t is bytes else "ba": v.hex()}
        if t is _Remote and v._lorarl_peer is self:
            return {"r": v._lorarl_id}
        if depth >= MAX_DEPTH:
            return self._export(v)
        items = [v.start, v.stop, v.step] if t is slice else v
        if t in (list, tuple, slice):
            out = [self._enc(x, depth + 1, budget) for x in items]
            return out if t is list else {"t" if t is tuple else "sl": out}
        if t in (set, frozenset) and all(_hashable_plain(x) for x in v):
            return {"s" if t is set else "f": [self._enc(x, depth + 1, budget) for x in v]}
        if t is dict and all(_hashable_plain(k) for k in v):
            return {"d": [[self._enc(k, depth + 1, budget), self._enc(x, depth + 1, budget)] for k, x in v.items()]}
        return self._export(v)

    def decode(self, d, depth: int = 0):
        """A value from a message; raises ValueError on anything that is not an encoded value."""
        if depth > MAX_DEPTH + 2:
            raise ValueError("nested too deep")
        if type(d) is list:
            return [self.decode(x, depth + 1) for x in d]
        if type(d) is not dict:
            return d  # None, bool, int, float, str: json.loads makes nothing else
        if len(d) != 1:
            raise ValueError("not a value")
        ((key, val),) = d.items()
        if key in ("t", "s", "f", "sl", "d", "c") and type(val) is not list:
            raise ValueError("not a value")
        if key in ("t", "s", "f", "sl"):
            items = [self.decode(x, depth + 1) for x in val]
            return {"t": tuple, "s": set, "f": frozenset, "sl": lambda x: slice(*x)}[key](items)
        if key == "d":
            return dict((self.decode(k, depth + 1), self.decode(x, depth + 1)) for k, x in val)
        if key == "c":
            return complex(*[float(x) for x in val])
        if key in ("i", "b", "ba") and type(val) is str:
            return int(val, 16) if key == "i" else (bytes if key == "b" else bytearray).fromhex(val)
        if key == "h" and type(val) is int:
            return _Remote(self, val)
        if key == "r" and type(val) is int and val in self.own:
            return self.own[val]
        raise ValueError("not a value")

    # -- transport
    def send(self, message: dict) -> None:
        import json

        data = (json.dumps(message) + "\n").encode("utf-8", "surrogatepass")
        view = memoryview(data)
        try:
            while len(view):
                view = view[os.write(self.wfd, view) :]
        except OSError:
            self.fail("the other process ended")

    def receive(self) -> dict:
        import json

        start = 0
        while True:
            end = self.buf.find(b"\n", start)
            if end >= 0:
                break
            start = len(self.buf)
            if start > MAX_MESSAGE:
                self.fail(f"a message over {MAX_MESSAGE} bytes")
            try:
                chunk = os.read(self.rfd, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                self.fail("the other process ended")
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        try:
            message = json.loads(line.decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError, MemoryError):
            self.fail("not a message")
        if type(message) is not dict:
            self.fail("not a message")
        return message

    def fail(self, why: str) -> None:
        self.broken = True
        raise _Broken(why)

    # -- asking
    def request(self, message: dict) -> dict:
        """Send ``message``, serve the other side's requests until its reply comes; the reply."""
        if self.broken:
            raise _Broken("the connection is gone")
        if self.depth >= MAX_NESTING:
            raise RecursionError("requests nested too deep")
        self.depth += 1
        try:
            self.send(message)
            while True:
                reply = self.receive()
                if "q" not in reply:
                    return reply
                self.send(self.serve(reply))
        except _Broken:
            raise
        except BaseException:  # the reply is still to come: the two ends no longer agree on what comes next
            self.broken = True
            raise
        finally:
            self.depth -= 1

    def result(self, reply: dict):
        if "x" in reply:
            _raise_remote(reply)
        try:
            return self.decode(reply.get("v"))
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError, OverflowError):
            self.fail("not a value")

    def ask(self, op: str, target, *args):
        return self.result(self.request({"q": op, "o": self.encode(target), "a": [self.encode(a) for a in args]}))

    def names(self, wanted: list) -> dict:
        """The worker's global values of ``wanted`` names that it has."""
        pairs = self.result(self.request({"q": "names", "a": wanted}))
        if type(pairs) is not list or not all(type(p) is list and len(p) == 2 for p in pairs):
            self.fail("not a value")
        return {n: v for n, v in pairs if n in wanted}

    def call(self, target, args: tuple, kwargs: dict):
        """``target(*args, **kwargs)`` on the other side; lists, dicts, sets and bytearrays passed are copied back."""
        message = {"q": "call", "o": self.encode(target), "a": [self.encode(a) for a in args]}
        message["k"] = [[k, self.encode(v)] for k, v in kwargs.items()]
        reply = self.request(message)
        value = self.result(reply)
        passed = dict(enumerate(args), **kwargs)
        for key, state in reply.get("w", []) if type(reply.get("w")) is list else []:
            try:
                _copy_back(passed.get(key), self.decode(state))
            except (ValueError, TypeError, KeyError, RecursionError, MemoryError):
                self.fail("not a value")
        return value

    # -- serving
    def serve(self, message: dict) -> dict:
        try:
            op = message.get("q")
            if op not in OPERATIONS and op not in ("call", "names"):
                raise ValueError(f"unknown request {op!r}")
            if self.judge and op in DENIED_TO_WORKER:
                raise PermissionError(f"the judge's objects answer no {op}")
            if op == "names":
                g = self.namespace
                return {"v": [[n, self.encode(g[n])] for n in message.get("a", []) if type(n) is str and n in g]}
            target = self.decode(message.get("o"))
            raw = message.get("a", [])
            args = [self.decode(a) for a in raw]
            if op != "call":
                return {"v": self.encode(OPERATIONS[op](target, *args))}
            kwargs = {str(k): self.decode(v) for k, v in message.get("k", [])}
            value = self.encode(target(*args, **kwargs))
            passed = list(zip(range(len(args)), raw, args)) + [(k, v, kwargs[str(k)]) for k, v in message.get("k", [])]
            changed = []
            for key, before, arg in passed:
                if type(arg) in (list, dict, set, bytearray):
                    after = self.encode(arg)
                    if after != before:
                        changed.append([key, after])
            return {"v": value, "w": changed}
        except _Broken:
            raise
        except BaseException as exc:
            return _error_reply(exc)


def _copy_back(original, state) -> None:
    """Make ``original`` (a container a test passed to the code) hold ``state`` (what the code left in it)."""
    if type(original) is not type(state):
        return
    if type(original) in (list, bytearray):
        original[:] = state
    elif type(original) in (dict, set):
        original.clear()
        original.update(state)


# ---- the worker ---------------------------------------------------------------------------------------------------


def _capabilities() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Cap"))
    return int(fields["CapEff"], 16) | int(fields["CapPrm"], 16)


def _drop_capabilities() -> None:
    """No capabilities left (with ``CAP_SYS_PTRACE`` the worker could read the judge despite PR_SET_DUMPABLE); with
    PR_SET_NO_NEW_PRIVS set, no exec gives them back."""
    if _capabilities() == 0:
        return
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    ctypes.CDLL(None).capset(header, (ctypes.c_uint32 * 6)())  # effective, permitted, inheritable: all empty
    if _capabilities() != 0:
        raise OSError("could not drop the worker's capabilities")


def _worker(code, rfd: int, wfd: int) -> None:
    """Run the code as ``__main__``, say whether it ran ("ready"), then answer the judge until it hangs up."""
    import traceback

    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # the code's prints go to stderr: stdout is the judge's alone
    os.close(null)
    _drop_capabilities()
    g = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins}
    peer = _Peer(rfd, wfd, judge=False, namespace=g)
    ran = True
    try:
        exec(code, g)
    except SystemExit as exc:
        ran = exc.code in (None, 0)
    except BaseException:
        ran = False
        traceback.print_exc(limit=2)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    peer.send({"ready": ran})
    while True:
        message = peer.receive()
        if "q" in message:
            peer.send(peer.serve(message))


# ---- the judge ----------------------------------------------------------------------------------------------------


def _start_worker(code) -> tuple:
    """Make the judge non-dumpable, fork the worker (before the judge reads the nonce); ``(pid, peer)``."""
    import ctypes

    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError("PR_SET_DUMPABLE failed")
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(req_w)
            os.close(rep_r)
            _worker(code, req_r, rep_w)
        except BaseException:
            pass
        os._exit(0)
    os.close(req_r)
    os.close(rep_w)
    return pid, _Peer(rep_r, req_w, judge=True)


def _passes(peer: _Peer, index: int, test, namespace: dict, fetched: dict) -> bool:
    """Run one test's statements here; the worker's globals they name are fetched before each statement (those the
    test bound itself are left alone)."""
    import ast
    import traceback

    name = f"<test {index}>"
    try:
        if not isinstance(test, str):
            raise TypeError("a test is a string of Python statements")
        for stmt in ast.parse(test, name).body:
            used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and not n.id.startswith("__")}
            wanted = sorted(n for n in used if n not in namespace or (n in fetched and namespace[n] is fetched[n]))
            if wanted:
                found = peer.names(wanted)
                namespace.update(found)
                fetched.update(found)
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), name, "exec"), namespace)
        return not peer.broken
    except BaseException:
        try:
            traceback.print_exc(limit=2)
        except BaseException:
            pass
        return False


def _judge(code) -> None:
    import json

    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    pid, peer = _start_worker(code)
    nonce = sys.stdin.readline().strip()
    sys.stdout = sys.stderr  # a test's prints; the verdicts go to file descriptor 1 alone
    try:
        ready = peer.receive()
        if ready.get("ready") is not True:
            return
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        fetched = {}
        for i, test in enumerate(tests):
            if _passes(peer, i, test, namespace, fetched):
                os.write(1, f"{nonce}:{i}\n".encode())
            if peer.broken:
                return
    except _Broken:
        return
    finally:
        _end_worker(pid, wait=peer.broken)


def _end_worker(pid: int, wait: bool) -> None:
    """Kill and reap the worker. When its pipe broke (``wait``), it is given half a second to be reaped first (the
    pipe closes before the exit status is there): a worker the CPU limit ended (SIGXCPU) ends the judge the same
    way, so the runner reports ``cpu_limit`` as it does for a script."""
    import signal
    import time

    status = None
    try:
        deadline = time.monotonic() + (0.5 if wait else 0.0)
        while status is None and time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            else:
                time.sleep(0.005)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]  # a worker the CPU limit had already ended still reports SIGXCPU
    except OSError:
        return
    if status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        sys.stderr.flush()
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGXCPU)


def _main() -> None:
    _limit()
    builtins.exit = builtins.quit = sys.exit  # normally added by site (-S)
    mode = sys.argv[1]
    compile_error_rc = int(sys.argv[4])
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        src = f.read()
    try:
        code = compile(src, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(compile_error_rc)
    sys.argv = ["solution.py"]
    if mode == "script":
        exec(code, {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins})
        return
    _judge(code)


if __name__ == "__main__":
    _main()
