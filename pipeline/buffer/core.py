"""The buffer without sockets: every message in, every message out, on the caller's clock.

`BufferCore.handle(sender, msg, now)` takes one decoded message from the peer whose ZeroMQ identity is `sender`
and returns what to send (`Out`: a reply to one peer, or a broadcast on the control channel); `tick(now)` runs
the timers (expiry, parked requests, progress). `service.py` is only the socket glue around it, and tests drive
the core directly. It holds the Scheduler (training rounds), Evals (evaluation rounds), parked requests, the
counters, snapshots and eval.jsonl.

Parking (long polling): a WorkRequest that cannot be served yet waits until a round is available or WORK_POLL_S
passes (then it is answered empty); a BatchRequest until enough groups are released or its timeout passes.

Sharing producers: while training rounds are available, evaluation rounds take at most half of a work request
(an odd request's extra slot alternates), so an evaluation of hundreds of problems never holds every producer
while the learner waits; they take whatever training cannot use.

Draining: a Shutdown stops the handing out of training rounds and lets the evaluations already started (the final
one above all) finish, for at most buffer.lease_s; `finished(now)` then says to stop.

Invariants:
- every message goes through `handle`, one dispatch (a `match` on its type), with its sender's identity;
- a malformed or invalid message is counted (per sender), logged and dropped: it never reaches a handler;
- every round handed out reaches the Scheduler or Evals exactly once, or is re-issued after its lease or its
  producer dies (and an Abort names it);
- eval.jsonl gets one row per evaluation, in version order.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline import protocol as P
from pipeline.buffer import metrics as M
from pipeline.buffer.checks import check_message, out_of_vocab
from pipeline.buffer.evals import Evals
from pipeline.buffer.progress import ProgressLog, progress
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.snapshot import (
    RESUME_ROUND_ID_GAP,
    SNAPSHOT_EVERY,
    SNAPSHOT_FORMAT,
    BufferSnapshot,
    read_snapshot,
    snapshot_path,
    write_snapshot,
)
from pipeline.config import Config
from pipeline.prompts import Prompt

log = logging.getLogger(__name__)

WORK_POLL_S = 0.5  # an idle producer's WorkRequest is answered (empty) after this long
EXPIRE_EVERY_S = 0.05  # leases are checked this often
MAX_TRACKED_SENDERS = 1000  # per-sender rejection counts beyond this many senders go to "(other)"


@dataclass(frozen=True, slots=True)
class Out:
    """A message to send: to the peer with ZeroMQ identity `to`, or on the control channel when `to` is None."""

    to: bytes | None
    msg: Any


@dataclass
class _Parked:
    identity: bytes
    msg: Any
    deadline: float


class BufferCore:
    """The buffer's state and message handling; see the module docstring."""

    def __init__(self, cfg: Config, prompts: Sequence[tuple[str, str]], eval_prompts: Sequence[Prompt], *,
                 now: float, snapshot_every: int = SNAPSHOT_EVERY, resume: bool = False,
                 vocab_size: int | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        if snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = never), got {snapshot_every}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None: no check), got {vocab_size}")
        self.cfg, self.vocab_size, self.snapshot_every, self.wall_clock = cfg, vocab_size, snapshot_every, wall_clock
        self.scheduler = Scheduler(cfg.sampling, cfg.buffer, cfg.learner.batch_prompts, prompts, cfg.run.seed)
        self.counters = dict.fromkeys(M.COUNTERS, 0)
        self.bad_senders: dict[str, dict[str, int]] = {"malformed_by_sender": {}, "rejected_by_sender": {}}
        self.latest_weights: P.WeightAnnouncement | None = None
        self.producer_stats: dict[str, dict[str, float]] = {}
        self.learner_stats: dict[str, float] = {}
        self.samples_by_producer: dict[str, int] = {}
        self.parked_work: dict[bytes, _Parked] = {}
        self.parked_batch: _Parked | None = None
        self.snapshot_path = snapshot_path(cfg)
        self.snapshot_info: dict[str, float] = {}
        self.snapshot_version = 0  # learner version of the last snapshot written or restored
        self.last_eval: dict[str, Any] | None = None
        self.eval_log = cfg.run_dir / "eval.jsonl"
        self.eval_log.parent.mkdir(parents=True, exist_ok=True)
        self.stop_reason: str | None = None  # set by a Shutdown (then draining) or `stop`
        self.started = now
        self._drain_until = 0.0
        self._eval_turn = 0  # which of evaluation and training gets an odd request's extra slot
        self._last_batch_counts = (0.0, 0.0)  # (positives, samples) received at the previous Batch
        self._last_expire = now
        self._outbox: list[Out] = []
        self.progress_log = ProgressLog(now)
        self.resumed = resume and self._resume(prompts)
        # after a resume: the evaluation rounds share the restored scheduler's round id allocator
        self.evals = Evals(eval_prompts, cfg.eval.k, cfg.buffer.lease_s, cfg.eval.max_new_tokens,
                           cfg.sampling.positive_threshold, self.scheduler.round_ids)
        if cfg.learner.eval_every and not self.resumed:
            self.evals.start(0, now)

    @property
    def learner_version(self) -> int:
        return self.scheduler.learner_version

    # ------------------------------------------------------------ the one dispatch

    def handle(self, sender: bytes, msg: Any, now: float) -> list[Out]:
        """Act on one decoded message from the peer `sender`; returns what to send."""
        problem = check_message(msg)
        if problem:
            self._count_bad("invalid", sender, problem, "rejected_by_sender")
            return self._flush()
        match msg:
            case P.WorkRequest():
                self._on_work(sender, msg, now)
            case P.RoundResult():
                self._on_result(sender, msg, now)
            case P.Heartbeat():
                self._on_heartbeat(sender, msg, now)
            case P.BatchRequest():
                self._on_batch_request(sender, msg, now)
            case P.VersionUpdate():
                self._on_version(sender, msg, now)
            case P.MetricsRequest():
                self._outbox.append(Out(sender, P.MetricsSnapshot(self.metrics(now))))
            case P.Shutdown():
                self._on_shutdown(sender, msg, now)
            case _:
                raise TypeError(f"the buffer has no handler for {type(msg).__name__}")
        return self._flush()

    def malformed(self, sender: bytes, why: str) -> None:
        """A message from `sender` that could not be decoded (the socket side found out)."""
        self._count_bad("malformed", sender, why, "malformed_by_sender")

    def tick(self, now: float) -> list[Out]:
        """The timers: lost rounds re-issued, parked requests answered, the progress line logged."""
        if now - self._last_expire >= EXPIRE_EVERY_S:
            self._last_expire = now
            lost = self.scheduler.expire(now)
            lost += self.evals.expire(now, lambda producer: self.scheduler.is_silent(producer, now))
            if lost:
                self._outbox.append(Out(None, P.Abort(lost, "lease expired")))
        for parked in list(self.parked_work.values()):
            self._serve_work(parked, now)
        self._serve_batch(now)
        if self.progress_log.due(now):
            m = self.scheduler.metrics()
            self.progress_log.report(now, m, progress(m, self.producer_stats, self.samples_by_producer))
        return self._flush()

    def stop(self, reason: str) -> None:
        """Stop at once, without draining (e.g. a time limit)."""
        self.stop_reason = reason
        self._drain_until = -float("inf")

    def finished(self, now: float) -> bool:
        """Whether the buffer should stop: stopped, and no evaluation left to wait for (or waited long enough)."""
        return self.stop_reason is not None and (self.evals.outstanding == 0 or now >= self._drain_until)

    def count(self, counter: str) -> None:
        """Count an event the socket side saw (e.g. an unroutable reply)."""
        self.counters[counter] += 1

    # ------------------------------------------------------------ handlers

    def _on_work(self, sender: bytes, msg: P.WorkRequest, now: float) -> None:
        self.scheduler.heartbeat(msg.producer_id, now)
        self.producer_stats.setdefault(msg.producer_id, {})["version"] = msg.version
        self.parked_work[sender] = parked = _Parked(sender, msg, now + WORK_POLL_S)
        self._serve_work(parked, now)

    def _on_result(self, sender: bytes, msg: P.RoundResult, now: float) -> None:
        self.scheduler.heartbeat(msg.producer_id, now)
        if msg.kind == "eval" or self.evals.owns(msg.round_id):
            if msg.kind != "eval":  # still scored: an older producer's results are not lost
                self.counters["results_wrong_kind"] += 1
                if self.counters["results_wrong_kind"] == 1:
                    log.warning("%s sent eval round %d back as kind %r (scored all the same): the producer must "
                                "echo RoundAssignment.kind in RoundResult.kind; update it", msg.producer_id,
                                msg.round_id, msg.kind)
            if self.evals.submit(msg.round_id, msg.samples, now) == "accepted":
                self._count_samples(msg)
            self._write_eval_rows()
            return
        if self.vocab_size is not None:
            problem = out_of_vocab(msg, self.vocab_size)
            if problem:
                self._count_bad("rejected_oov", sender, problem, "rejected_by_sender")
                self.scheduler.reject(msg.producer_id, msg.round_id, now)  # re-issued at once
                return
        outcome = self.scheduler.submit_result(msg.producer_id, msg.round_id, msg.prompt_token_ids, msg.samples, now)
        if outcome.accepted:
            self._count_samples(msg)

    def _on_heartbeat(self, sender: bytes, msg: P.Heartbeat, now: float) -> None:
        if msg.role == "producer":
            self.scheduler.heartbeat(msg.sender_id, now)
            self.producer_stats[msg.sender_id] = {**msg.stats, "version": msg.version, "seen": self.wall_clock()}
        else:
            self.learner_stats = dict(msg.stats)

    def _on_batch_request(self, sender: bytes, msg: P.BatchRequest, now: float) -> None:
        self._set_version(msg.learner_version, now)
        self.parked_batch = _Parked(sender, msg, now + msg.timeout_ms / 1000)
        self._serve_batch(now)

    def _on_version(self, sender: bytes, msg: P.VersionUpdate, now: float) -> None:
        # a learner re-sends its version after a timeout (the buffer may have restarted): that must not run an
        # evaluation twice or move the weights back
        new = msg.version > self.learner_version
        if msg.weights is not None and (self.latest_weights is None or
                                        msg.weights.version >= self.latest_weights.version):
            self.latest_weights = msg.weights
        self._set_version(msg.version, now)
        self._outbox.append(Out(None, msg))  # producers load the new weights from the announcement
        every = self.cfg.learner.eval_every
        if new and every and (msg.version % every == 0 or msg.version == self.cfg.learner.num_steps):
            self.evals.start(msg.version, now)
        if self.snapshot_every and self.learner_version - self.snapshot_version >= self.snapshot_every:
            self.write_snapshot()

    def _on_shutdown(self, sender: bytes, msg: P.Shutdown, now: float) -> None:
        log.info("shutdown requested by %s: %s%s", sender.decode(errors="replace"), msg.reason,
                 f"; waiting up to {self.cfg.buffer.lease_s:g} s for {self.evals.outstanding} evaluation(s)"
                 if self.evals.outstanding else "")
        if self.stop_reason is None:
            self.stop_reason = msg.reason
            self._drain_until = now + self.cfg.buffer.lease_s

    # ------------------------------------------------------------ helpers

    def _flush(self) -> list[Out]:
        out, self._outbox = self._outbox, []
        return out

    def _count_bad(self, counter: str, sender: bytes, why: str, by_sender: str) -> None:
        self.counters[counter] += 1
        name = sender.decode(errors="replace") or "?"
        table = self.bad_senders[by_sender]
        key = name if name in table or len(table) < MAX_TRACKED_SENDERS else "(other)"
        table[key] = table.get(key, 0) + 1
        count = self.counters[counter]
        if count <= 20 or count % 1000 == 0:  # a flood of bad input must not flood the log
            log.warning("dropped %s message #%d from %s: %s", counter, count, name, why)

    def _count_samples(self, msg: P.RoundResult) -> None:
        by = self.samples_by_producer
        if msg.producer_id in by or len(by) < MAX_TRACKED_SENDERS:
            by[msg.producer_id] = by.get(msg.producer_id, 0) + len(msg.samples)

    def _set_version(self, version: int, now: float) -> None:
        aborted = self.scheduler.set_learner_version(version, now)
        if aborted:
            self._outbox.append(Out(None, P.Abort(aborted, "samples would be stale")))

    def _pick_rounds(self, producer_id: str, wanted: int, now: float) -> list[P.RoundAssignment]:
        """Eval rounds take at most half of `wanted` while training has rounds, and what training cannot use."""
        if self.stop_reason is not None:  # draining: the learner is done, only evaluations are left
            rounds = self.evals.take(wanted, producer_id, now)
        else:
            share = 0
            if self.evals.available:
                share = (wanted + self._eval_turn) // 2
                self._eval_turn ^= wanted % 2
            rounds = self.evals.take(share, producer_id, now)
            rounds += self.scheduler.request_work(producer_id, wanted - len(rounds), now)
            rounds += self.evals.take(wanted - len(rounds), producer_id, now)
        self.counters["eval_rounds"] += sum(r.kind == "eval" for r in rounds)
        return rounds

    def _serve_work(self, parked: _Parked, now: float) -> None:
        msg: P.WorkRequest = parked.msg
        rounds: list[P.RoundAssignment] = []
        # a producer whose weights are too old would only generate samples that are evicted on arrival
        if self.learner_version - msg.version <= self.cfg.buffer.max_staleness:
            rounds = self._pick_rounds(msg.producer_id, msg.max_rounds, now)
        latest = self.latest_weights
        stale_weights = latest if latest is not None and msg.version < latest.version else None
        if not rounds and stale_weights is None and now < parked.deadline:
            return
        del self.parked_work[parked.identity]
        self._outbox.append(Out(parked.identity, P.Assignments(rounds, self.learner_version, stale_weights)))

    def _serve_batch(self, now: float) -> None:
        parked = self.parked_batch
        if parked is None:
            return
        req: P.BatchRequest = parked.msg
        groups = self.scheduler.take_batch(req.learner_version, req.num_groups, now)
        if groups is None and now < parked.deadline:
            return
        self.parked_batch = None
        m = self.scheduler.metrics()
        flat = M.batch_metrics(m, self.counters, self.producer_stats, self.last_eval, self._last_batch_counts)
        self._last_batch_counts = M.positive_counts(m)
        self._outbox.append(Out(parked.identity, P.Batch(req.learner_version, groups or [], flat)))

    def _write_eval_rows(self) -> None:
        for row in self.evals.pop_rows():
            row["time"] = self.wall_clock()
            with open(self.eval_log, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.last_eval = row
            per = ", ".join(f"{name} {b['ave_at_k']:.3f}" for name, b in row["benchmarks"].items())
            log.info("eval at version %d: Ave@%d = %.3f, pass@%d = %.3f over %d problems (%s)", row["version"],
                     row["k"], row["accuracy"], row["k"], row["pass_at_k"], row["problems"], per)

    # ------------------------------------------------------------ observation and snapshots

    def metrics(self, now: float) -> dict[str, Any]:
        """The MetricsSnapshot's content (see metrics.py)."""
        m = self.scheduler.metrics()
        return M.snapshot_metrics(
            m, self.counters, bad_senders=self.bad_senders, snapshot=self.snapshot_info,
            producers=self.producer_stats, learner=self.learner_stats, last_eval=self.last_eval,
            evals_running=self.evals.in_progress(), eval_counts=self.evals.counts,
            progress=progress(m, self.producer_stats, self.samples_by_producer),
            uptime_s=now - self.started, draining=self.stop_reason is not None)

    def write_snapshot(self) -> bool:
        """Write the state that `--resume` restores (see snapshot.py) atomically; False if it failed."""
        t0 = time.perf_counter()
        snap = BufferSnapshot(SNAPSHOT_FORMAT, self.scheduler.snapshot(), self.learner_version, self.latest_weights,
                              dict(self.counters), self.wall_clock())
        try:
            size = write_snapshot(self.snapshot_path, snap)
        except OSError as exc:  # a full disk must not stop training; the previous snapshot stays valid
            self.counters["snapshot_errors"] += 1
            log.error("could not write the buffer snapshot %s: %s", self.snapshot_path, exc)
            return False
        self.counters["snapshots"] += 1
        self.snapshot_version = self.learner_version
        self.snapshot_info = {"version": float(self.learner_version), "bytes": float(size),
                              "seconds": time.perf_counter() - t0}
        return True

    def _resume(self, prompts: Sequence[tuple[str, str]]) -> bool:
        """Restore the last snapshot; False (a fresh start) when there is none. Raises ValueError if unusable."""
        path = self.snapshot_path
        snap = read_snapshot(path)
        if snap is None:
            log.warning("--resume: no snapshot at %s, starting fresh", path)
            return False
        cfg = self.cfg
        try:
            self.scheduler = Scheduler.restore(snap.scheduler, cfg.sampling, cfg.buffer, cfg.learner.batch_prompts,
                                               prompts, round_id_offset=RESUME_ROUND_ID_GAP)
        except ValueError as exc:
            raise ValueError(f"cannot resume from {path}: {exc}") from None
        self.latest_weights = snap.latest_weights
        self.counters.update({k: v for k, v in snap.counters.items() if k in self.counters})
        self.counters["resumes"] += 1
        self.snapshot_version = self.learner_version
        log.info("resumed from %s: learner version %d, %d prompts active, %d groups waiting (written %.0f s ago)",
                 path, self.learner_version, self.scheduler.metrics()["active"], self.scheduler.groups_waiting,
                 self.wall_clock() - snap.time)
        return True
