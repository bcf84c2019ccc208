"""The buffer as a ZeroMQ service: `BufferCore` behind a ROUTER socket (requests and results) and a PUB socket
(the control channel: version updates, aborts, shutdown).

This module is only socket glue: bind, poll, receive, decode, hand each message with its sender's identity and
connection (role and ZAP User-Id, see pipeline/auth.py) to `BufferCore.handle`, run `BufferCore.tick`, and send
or publish what they return. One thread, one poll loop; every decision, the draining after a Shutdown included,
is the core's (core.py).

Invariants:
- a message that cannot be decoded, or that has more than `max_frames` frames, is counted by the core
  (`malformed`, per sender), logged and dropped; it never stops the loop. A frame larger than `max_frame_bytes`
  (buffer.max_message_bytes, lowered to what the run's largest frame needs) never reaches the loop: ZeroMQ drops
  the sender's connection (its client reconnects by itself, losing what it had queued), and nothing is counted.
  ZeroMQ hands over a message only once all its frames arrived, so it holds a message of too many frames until
  its end (bounded per frame, not in number) before the loop can drop it: like a flood, bounded by what the
  sender sends;
- nothing raised while handling one message, or running the timers, ends the loop: the core's guard counts it
  (`handler_errors`), and a last guard here catches what escapes the core (sending included);
- a second connection under an identity the router still serves is refused (ROUTER_HANDOVER off), so nobody
  takes over a producer's identity and its leases;
- a reply never blocks the loop: one that cannot be queued (the peer is gone or not reading) is dropped and
  counted (`unroutable`); the rounds of a vanished producer expire with their leases;
- the loop stops only when the core says it has finished (after a Shutdown and the final evaluation) or at
  `stop_after_s`, and then publishes the Shutdown to everyone; it goes on receiving (handing out nothing) until
  every producer still heard from has sent what it holds and its final heartbeat, for FINAL_REPORTS_S at most,
  and writes the ledger (RUN/ledger.json, see ledger.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import zmq

from pipeline import protocol as P
from pipeline.auth import learner_token_path, read_token
from pipeline.buffer.core import BufferCore, Out
from pipeline.buffer.incidents import log_now
from pipeline.buffer.peers import Conn
from pipeline.buffer.snapshot import SNAPSHOT_EVERY
from pipeline.buffer.state import PromptRow
from pipeline.config import Config
from pipeline.prompts import Prompt
from pipeline.transport import ServerSecurity, apply_keepalive, check_bind

log = logging.getLogger(__name__)

TICK_S = 0.05  # the poll timeout: timers run at least this often
DRAIN_LIMIT = 256  # messages handled per wake-up at most, so that a burst never starves the timers
FRAME_SLACK = 2  # how far above the largest message a client sends the frame limit lies (a factor)
FINAL_REPORTS_S = 5.0  # after the Shutdown, producers' last results and final heartbeats are awaited this long


def max_frames(cfg: Config) -> int:
    """Frames (the identity included) above which a message is dropped as malformed before anything is decoded:
    FRAME_SLACK times the largest a client sends. That is a SampleResults of every sample a producer's engine can
    hold at once (max_num_seqs plus its queue, see producer/engine.py's free_samples) or a RoundResult of the
    largest round (up to round_size * max_rounds samples); each sample is 2 frames, each round's part 1 more."""
    s, engine = cfg.sampling, cfg.producers.engine
    in_engine = engine.max_num_seqs + max(s.round_size, engine.max_num_seqs // 4)
    samples = max(in_engine, s.round_size * s.max_rounds, s.group_size, cfg.eval.k)
    return FRAME_SLACK * (2 + 3 * samples)


def max_frame_bytes(cfg: Config) -> int:
    """Bytes per frame above which ZeroMQ drops the sender's connection (ZMQ_MAXMSGSIZE, which bounds each frame,
    not a message): buffer.max_message_bytes, lowered to FRAME_SLACK times the largest frame a client sends. An
    array frame holds one sample's tokens or log-probs (4 bytes each, max_model_len at most); the header holds a
    few hundred bytes per sample (its fields and array references), a heartbeat's stats, or a weights uri.
    With this and `max_frames`, a message the buffer reads is at most max_frames * max_frame_bytes."""
    s, engine = cfg.sampling, cfg.producers.engine
    samples = max_frames(cfg) // 2  # every sample brings 2 frames of its own
    array = 4 * engine.max_model_len
    header = (64 << 10) + 512 * samples
    return min(cfg.buffer.max_message_bytes, max(1 << 20, FRAME_SLACK * max(array, header, 4 * s.max_new_tokens)))


class BufferService:
    """Serves producers and the learner over ZeroMQ; see the module docstring."""

    def __init__(self, cfg: Config, prompts: Sequence[PromptRow], eval_prompts: Sequence[Prompt],
                 router_url: str | None = None, control_url: str | None = None, *,
                 snapshot_every: int = SNAPSHOT_EVERY, resume: bool = False, vocab_size: int | None = None,
                 tokenize: Callable[[str], Sequence[int]] | None = None) -> None:
        keys_dir = cfg.endpoints.keys_dir
        check_bind(cfg.endpoints.host, keys_dir)
        # SecurityError (keys, token) and snapshot errors are ValueErrors, raised before any socket exists
        token = None if keys_dir else read_token(learner_token_path(cfg.run_dir))
        self.core = BufferCore(cfg, prompts, eval_prompts, now=time.monotonic(), snapshot_every=snapshot_every,
                               resume=resume, vocab_size=vocab_size, tokenize=tokenize)
        self.cfg = cfg
        self.max_frames, self.max_frame_bytes = max_frames(cfg), max_frame_bytes(cfg)
        self.ctx = zmq.Context()
        self.security = ServerSecurity(self.ctx, keys_dir, token)
        self.roles = self.security.roles
        if self.security.enabled:  # fairness is per key: each admitted producer key is one client
            self.core.share_among(self.security.producer_keys)
        if self.roles.mode == "open":
            log.warning("no learner token at %s and no CurveZMQ keys: every local client may act as the learner "
                        "(`reinforce-ada train` gives each run keys instead; `reinforce-ada keys --learner-token "
                        "PATH` makes one)",
                        learner_token_path(cfg.run_dir))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        for sock in (self.router, self.pub):
            self.security.apply(sock)
            apply_keepalive(sock)
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # per frame; see the module docstring
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises instead of vanishing
        # ROUTER_HANDOVER stays off: a client under an identity already connected is refused, never handed over
        try:
            self.router_url = self._bind(self.router, router_url, cfg.endpoints.router_port)
            self.control_url = self._bind(self.pub, control_url, cfg.endpoints.control_port)
        except OSError:
            self.close()
            raise
        self.enc = P.Encoder()
        self.dec = P.Decoder(P.ToBuffer)

    def _bind(self, sock: zmq.Socket, url: str | None, port: int) -> str:
        if url is None:
            host = self.cfg.endpoints.host
            if port == 0:
                port = sock.bind_to_random_port(f"tcp://{host}")
                return f"tcp://{host}:{port}"
            url = f"tcp://{host}:{port}"
        try:
            sock.bind(url)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot bind {url}: {exc} (is another buffer running? pick other endpoints ports)") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self, stop_after_s: float | None = None) -> str:
        """Run until the core has finished (a Shutdown, then the final evaluation) or `stop_after_s` passed;
        returns the reason."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        end = time.monotonic() + stop_after_s if stop_after_s else None
        core = self.core
        while True:
            events = dict(poller.poll(int(TICK_S * 1000)))
            now = time.monotonic()
            if self.router in events:
                self._receive(now)
            try:
                self._send(core.tick(now))
            except Exception:  # noqa: BLE001 - the last guard: the serving loop outlives everything
                self._escaped(b"", "timer")
            if end is not None and now >= end and core.stop_reason is None:
                core.stop("time limit")
            if core.finished(now):
                break
        reason = core.stop_reason or "stopped"
        self._send([Out(None, P.Shutdown(reason))])
        self._final_reports(poller)
        return reason

    def _final_reports(self, poller: zmq.Poller) -> None:
        """Receive the producers' last results and final heartbeats (see the module docstring), then write the
        ledger."""
        end = time.monotonic() + FINAL_REPORTS_S
        while not self.core.reports_complete(time.monotonic()) and time.monotonic() < end:
            if self.router in dict(poller.poll(int(TICK_S * 1000))):
                self._receive(time.monotonic())
            try:
                self._send(self.core.tick(time.monotonic()))
            except Exception:  # noqa: BLE001 - the last guard
                self._escaped(b"", "timer")
        try:
            self.core.write_ledger(time.monotonic())
        except OSError as exc:
            log.error("could not write the ledger: %s", exc)

    def _receive(self, now: float) -> None:
        """Hand the messages waiting on the router to the core, DRAIN_LIMIT at most."""
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [self.router.recv(zmq.NOBLOCK, copy=False)]
            except zmq.Again:
                return
            # part by part: a message of a million tiny frames must not become a million Python objects
            while frames[-1].more and len(frames) < self.max_frames:
                frames.append(self.router.recv(copy=False))
            identity = bytes(frames[0].bytes)
            if frames[-1].more:
                while self.router.getsockopt(zmq.RCVMORE):
                    self.router.recv()
                self.core.malformed(identity, f"more than {self.max_frames} frames in one message")
                continue
            try:
                msg = self.dec.decode(frames[1:])
            except P.ProtocolError as exc:
                self.core.malformed(identity, str(exc))
                continue
            role, user = self.roles.of(frames[0])
            try:
                self._send(self.core.handle(identity, msg, now, Conn(role, user)))
            except Exception:  # noqa: BLE001 - the last guard: the serving loop outlives every message
                self._escaped(identity, type(msg).__name__)

    def _escaped(self, identity: bytes, kind: str) -> None:
        """What escaped the core's own guard (a reply that cannot be encoded...): counted and logged."""
        self.core.count("handler_errors")
        if log_now(self.core.counters["handler_errors"]):
            log.exception("dropped a %s from %r: it raised outside the core's guard", kind, identity[:80])

    def _send(self, outs: list[Out]) -> None:
        for out in outs:
            frames = self.enc.encode(out.msg)
            if out.to is None:
                self.pub.send_multipart(frames, copy=False)
                continue
            try:
                # NOBLOCK: a peer that stops reading (its queue full) must not freeze the loop for everyone else
                self.router.send_multipart([out.to, *frames], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY) or not reading
                self.core.count("unroutable")

    def close(self) -> None:
        self.router.close(linger=200)
        self.pub.close(linger=500)
        self.security.close()
        self.ctx.term()
