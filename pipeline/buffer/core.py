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
one above all) finish, for at most buffer.lease_s; `finished(now)` then says to stop. The service then publishes
the Shutdown, waits (`reports_complete`) for every producer still heard from to send what it holds and its final
heartbeat, and writes the ledger of every generated sample and token by fate (`write_ledger`, ledger.py).

Trust: each message comes with its sender's identity and connection (`Conn`: role, ZAP User-Id), learned from the
connection, never from the message; a producer is named by its connection (peers.py). Learner-only messages from
other roles are refused, and a result counts only from the holder of its round's lease and once its values pass
the edge checks (intake.py, checks.py).

Invariants:
- every message goes through `handle`, one dispatch (a `match` on its type), with its sender's identity, under
  one guard: a handler that raises is counted (`handler_errors`), logged with the sender, the message kind and
  the state needed to debug it, and the message is dropped; nothing a message does stops the buffer;
- a malformed, invalid or refused message is counted (per sender), logged and dropped: it never reaches a handler;
- every round handed out reaches the Scheduler or Evals exactly once, from its lease holder and with values the
  edge accepted, or is re-issued after its lease, its producer's death or a rejection (and an Abort names it);
- eval.jsonl gets one row per evaluation, in version order.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import msgspec

from pipeline import protocol as P
from pipeline.auth import LEARNER
from pipeline.buffer import ledger as L
from pipeline.buffer import metrics as M
from pipeline.buffer.checks import Limits, check_message, role_problem, weights_problem
from pipeline.buffer.evals import Evals
from pipeline.buffer.incidents import Incidents
from pipeline.buffer.intake import Intake
from pipeline.buffer.leases import Lease, Leases
from pipeline.buffer.peers import IN_PROCESS, Conn, Peers, peer_name
from pipeline.buffer.progress import ProgressLog, hopeless, progress
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.snapshot import SNAPSHOT_EVERY, Snapshots
from pipeline.buffer.state import PromptRow
from pipeline.config import Config
from pipeline.prompts import Prompt

log = logging.getLogger(__name__)

WORK_POLL_S = 0.5  # an idle producer's WorkRequest is answered (empty) after this long
EXPIRE_EVERY_S = 0.05  # leases are checked this often
PEER_IDLE_S = 60.0  # a producer connection silent this long (and at least 4 heartbeat timeouts) is forgotten
PEERS_EVERY_S = 1.0  # idle peers are looked for this often
_HANDLED = get_args(P.ToBuffer)  # the kinds the buffer's decoder admits: one handler each


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
    user: str = ""  # the connection's ZAP User-Id: the leases of the rounds it gets record it


class BufferCore:
    """The buffer's state and message handling; see the module docstring."""

    def __init__(self, cfg: Config, prompts: Sequence[PromptRow], eval_prompts: Sequence[Prompt], *,
                 now: float, snapshot_every: int = SNAPSHOT_EVERY, resume: bool = False,
                 vocab_size: int | None = None, wall_clock: Callable[[], float] = time.time,
                 tokenize: Callable[[str], Sequence[int]] | None = None) -> None:
        """`vocab_size`: token ids at or above it are refused (None: not checked); `tokenize`: a prompt's text to
        its token ids as the engines tokenize it, to check each result's prompt tokens (None: no tokenizer)."""
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None: no check), got {vocab_size}")
        self.cfg, self.vocab_size, self.wall_clock = cfg, vocab_size, wall_clock
        self.scheduler = Scheduler(cfg.sampling, cfg.buffer, cfg.learner.batch_prompts, prompts, cfg.run.seed)
        self.counters = dict.fromkeys(M.SERVICE_COUNTERS, 0)
        self.incidents = Incidents(self.counters)
        # no sample of a version the learner has not announced here: producers load only what the buffer passed on
        # (after a resume, the learner's next request brings the buffer to its version within seconds)
        self.limits = Limits(cfg.buffer.max_abs_reward, cfg.producers.engine.max_model_len, 0)
        self.latest_weights: P.WeightAnnouncement | None = None
        self.learner_stats: dict[str, float] = {}
        self.parked_work: dict[bytes, _Parked] = {}
        self.parked_batch: _Parked | None = None
        self.snapshots = Snapshots(cfg, snapshot_every, self.counters, wall_clock)
        self.last_eval: dict[str, Any] | None = None
        self.eval_log = cfg.run_dir / "eval.jsonl"
        self.eval_log.parent.mkdir(parents=True, exist_ok=True)
        self.stop_reason: str | None = None  # set by a Shutdown (then draining) or `stop`
        self.fatal = ""  # why the buffer stopped the run itself (the process then exits with EXIT_FATAL)
        self._last_hope_check = now
        self.started = now
        self._drain_until = 0.0
        self._eval_turn = 0  # which of evaluation and training gets an odd request's extra slot
        self._last_batch_counts = (0.0, 0.0)  # (positives, samples) received at the previous Batch
        self._last_expire = self._last_peers = now
        self._outbox: list[Out] = []
        self.progress_log = ProgressLog(now)
        self.resumed = resume and self._resume(prompts)
        self.share_among(cfg.producers.count)
        # built once the scheduler is final (a resume replaces it): the peers ask its book of leases
        self.peers = Peers(self.leases, self._forget_peer, self.counters,
                           idle_s=max(PEER_IDLE_S, 4 * cfg.buffer.heartbeat_timeout_s))
        # after a resume: the evaluation rounds share the restored scheduler's round id allocator
        self.evals = Evals(eval_prompts, cfg.eval.k, cfg.buffer.lease_s, cfg.eval.max_new_tokens,
                           cfg.sampling.positive_threshold, self.scheduler.round_ids)
        self.generation = L.Generation()  # the producers' side of the ledger
        self.intake = Intake(self.scheduler, self.evals, self.peers, self.incidents, self.limits, vocab_size,
                             self.generation, tokenize)
        if cfg.learner.eval_every and not self.resumed:
            self.evals.start(0, now)

    @property
    def learner_version(self) -> int:
        return self.scheduler.learner_version

    @property
    def leases(self) -> Leases:
        """The one book of rounds out at producers, training and evaluation (leases.py); the Scheduler's."""
        return self.scheduler.leases

    @property
    def producer_stats(self) -> dict[str, dict[str, float]]:
        """Each tracked producer's last heartbeat stats (with its version and when it was seen)."""
        return self.peers.stats

    # ------------------------------------------------------------ the one dispatch

    def handle(self, sender: bytes, msg: Any, now: float, conn: Conn = IN_PROCESS) -> list[Out]:
        """Act on one decoded message from the peer `sender`, on connection `conn`; returns what to send.

        Raises TypeError only for a kind the buffer's decoder never yields (a caller's bug); whatever a message
        makes a handler raise is counted, logged and dropped (see the module docstring)."""
        if not isinstance(msg, _HANDLED):
            raise TypeError(f"the buffer has no handler for {type(msg).__name__}")
        try:
            self._dispatch(sender, msg, now, conn)
        except Exception as exc:  # noqa: BLE001 - the guard: no message may stop the buffer
            self._handler_error(sender, type(msg).__name__, exc)
        return self._flush()

    def _dispatch(self, sender: bytes, msg: Any, now: float, conn: Conn) -> None:
        problem = role_problem(msg, conn.role)
        if problem:
            self.incidents.bad("refused_role", sender, problem, "rejected_by_sender")
            return
        problem = check_message(msg)
        if problem:
            self.incidents.bad("invalid", sender, problem, "rejected_by_sender")
            return
        match msg:
            case P.WorkRequest():
                self._on_work(sender, msg, now, conn)
            case P.RoundResult():
                self._on_result(sender, msg, now, conn)
            case P.SampleResults():
                self._on_samples(sender, msg, now, conn)
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
                raise AssertionError(f"{type(msg).__name__} is in protocol.ToBuffer but has no case here")

    def malformed(self, sender: bytes, why: str) -> None:
        """A message from `sender` that could not be decoded (the socket side found out)."""
        self.incidents.bad("malformed", sender, why, "malformed_by_sender")

    def tick(self, now: float) -> list[Out]:
        """The timers: lost rounds re-issued, parked requests answered, idle peers forgotten, the progress line."""
        try:
            self._timers(now)
        except Exception as exc:  # noqa: BLE001 - the same guard as a message's
            self._handler_error(b"", "timer", exc)
        return self._flush()

    def _timers(self, now: float) -> None:
        if now - self._last_expire >= EXPIRE_EVERY_S:
            self._last_expire = now
            lost = self.scheduler.expire(now)  # their leases ended there
            lost_evals = self.evals.expire(now, lambda producer: self.scheduler.is_silent(producer, now))
            for round_id in lost_evals:
                self.leases.remove(round_id)
            lost += lost_evals
            if lost:
                self._outbox.append(Out(None, P.Abort(lost, "lease expired")))
        if now - self._last_peers >= PEERS_EVERY_S:
            self._last_peers = now
            self.peers.expire(now)
        for parked in list(self.parked_work.values()):
            self._serve_work(parked, now)
        self._serve_batch(now)
        if self.progress_log.due(now):
            m = self.scheduler.metrics()
            self.progress_log.report(now, m, progress(m, self.producer_stats, self.peers.samples))
        if self.stop_reason is None and self._last_hope_check + PEERS_EVERY_S <= now:
            self._last_hope_check = now
            why = hopeless(self.scheduler.metrics(), self.cfg.buffer.stop_without_signal, self.intake.evidence,
                           self.scheduler.leases.expected)
            if why:
                log.error("%s", why)
                self.fatal = why
                self.stop(why)

    def stop(self, reason: str) -> None:
        """Stop at once, without draining (e.g. a time limit)."""
        self.stop_reason = reason
        self._drain_until = -float("inf")

    def finished(self, now: float) -> bool:
        """Whether the buffer should stop: stopped, and no evaluation left to wait for (or waited long enough)."""
        return self.stop_reason is not None and (self.evals.outstanding == 0 or now >= self._drain_until)

    def share_among(self, clients: int) -> None:
        """Share training rounds among at least `clients` clients (the producers the run starts, or the producer
        keys admitted), so that the first client to ask cannot take the rounds of those still starting."""
        self.scheduler.leases.expected = max(1, clients)

    def count(self, counter: str) -> None:
        """Count an event the socket side saw (e.g. an unroutable reply)."""
        self.counters[counter] += 1

    # ------------------------------------------------------------ handlers

    def _on_work(self, sender: bytes, msg: P.WorkRequest, now: float, conn: Conn) -> None:
        name = self.peers.touch(sender, now)
        if name is None:
            return
        self.scheduler.heartbeat(name, now)
        self.producer_stats.setdefault(name, {})["version"] = msg.version
        self.parked_work[sender] = parked = _Parked(sender, msg, now + WORK_POLL_S, conn.user)
        self._serve_work(parked, now)

    def _on_result(self, sender: bytes, msg: P.RoundResult, now: float, conn: Conn) -> None:
        name = self.peers.touch(sender, now)
        if name is not None:
            self.intake.result(sender, name, msg, now, conn)
            self._write_eval_rows()

    def _on_samples(self, sender: bytes, msg: P.SampleResults, now: float, conn: Conn) -> None:
        name = self.peers.touch(sender, now)
        cut = self.intake.samples(sender, name, msg, now, conn) if name is not None else []
        if cut:
            self._outbox.append(Out(None, P.Abort(cut, "prompt exited")))

    def _on_heartbeat(self, sender: bytes, msg: P.Heartbeat, now: float) -> None:
        if msg.role == LEARNER:  # role_problem let it through: the connection is the learner's
            self.learner_stats = dict(msg.stats)
            return
        name = self.peers.touch(sender, now)
        if name is not None:
            self.scheduler.heartbeat(name, now)
            self.producer_stats[name] = {**msg.stats, "version": msg.version, "seen": self.wall_clock()}
            self.generation.heartbeat(name, msg.stats)

    def _on_batch_request(self, sender: bytes, msg: P.BatchRequest, now: float) -> None:
        self._set_version(msg.learner_version, now)
        self.parked_batch = _Parked(sender, msg, now + msg.timeout_ms / 1000)
        self._serve_batch(now)

    def _on_version(self, sender: bytes, msg: P.VersionUpdate, now: float) -> None:
        # a learner re-sends its version after a timeout (the buffer may have restarted): that must not run an
        # evaluation twice or move the weights back
        new = msg.version > self.learner_version
        weights = msg.weights
        problem = weights_problem(weights, msg.version, self.cfg) if weights is not None else ""
        if problem:  # the version still counts (the learner holds it); producers are not told to load the file
            self.incidents.bad("weights_refused", sender, problem, "rejected_by_sender")
            weights = None
        if weights is not None and (self.latest_weights is None or weights.version >= self.latest_weights.version):
            self.latest_weights = weights
        self._set_version(msg.version, now)
        # producers load the new weights from the announcement; nothing unchecked is passed on
        self._outbox.append(Out(None, msgspec.structs.replace(msg, weights=weights)))
        every = self.cfg.learner.eval_every
        if new and every and (msg.version % every == 0 or msg.version == self.cfg.learner.num_steps):
            self.evals.start(msg.version, now)
        if self.snapshots.due(self.learner_version):
            self.write_snapshot()

    def _on_shutdown(self, sender: bytes, msg: P.Shutdown, now: float) -> None:
        log.info("shutdown requested by %s: %s%s", peer_name(sender), msg.reason[:200],
                 f"; waiting up to {self.cfg.buffer.lease_s:g} s for {self.evals.outstanding} evaluation(s)"
                 if self.evals.outstanding else "")
        if self.stop_reason is None:
            self.stop_reason = msg.reason
            self._drain_until = now + self.cfg.buffer.lease_s

    # ------------------------------------------------------------ helpers

    def _flush(self) -> list[Out]:
        out, self._outbox = self._outbox, []
        return out

    def _handler_error(self, sender: bytes, kind: str, exc: Exception) -> None:
        self.incidents.handler_error(sender, kind, exc, self.scheduler, {
            "leases": len(self.leases), "peers": len(self.peers.last_seen), "stopping": self.stop_reason})

    def _forget_peer(self, identity: bytes, name: str) -> None:
        """A producer connection let go (idle, or making room): what else is kept per producer goes with it."""
        self.parked_work.pop(identity, None)
        self.scheduler.forget(name)
        self.generation.retire(name)

    def _set_version(self, version: int, now: float) -> None:
        aborted = self.scheduler.set_learner_version(version, now)  # their leases ended there
        if aborted:
            self._outbox.append(Out(None, P.Abort(aborted, "samples would be stale")))

    def _pick_rounds(self, producer_id: str, wanted: int, now: float, samples: int = 0, client: str = ""
                     ) -> list[P.RoundAssignment]:
        """Eval rounds take at most half of `wanted` while training has rounds, and what training cannot use;
        training rounds fit in `samples` less the eval rounds' (0: no sample budget) and the fair share of
        `client` (the connection's CurveZMQ key, "" = the producer alone; see leases.py)."""
        if self.stop_reason is not None:  # draining: the learner is done, only evaluations are left
            rounds = self._take_evals(wanted, producer_id, now, client)
        else:
            share = 0
            if self.evals.available:
                share = (wanted + self._eval_turn) // 2
                self._eval_turn ^= wanted % 2
            rounds = self._take_evals(share, producer_id, now, client)
            room = samples - sum(r.num_samples for r in rounds)
            if not samples or room > 0:  # the Scheduler records the leases of its rounds itself
                rounds += self.scheduler.request_work(producer_id, wanted - len(rounds), now, max(0, room), client)
            rounds += self._take_evals(wanted - len(rounds), producer_id, now, client)
        self.counters["eval_rounds"] += sum(r.kind == "eval" for r in rounds)
        return rounds

    def _take_evals(self, wanted: int, producer_id: str, now: float, client: str) -> list[P.RoundAssignment]:
        """Up to `wanted` evaluation rounds for `producer_id`, their leases recorded in the book."""
        rounds = self.evals.take(wanted, producer_id, now)
        for r in rounds:
            self.leases.add(r.round_id, Lease(producer_id, client, r.kind, r.prompt_id, r.num_samples,
                                              r.max_new_tokens or self.cfg.sampling.max_new_tokens, now + r.lease_s))
        return rounds

    def _serve_work(self, parked: _Parked, now: float) -> None:
        msg: P.WorkRequest = parked.msg
        rounds: list[P.RoundAssignment] = []
        # a producer whose weights are too old would only generate samples that are evicted on arrival
        if msg.max_rounds and self.learner_version - msg.version <= self.cfg.buffer.max_staleness:
            rounds = self._pick_rounds(peer_name(parked.identity), msg.max_rounds, now, msg.max_samples, parked.user)
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
        flat = M.batch_metrics(m, self.counters, self.producer_stats, self.last_eval, self._last_batch_counts,
                               self.ledger(now, m))
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
            m, self.counters, bad_senders=self.incidents.tables, snapshot=self.snapshots.info,
            peers={"tracked": len(self.peers.last_seen), "leases": len(self.leases)},
            producers=self.producer_stats, learner=self.learner_stats, last_eval=self.last_eval,
            evals_running=self.evals.in_progress(), eval_counts=self.evals.counts,
            progress=progress(m, self.producer_stats, self.peers.samples),
            uptime_s=now - self.started, draining=self.stop_reason is not None, ledger=self.ledger(now, m))

    def ledger(self, now: float, scheduler_metrics: dict[str, Any] | None = None) -> dict[str, int]:
        """Every generated sample and token by fate, now (ledger.py)."""
        m = self.scheduler.metrics() if scheduler_metrics is None else scheduler_metrics
        return L.ledger(m, self.generation.totals(lambda name: self.scheduler.is_silent(name, now)))

    def reports_complete(self, now: float) -> bool:
        """Whether every producer still heard from has sent its final heartbeat (after its last results)."""
        return self.generation.complete(lambda name: self.scheduler.is_silent(name, now))

    def write_ledger(self, now: float) -> dict[str, int]:
        """Write the ledger to RUN/ledger.json (atomically; at the end of a run) and return it."""
        led = self.ledger(now)
        path = self.cfg.run_dir / "ledger.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**led, "complete": self.reports_complete(now)}, indent=1) + "\n")
        tmp.replace(path)
        log.info("ledger: %s", L.compact(led))
        return led

    def write_snapshot(self) -> bool:
        """Write the state that `--resume` restores (see snapshot.py) atomically; False if it failed."""
        return self.snapshots.write(self.scheduler, self.latest_weights)

    def _resume(self, prompts: Sequence[PromptRow]) -> bool:
        """Restore the last snapshot; False (a fresh start) when there is none. Raises ValueError if unusable."""
        restored = self.snapshots.restore(prompts)
        if restored is not None:
            self.scheduler, snap = restored
            self.latest_weights = snap.latest_weights
        return restored is not None
