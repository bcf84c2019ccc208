"""What runs inside the code reward's sandboxes (stdlib only: the sandbox has no view of the virtualenv).

`code.py` runs this file's source with `python -I -S -B -c` twice per sample, as two processes in two sandboxes:
- the *program box* (role "program") execs the model's program, then serves calls on its globals: it reads
  requests on stdin and answers on a copy of stdout (fd 1 and 2 then go to /dev/null, so prints cost nothing);
- the *tester box* (role "tester") reads {"program", "tests"} on stdin, sends the program to the program box, runs
  the tests in its own interpreter with the program's functions and classes as `Remote` proxies, and writes
  "pass" on its stdout only if the tests ran to their end.

Invariants: the expected values (the tests' code and whatever it computes) never cross to the program box: only
a call's arguments, an attribute name, an index, and the program's own objects do. What the program box sends is
decoded into plain builtin values only (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
frozenset) or handles on its objects; a handle never compares equal to anything but itself, so an object whose
`__eq__` always says True cannot pass a test, and the tests' builtins (`assert`, AssertionError, len, ...) are
their own. A program can only answer calls, so it cannot write the verdict: it holds no descriptor of the tester's
stdout, and (with bwrap or unshare) cannot see or signal the tester's process.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys

MAX_MESSAGE_BYTES = 32 << 20  # one request or answer; a longer line is a protocol error (the tests fail)
PLAIN_SCALARS = (type(None), bool, int, float, str)


# ---- values on the wire: JSON, with one-key objects as tags ----


def encode(value, handles: dict | None = None):
    """A JSON-able form of `value`: plain builtins by value, anything else as a handle {"h": id} (program side),
    or TypeError (tester side, `handles` None: only plain values and Remote proxies cross)."""
    t = type(value)
    if t is int and abs(value) >= 1 << 64:
        return {"i": hex(value)}  # linear to parse, and free of the int <-> str digit limit
    if t in PLAIN_SCALARS:
        return value
    if t is list:
        return [encode(v, handles) for v in value]
    if t is tuple:
        return {"t": [encode(v, handles) for v in value]}
    if t is dict:
        return {"d": [[encode(k, handles), encode(v, handles)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, handles) for v in value]}
    if t is bytes or t is bytearray:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    if isinstance(value, Remote):
        return {"h": value._id}
    if handles is None:
        raise TypeError(f"a {t.__name__} cannot be passed to the program (only plain values and its own objects)")
    if t is type(sys):
        return {"m": value.__name__}
    handles[id(value)] = value
    return {"h": id(value)}


def decode(obj, remote=None):
    """Plain builtins from the JSON form; a handle becomes `remote(id)` (tester side) or the object (program side,
    `remote` a dict of handles). Anything else is a ValueError."""
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [decode(v, remote) for v in obj]
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    (tag, v), = obj.items()
    if tag == "i":
        return int(v, 16)
    if tag == "t":
        return tuple(decode(x, remote) for x in v)
    if tag == "d":
        return {decode(k, remote): decode(x, remote) for k, x in v}
    if tag == "s":
        return {decode(x, remote) for x in v}
    if tag == "f":
        return frozenset(decode(x, remote) for x in v)
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    if tag == "h" and type(v) is int:
        return remote(v) if callable(remote) else remote[v]
    if tag == "m" and type(v) is str:
        return Module(v)
    raise ValueError(f"unknown tag {tag!r}")


class Module:
    """A module the program imported; the tester imports its own copy by name (tests may use the program's
    `import math`)."""

    def __init__(self, name: str):
        self.name = name


def send(stream, message) -> None:
    stream.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    stream.flush()


def receive(stream):
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line.endswith(b"\n"):
        raise EOFError("the other box closed its channel or sent an overlong message")
    return json.loads(line)


# ---- the tester box ----


class RemoteError(Exception):
    """An exception the program raised that is not a builtin one (its type name and message)."""


class Remote:
    """A handle on one of the program's objects: calls, attributes, items, length and iteration go to the program
    box; comparison is identity only (`__eq__` is never asked of the program, nor hashing)."""

    __slots__ = ("_id", "_link")

    def __init__(self, handle_id: int, link):
        object.__setattr__(self, "_id", handle_id)
        object.__setattr__(self, "_link", link)

    def __call__(self, *args, **kwargs):
        return self._link.ask("call", self._id, encode(list(args)), encode(kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.ask("getattr", self._id, name)

    def __getitem__(self, key):
        return self._link.ask("getitem", self._id, encode(key))

    def __len__(self) -> int:
        n = self._link.ask("len", self._id)
        if type(n) is not int or n < 0:
            raise TypeError("the program's __len__ did not return a non-negative int")
        return n

    def __bool__(self) -> bool:
        return self._link.ask("bool", self._id) is True

    def __iter__(self):
        it = self._link.ask("iter", self._id)
        while True:
            try:
                yield self._link.ask("next", it._id)
            except StopIteration:
                return

    def __next__(self):
        return self._link.ask("next", self._id)

    def __contains__(self, item) -> bool:
        return self._link.ask("contains", self._id, encode(item)) is True

    def __repr__(self) -> str:
        return f"<program object {self._id}>"

    __hash__ = object.__hash__


class Link:
    """The tester's channel to the program box."""

    def __init__(self, out_stream, in_stream):
        self.out, self.inp = out_stream, in_stream

    def ask(self, op: str, *args):
        send(self.out, [op, *args])
        return self.answer()

    def answer(self):
        reply = receive(self.inp)
        if type(reply) is not list or len(reply) != 3:
            raise ValueError("malformed answer from the program box")
        kind, a, b = reply
        if kind == "ok":
            return decode(a, lambda i: Remote(i, self))
        name, message = str(a)[:100], str(b)[:1000]
        exc = getattr(builtins, name, None)
        if isinstance(exc, type) and issubclass(exc, Exception):
            raise exc(message)
        raise RemoteError(f"{name}: {message}")


def tester_main() -> None:
    verdict = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    to_program, from_program = os.fdopen(int(sys.argv[4]), "wb"), os.fdopen(int(sys.argv[5]), "rb")
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(null, 0)
    link = Link(to_program, from_program)
    send(to_program, job["program"])
    table = link.answer()  # the program's globals, or its exception
    names = {"__name__": "__main__", "__builtins__": builtins}
    for name, value in table.items():
        if name.startswith("__") or hasattr(builtins, name):
            continue  # a program cannot rebind a builtin (or `assert`'s AssertionError) for the tests
        if isinstance(value, Module):
            try:
                value = __import__(value.name)
            except Exception:  # noqa: BLE001 -- not in the standard library: the tests cannot use it
                continue
        names[name] = value
    exec(compile(job["tests"], "tests.py", "exec"), names)
    verdict.write(b"pass\n")
    verdict.flush()


# ---- the program box ----


def _globals_table(namespace: dict, handles: dict) -> dict:
    table = {}
    for name, value in list(namespace.items()):
        if not name.startswith("__"):
            try:
                table[name] = encode(value, handles)
            except RecursionError:
                handles[id(value)] = value
                table[name] = {"h": id(value)}
    return table


def _serve(op: str, args: list, handles: dict):
    def arg(v):
        return decode(v, handles)

    target = handles[args[0]]
    if op == "call":
        return target(*arg(args[1]), **arg(args[2]))
    if op == "getattr":
        return getattr(target, str(args[1]))
    if op == "getitem":
        return target[arg(args[1])]
    if op == "len":
        return len(target)
    if op == "bool":
        return bool(target)
    if op == "iter":
        return iter(target)
    if op == "next":
        return next(target)
    if op == "contains":
        return arg(args[1]) in target
    raise ValueError(f"unknown request {op!r}")


def program_main() -> None:
    answers, requests = os.fdopen(os.dup(1), "wb"), os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the program's input() sees an end of file, its prints go nowhere
        os.dup2(null, fd)
    source = receive(requests)
    namespace: dict = {"__name__": "__main__"}
    handles: dict = {}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
        reply = ["ok", {"d": [[k, v] for k, v in _globals_table(namespace, handles).items()]}, None]
    except BaseException as e:  # noqa: BLE001 -- the program failed: the tester fails with its exception
        reply = ["raise", type(e).__name__, str(e)[:1000]]
    send(answers, reply)
    while True:
        op, *args = receive(requests)
        try:
            value = _serve(op, args, handles)
            try:
                reply = ["ok", encode(value, handles), None]
            except RecursionError:
                handles[id(value)] = value
                reply = ["ok", {"h": id(value)}, None]
        except BaseException as e:  # noqa: BLE001 -- the program's exception goes to the tests
            reply = ["raise", type(e).__name__, str(e)[:1000]]
        send(answers, reply)


# ---- both: limits, then the unprivileged user, then the role ----


def drop_privileges(limits: dict, uid: int) -> None:
    """Lower the resource limits and, when started as root inside bwrap, become `uid` (no groups, no capabilities
    left) before anything untrusted runs."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.geteuid() == 0 and uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        assert os.geteuid() == uid and os.getuid() == uid
    try:  # die with the harness where no bwrap does it (PR_SET_PDEATHSIG = SIGKILL)
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)
    except Exception:  # noqa: BLE001 -- best effort: the harness kills the box's process group too
        pass


if __name__ == "__main__":
    # argv: role, limits (JSON), uid to become (0: stay), then the tester's two descriptors to the program box
    drop_privileges(json.loads(sys.argv[2]), int(sys.argv[3]))
    sys.setrecursionlimit(10_000)
    try:
        tester_main() if sys.argv[1] == "tester" else program_main()
    except BaseException:  # noqa: BLE001 -- any failure is a failed test: no "pass" was written
        os._exit(1)
    os._exit(0)
