"""The buffer as a ZeroMQ service: the Scheduler (pure logic) behind a ROUTER socket and a PUB control channel.

One thread, one poll loop. Requests that cannot be answered yet are parked and answered as soon as they can be
(long polling): a WorkRequest when a round becomes available (or after `WORK_POLL_S` with nothing), a
BatchRequest when enough groups are released (or at its timeout with an empty Batch).

Invariants:
- a malformed message is counted, logged with its sender and dropped; it never stops the loop. Bad input is
  counted by kind: `malformed` (cannot be decoded: garbage, truncated, unknown kind, NaN reward, negative or
  mismatched arrays), `invalid` (decodes, but a value no client may send: negative counts or versions),
  `rejected_oov` (a result with a token id >= the model's vocab_size; its round is re-issued at once). A frame
  larger than buffer.max_message_bytes never reaches the loop: ZeroMQ drops the sender's connection (its client
  reconnects by itself, losing what it had queued), and nothing is counted here;
- every round handed out reaches the scheduler exactly once, or is re-issued after its lease or producer dies;
- the service adds held-out evaluation rounds (k samples of each eval problem at chosen learner versions) on top
  of the scheduler's training rounds; their round ids live above EVAL_ROUND_BASE and never touch the pools.

Snapshots and `--resume`: after every `snapshot_every`-th new learner version (VersionUpdate), the scheduler's
state plus the learner version, the latest weight announcement and the counters are written atomically (tmp +
fsync + rename) to run_dir/buffer/snapshot.msgpack. A buffer restarted with `--resume` continues from the last
snapshot. Exactly what can repeat or be lost since then:
- groups handed to the learner after the snapshot may be handed out again (at most `snapshot_every` batches, one
  with the default of 1: the learner takes one batch per version), or re-opened if they became stale;
- prompts admitted after the snapshot are admitted again, under the same prompt ids and from the same data
  position; samples received after it are gone (their prompts need those rounds again);
- rounds in flight at the snapshot, and every round issued after it, are issued again under new round ids;
  results for the old ids that arrive after the restart are ignored as late (`results_ignored.late`), never
  attributed to another prompt (round ids jump by RESUME_ROUND_ID_GAP on resume);
- counters and metrics continue from the snapshot's values; parked requests are lost (clients re-send them after
  their timeout); evaluations in progress are not resumed.
Nothing admitted before the snapshot is lost: admitted == released - reopened + dropped + active still holds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler
from pipeline.config import Config
from pipeline.transport import ServerSecurity, apply_heartbeats, check_bind

log = logging.getLogger("reinforce_ada.buffer")

WORK_POLL_S = 0.5  # an idle producer's WorkRequest is answered (empty) after this long
EVAL_ROUND_BASE = 1 << 48  # eval round ids live above this, training rounds below
TICK_S = 0.05
SNAPSHOT_FORMAT = 1
SNAPSHOT_EVERY = 1  # default: a snapshot after every new learner version (`reinforce-ada buffer --snapshot-every`)
# Round ids skipped on resume: the crashed buffer may have issued ids above the snapshot's counter, and a late
# result for one of them must never match a new round (of another prompt). 2**32 rounds between two snapshots
# is out of reach, and 65536 resumes still stay below EVAL_ROUND_BASE.
RESUME_ROUND_ID_GAP = 1 << 32
MAX_TRACKED_SENDERS = 1000  # per-sender rejection counts beyond this many senders go to "(other)"


def snapshot_path(cfg: Config):
    """Where the buffer of run `cfg` writes its snapshot."""
    return cfg.run_dir / "buffer" / "snapshot.msgpack"


class _ServiceSnapshot(msgspec.Struct):
    format: int
    scheduler: bytes  # Scheduler.snapshot()
    learner_version: int
    latest_weights: P.WeightAnnouncement | None
    counters: dict[str, int]
    eval_round_id: int
    time: float  # wall clock when written


def check_message(msg: Any) -> str:
    """Why a decoded message must not be acted on ("" if it may): values its types allow but no client sends,
    which the scheduler would reject with an exception (the loop must never see one from a client's input)."""
    if isinstance(msg, P.WorkRequest):
        if msg.max_rounds < 0 or msg.version < 0:
            return f"WorkRequest needs max_rounds >= 0 and version >= 0, got {msg.max_rounds} and {msg.version}"
    elif isinstance(msg, P.BatchRequest):
        if msg.num_groups < 1 or msg.learner_version < 0:
            return f"BatchRequest needs num_groups >= 1 and learner_version >= 0, got {msg.num_groups} and " \
                   f"{msg.learner_version}"
    elif isinstance(msg, P.VersionUpdate):
        if msg.version < 0:
            return f"VersionUpdate needs version >= 0, got {msg.version}"
    elif isinstance(msg, P.RoundResult):
        if msg.prompt_token_ids.size and int(msg.prompt_token_ids.min()) < 0:
            return "RoundResult.prompt_token_ids holds a negative token id"
    return ""


def out_of_vocab(msg: P.RoundResult, vocab_size: int) -> str:
    """Why `msg` holds a token id the model cannot embed ("" if it does not); the learner would crash on it."""
    ids = msg.prompt_token_ids
    if ids.size and int(ids.max()) >= vocab_size:
        return f"prompt token id {int(ids.max())} >= vocab_size {vocab_size}"
    for i, sample in enumerate(msg.samples):
        ids = sample.token_ids
        if ids.size and int(ids.max()) >= vocab_size:
            return f"sample {i} has token id {int(ids.max())} >= vocab_size {vocab_size}"
    return ""


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
                 router_url: str | None = None, control_url: str | None = None, *,
                 snapshot_every: int = SNAPSHOT_EVERY, resume: bool = False, vocab_size: int | None = None) -> None:
        if snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = never), got {snapshot_every}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None: no check), got {vocab_size}")
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
            apply_heartbeats(sock)
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.buffer.max_message_bytes)  # per frame; see the module docstring
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises instead of vanishing
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client with the same identity takes over
        try:
            self.router_url = self._bind(self.router, router_url, cfg.endpoints.router_port)
            self.control_url = self._bind(self.pub, control_url, cfg.endpoints.control_port)
        except OSError:
            self.close()
            raise
        self.enc = P.Encoder()
        self.dec = P.Decoder(P.ToBuffer)
        self.parked_work: dict[bytes, _Parked] = {}
        self.parked_batch: _Parked | None = None
        self.learner_version = 0
        self.latest_weights: P.WeightAnnouncement | None = None
        self.producer_stats: dict[str, dict[str, float]] = {}
        self.learner_stats: dict[str, float] = {}
        self.counters: dict[str, int] = {"malformed": 0, "invalid": 0, "rejected_oov": 0, "unroutable": 0,
                                         "eval_rounds": 0, "snapshots": 0, "snapshot_errors": 0, "resumes": 0}
        self.malformed_by_sender: dict[str, int] = {}
        self.rejected_by_sender: dict[str, int] = {}  # invalid and rejected_oov
        self.vocab_size = vocab_size
        self.snapshot_every = snapshot_every
        self.snapshot_path = snapshot_path(cfg)
        self.snapshot_info: dict[str, float] = {}
        self.snapshot_version = 0  # learner version of the last snapshot written or restored
        self.eval_runs: dict[int, _EvalRun] = {}
        self.eval_results: list[dict[str, float]] = []
        self.eval_round_id = EVAL_ROUND_BASE
        self.shutdown_reason = ""
        self._last_rate_counts = (0.0, 0.0)  # (positives, samples) received at the previous batch
        self.started = time.monotonic()
        run_dir = cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.eval_log = run_dir / "eval.jsonl"
        try:
            self.resumed = resume and self._resume(prompts)
        except ValueError:
            self.close()
            raise
        if cfg.learner.eval_every and eval_prompts and not self.resumed:
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
                self._drain(now)
            if now - last_expire >= TICK_S:
                last_expire = now
                self._expire(now)
            self._serve_parked(now)
            if end is not None and now >= end:
                self.shutdown_reason = "time limit"
        self._publish(P.Shutdown(self.shutdown_reason))
        return self.shutdown_reason

    def _drain(self, now: float, limit: int = 256) -> None:
        """Handle the messages waiting on the router, at most `limit` (a burst never starves the timers)."""
        for _ in range(limit):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames, now)

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
            self._count_bad("malformed", self.malformed_by_sender, sender, str(exc))
            return
        problem = check_message(msg)
        if problem:
            self._count_bad("invalid", self.rejected_by_sender, sender, problem)
            return
        handler = getattr(self, f"_on_{type(msg).__name__}")
        handler(identity, msg, now)

    def _count_bad(self, counter: str, by_sender: dict[str, int], sender: str, why: str) -> None:
        self.counters[counter] += 1
        key = sender if sender in by_sender or len(by_sender) < MAX_TRACKED_SENDERS else "(other)"
        by_sender[key] = by_sender.get(key, 0) + 1
        count = self.counters[counter]
        if count <= 20 or count % 1000 == 0:  # a flood of bad input must not flood the log
            log.warning("dropped %s message #%d from %s: %s", counter, count, sender, why)

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
        if self.vocab_size is not None:
            problem = out_of_vocab(msg, self.vocab_size)
            if problem:
                self._count_bad("rejected_oov", self.rejected_by_sender, identity.decode(errors="replace"), problem)
                # a result with the wrong number of samples is rejected by the scheduler, which re-issues its
                # round at once (and counts it in results_rejected); an unknown round is just ignored
                self.scheduler.submit_result(msg.producer_id, msg.round_id, msg.prompt_token_ids, [], now)
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
        # a learner re-sends its version after a timeout (the buffer may have restarted): that must not run an
        # evaluation twice or move the weights back
        new = msg.version > self.learner_version
        if msg.weights is not None and (self.latest_weights is None or
                                        msg.weights.version >= self.latest_weights.version):
            self.latest_weights = msg.weights
        self._set_version(msg.version, now)
        self._publish(msg)  # producers load the new weights from the announcement
        every = self.cfg.learner.eval_every
        if new and self.eval_prompts and every and (msg.version % every == 0
                                                     or msg.version == self.cfg.learner.num_steps):
            self._start_eval(msg.version)
        if self.snapshot_every and self.learner_version - self.snapshot_version >= self.snapshot_every:
            self.write_snapshot()

    def _on_MetricsRequest(self, identity: bytes, msg: P.MetricsRequest, now: float) -> None:
        self._send(identity, P.MetricsSnapshot(self.metrics()))

    def _on_Shutdown(self, identity: bytes, msg: P.Shutdown, now: float) -> None:
        log.info("shutdown requested by %s: %s", identity.decode(errors="replace"), msg.reason)
        self._finish_evals(timeout_s=self.cfg.buffer.lease_s)
        self.shutdown_reason = msg.reason

    # ------------------------------------------------------------ helpers

    def _send(self, identity: bytes, msg: Any) -> bool:
        try:
            # NOBLOCK: a peer that stops reading (its queue full) must not freeze the loop for everyone else
            self.router.send_multipart([identity, *self.enc.encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY) or not reading; its rounds expire with its leases
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

    # ------------------------------------------------------------ snapshots

    def write_snapshot(self) -> bool:
        """Write the state that `--resume` restores (see the module docstring) atomically; False if it failed."""
        t0 = time.perf_counter()
        snap = _ServiceSnapshot(SNAPSHOT_FORMAT, self.scheduler.snapshot(), self.learner_version,
                                self.latest_weights, dict(self.counters), self.eval_round_id, time.time())
        data = msgspec.msgpack.encode(snap)
        path = self.snapshot_path
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the rename must never expose a file whose bytes are not on disk yet
            os.replace(tmp, path)
        except OSError as exc:  # a full disk must not stop training; the previous snapshot stays valid
            self.counters["snapshot_errors"] += 1
            log.error("could not write the buffer snapshot %s: %s", path, exc)
            return False
        self.counters["snapshots"] += 1
        self.snapshot_version = self.learner_version
        self.snapshot_info = {"version": float(self.learner_version), "bytes": float(len(data)),
                              "seconds": time.perf_counter() - t0}
        return True

    def _resume(self, prompts: list[tuple[str, str]]) -> bool:
        """Restore the last snapshot; False (a fresh start) when there is none. Raises ValueError if unusable."""
        path = self.snapshot_path
        if not path.is_file():
            log.warning("--resume: no snapshot at %s, starting fresh", path)
            return False
        try:
            snap = msgspec.msgpack.decode(path.read_bytes(), type=_ServiceSnapshot)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path} is not a buffer snapshot (or a corrupt one): {exc}; move it away to start "
                             "fresh") from None
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"{path} has snapshot format {snap.format}, not {SNAPSHOT_FORMAT}; move it away to "
                             "start fresh")
        cfg = self.cfg
        try:
            self.scheduler = Scheduler.restore(snap.scheduler, cfg.sampling, cfg.buffer, cfg.learner.batch_prompts,
                                               prompts, round_id_offset=RESUME_ROUND_ID_GAP)
        except ValueError as exc:
            raise ValueError(f"cannot resume from {path}: {exc}") from None
        self.eval_round_id = snap.eval_round_id + RESUME_ROUND_ID_GAP
        self.learner_version = snap.learner_version
        self.latest_weights = snap.latest_weights
        self.counters.update({k: v for k, v in snap.counters.items() if k in self.counters})
        self.counters["resumes"] += 1
        self.snapshot_version = snap.learner_version
        log.info("resumed from %s: learner version %d, %d prompts active, %d groups waiting (written %.0f s ago)",
                 path, snap.learner_version, self.scheduler.metrics()["active"], self.scheduler.groups_waiting,
                 time.time() - snap.time)
        return True

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
                self._drain(time.monotonic())
            now = time.monotonic()
            self._expire(now)
            for parked in list(self.parked_work.values()):
                self._try_work(parked, now)

    # ------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = dict(self.scheduler.metrics())
        m.update({f"buffer/{k}": v for k, v in self.counters.items()})
        m["malformed_by_sender"] = dict(self.malformed_by_sender)
        m["rejected_by_sender"] = dict(self.rejected_by_sender)
        m["snapshot"] = dict(self.snapshot_info)
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
        # the pass rate of the samples generated since the previous batch: the cumulative rate hides progress
        pos, num = flat["buffer/positives_received"], flat["buffer/samples_received"]
        last_pos, last_num = self._last_rate_counts
        flat["buffer/positive_rate_step"] = (pos - last_pos) / (num - last_num) if num > last_num else 0.0
        self._last_rate_counts = (pos, num)
        for key, value in self.counters.items():
            flat[f"buffer/{key}"] = float(value)
        if self.eval_results:
            last = self.eval_results[-1]
            flat["eval/accuracy"] = last["accuracy"]
            flat["eval/version"] = float(last["version"])
        tps = [s.get("tokens_per_s", 0.0) for s in self.producer_stats.values()]
        flat["producers/tokens_per_s"] = float(sum(tps))
        busy = [s.get("busy_fraction", 0.0) for s in self.producer_stats.values()]
        flat["producers/busy"] = float(sum(busy) / len(busy)) if busy else 0.0
        return flat

