"""The half of the code sandbox that runs inside it (standard library only, imports nothing of the
project): `code_sandbox.Sandbox` starts it as ``python -I [-S] -c <this file's text> <settings>``,
with the program's source on one inherited file descriptor and the test on another.

Input tests (``kind: input``): the program runs in this process on the case's stdin and the
worker compares its stdout with the expected one, which never enters the sandbox.

Assert tests (``kind: assert``) run in two processes, so that nothing the program does can make a
test pass without passing it. This process, the judge (PID 1 of the sandbox's PID namespace, made
non-dumpable: the program's process can neither signal, trace, read nor write it), forks the
program's process first and only then reads the test, which the program therefore never sees. The
judge runs the test with its own builtins; each global the program defined stands for a reference
into the program's process (`Remote`): calling one sends the arguments as plain data and gets the
result back as plain data (None, bool, int, float, complex, str, bytes, bytearray, list, tuple,
dict, set, frozenset, and a few standard-library value types the judge rebuilds: Fraction, Decimal,
deque, date, datetime, time, timedelta) or as a reference to the program's object. Comparisons with plain data run
in the judge: a reference is never equal to plain data (an object whose ``__eq__`` always answers
True compares as what it is), except that an instance of a subclass of a plain type (a namedtuple,
an IntEnum) compares as its plain value. Lists, dicts, sets and bytearrays the test passes are
copies; what the program changes in them is copied back after each call (in-place functions).
The verdict goes to the worker as one JSON line on the judge's stdout, which the program's
process does not hold.

Before any of that, in the ``rlimits`` sandbox (no bubblewrap), the judge builds its own mount
namespace (every mount read-only, a size-bounded tmpfs on /tmp and /dev/shm) and drops its
privileges: the sandbox's uid when started as root, every capability when started as the root
of a user namespace.
"""
import builtins
import errno
import json
import os
import re
import signal
import sys
import traceback

EXIT_FAILED, EXIT_EXITED, EXIT_CRASHED, EXIT_BLOCKED = 81, 82, 83, 84
# Errors that mean a limit or a refused action stopped the program (scored as `blocked`).
BLOCKED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENETUNREACH, errno.ECONNREFUSED,
                            errno.EAFNOSUPPORT, errno.EFBIG, errno.EAGAIN, errno.ENOSPC, errno.EDQUOT,
                            errno.EHOSTUNREACH, errno.ENOMEM})
VERDICTS = ("passed", "failed", "crashed", "blocked", "timeout", "killed")
TEST_FUNCTION = re.compile(r"^def (test_\w+)\s*\(", re.MULTILINE)
MAX_DEPTH = 200                 # nesting of plain data sent either way; deeper parts go by reference
MAX_MESSAGE_BYTES = 64 << 20    # one message from the program's process
MAX_DETAIL_CHARS = 2000

# -- isolation (rlimits sandbox) ----------------------------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1 << 14, 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# statvfs flag -> mount flag: a read-only remount must keep these, or a user namespace refuses it.
_KEPT_MOUNT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                     (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                     (os.ST_RELATIME, MS_RELATIME))


def _libc():
    """ctypes and the C library with the signatures used here."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return ctypes, libc


def _check(ctypes, result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount_points() -> list:
    """Every mount point of this mount namespace, outermost first (octal escapes decoded)."""
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def make_private_filesystem(tmpfs_sizes, hidden=(), keep=(), hidden_bytes: int = 1 << 20) -> None:
    """In this (private) mount namespace: every mount read-only; a fresh tmpfs of the given size in
    bytes, writable by all, on each ``(folder, size)`` of ``tmpfs_sizes``; each ``hidden`` folder
    (other users' files) replaced by a small read-only tmpfs into which the folders of ``keep``
    below it (the interpreter) are bound back, read-only. /proc and /sys keep their own rules."""
    ctypes, libc = _libc()
    for point in mount_points():
        if point in ("/proc", "/sys") or point.startswith(("/proc/", "/sys/")):
            continue
        result = _remount_read_only(libc, point)
        if point == "/":  # a mount hidden under another cannot be reached, so only / must succeed
            _check(ctypes, result, "remount / read-only")
    for folder in hidden:
        if not os.path.isdir(folder):
            continue
        inside = [path for path in keep if path.startswith(folder.rstrip("/") + "/") and os.path.isdir(path)]
        # Opened before the tmpfs hides them; bound from /proc/self/fd afterwards.
        handles = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in inside]
        _check(ctypes, libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                                  f"size={int(hidden_bytes)},mode=0755".encode()), f"tmpfs on {folder}")
        for path, handle in handles:
            os.makedirs(path, exist_ok=True)
            for parent in folders_between(folder, path) + [path]:
                os.chmod(parent, 0o755)  # reachable by the sandbox uid whatever the umask
            _check(ctypes, libc.mount(f"/proc/self/fd/{handle}".encode(), path.encode(), None, MS_BIND | MS_REC,
                                      None), f"bind {path}")
            os.close(handle)
            _remount_read_only(libc, path)
        _check(ctypes, _remount_read_only(libc, folder), f"remount {folder} read-only")
    for folder, size in tmpfs_sizes:
        if os.path.isdir(folder):
            options = f"size={int(size)},mode=1777".encode()
            _check(ctypes, libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options),
                   f"tmpfs on {folder}")


def _remount_read_only(libc, point: str) -> int:
    """Bind-remount ``point`` read-only (keeping the flags a user namespace locks); 0 on success."""
    try:
        flags = os.statvfs(point).f_flag
    except OSError:
        return -1
    kept = sum(mount_flag for stat_flag, mount_flag in _KEPT_MOUNT_FLAGS if flags & stat_flag)
    return libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)


def folders_between(top: str, path: str) -> list:
    """The folders strictly between ``top`` and ``path`` (its descendant), outermost first."""
    parts = os.path.relpath(path, top).split(os.sep)[:-1]
    return [os.path.join(top, *parts[:i + 1]) for i in range(len(parts))]


def drop_privileges(uid) -> None:
    """Become ``uid`` (started as root), or lose every capability for good (started as the root of
    a user namespace, ``uid`` None); then no exec may gain privileges."""
    ctypes, libc = _libc()
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif os.geteuid() == 0:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last_cap = int(fh.read())
        for cap in range(last_cap + 1):  # the bounding set: an exec as uid 0 regains nothing
            _check(ctypes, libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability")
        header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
        _check(ctypes, libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(ctypes, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # A change of uid clears the parent-death signal bwrap (--die-with-parent) and unshare
    # (--kill-child) set; set again (a parent whose uid differs and lacks CAP_KILL cannot send it:
    # the worker also kills the wrapper's process group, which holds this process).
    _check(ctypes, libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")


def make_undumpable() -> None:
    """Processes of the same uid may no longer trace this one or open its /proc files."""
    ctypes, libc = _libc()
    _check(ctypes, libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")


# -- plain data, both ways --------------------------------------------------------------------
_SEQUENCE_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_MUTABLE_TAGS = {list: "L", dict: "D", set: "S", bytearray: "Y"}  # containers whose changes are copied back


def encode(value, reference, depth: int = 0, containers=None):
    """``value`` as JSON-able data: exactly-typed plain data by value, anything else through
    ``reference(value)`` (a subclass of a plain type included: its methods are the program's).
    With ``containers`` (a dict id -> (index, container)), each list, dict, set and bytearray is
    numbered so that its changes can be sent back, and one seen twice is sent once."""
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -(1 << 63) <= value < (1 << 63) else {"I": hex(value)}  # hex: no digit limit
    if depth >= MAX_DEPTH:
        return reference(value)
    if containers is not None and kind in _MUTABLE_TAGS:
        if id(value) in containers:
            return {"a": containers[id(value)][0]}
        index = len(containers)
        containers[id(value)] = (index, value)
        return {_MUTABLE_TAGS[kind]: [index, _contents(value, reference, depth, containers)]}
    if kind in _SEQUENCE_TAGS:
        return {_SEQUENCE_TAGS[kind]: [encode(item, reference, depth + 1, containers) for item in value]}
    if kind is dict:
        return {"d": [[encode(k, reference, depth + 1, containers), encode(v, reference, depth + 1, containers)]
                      for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is bytearray:
        return {"y": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    return reference(value)


def _contents(value, reference, depth, containers):
    """The body of a numbered container (its items, pairs or hex)."""
    if type(value) is bytearray:
        return value.hex()
    if type(value) is dict:
        return [[encode(k, reference, depth + 1, containers), encode(v, reference, depth + 1, containers)]
                for k, v in value.items()]
    return [encode(item, reference, depth + 1, containers) for item in value]


class ProtocolError(Exception):
    """A message that is not what this protocol sends."""


def decode(data, resolve, depth: int = 0, containers=None):
    """The value ``encode`` made; tags it does not know go to ``resolve(tag, body)``. Numbered
    containers are filled into ``containers`` (index -> container). Strict: anything malformed
    raises ProtocolError."""
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if kind is not dict or len(data) != 1 or depth > MAX_DEPTH + 1:
        raise ProtocolError(f"not an encoded value: {str(data)[:80]}")
    (tag, body), = data.items()
    try:
        if tag == "I":
            return int(str(body), 16)
        if tag in ("l", "t", "s", "f"):
            items = [decode(item, resolve, depth + 1, containers) for item in _list(body)]
            return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
        if tag == "d":
            return {decode(k, resolve, depth + 1, containers): decode(v, resolve, depth + 1, containers)
                    for k, v in map(_pair, _list(body))}
        if tag in ("b", "y"):
            return (bytes if tag == "b" else bytearray).fromhex(str(body))
        if tag == "c":
            real, imag = _pair(body)
            if type(real) not in (int, float) or type(imag) not in (int, float):
                raise ProtocolError("complex parts must be numbers")
            return complex(real, imag)
        if tag in ("L", "D", "S", "Y") and containers is not None:
            index, contents = _pair(body)
            if type(index) is not int or index in containers:
                raise ProtocolError("bad container number")
            empty = {"L": list, "D": dict, "S": set, "Y": bytearray}[tag]()
            containers[index] = empty  # registered first: a container may hold itself
            fill_container(empty, contents, resolve, depth, containers)
            return empty
        if tag == "a" and containers is not None:
            if type(body) is not int or body not in containers:
                raise ProtocolError("reference to an unknown container")
            return containers[body]
    except (TypeError, ValueError, KeyError, RecursionError) as exc:
        raise ProtocolError(f"bad {tag!r} value: {exc}") from None
    return resolve(tag, body)


def fill_container(container, contents, resolve, depth, containers) -> None:
    """Replace the contents of ``container`` (in place) with the decoded ``contents``."""
    kind = type(container)
    if kind is bytearray:
        container[:] = bytes.fromhex(str(contents))
    elif kind is dict:
        pairs = [(decode(k, resolve, depth + 1, containers), decode(v, resolve, depth + 1, containers))
                 for k, v in map(_pair, _list(contents))]
        container.clear()
        container.update(pairs)
    else:
        items = [decode(item, resolve, depth + 1, containers) for item in _list(contents)]
        if kind is list:
            container[:] = items
        else:
            container.clear()
            container.update(items)


def _list(body) -> list:
    if type(body) is not list:
        raise ProtocolError("expected a list")
    return body


def _pair(body):
    if type(body) is not list or len(body) != 2:
        raise ProtocolError("expected a pair")
    return body


def as_plain(value):
    """An instance of a subclass of a plain type as that type's value, read through the plain
    type's own methods (the subclass's overrides never run); TypeError for anything else."""
    for base, convert in ((int, int.__int__), (float, float.__float__),
                          (complex, complex.__complex__), (str, str.__str__), (bytes, bytes.__bytes__),
                          (bytearray, lambda v: bytearray(memoryview(v))), (tuple, lambda v: tuple(tuple.__iter__(v))),
                          (list, lambda v: list(list.__iter__(v))), (dict, lambda v: dict(dict.items(v))),
                          (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
                          (set, lambda v: set(set.__iter__(v)))):
        if isinstance(value, base):
            return convert(value)
    raise TypeError(f"{type(value).__name__} is not plain data")


def is_blocked(exc: BaseException) -> bool:
    """Whether a limit or a refused action (memory, processes, network, read-only files, the
    write cap) stopped the program."""
    return isinstance(exc, (MemoryError, RecursionError, BlockingIOError)) or (
        isinstance(exc, OSError) and exc.errno in BLOCKED_ERRNOS)


_DATETIMES = ("datetime.date", "datetime.datetime", "datetime.time")


def standard_value(value, reference):
    """A value of one of a few standard-library value types as ``[type name, plain data]`` (the
    judge rebuilds it: `rebuild_standard_value`), else None."""
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if name == "fractions.Fraction":
        return [name, [encode(value.numerator, reference), encode(value.denominator, reference)]]
    if name == "decimal.Decimal":
        return [name, str(value)]
    if name == "collections.deque":
        return [name, [[encode(item, reference) for item in value], value.maxlen]]
    if name in _DATETIMES:
        return [name, value.isoformat()]
    if name == "datetime.timedelta":
        return [name, [value.days, value.seconds, value.microseconds]]
    return None


def rebuild_standard_value(body, resolve):
    """The judge's own copy of a `standard_value` (its types, its methods); ProtocolError when the
    data does not fit the type."""
    name, data = _pair(body)
    try:
        if name == "fractions.Fraction":
            import fractions

            numerator, denominator = (decode(part, resolve) for part in _pair(data))
            if type(numerator) is not int or type(denominator) is not int:
                raise ProtocolError("a fraction of non-integers")
            return fractions.Fraction(numerator, denominator)
        if name == "decimal.Decimal" and type(data) is str:
            import decimal

            return decimal.Decimal(data)
        if name == "collections.deque":
            import collections

            items, maxlen = _pair(data)
            if maxlen is not None and type(maxlen) is not int:
                raise ProtocolError("a deque's maxlen must be an int")
            return collections.deque((decode(item, resolve) for item in _list(items)), maxlen)
        if name in _DATETIMES and type(data) is str:
            import datetime

            return getattr(datetime, name.split(".")[1]).fromisoformat(data)
        if name == "datetime.timedelta" and all(type(part) is int for part in _list(data)) and len(data) == 3:
            import datetime

            return datetime.timedelta(*data)
    except (ValueError, TypeError, ArithmeticError, OverflowError) as exc:
        raise ProtocolError(f"bad {name}: {exc}") from None
    raise ProtocolError(f"not a standard value: {str(name)[:80]}")


# -- the program's process ------------------------------------------------------------------------
def _send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def describe(exc: BaseException) -> dict:
    """An exception as the judge receives it: its class name, message and category."""
    try:
        message = str(exc)[:MAX_DETAIL_CHARS]
    except BaseException:
        message = "<unprintable>"
    category = "exited" if isinstance(exc, SystemExit) else "blocked" if is_blocked(exc) else "crashed"
    try:
        tail = "".join(traceback.format_exception(exc))[-MAX_DETAIL_CHARS:]
    except BaseException:
        tail = ""
    names = [cls.__name__ for cls in type(exc).__mro__]  # the judge raises the nearest builtin class
    return {"types": names, "message": message, "category": category, "traceback": tail}


class ObjectTable:
    """The program's side: objects the judge holds references to, and the operations it asks for."""

    OPERATIONS = {
        "call": lambda f, *a, **k: f(*a, **k), "getattr": getattr, "setattr": setattr, "delattr": delattr,
        "len": len, "iter": iter, "next": next, "bool": bool, "hash": hash, "repr": repr, "str": str,
        "format": format, "int": int, "float": float, "index": lambda v: v.__index__(), "round": round,
        "isinstance": isinstance, "issubclass": issubclass, "plain": as_plain,
    }

    def __init__(self):
        import operator

        self.objects, self.numbers = {}, {}
        self.operations = dict(self.OPERATIONS)
        for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift", "rshift",
                     "and_", "or_", "xor", "neg", "pos", "abs", "invert", "getitem", "setitem", "delitem",
                     "eq", "ne", "lt", "le", "gt", "ge"):
            self.operations[name] = getattr(operator, name)

    def reference(self, value) -> dict:
        """A module, or a class or function of an importable module, is named so that the judge can
        use its own; anything else is numbered."""
        import types

        standard = standard_value(value, self.reference)
        if standard is not None:
            return {"x": standard}
        if isinstance(value, types.ModuleType) and isinstance(getattr(value, "__name__", None), str):
            return {"m": [value.__name__, self._number(value)]}
        if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
            module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
            if isinstance(module, str) and isinstance(qualname, str) and module not in ("__main__", "builtins"):
                return {"g": [module, qualname, self._number(value)]}
        return {"r": self._number(value)}

    def _number(self, value) -> int:
        if id(value) not in self.numbers:
            self.numbers[id(value)] = len(self.objects)
            self.objects[len(self.objects)] = value  # kept alive: its id stays its own
        return self.numbers[id(value)]

    def resolve(self, tag, body):
        if tag == "r":
            return self.objects[body]
        if tag == "p":
            import io
            import pickle

            table = self

            class Unpickler(pickle.Unpickler):
                def persistent_load(self, number):
                    return table.objects[number]

            return Unpickler(io.BytesIO(bytes.fromhex(body))).load()
        raise ProtocolError(f"unknown tag {tag!r}")

    def perform(self, request: dict) -> dict:
        """Run one operation; the reply carries its result and the changed containers."""
        containers = {}
        args = [decode(a, self.resolve, containers=containers) for a in request["args"]]
        kwargs = {k: decode(v, self.resolve, containers=containers) for k, v in request["kwargs"]}
        result = self.operations[request["op"]](*args, **kwargs)
        numbered = {id(c): (i, c) for i, c in containers.items()}
        reply = {"ok": encode(result, self.reference, containers=numbered)}
        if containers:
            reply["sync"] = [_contents(containers[i], self.reference, 0, numbered) for i in range(len(containers))]
        return reply


def serve_program(source: str, requests_fd: int, replies_fd: int) -> None:
    """Run the program, report the names it defined, then answer the judge until it hangs up."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    table = ObjectTable()
    try:
        exec(compile_program(source), namespace)
    except BaseException as exc:
        _send(replies_fd, {"loaded": False, "error": describe(exc)})
        return
    names = {}
    for name, value in list(namespace.items()):
        if not name.startswith("__"):
            try:
                names[name] = encode(value, table.reference)
            except Exception:  # a global that cannot be sent is one the test cannot use
                pass
    _send(replies_fd, {"loaded": True, "names": names})
    with os.fdopen(requests_fd, "rb") as requests:
        for line in requests:
            try:
                reply = table.perform(json.loads(line))
            except BaseException as exc:
                reply = {"error": describe(exc)}
            _send(replies_fd, reply)


def compile_program(source: str):
    """The program compiled as ``program.py``, written to the (private) working folder so that its
    tracebacks show its lines."""
    try:
        with open("program.py", "w") as fh:
            fh.write(source)
    except OSError:
        pass
    return compile(source, "program.py", "exec")


# -- the judge ------------------------------------------------------------------------------
class ProgramEnded(BaseException):
    """The program's process is gone or exited (a BaseException: a test's `except Exception`
    must not swallow it)."""


class ProgramError(Exception):
    """An exception in the program's process whose class is not a builtin one."""


class Program:
    """The judge's end of the connection to the program's process."""

    def __init__(self, requests_fd: int, replies_fd: int, pid: int):
        self.requests = os.fdopen(requests_fd, "wb")
        self.replies = os.fdopen(replies_fd, "rb")
        self.pid = pid
        self.ended = None  # (verdict, detail) once the program's process is gone or has exited
        self.remotes = {}

    def receive(self) -> dict:
        line = self.replies.readline(MAX_MESSAGE_BYTES)
        if not line:
            self.end(*self._death())
        if not line.endswith(b"\n"):
            self.end("failed", "the program's process sent a message too large or cut short")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if type(message) is not dict:
            self.end("failed", "the program's process broke the judge's protocol")
        return message

    def end(self, verdict: str, detail: str):
        if self.ended is None:
            self.ended = (verdict, detail)
        raise ProgramEnded(self.ended[1])

    def _death(self):
        """Why the program's process stopped answering."""
        import time

        try:
            deadline = time.monotonic() + 0.5
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            while pid == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
                pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid == 0:  # alive but silent: it hung up on the judge
                os.kill(self.pid, signal.SIGKILL)
                os.wait4(self.pid, 0)
                return "failed", "the program's process stopped answering"
        except ChildProcessError:
            return "failed", "the program's process is gone"
        if os.WIFSIGNALED(status):
            signal_number = os.WTERMSIG(status)
            if signal_number == signal.SIGXCPU or (signal_number == signal.SIGKILL and usage.ru_utime + usage.ru_stime
                                                   >= _cpu_limit() - 0.05):
                return "timeout", "CPU time limit"
            return "killed", f"the program's process died of signal {signal_number}"
        return "failed", "the program exited before the test completed"

    def request(self, operation: str, *args, **kwargs):
        if self.ended is not None:
            raise ProgramEnded(self.ended[1])
        containers = {}
        message = {"op": operation, "args": [encode(a, self.reference, containers=containers) for a in args],
                   "kwargs": [[k, encode(v, self.reference, containers=containers)] for k, v in kwargs.items()]}
        try:
            self.requests.write((json.dumps(message) + "\n").encode())
            self.requests.flush()
        except OSError:
            self.end(*self._death())
        reply = self.receive()
        sent = {index: container for index, container in containers.values()}
        by_index = dict(sent)
        if "ok" not in reply:
            raise self.exception(reply.get("error"))
        try:
            result = decode(reply["ok"], self.resolve, containers=by_index)
            # The program's changes to the test's lists, dicts, sets and bytearrays.
            changed = _list(reply.get("sync", []))
            if len(changed) != len(sent):
                raise ProtocolError("wrong number of containers")
            for index, contents in enumerate(changed):
                fill_container(sent[index], contents, self.resolve, 0, by_index)
            return result
        except (ProtocolError, KeyError, TypeError) as exc:
            self.end("failed", f"the program's process broke the judge's protocol: {exc}")

    def exception(self, error) -> BaseException:
        """The program's exception as one the test can catch: a builtin class of the same name,
        else ProgramError; a SystemExit ends the program."""
        if type(error) is not dict:
            self.end("failed", "the program's process broke the judge's protocol")
        names = error.get("types") if type(error.get("types")) is list else []
        name, message = (str(names[0]) if names else "Exception"), str(error.get("message"))
        category = error.get("category") if error.get("category") in ("blocked", "crashed") else "crashed"
        if error.get("category") == "exited":
            self.end("failed", "the program exited before the test completed")
        exc = None
        for candidate in names:
            cls = getattr(builtins, str(candidate), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    exc = cls(message)
                except Exception:
                    continue
                break
        exc = exc or ProgramError(f"{name}: {message}")
        exc.sandbox_category = category
        exc.sandbox_traceback = str(error.get("traceback", ""))[-MAX_DETAIL_CHARS:]
        return exc

    def reference(self, value) -> dict:
        """How a test's value that is not plain data reaches the program: a reference back, a
        plain subclass as its plain value, else pickled (standard-library types)."""
        if isinstance(value, Remote):
            return {"r": object.__getattribute__(value, "_sandbox_number")}
        import io
        import pickle

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                return object.__getattribute__(obj, "_sandbox_number") if isinstance(obj, Remote) else None

        buffer = io.BytesIO()
        try:
            Pickler(buffer).dump(value)
            return {"p": buffer.getvalue().hex()}
        except Exception as exc:
            problem = exc
        try:  # e.g. a namedtuple the test defined: it arrives as its tuple
            return encode(as_plain(value), self.reference)
        except TypeError:
            raise TypeError(f"the test passes a {type(value).__name__} to the program, which receives only "
                            f"plain data, standard-library values and its own objects ({problem})") from None

    def resolve(self, tag, body):
        if tag == "r" and type(body) is int:
            return self.remote(body)
        if tag == "x":
            return rebuild_standard_value(body, self.resolve)
        if tag in ("m", "g"):
            # A module the program imported (or a class or function of one) is imported here too:
            # the test then uses the judge's copy, whatever the program patched in its own.
            parts = _list(body)
            if len(parts) != (2 if tag == "m" else 3) or type(parts[-1]) is not int:
                raise ProtocolError("bad module reference")
            found = _import_here(*parts[:-1])
            return found if found is not None else self.remote(parts[-1])
        raise ProtocolError(f"unknown tag {tag!r}")

    def remote(self, number: int) -> "Remote":
        if number not in self.remotes:
            self.remotes[number] = Remote(self, number)
        return self.remotes[number]


def _import_here(module, qualname=None):
    """``module`` (and its ``qualname`` attribute) imported by the judge; None when it cannot be."""
    if type(module) is not str or not re.fullmatch(r"[A-Za-z_][\w.]*", module) or module == "__main__":
        return None
    if qualname is not None and (type(qualname) is not str or not re.fullmatch(r"[A-Za-z_][\w.]*", qualname)):
        return None
    try:
        import importlib

        found = importlib.import_module(module)
        for part in (qualname.split(".") if qualname else ()):
            found = getattr(found, part)
        return found
    except Exception:
        return None


def _cpu_limit() -> float:
    import resource

    return float(resource.getrlimit(resource.RLIMIT_CPU)[0])


def _checked(value, kind):
    if type(value) is not kind:
        raise TypeError(f"the program answered {type(value).__name__} where {kind.__name__} is required")
    return value


class Remote:
    """A reference to an object in the program's process. Calls, attributes, items, iteration,
    arithmetic and comparisons between references are carried out there; a comparison with plain
    data is carried out here (against the object's plain value when it is an instance of a
    subclass of a plain type, else the two are unequal), so the program's code never sees the
    value a test compares with."""

    __slots__ = ("_sandbox_program", "_sandbox_number")

    def __init__(self, program: Program, number: int):
        object.__setattr__(self, "_sandbox_program", program)
        object.__setattr__(self, "_sandbox_number", number)

    def _ask(self, operation, *args, **kwargs):
        return object.__getattribute__(self, "_sandbox_program").request(operation, *args, **kwargs)

    def __getattr__(self, name):
        return self._ask("getattr", self, name)

    def __setattr__(self, name, value):
        self._ask("setattr", self, name, value)

    def __delattr__(self, name):
        self._ask("delattr", self, name)

    def __call__(self, *args, **kwargs):
        return self._ask("call", self, *args, **kwargs)

    def __getitem__(self, key):
        return self._ask("getitem", self, key)

    def __setitem__(self, key, value):
        self._ask("setitem", self, key, value)

    def __delitem__(self, key):
        self._ask("delitem", self, key)

    def __len__(self):
        return _checked(self._ask("len", self), int)

    def __bool__(self):
        return _checked(self._ask("bool", self), bool)

    def __iter__(self):
        return self._ask("iter", self)

    def __next__(self):
        return self._ask("next", self)

    def __hash__(self):
        return _checked(self._ask("hash", self), int)

    def __index__(self):
        return _checked(self._ask("index", self), int)

    def __int__(self):
        return _checked(self._ask("int", self), int)

    def __float__(self):
        return _checked(self._ask("float", self), float)

    def __round__(self, ndigits=None):
        return self._ask("round", self, ndigits)

    def __repr__(self):
        try:
            return _checked(self._ask("repr", self), str)
        except BaseException:
            return "<the program's object>"

    def __str__(self):
        return _checked(self._ask("str", self), str)

    def __format__(self, spec):
        return _checked(self._ask("format", self, spec), str)

    def __instancecheck__(self, instance):
        return _checked(self._ask("isinstance", instance, self), bool)

    def __subclasscheck__(self, subclass):
        return _checked(self._ask("issubclass", subclass, self), bool)

    def _compare(self, operation, other):
        if isinstance(other, Remote):  # both the program's: its own rules
            return self._ask(operation, self, other)
        try:
            plain = self._ask("plain", self)
        except (TypeError, ProgramError):
            return NotImplemented  # never equal to plain data
        import operator

        return getattr(operator, operation)(plain, other)

    def __eq__(self, other):
        return self._compare("eq", other)

    def __ne__(self, other):
        result = self._compare("ne", other)
        return True if result is NotImplemented and not isinstance(other, Remote) else result

    def __lt__(self, other):
        return self._compare("lt", other)

    def __le__(self, other):
        return self._compare("le", other)

    def __gt__(self, other):
        return self._compare("gt", other)

    def __ge__(self, other):
        return self._compare("ge", other)


def _binary(name):
    def forward(self, other):
        return self._ask(name, self, other)

    def reflected(self, other):
        return self._ask(name, other, self)

    return forward, reflected


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift", "rshift",
              "and_", "or_", "xor"):
    _dunder = _name.rstrip("_")
    _forward, _reflected = _binary(_name)
    setattr(Remote, f"__{_dunder}__", _forward)
    setattr(Remote, f"__r{_dunder}__", _reflected)
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Remote, f"__{_name}__", (lambda op: lambda self: self._ask(op, self))(_name))


def judge(test_code: str, program: Program):
    """Run the test against the program's process; ``(verdict, detail)``."""
    try:
        loaded = program.receive()
    except ProgramEnded:
        return program.ended
    if not loaded.get("loaded"):
        error = loaded.get("error") if type(loaded.get("error")) is dict else {}
        detail = str(error.get("traceback") or error.get("message") or "")[-MAX_DETAIL_CHARS:]
        if error.get("category") == "exited":
            return "failed", "the program exited before the test completed"
        if error.get("category") == "blocked":
            return "blocked", detail
        return ("failed" if "AssertionError" in (error.get("types") or ()) else "crashed"), detail
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    names = loaded.get("names")
    try:
        for name, value in (names.items() if type(names) is dict else ()):
            # A program's global that shadows a builtin (`abs = lambda x: 0`) must not change the
            # test's builtins.
            if name.isidentifier() and not hasattr(builtins, name):
                namespace[name] = decode(value, program.resolve)
        exec(compile(test_code, "test.py", "exec"), namespace)
        for name in TEST_FUNCTION.findall(test_code):
            namespace[name]()
    except ProgramEnded:
        pass
    except ProtocolError as exc:
        return "failed", f"the program's process broke the judge's protocol: {exc}"
    except AssertionError:
        return program.ended or ("failed", _tail())
    except SystemExit:
        return program.ended or ("failed", "the test exited before it completed")
    except BaseException as exc:
        if program.ended:
            return program.ended
        category = getattr(exc, "sandbox_category", None) or ("blocked" if is_blocked(exc) else "crashed")
        return category, (getattr(exc, "sandbox_traceback", "") or _tail())
    return program.ended or ("passed", "")


def _tail() -> str:
    return traceback.format_exc()[-MAX_DETAIL_CHARS:]


def _read_all(fd: int) -> str:
    with os.fdopen(fd, "rb") as fh:
        return fh.read().decode("utf-8", "replace")


def _keep_only(fds) -> None:
    """Close every descriptor above 2 but ``fds``."""
    top = os.sysconf("SC_OPEN_MAX")
    start = 3
    for fd in sorted(fds):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, top)


def run_assert(program_source: str, tests_fd: int) -> None:
    """Fork the program's process, then read the test and judge; writes the verdict line."""
    make_undumpable()  # before the fork: the program's process is never able to reach this one
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # the judge's stdout carries the verdict: never the program's
                os.dup2(null, fd)
            _keep_only((requests_r, replies_w))  # the test's descriptor is gone before the program runs
            serve_program(program_source, requests_r, replies_w)
        finally:
            os._exit(0)
    os.close(requests_r)
    os.close(replies_w)
    test_code = json.loads(_read_all(tests_fd))["test"]
    verdict_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the test prints is not the verdict
    program = Program(requests_w, replies_r, pid)
    try:
        verdict, detail = judge(test_code, program)
    except BaseException:
        verdict, detail = "crashed", _tail()
    _kill_everything_else(pid)
    _send(verdict_fd, {"verdict": verdict, "detail": str(detail)[-MAX_DETAIL_CHARS:]})
    os._exit(0)


def _kill_everything_else(pid: int) -> None:
    try:
        if os.getpid() == 1:  # the sandbox's PID namespace: all but this process
            os.kill(-1, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def exit_code(exc: BaseException) -> int:
    """The harness's exit code for an exception out of an input-test program."""
    if isinstance(exc, AssertionError):
        return EXIT_FAILED
    return EXIT_BLOCKED if is_blocked(exc) else EXIT_CRASHED


def run_input(program_source: str) -> None:
    """Run the program on this process's stdin; its exit tells how it ended."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile_program(program_source), namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            os._exit(EXIT_EXITED)
    except BaseException as exc:
        traceback.print_exc()
        os._exit(exit_code(exc))
    try:
        sys.stdout.flush()
    except BaseException as exc:
        os._exit(exit_code(exc))
    os._exit(0)


def main(argv) -> None:
    settings = json.loads(argv[1])
    try:
        private = settings.get("private_filesystem")
        if private:
            make_private_filesystem(private["tmpfs"], private["hidden"], private["keep"])
        if settings.get("drop"):
            drop_privileges(settings["drop"].get("uid"))
        os.chdir(settings.get("workdir") or "/tmp")
        program_source = _read_all(settings["program_fd"])
    except BaseException:
        traceback.print_exc()
        os._exit(EXIT_CRASHED)
    if settings["kind"] == "input":
        os.close(settings["tests_fd"])
        run_input(program_source)
    else:
        run_assert(program_source, settings["tests_fd"])


if __name__ == "__main__" and sys.argv[0] == "-c":
    main(sys.argv)
