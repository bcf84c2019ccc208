"""The buffer as a ZeroMQ service: the Scheduler (pure logic) behind a ROUTER socket and a PUB control channel.

One thread, one poll loop. Requests that cannot be answered yet are parked and answered as soon as they can be
(long polling): a WorkRequest when a round becomes available (or after `WORK_POLL_S` with nothing), a
BatchRequest when enough groups are released (or at its timeout with an empty Batch).

Invariants:
- a malformed message is counted, logged with its sender and dropped; it never stops the loop;
- every round handed out reaches the scheduler exactly once, or is re-issued after its lease or producer dies;
- the service adds held-out evaluation rounds (k samples of each eval problem at chosen learner versions) on top
  of the scheduler's training rounds; their round ids live above EVAL_ROUND_BASE and never touch the pools.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler
from pipeline.config import Config
from pipeline.transport import ServerSecurity, check_bind

log = logging.getLogger("reinforce_ada.buffer")

WORK_POLL_S = 0.5  # an idle producer's WorkRequest is answered (empty) after this long
EVAL_ROUND_BASE = 1 << 48  # eval round ids live above this, training rounds below
TICK_S = 0.05


@dataclass
class _Parked:
    identity: bytes
    msg: Any
    deadline: float


@dataclass
class _EvalRun:
    version: int
    pending: dict[int, tuple[int, str, str]]  # round id -> (problem index, prompt, answer)
    total: int
    rewards: list[float] = field(default_factory=list)
    out: deque = field(default_factory=deque)  # rounds not yet handed out
    issued: dict[int, float] = field(default_factory=dict)  # round id -> lease deadline
    started: float = 0.0


class BufferService:
    """Serves producers and the learner; see the module docstring."""

    def __init__(self, cfg: Config, prompts: list[tuple[str, str]], eval_prompts: list[tuple[str, str]],
                 router_url: str | None = None, control_url: str | None = None) -> None:
        self.cfg = cfg
        self.scheduler = Scheduler(cfg.sampling, cfg.buffer, cfg.learner.batch_prompts, prompts, cfg.run.seed)
        self.eval_prompts = eval_prompts
        self.ctx = zmq.Context()
        check_bind(cfg.endpoints.host, cfg.endpoints.keys_dir)
        self.security = ServerSecurity(self.ctx, cfg.endpoints.keys_dir)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        for sock in (self.router, self.pub):
            self.security.apply(sock)
            sock.setsockopt(zmq.LINGER, 500)
        self.router.setsockopt(zmq.MAXMSGSIZE, cfg.buffer.max_message_bytes)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises instead of vanishing
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client with the same identity takes over
        self.router_url = self._bind(self.router, router_url, cfg.endpoints.router_port)
        self.control_url = self._bind(self.pub, control_url, cfg.endpoints.control_port)
        self.enc = P.Encoder()
        self.dec = P.Decoder(P.ToBuffer)
        self.parked_work: dict[bytes, _Parked] = {}
        self.parked_batch: _Parked | None = None
        self.learner_version = 0
        self.latest_weights: P.WeightAnnouncement | None = None
        self.producer_stats: dict[str, dict[str, float]] = {}
        self.learner_stats: dict[str, float] = {}
        self.counters: dict[str, int] = {"malformed": 0, "unroutable": 0, "eval_rounds": 0}
        self.malformed_by_sender: dict[str, int] = {}
        self.eval_runs: dict[int, _EvalRun] = {}
        self.eval_results: list[dict[str, float]] = []
        self.eval_round_id = EVAL_ROUND_BASE
        self.shutdown_reason = ""
        self.started = time.monotonic()
        run_dir = cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.eval_log = run_dir / "eval.jsonl"
        if cfg.learner.eval_every and eval_prompts:
            self._start_eval(0)

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

    # ------------------------------------------------------------ main loop

    def serve(self, stop_after_s: float | None = None) -> str:
        """Run until a Shutdown arrives (or `stop_after_s`); returns the shutdown reason."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        end = time.monotonic() + stop_after_s if stop_after_s else None
        last_expire = 0.0
        while not self.shutdown_reason:
            events = dict(poller.poll(int(TICK_S * 1000)))
            now = time.monotonic()
            if self.router in events:
                for _ in range(256):  # drain a burst, but keep the timers below running
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, now)
            if now - last_expire >= TICK_S:
                last_expire = now
                self._expire(now)
            self._serve_parked(now)
            if end is not None and now >= end:
                self.shutdown_reason = "time limit"
        self._publish(P.Shutdown(self.shutdown_reason))
        return self.shutdown_reason

    def close(self) -> None:
        self.router.close(linger=200)
        self.pub.close(linger=500)
        self.security.close()
        self.ctx.term()

    # ------------------------------------------------------------ messages

    def _handle(self, frames: list, now: float) -> None:
        identity = bytes(frames[0].bytes) if frames else b""
        sender = identity.decode(errors="replace") or "?"
        try:
            msg = self.dec.decode(frames[1:])
        except P.ProtocolError as exc:
            self.counters["malformed"] += 1
            self.malformed_by_sender[sender] = self.malformed_by_sender.get(sender, 0) + 1
            if self.counters["malformed"] <= 20 or self.counters["malformed"] % 1000 == 0:
                log.warning("dropped malformed message #%d from %s: %s", self.counters["malformed"], sender, exc)
            return
        handler = getattr(self, f"_on_{type(msg).__name__}")
        handler(identity, msg, now)

    def _on_WorkRequest(self, identity: bytes, msg: P.WorkRequest, now: float) -> None:
        self.scheduler.heartbeat(msg.producer_id, now)
        self.producer_stats.setdefault(msg.producer_id, {})["version"] = msg.version
        self.parked_work[identity] = _Parked(identity, msg, now + WORK_POLL_S)
        self._try_work(self.parked_work[identity], now)

    def _on_RoundResult(self, identity: bytes, msg: P.RoundResult, now: float) -> None:
        self.scheduler.heartbeat(msg.producer_id, now)
        if msg.round_id >= EVAL_ROUND_BASE:
            self._eval_result(msg)
            return
        self.scheduler.submit_result(msg.producer_id, msg.round_id, msg.prompt_token_ids, msg.samples, now)

    def _on_Heartbeat(self, identity: bytes, msg: P.Heartbeat, now: float) -> None:
        if msg.role == "producer":
            self.scheduler.heartbeat(msg.sender_id, now)
            stats = dict(msg.stats)
            stats["version"] = msg.version
            stats["seen"] = time.time()
            self.producer_stats[msg.sender_id] = stats
        else:
            self.learner_stats = dict(msg.stats)

    def _on_BatchRequest(self, identity: bytes, msg: P.BatchRequest, now: float) -> None:
        self._set_version(msg.learner_version, now)
        self.parked_batch = _Parked(identity, msg, now + msg.timeout_ms / 1000)

    def _on_VersionUpdate(self, identity: bytes, msg: P.VersionUpdate, now: float) -> None:
        if msg.weights is not None:
            self.latest_weights = msg.weights
        self._set_version(msg.version, now)
        self._publish(msg)  # producers load the new weights from the announcement
        every = self.cfg.learner.eval_every
        if self.eval_prompts and every and (msg.version % every == 0 or msg.version == self.cfg.learner.num_steps):
            self._start_eval(msg.version)

    def _on_MetricsRequest(self, identity: bytes, msg: P.MetricsRequest, now: float) -> None:
        self._send(identity, P.MetricsSnapshot(self.metrics()))

    def _on_Shutdown(self, identity: bytes, msg: P.Shutdown, now: float) -> None:
        log.info("shutdown requested by %s: %s", identity.decode(errors="replace"), msg.reason)
        self._finish_evals(timeout_s=self.cfg.buffer.lease_s)
        self.shutdown_reason = msg.reason

    # ------------------------------------------------------------ helpers

    def _send(self, identity: bytes, msg: Any) -> bool:
        try:
            self.router.send_multipart([identity, *self.enc.encode(msg)], copy=False)
            return True
        except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY); its rounds expire with its heartbeats
            self.counters["unroutable"] += 1
            return False

    def _publish(self, msg: Any) -> None:
        self.pub.send_multipart(self.enc.encode(msg), copy=False)

    def _set_version(self, version: int, now: float) -> None:
        if version <= self.learner_version and version != 0:
            return
        self.learner_version = max(self.learner_version, version)
        aborted = self.scheduler.set_learner_version(self.learner_version, now)
        if aborted:
            self._publish(P.Abort(list(aborted), "samples would be stale"))

    def _expire(self, now: float) -> None:
        reissued = self.scheduler.expire(now)
        if reissued:
            self._publish(P.Abort(list(reissued), "lease expired"))
        for run in self.eval_runs.values():
            for rid, deadline in list(run.issued.items()):
                if now > deadline:  # lost eval round: hand it out again under a new id
                    del run.issued[rid]
                    run.out.append(self._new_eval_round(run, run.pending.pop(rid)))

    def _producer_current(self, msg: P.WorkRequest) -> bool:
        """A producer whose weights are too old would only generate samples that are evicted on arrival."""
        return self.learner_version - msg.version <= self.cfg.buffer.max_staleness

    def _try_work(self, parked: _Parked, now: float) -> bool:
        msg: P.WorkRequest = parked.msg
        rounds: list[P.RoundAssignment] = []
        if self._producer_current(msg):
            rounds = self._eval_rounds(msg.max_rounds, now)
            if len(rounds) < msg.max_rounds:
                rounds += self.scheduler.request_work(msg.producer_id, msg.max_rounds - len(rounds), now)
        stale_weights = self.latest_weights if (self.latest_weights and msg.version < self.latest_weights.version) \
            else None
        if not rounds and stale_weights is None and now < parked.deadline:
            return False
        self.parked_work.pop(parked.identity, None)
        self._send(parked.identity, P.Assignments(rounds, self.learner_version, stale_weights))
        return True

    def _serve_parked(self, now: float) -> None:
        for parked in list(self.parked_work.values()):
            self._try_work(parked, now)
        parked = self.parked_batch
        if parked is None:
            return
        req: P.BatchRequest = parked.msg
        groups = self.scheduler.take_batch(req.learner_version, req.num_groups)
        if groups is None and now < parked.deadline:
            return
        self.parked_batch = None
        self._send(parked.identity, P.Batch(req.learner_version, groups or [], self._batch_metrics()))

    # ------------------------------------------------------------ evaluation rounds

    def _new_eval_round(self, run: _EvalRun, item: tuple[int, str, str]) -> P.RoundAssignment:
        self.eval_round_id += 1
        run.pending[self.eval_round_id] = item
        _, prompt, answer = item
        return P.RoundAssignment(self.eval_round_id, -1 - item[0], prompt, answer, self.cfg.eval.k,
                                 self.cfg.buffer.lease_s)

    def _start_eval(self, version: int) -> None:
        if version in self.eval_runs:
            return
        run = _EvalRun(version, {}, len(self.eval_prompts), started=time.monotonic())
        for i, (prompt, answer) in enumerate(self.eval_prompts):
            run.out.append(self._new_eval_round(run, (i, prompt, answer)))
        self.eval_runs[version] = run

    def _eval_rounds(self, limit: int, now: float) -> list[P.RoundAssignment]:
        out = []
        for run in self.eval_runs.values():
            while run.out and len(out) < limit:
                rnd = run.out.popleft()
                run.issued[rnd.round_id] = now + rnd.lease_s
                out.append(rnd)
        self.counters["eval_rounds"] += len(out)
        return out

    def _eval_result(self, msg: P.RoundResult) -> None:
        for run in self.eval_runs.values():
            if msg.round_id in run.issued:
                del run.issued[msg.round_id]
                run.pending.pop(msg.round_id)
                run.rewards.extend(
                    float(s.reward > self.cfg.sampling.positive_threshold) for s in msg.samples)
                if not run.pending and not run.out:
                    self._close_eval(run)
                return

    def _close_eval(self, run: _EvalRun) -> None:
        del self.eval_runs[run.version]
        acc = sum(run.rewards) / max(1, len(run.rewards))
        row = {"version": run.version, "accuracy": acc, "k": self.cfg.eval.k, "problems": run.total,
               "seconds": time.monotonic() - run.started, "time": time.time()}
        self.eval_results.append(row)
        with open(self.eval_log, "a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("eval at version %d: Ave@%d = %.3f over %d problems", run.version, self.cfg.eval.k, acc, run.total)

    def _finish_evals(self, timeout_s: float) -> None:
        """Let outstanding evaluations (the final one above all) complete before shutting down."""
        end = time.monotonic() + timeout_s
        while self.eval_runs and time.monotonic() < end:
            if self.router.poll(int(TICK_S * 1000)):
                while True:
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, time.monotonic())
            now = time.monotonic()
            self._expire(now)
            for parked in list(self.parked_work.values()):
                self._try_work(parked, now)

    # ------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = dict(self.scheduler.metrics())
        m.update({f"buffer/{k}": v for k, v in self.counters.items()})
        m["malformed_by_sender"] = dict(self.malformed_by_sender)
        m["learner_version"] = self.learner_version
        m["producers"] = self.producer_stats
        m["learner"] = self.learner_stats
        m["eval"] = self.eval_results[-1] if self.eval_results else {}
        m["uptime_s"] = time.monotonic() - self.started
        return m

    def _batch_metrics(self) -> dict[str, float]:
        """Flat numeric metrics for the learner's per-step log line and metrics.jsonl."""
        flat: dict[str, float] = {}
        for key, value in self.scheduler.metrics().items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"buffer/{key}"] = float(value)
        for key, value in self.counters.items():
            flat[f"buffer/{key}"] = float(value)
        if self.eval_results:
            last = self.eval_results[-1]
            flat["eval/accuracy"] = last["accuracy"]
            flat["eval/version"] = float(last["version"])
        tps = [s.get("tokens_per_s", 0.0) for s in self.producer_stats.values()]
        flat["producers/tokens_per_s"] = float(sum(tps))
        busy = [s.get("busy", 0.0) for s in self.producer_stats.values()]
        flat["producers/busy"] = float(sum(busy) / len(busy)) if busy else 0.0
        return flat

