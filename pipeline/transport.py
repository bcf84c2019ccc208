"""ZeroMQ plumbing shared by every process: endpoints, CurveZMQ security, and the clients of the buffer.

Socket layout (the buffer binds both):
- ROUTER `tcp://host:router_port`: requests and results. Clients are DEALERs with a stable identity; a request
  (WorkRequest, BatchRequest, MetricsRequest) gets exactly one reply, results and heartbeats get none.
- PUB `tcp://host:control_port`: the control channel (VersionUpdate, Abort, Shutdown) to every client's SUB.

Security invariants: the buffer binds a non-loopback interface only with CurveZMQ keys, and then accepts only
clients whose public key lies in `keys_dir/authorized/<role>/` (on both sockets: a client without an admitted key
gets neither replies nor control messages). Every connection holds a role, producer or learner, that the buffer
learns from its key or, on loopback, from the learner token in its handshake (see auth.py); a client presents
its role's key and, as the learner, the token, and never a secret in a message. The ROUTER refuses a second
connection under an identity it still serves (ROUTER_HANDOVER off): nobody takes over a producer's identity and
with it its leases. Nothing on the wire is unpickled (see protocol.py).

Reconnection: clients connect (the buffer binds), so a restarted buffer on the same ports is found again by
ZeroMQ's reconnect; messages sent while it was down wait in the client's queue and are delivered after it returns
(requests whose replies were lost must be re-sent by the caller after a timeout). TCP keepalive probes and a bound
on retransmission time on every socket drop a connection whose peer vanished without closing it (a dead machine, a
cut cable) within about DEAD_PEER_S, so the reconnect starts then instead of when TCP gives up (minutes).

Why not ZMTP heartbeats: with them, libzmq 4.3.5 aborts the whole process ("Assertion failed: !_io_error
(stream_engine_base.cpp:310)") when its peer goes away while the connection's receive queue is full, e.g. a client
that reads its control channel only between long learner steps, or not at all, once the buffer exits. The kernel's
keepalive has no such timer inside libzmq (tests/test_transport_keepalive.py reproduces the abort).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from pipeline import protocol
from pipeline.auth import (
    LEARNER,
    PRODUCER,
    ConnectionRoles,
    RoleAuthenticator,
    SecurityError,
    authorized_keys,
    client_key_name,
    learner_token_path,
    load_pair,
    make_keys,
    read_token,
    server_public_key,
    token_metadata,
)

if TYPE_CHECKING:
    from pipeline.config import Config

__all__ = ["AsyncBufferClient", "BufferClient", "SecurityError", "ServerSecurity", "check_bind", "free_port",
           "free_port_pair", "make_keys", "parse_connect", "unique_identity"]

log = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 5  # an idle connection is probed after this long
KEEPALIVE_INTVL_S = 2  # then every this long
KEEPALIVE_CNT = 3  # and dropped (and re-made) after this many unanswered probes
MAXRT_MS = 10_000  # a connection whose sent data stays unacknowledged this long is dropped too
DEAD_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTVL_S * KEEPALIVE_CNT
# refusals after which ZeroMQ stops reconnecting (EVENT_HANDSHAKE_FAILED_NO_DETAIL is left out: it also comes
# from a connection cut mid-handshake, e.g. by a buffer restart, and from a wrong server key, and ZeroMQ retries)
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security mechanism mismatch: keys on one side only",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "this client's public key is not in the buffer's keys_dir/authorized/<role>/",
}
_monitor_ids = itertools.count()
_reconnects = itertools.count(1)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys_dir: str) -> None:
    """Refuse a non-loopback bind without keys (the error says how to make them)."""
    if not is_loopback(host) and not keys_dir:
        raise SecurityError(
            f"endpoints.host = {host!r} is not a loopback address, so the buffer would accept anyone on the "
            "network. Create CurveZMQ keys with `reinforce-ada keys --out KEYS_DIR`, copy them to every machine, "
            "and set endpoints.keys_dir = KEYS_DIR (or bind 127.0.0.1)."
        )


class ServerSecurity:
    """The buffer's side: CurveZMQ keys on the bound sockets and the ZAP authenticator (allow-list per role), and
    `roles`, which tells the role of the connection each received message came on (see auth.py).

    `token` is the learner token (loopback without keys); None without one. Every key file is read before any
    thread starts: a bad one raises SecurityError naming it."""

    def __init__(self, ctx: zmq.Context, keys_dir: str, token: str | None = None) -> None:
        self.enabled = bool(keys_dir)
        self.roles = ConnectionRoles(self.enabled, None if self.enabled else token)
        self._auth: RoleAuthenticator | None = None
        self.producer_keys = 0  # producer keys admitted (with keys): each is one client of the buffer
        if not self.enabled:
            return
        self.public, self.secret = load_pair(keys_dir, "server")
        admitted = authorized_keys(keys_dir)
        self.producer_keys = sum(role == PRODUCER for role in admitted.values())
        self._auth = RoleAuthenticator(ctx, admitted)
        self._auth.start()

    def apply(self, sock: zmq.Socket) -> None:
        if self.enabled:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def apply_client_keys(sock: zmq.Socket, keys_dir: str, role: str = PRODUCER, identity: str = "") -> None:
    """The key pair of `role` (a producer's own, by its identity, where keys_dir has one) and the server's public
    key, when `keys_dir` is set."""
    if not keys_dir:
        return
    public, secret = load_pair(keys_dir, client_key_name(keys_dir, role, identity))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public_key(keys_dir)


def unique_identity(name: str) -> str:
    """A connection identity for one process of a role that the buffer serves by its key or token, not its name
    (the learner, the supervisor): `name` with this process's id and a random suffix. The router refuses a second
    connection under an identity it serves, so a fixed one could be taken first by anyone who connects."""
    return f"{name}-{os.getpid()}-{secrets.token_hex(8)}"


# Ports handed out by free_port lie below the kernel's ephemeral range. A port from bind(0) lies inside it, where
# any outgoing connection may take it as its source port before the buffer binds it: "Address already in use" at
# start-up, or worse, a client that connects before the buffer listens ends up connected to itself (TCP
# self-connect: source port = destination port) and talks to itself for good, no refusal, no reply. Below the
# range only an explicit bind can take a port. The floor leaves out Ray's default worker ports (10002-19999: a
# Ray head refuses a --port among them, and Ray's workers may bind any of them later).
PORT_FLOOR = 20_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; other systems' ranges start higher (49152)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface: a port another process holds on any address is not free
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port P such that P .. P + span - 1 are free now on every interface, chosen at random below the
    kernel's ephemeral range (see PORT_FLOOR), so that only another explicit bind can take it before it is used.
    Falls back to one from the kernel (bind to port 0) where that range leaves no room below it."""
    room = _ephemeral_start() - span - PORT_FLOOR
    for _ in range(200 if room > 0 else 0):
        port = PORT_FLOOR + secrets.randbelow(room)  # not `random`: tests seed it alike in each process
        if all(_bindable(port + i) for i in range(span)):
            return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port + span <= 65_536 and all(_bindable(port + i) for i in range(1, span)):
            return port
    raise OSError(f"no {span} consecutive free TCP ports found")


def free_port_pair() -> int:
    """A free port P whose successor P + 1 is free too (the router and control ports of a buffer)."""
    return free_port(span=2)


def parse_connect(spec: str, control_port: int | None = None) -> tuple[str, str]:
    """`HOST:PORT` (control = PORT + 1 unless given) or `tcp://...` -> (router_url, control_url)."""
    if spec.startswith("ipc://"):
        return spec, spec + ".control"
    if spec.startswith("tcp://"):
        spec = spec[len("tcp://"):]
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--connect {spec!r}: expected HOST:PORT, e.g. 127.0.0.1:5555")
    cport = control_port if control_port else int(port) + 1
    return f"tcp://{host}:{port}", f"tcp://{host}:{cport}"


def apply_keepalive(sock: zmq.Socket) -> None:
    """Detect a peer that vanished without closing the connection, in the kernel (see the module docstring)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, MAXRT_MS)


def _setup_dealer(router: zmq.Socket, identity: str, keys_dir: str, role: str = PRODUCER,
                  token: str | None = None) -> None:
    router.setsockopt(zmq.IDENTITY, identity.encode())
    if token:  # presented in the handshake of every (re)connection, never in a message
        router.setsockopt(zmq.METADATA, token_metadata(token))
    router.setsockopt(zmq.LINGER, 2000)
    router.setsockopt(zmq.RECONNECT_IVL, 100)
    router.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    # a restarted buffer must not receive a flood of requests queued while it was down
    router.setsockopt(zmq.SNDHWM, 10_000)
    apply_keepalive(router)
    apply_client_keys(router, keys_dir, role, identity.split("~")[0])  # the name before a reconnect's suffix


def _setup_client(router: zmq.Socket, control: zmq.Socket, identity: str, keys_dir: str, role: str = PRODUCER,
                  token: str | None = None) -> None:
    _setup_dealer(router, identity, keys_dir, role, token)
    control.setsockopt(zmq.LINGER, 0)
    control.setsockopt(zmq.SUBSCRIBE, b"")
    control.setsockopt(zmq.RECONNECT_IVL, 100)
    control.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    apply_keepalive(control)
    apply_client_keys(control, keys_dir, role, identity.split("~")[0])


class _HandshakeWatch:
    """Turns a refused CurveZMQ handshake into a SecurityError. ZeroMQ does not reconnect after one, so without
    this the client's next send would block forever without a word. (A wrong *server* key cannot be told apart
    from a buffer that is down: the client just never gets a reply.)"""

    def __init__(self, sock: zmq.Socket, url: str) -> None:
        self.sock, self.url = sock, url
        addr = f"inproc://handshake-watch-{os.getpid()}-{next(_monitor_ids)}"
        sock.monitor(addr, sum(_HANDSHAKE_FAILURES))
        # a plain (blocking) socket on the same context also serves asyncio clients: it is only polled with 0
        self.mon = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self.mon.connect(addr)

    def check(self) -> None:
        """Raise SecurityError if the buffer refused this client's handshake since the last check."""
        from zmq.utils.monitor import recv_monitor_message

        while self.mon.poll(0):
            event = recv_monitor_message(self.mon)["event"]
            if event in _HANDSHAKE_FAILURES:
                raise SecurityError(
                    f"the buffer at {self.url} refused this client ({_HANDSHAKE_FAILURES[event]}). Use the buffer's "
                    "keys: copy the directory made by `reinforce-ada keys --out DIR` to this machine and set "
                    "endpoints.keys_dir = DIR (or no keys on either side, on loopback)"
                )

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(linger=0)


class BufferClient:
    """Blocking client of the buffer (the learner, scripts and tests). Raises SecurityError once the buffer
    refuses its keys (see `_HandshakeWatch`); otherwise a buffer that is down just means no reply yet.

    `role` picks the key pair under `keys_dir`; `token_file` is the learner token to present (read here, checked
    to be private; a missing file presents none). `subscribe=False` leaves out the control channel: a client that
    never reads it (the supervisor's metrics probe) must not hold a queue the buffer keeps filling."""

    def __init__(self, router_url: str, control_url: str, identity: str, keys_dir: str = "", *,
                 role: str = PRODUCER, token_file: str | os.PathLike | None = None, subscribe: bool = True) -> None:
        self.identity = identity
        self.router_url = router_url
        self.keys_dir, self.role = keys_dir, role
        self.token = read_token(token_file) if token_file else None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.control = self.ctx.socket(zmq.SUB) if subscribe else None
        if self.control is None:
            _setup_dealer(self.sock, identity, keys_dir, role, self.token)
        else:
            _setup_client(self.sock, self.control, identity, keys_dir, role, self.token)
        self._watch = _HandshakeWatch(self.sock, router_url)
        self.sock.connect(router_url)
        if self.control is not None:
            self.control.connect(control_url)
        self._enc = protocol.Encoder()
        self._dec = protocol.Decoder(protocol.ToLearner | protocol.ToProducer)
        self._ctl = protocol.Decoder(protocol.Control)

    @classmethod
    def for_learner(cls, cfg: Config, router_url: str, control_url: str, identity: str) -> BufferClient:
        """The learner's client: its CurveZMQ learner key with endpoints.keys_dir, else the run's learner token
        (run_dir/learner.token, made by `reinforce-ada train`) when there is one."""
        keys_dir = cfg.endpoints.keys_dir
        token_file = None if keys_dir else learner_token_path(cfg.run_dir)
        return cls(router_url, control_url, identity, keys_dir, role=LEARNER, token_file=token_file)

    def reconnect(self) -> None:
        """Replace the request socket, dropping what it still queues (ZeroMQ's "lazy pirate" retry): after a
        request timed out, re-sending on a fresh socket leaves one request outstanding, not a backlog that a
        restarted buffer would answer one by one. Fire-and-forget messages queued meanwhile are dropped too.

        The new socket gets a fresh identity: the buffer refuses a connection under an identity it still serves
        (ROUTER_HANDOVER off), and it may not have seen the old connection close yet. A producer must not
        reconnect this way (its leases are bound to its identity); the learner may (its role is its key or
        token)."""
        self._watch.close()
        self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        _setup_dealer(self.sock, f"{self.identity}~{next(_reconnects)}", self.keys_dir, self.role, self.token)
        self._watch = _HandshakeWatch(self.sock, self.router_url)
        self.sock.connect(self.router_url)

    def send(self, msg: Any) -> None:
        """Queue `msg` for the buffer; waits only while the queue is full (raises SecurityError if refused)."""
        frames = self._enc.encode(msg)
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # queue full, or no connection at all after a refused handshake
                self._watch.check()
                self.sock.poll(100, zmq.POLLOUT)

    def recv(self, timeout_s: float) -> Any | None:
        """The next reply, or None after `timeout_s`. Malformed replies are logged and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                return None
            frames = self.sock.recv_multipart(copy=False)
            try:
                return self._dec.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("dropping a malformed reply from the buffer: %s", exc)

    def request(self, msg: Any, reply_type: type, timeout_s: float) -> Any | None:
        """Send `msg` and wait for a reply of `reply_type` (replies of other types, e.g. late ones, are skipped)."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            reply = self.recv(left)
            if isinstance(reply, reply_type):
                return reply
            if reply is not None:
                log.warning("skipping an unexpected %s while waiting for %s", type(reply).__name__,
                            reply_type.__name__)
        self._watch.check()  # no reply: say so if it is because the buffer refused our keys
        return None

    def poll_control(self, timeout_s: float = 0.0) -> list[Any]:
        """All control messages available now (waiting up to `timeout_s` for the first)."""
        out = []
        wait = int(timeout_s * 1000)
        while self.control is not None and self.control.poll(wait):
            frames = self.control.recv_multipart(copy=False)
            try:
                out.append(self._ctl.decode(frames))
            except protocol.ProtocolError as exc:
                log.warning("dropping a malformed control message: %s", exc)
            wait = 0
        return out

    def close(self) -> None:
        self._watch.close()
        self.sock.close(linger=500)
        if self.control is not None:
            self.control.close(linger=0)
        self.ctx.term()


class AsyncBufferClient:
    """asyncio client of the buffer (the producers, which share their loop with vLLM's AsyncLLM)."""

    def __init__(self, router_url: str, control_url: str, identity: str, keys_dir: str = "", *,
                 role: str = PRODUCER) -> None:
        self.identity = identity
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.control = self.ctx.socket(zmq.SUB)
        _setup_client(self.sock, self.control, identity, keys_dir, role)
        self._watch = _HandshakeWatch(self.sock, router_url)
        self.sock.connect(router_url)
        self.control.connect(control_url)
        self._enc = protocol.Encoder()
        self._dec = protocol.Decoder(protocol.ToProducer)
        self._ctl = protocol.Decoder(protocol.Control)

    async def send(self, msg: Any) -> None:
        """Queue `msg` for the buffer; waits only while the queue is full (raises SecurityError if refused)."""
        frames = self._enc.encode(msg)
        while True:
            try:
                await self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # queue full, or no connection at all after a refused handshake
                self._watch.check()
                await asyncio.sleep(0.01)

    async def recv(self) -> Any:
        """The next well-formed reply (malformed ones are logged and skipped). Raises SecurityError if refused."""
        while True:
            if not await self.sock.poll(1000):
                self._watch.check()
                continue
            frames = await self.sock.recv_multipart(copy=False)
            try:
                return self._dec.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("dropping a malformed reply from the buffer: %s", exc)

    async def recv_control(self) -> Any:
        while True:
            frames = await self.control.recv_multipart(copy=False)
            try:
                return self._ctl.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("dropping a malformed control message: %s", exc)

    def close(self) -> None:
        self._watch.close()
        self.sock.close(linger=1000)
        self.control.close(linger=0)
        self.ctx.term()
