"""Producers' results on their way in: a whole round (RoundResult) or the samples of streamed rounds as they finish
(SampleResults), each from the holder of its round's lease and with values the edge accepts, to the Scheduler
(training) or Evals (evaluation). `BufferCore` hands every result message here; nothing here does I/O.

Invariants:
- a result for a round leased to another connection (identity, or ZAP User-Id under CurveZMQ) is counted as
  `results_foreign` and touches nothing: not the round, not its prompt, not the holder's lease (leases.py: the
  one book of rounds out, training ones ended by the Scheduler, evaluation ones here);
- a result for a round out at no producer goes where it would have gone only to be counted (late, duplicate or
  unknown): it can change no pool;
- a result whose values fail the edge checks (checks.py) is counted by reason and its round re-issued (the
  Scheduler gives its prompt up after repeated rejections; Evals queues the problem again); it is never pooled;
- with a tokenizer, a training result's prompt tokens must equal the buffer's own tokenization of the prompt it
  assigned (each example tokenized once, when first served, and cached): a producer cannot make the learner train
  on another prompt; without one, they must equal those of the prompt's first accepted round;
- a lease ends when its holder's whole result arrives, or when a streamed round is over (complete, cut by the
  exit rule, or rejected);
- every training sample a result message carries, and every abort it reports, reaches the Scheduler's ledger
  (ledger.py) once, whatever else happens to it (refused ones as refused), and is credited to the sender in
  `Generation`: exactly what the Scheduler counted as arrived while handling the message.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline import protocol as P
from pipeline.buffer.checks import Limits, check_result, out_of_vocab
from pipeline.buffer.evals import Evals
from pipeline.buffer.incidents import Incidents
from pipeline.buffer.leases import Lease
from pipeline.buffer.ledger import Generation
from pipeline.buffer.peers import Conn, Peers
from pipeline.buffer.progress import Evidence
from pipeline.buffer.scheduler import Scheduler

log = logging.getLogger(__name__)

PROMPT_CACHE = 4096  # examples whose prompt tokens are kept (far more than the prompts active at once)


class Intake:
    """Ownership and the edge checks for every result; see the module docstring."""

    def __init__(self, scheduler: Scheduler, evals: Evals, peers: Peers, incidents: Incidents, limits: Limits,
                 vocab_size: int | None, generation: Generation | None = None,
                 tokenize: Callable[[str], Sequence[int]] | None = None) -> None:
        """`tokenize`: the prompt text to its token ids as the engines tokenize it (None: no tokenizer)."""
        self.scheduler, self.evals, self.peers, self.incidents = scheduler, evals, peers, incidents
        self.leases = scheduler.leases  # the one book of rounds out at producers
        self.tokenize = tokenize
        self._prompt_ids: OrderedDict[int, np.ndarray] = OrderedDict()  # example index -> its prompt's tokens
        self.limits, self.vocab_size = limits, vocab_size
        self.counters = incidents.counters
        self.generation = Generation() if generation is None else generation
        self.evidence = Evidence()  # training samples and positives per client, for the stop without signal

    def result(self, sender: bytes, name: str, msg: P.RoundResult, now: float, conn: Conn) -> None:
        """The whole result of one round from `sender` (named `name`), on connection `conn`."""
        before, seen = self._arrived(), self._received()
        self._result(sender, name, msg, now, conn)
        self._credit(name, before)
        self._evidence(conn.user or name, seen)

    def _result(self, sender: bytes, name: str, msg: P.RoundResult, now: float, conn: Conn) -> None:
        lease = self.leases.get(msg.round_id)
        if lease is None:  # out at no producer: late, duplicate or unknown, counted where it would have gone
            assert not self.evals.owns(msg.round_id), f"eval round {msg.round_id} is in flight without a lease"
            if msg.kind == "eval":
                self.evals.submit(msg.round_id, [], now)
            else:  # not in flight: only counted as ignored (and its samples in the ledger)
                self.scheduler.submit_samples(name, msg.round_id, range(len(msg.samples)), msg.samples,
                                              P.empty_array("int32"), now)
            return
        if self._foreign(sender, name, conn, msg.round_id, lease):
            if lease.kind == "train":
                self.scheduler.refuse(msg.samples)
            return
        # its holder answered: whatever follows, the lease is over (a training round's whole result, accepted or
        # rejected, ends the round in the Scheduler, which ends its lease)
        if lease.kind == "eval":
            self.leases.remove(msg.round_id)
        if msg.kind != lease.kind:  # the lease decides: an older producer's results are not lost
            self.counters["results_wrong_kind"] += 1
            if self.counters["results_wrong_kind"] == 1:
                log.warning("%s sent %s round %d back as kind %r (taken as its round's kind): the producer must "
                            "echo RoundAssignment.kind in RoundResult.kind; update it", name, lease.kind,
                            msg.round_id, msg.kind)
        reason, why = self._problem(msg, lease, self._known_prompt(lease))
        if reason:
            self._reject(sender, name, msg.round_id, lease, reason, why, now, msg.samples)
        elif lease.kind == "eval":
            if self.evals.submit(msg.round_id, msg.samples, now) == "accepted":
                self.peers.count_samples(name, len(msg.samples))
        elif self.scheduler.submit_result(name, msg.round_id, msg.prompt_token_ids, msg.samples, now).accepted:
            self.peers.count_samples(name, len(msg.samples))

    def samples(self, sender: bytes, name: str, msg: P.SampleResults, now: float, conn: Conn) -> list[int]:
        """Streamed samples, one part per training round: checked like a result (a later part may leave the prompt
        tokens out), then accepted one by one. Returns the rounds the exit rule cut (the caller aborts them)."""
        before, seen = self._arrived(), self._received()
        try:
            return self._samples(sender, name, msg, now, conn)
        finally:
            self._credit(name, before)
            self._evidence(conn.user or name, seen)

    def _samples(self, sender: bytes, name: str, msg: P.SampleResults, now: float, conn: Conn) -> list[int]:
        cut: list[int] = []
        for part in msg.rounds:
            lease = self.leases.get(part.round_id)
            if lease is not None and self._foreign(sender, name, conn, part.round_id, lease):
                self.scheduler.refuse(part.samples, part.num_aborted, part.aborted_tokens)
                continue
            self.scheduler.report_aborted(part.round_id, part.num_aborted, part.aborted_tokens)  # waste, counted
            if not part.samples:
                continue
            if lease is None:  # not out here: late, duplicate or unknown, counted as such
                self.scheduler.submit_samples(name, part.round_id, part.indices, part.samples, P.empty_array("int32"),
                                              now)
                continue
            known = self._known_prompt(lease)
            prompt = known if part.prompt_token_ids.size == 0 and known is not None else part.prompt_token_ids
            as_result = P.RoundResult(name, part.round_id, part.prompt_id, prompt, part.samples, 0.0, lease.kind)
            reason, why = self._problem(as_result, lease, known)
            if not reason and lease.kind != "train":
                reason, why = "samples", f"eval round {part.round_id} came back streamed; eval rounds are whole"
            if reason:
                self._reject(sender, name, part.round_id, lease, reason, why, now, part.samples)
                continue
            out = self.scheduler.submit_samples(name, part.round_id, part.indices, part.samples, prompt, now)
            if out.accepted:
                self.peers.count_samples(name, len(part.samples))
            # once the round is over (complete, cut or rejected) the Scheduler has ended its lease
            cut += out.aborted
        return cut

    def _foreign(self, sender: bytes, name: str, conn: Conn, round_id: int, lease: Lease) -> bool:
        if lease.held_by(name, conn.user):  # names are injective (peers.peer_name): the same connection
            return False
        self.incidents.bad("results_foreign", sender, f"a result for round {round_id}, which is leased to "
                           f"{lease.producer}", "rejected_by_sender")
        return True

    def _problem(self, msg: P.RoundResult, lease: Lease, known: Any) -> tuple[str, str]:
        reason, why = check_result(msg, lease, self.limits, self.scheduler.learner_version, known)
        if not reason and self.vocab_size is not None:
            why = out_of_vocab(msg, self.vocab_size)
            reason = "oov" if why else ""
        return reason, why

    def _reject(self, sender: bytes, name: str, round_id: int, lease: Lease, reason: str, why: str,
                now: float, samples: list[P.Sample]) -> None:
        """A result its holder sent with values the edge refuses: counted by reason, its round re-issued."""
        self.incidents.bad("rejected_oov" if reason == "oov" else "rejected_values", sender, why,
                           "rejected_by_sender", reason)
        if lease.kind == "eval":
            self.leases.remove(round_id)
            self.evals.reject(round_id)
        else:  # re-issued at once (the prompt given up on if it repeats); its samples are refused in the ledger
            self.scheduler.reject(name, round_id, now, samples)

    def _arrived(self) -> tuple[int, int]:
        m = self.scheduler.fates.counts
        return m["arrived_samples"], m["arrived_tokens"]

    def _credit(self, name: str, before: tuple[int, int]) -> None:
        """Credit producer `name` with what the Scheduler counted as arrived since `before` (the ledger's view of
        what reached the buffer from it)."""
        after = self._arrived()
        if after != before:
            self.generation.reported(name, after[0] - before[0], after[1] - before[1])

    def _received(self) -> tuple[int, int]:
        c = self.scheduler.pools.counts
        return c["samples_received"], c["positives_received"]

    def _evidence(self, source: str, before: tuple[int, int]) -> None:
        """Credit client `source` with the training samples (and positives) the Scheduler took since `before`."""
        after = self._received()
        self.evidence.add(source, after[0] - before[0], after[1] - before[1])

    def _known_prompt(self, lease: Lease) -> Any:
        """The prompt's token ids (training rounds; None otherwise): the buffer's own tokenization of the prompt,
        or without a tokenizer those of its earlier accepted rounds."""
        st = self.scheduler.pools.active.get(lease.prompt_id) if lease.kind == "train" else None
        if st is None or self.tokenize is None:
            return None if st is None else st.prompt_token_ids
        ids = self._prompt_ids.get(st.example_index)
        if ids is None:
            ids = np.asarray(self.tokenize(st.prompt), dtype=np.int32)
            self._prompt_ids[st.example_index] = ids
            if len(self._prompt_ids) > PROMPT_CACHE:
                self._prompt_ids.popitem(last=False)
        else:
            self._prompt_ids.move_to_end(st.example_index)
        return ids
