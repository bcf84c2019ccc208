"""The rollout buffer's decisions: which prompt gets the next round, when a prompt is released, what the learner gets.

`Scheduler` is synchronous, deterministic and clock-free: every event carries the caller's `now`, and the same
seed plus the same event log always produce the same groups. `BufferCore` wraps it; nothing here does I/O. The
exit rule and the allocation policy are objects of `policy/`: the scheduler asks the rule for the exit condition,
whether rounds are kept whole, and the advantages; the policy sizes each round, may defer an example, and says
when a visit's budget is spent.

Life of a prompt:
1. Admission (`admission.py`). Examples are taken in the given order, wrapping around for further epochs (the
   policy may defer one to a later epoch); every admission gets a fresh prompt_id. A new prompt is admitted only
   while
       groups_waiting + prompts_active < (learner_version + max_staleness + 1) * batch_size - groups_consumed
   (AReaL's bound: with one batch consumed per version this is (max_staleness + 1) * batch_size groups
   generated but not yet trained; max_staleness = 0 is fully synchronous on-policy training).
2. Rounds. `request_work` first gives rounds to active prompts without a round in flight (oldest admitted first),
   then admits new prompts, within the producer's round and sample budget and its fair share of the admission
   bound in rounds ((max_staleness + 1) * batch_size over the producers alive). A prompt has at most one round in
   flight; each round records its own size, chosen by the policy when it is issued. Round ids come from a
   `RoundIds` allocator that evaluation rounds share: no id serves two rounds.
3. Samples. Producers report samples as they finish (`submit_samples`, batched) or a whole round at once
   (`submit_result`). Only samples of a prompt's current round are accepted, each index once; duplicates, late
   results (after a re-issue, an abort or the prompt's exit) and unknown round ids are ignored and counted by
   reason. A sample index outside the round, or a whole result of the wrong size, is rejected and the round
   re-issued (`reject` does the same for a result the caller found unusable). Samples already too stale are
   evicted as they join the pool (whole rounds under a `whole_rounds` rule such as "fixed"). The exit rule is
   checked as samples join the pool (`pools.py`, sampling.exit_check); once it holds (and the pool has >= n
   samples) the prompt is released and the rest of its round is cut: the outcome names the round, whose running
   samples the caller aborts. A round that ends without the exit: budget spent (the policy's `exhausted`) ->
   unresolved; otherwise the prompt waits for its next round.
4. Release. The pool is downsampled to n (buffer.downsample, with the scheduler's seeded rng) and advantages use
   the whole pool's mean (and std when normalize_std), or whatever the rule's `advantages` says ("fixed": the
   group's own statistics, pool == group). A resolved pool whose rewards are all equal (e.g. "pos" with every
   sample correct) carries no signal: dropped under unresolved="drop" (dropped_zero_variance), released under
   "keep" (the reference: a zero-advantage group). An unresolved pool with signal is released with
   resolved=False (released_partial): dropping it would bias training toward easy prompts that exit fast; one
   with zero variance is dropped under "drop" (dropped_unresolved) and released under "keep".
5. Hand-off. `take_batch` gives exactly num_groups groups FIFO, or nothing. Every handed-out sample satisfies
   learner_version - sample.version <= max_staleness. The learner version moves only through
   `set_learner_version`, which returns the rounds it aborts.

Staleness: when the learner version rises, stale samples are evicted from active pools (a round that loses all
its samples is refunded, so staleness never exhausts a prompt's rounds); a waiting group holding a stale sample
is re-opened (its prompt goes back to active, with the stale samples evicted from its full pool, which is kept
until hand-off for this reason); rounds in flight issued at a now-stale version are aborted and re-issued.
Expiry: a round whose lease passed, or whose producer was silent for heartbeat_timeout_s, is re-issued.

Waste is counted exactly (counters.py), and every sample that reaches the scheduler is given one fate in the
ledger (ledger.py: `Fates`, counted in `pools.py` and here). The prompts' pools, their release and the hand-off
live in `Pools` (pools.py); admission and the per-example history in `Admission` (admission.py); the rounds in
flight and the producers' liveness in `Leases` (leases.py); the Scheduler decides, and keeps the learner version.

Invariants (`check_invariants`): those of `Pools` (no admitted prompt is lost or counted twice; every waiting
group has n samples and the formula's advantages), and every round in flight belongs to exactly one active
prompt, every other active prompt being queued for one; the per-producer round counts match the rounds in flight.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline import protocol as P
from pipeline.buffer import state_codec as codec
from pipeline.buffer.admission import Admission
from pipeline.buffer.counters import IGNORE_REASONS, MAX_REJECTIONS, SCHEDULER_COUNTERS
from pipeline.buffer.leases import Lease, Leases
from pipeline.buffer.ledger import num_tokens
from pipeline.buffer.policy import DEFAULT_WASTE, MAX_ROUNDS_FACTOR, Prior, build
from pipeline.buffer.pools import Pools, Released, SubmitOutcome
from pipeline.buffer.state import History, InFlight, PromptRow, PromptState, RoundIds
from pipeline.config import BufferConfig, SamplingConfig

__all__ = ["MAX_REJECTIONS", "MAX_ROUNDS_FACTOR", "Released", "Scheduler", "SubmitOutcome"]

class Scheduler:
    """The buffer's pure state machine. See the module docstring for the rules it follows."""

    def __init__(
        self,
        sampling: SamplingConfig,
        buffer: BufferConfig,
        batch_size: int,
        prompts: Sequence[PromptRow],
        seed: int,
        round_ids: RoundIds | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (groups per learner step), got {batch_size}")
        if len(prompts) == 0:
            raise ValueError("the scheduler needs at least one (prompt, answer) pair; check data.train_files")
        self.sampling = sampling
        self.buffer = buffer
        self.batch_size = batch_size
        self.rule, self.policy = build(sampling)  # the exit rule and the allocation policy (policy/)
        self.round_ids = RoundIds() if round_ids is None else round_ids
        self._prompts = prompts
        self._rng = random.Random(seed)
        self._counts = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        self.admission = Admission(prompts, self.policy)
        self.pools = Pools(sampling, buffer, self.rule, self.policy, self._rng, self._counts, context=self._context)
        self.fates = self.pools.fates  # the ledger (ledger.py)
        self._learner_version = 0
        # the one book of rounds out at producers (training rounds recorded here; the service adds evaluation ones)
        self.leases = Leases(buffer)
        self._now = -math.inf
        self._ignored = dict.fromkeys(IGNORE_REASONS, 0)
        self._rejections: dict[int, int] = {}  # prompt id -> results rejected (not snapshotted)

    # ------------------------------------------------------------ events

    def request_work(self, producer_id: str, max_rounds: int, now: float, max_samples: int = 0, client: str = ""
                     ) -> list[P.RoundAssignment]:
        """Up to `max_rounds` rounds for `producer_id`, waiting active prompts first, then new admissions; with
        `max_samples` > 0 also at most that many samples in all (the first round is given even if larger). Never
        more than its fair share, per `client` (its CurveZMQ key; "": the producer alone), see leases.py."""
        if max_rounds < 0 or max_samples < 0:
            raise ValueError(f"max_rounds and max_samples must be >= 0, got {max_rounds} and {max_samples}")
        self.heartbeat(producer_id, now)
        cap = self.buffer.max_rounds_in_flight
        share = self.leases.room(producer_id, (self.buffer.max_staleness + 1) * self.batch_size, now, client)
        out: list[P.RoundAssignment] = []
        samples = 0
        while len(out) < min(max_rounds, share) and (cap == 0 or self.leases.num_train < cap):
            st = self.pools.pop_ready()
            if st is None:
                if not self._admission_open():
                    break
                st = self._admit(now)
            size = self.policy.next_round(st, self._history(st), self._prior())
            if max_samples and out and samples + size > max_samples:
                self.pools.queue(st)
                break
            samples += size
            out.append(self._issue(st, producer_id, size, now))
            self._lease(out[-1], st, client)
        return out

    def submit_samples(self, producer_id: str, round_id: int, indices: Sequence[int], samples: Sequence[P.Sample],
                       prompt_token_ids: np.ndarray, now: float) -> SubmitOutcome:
        """Accept samples `indices` of round `round_id` as they finish; release the prompt once its exit rule holds
        (the outcome's `aborted` then names the round, whose running samples the caller must abort)."""
        self.fates.arrive(len(samples), num_tokens(samples))
        return self._submit_samples(producer_id, round_id, indices, samples, prompt_token_ids, now)

    def _submit_samples(self, producer_id: str, round_id: int, indices: Sequence[int], samples: Sequence[P.Sample],
                        prompt_token_ids: np.ndarray, now: float) -> SubmitOutcome:
        self.heartbeat(producer_id, now)
        st = self._round_prompt(round_id)
        if st is None:
            return SubmitOutcome(self._ignore(round_id, samples))
        fl = st.in_flight
        if len(indices) != len(samples) or not all(0 <= i < fl.num_samples for i in indices):
            self.fates.add("refused", len(samples), num_tokens(samples))
            return self._reject(st, cannot_serve=False)
        min_version = self._learner_version - self.buffer.max_staleness
        c = self._counts
        before = c["samples_received"], c["positives_received"]
        outcome, over = self.pools.receive(st, indices, samples, prompt_token_ids, min_version)
        if outcome.status == "duplicate":
            self._ignored["duplicate"] += 1
        num_new, num_pos = c["samples_received"] - before[0], c["positives_received"] - before[1]
        self.admission.observe(st.example_index, num_pos, num_new - num_pos)  # every new sample is evidence
        if over:
            self.leases.remove(round_id)
        return outcome

    def submit_result(
        self, producer_id: str, round_id: int, prompt_token_ids: np.ndarray, samples: list[P.Sample], now: float
    ) -> SubmitOutcome:
        """Accept (or ignore, or reject) the whole result of one round: its samples in issue order."""
        self.fates.arrive(len(samples), num_tokens(samples))
        st = self._round_prompt(round_id)
        if st is not None and len(samples) != st.in_flight.num_samples:
            self.heartbeat(producer_id, now)
            self.fates.add("refused", len(samples), num_tokens(samples))
            return self._reject(st, cannot_serve=not samples)
        return self._submit_samples(producer_id, round_id, range(len(samples)), samples, prompt_token_ids, now)

    def report_aborted(self, round_id: int, num_samples: int, num_tokens: int) -> None:
        """A producer aborted `num_samples` samples of round `round_id` that had generated `num_tokens` tokens:
        counted as waste (accounting only; only in the ledger, as refused, for a round id never issued). In the
        ledger they take the fate of the reason their round closed, or `stopped` while it is still in flight (its
        producer stopped)."""
        if num_samples < 0 or num_tokens < 0:
            raise ValueError(f"aborted samples and tokens must be >= 0, got {num_samples} and {num_tokens}")
        if not num_samples and not num_tokens:
            return
        self.fates.arrive(num_samples, num_tokens)
        if not self.round_ids.issued(round_id):
            self.fates.add("refused", num_samples, num_tokens)
            return
        self._counts["samples_aborted"] += num_samples
        self._counts["tokens_aborted"] += num_tokens
        if self.leases.is_train(round_id):
            self.fates.add("stopped", num_samples, num_tokens)
        else:
            self.fates.straggler(round_id, num_samples, num_tokens)

    def refuse(self, samples: Sequence[P.Sample], num_aborted: int = 0, aborted_tokens: int = 0) -> None:
        """Training samples that arrived (and aborted ones reported) but are not used at all (e.g. a result for a
        round leased to another producer): counted in the ledger as refused."""
        num, tokens = len(samples) + num_aborted, num_tokens(samples) + aborted_tokens
        self.fates.arrive(num, tokens)
        self.fates.add("refused", num, tokens)

    def reject(self, producer_id: str, round_id: int, now: float, samples: Sequence[P.Sample] = ()) -> SubmitOutcome:
        """Reject the result of round `round_id` as unusable (e.g. a token id outside the vocabulary): the round is
        re-issued, and its prompt given up on after MAX_REJECTIONS. Ignored like any result if not in flight.
        `samples`, the result's, are counted in the ledger as refused."""
        self.refuse(samples)
        self.heartbeat(producer_id, now)
        st = self._round_prompt(round_id)
        return SubmitOutcome(self._ignore(round_id, ())) if st is None else self._reject(st, cannot_serve=False)

    def take_batch(self, learner_version: int, num_groups: int, now: float | None = None) -> list[P.Group] | None:
        """Exactly `num_groups` waiting groups (FIFO) for the learner at `learner_version`, or None if fewer wait.

        The version never moves here (`set_learner_version` does that): a learner ahead of the scheduler is a
        ValueError; one behind it gets groups trainable at the scheduler's version, so at its own too.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if learner_version > self._learner_version:
            raise ValueError(f"a batch for learner version {learner_version} while the scheduler is at "
                             f"{self._learner_version}: call set_learner_version({learner_version}) first")
        self._tick(now)
        return self.pools.take(num_groups, self._learner_version)

    def set_learner_version(self, version: int, now: float | None = None) -> list[int]:
        """Raise the learner version: abort stale rounds, evict stale samples, re-open stale waiting groups.

        Returns the round ids aborted (their results will be ignored; their prompts get new rounds). A version
        not above the current one changes nothing.
        """
        if version < 0:
            raise ValueError(f"learner version must be >= 0, got {version}")
        self._tick(now)
        if version <= self._learner_version:
            return []
        self._learner_version = version
        aborted = []
        for round_id, lease in self.leases.train():  # in issue order
            st = self.pools.active[lease.prompt_id]
            if version - st.in_flight.issued_version > self.buffer.max_staleness:
                aborted.append(round_id)
                self._counts["rounds_aborted"] += 1
                self._cancel(st, "rounds_reissued", "stale")
        self.pools.evict_stale(version - self.buffer.max_staleness)
        return aborted

    def heartbeat(self, producer_id: str, now: float) -> None:
        """Record that `producer_id` is alive at `now`."""
        self._tick(now)
        self.leases.heartbeat(producer_id, now)

    def forget(self, producer_id: str) -> None:
        """Forget when `producer_id` was last heard of: the buffer bounds how many producers it keeps track of
        and lets idle ones go. Rounds it still held would then count as silent and expire."""
        self.leases.forget(producer_id)

    def is_silent(self, producer_id: str, now: float) -> bool:
        """Whether `producer_id` has not been heard of for more than buffer.heartbeat_timeout_s."""
        return self.leases.is_silent(producer_id, now)

    def expire(self, now: float) -> list[int]:
        """Cancel rounds whose lease passed or whose producer went silent; returns their ids (re-offered later)."""
        self._tick(now)
        expired = []
        for round_id, lease in self.leases.train():
            st = self.pools.active[lease.prompt_id]
            assert st.in_flight is not None and st.in_flight.round_id == round_id
            if now > lease.deadline or self.is_silent(lease.producer, now):
                expired.append(round_id)
                self._counts["rounds_expired"] += 1
                self._cancel(st, "rounds_reissued", "reissued")
        return expired

    # ------------------------------------------------------------ internals

    def _tick(self, now: float | None) -> None:
        if now is not None:
            self._now = max(self._now, now)

    def _round_prompt(self, round_id: int) -> PromptState | None:
        lease = self.leases.get(round_id)
        return None if lease is None or lease.kind != "train" else self.pools.active[lease.prompt_id]

    def _ignore(self, round_id: int, samples: Sequence[P.Sample]) -> str:
        if round_id in self.pools.accepted_rounds and round_id not in self.pools.cut_rounds:
            reason = "duplicate"
        elif self.round_ids.issued(round_id):
            reason = "late"  # re-issued, aborted, or its prompt exited before it arrived
            self._counts["samples_late"] += len(samples)
            self._counts["tokens_discarded"] += sum(len(s.token_ids) for s in samples)
            if samples:
                self.fates.straggler(round_id, len(samples), num_tokens(samples))
        else:
            reason = "unknown"
        if reason != "late":
            self.fates.add("refused", len(samples), num_tokens(samples))
        self._ignored[reason] += 1
        return reason

    def _reject(self, st: PromptState, cannot_serve: bool) -> SubmitOutcome:
        self._counts["results_rejected"] += 1
        # An empty result is the producer saying it cannot serve this prompt at all (e.g. longer than the
        # engine's max_model_len); a prompt rejected again and again would otherwise be re-issued forever.
        rejections = self._rejections[st.prompt_id] = self._rejections.get(st.prompt_id, 0) + 1
        if cannot_serve or rejections >= MAX_REJECTIONS:
            self._cancel(st, "rounds_aborted", "dropped")
            del self._rejections[st.prompt_id]
            self.pools.drop(st, "prompts_unservable")
            return SubmitOutcome("rejected", dropped=True)
        self._cancel(st, "rounds_reissued", "reissued")
        return SubmitOutcome("rejected")

    def _admission_open(self) -> bool:
        pools = self.pools
        bound = (self._learner_version + self.buffer.max_staleness + 1) * self.batch_size - pools.groups_consumed
        return len(pools.waiting) + len(pools.active) < bound

    def _history(self, st: PromptState) -> History:
        return self.admission.history.setdefault(st.example_index, History())

    def _context(self, st: PromptState) -> tuple[History, Prior]:
        """What the policy weighs besides `st`'s pool: its example's history and the population prior."""
        return self._history(st), self._prior()

    def _prior(self) -> Prior:
        """The population prior, with the measured cost of a cut sample relative to a finished one."""
        c = self._counts
        cut = c["samples_aborted"] + c["samples_discarded"]
        waste = DEFAULT_WASTE
        if cut >= 100 and c["samples_received"] and c["tokens_received"]:
            per_cut = (c["tokens_aborted"] + c["tokens_discarded"]) / cut
            waste = per_cut / (c["tokens_received"] / c["samples_received"])
        received = c["samples_received"]
        return self.admission.prior(waste, c["released_signal"] / received if received else 0.0)

    def _admit(self, now: float) -> PromptState:
        deferred = self.admission.deferrals
        st = self.admission.take(now, self._prior())
        self._counts["deferred"] += self.admission.deferrals - deferred
        self.pools.add(st)
        return st

    def _issue(self, st: PromptState, producer_id: str, size: int, now: float) -> P.RoundAssignment:
        assert size >= 1, size
        round_id = self.round_ids.take()
        st.in_flight = InFlight(round_id, producer_id, self._learner_version, now + self.buffer.lease_s, size)
        st.rounds_issued += 1
        self._counts["rounds_issued"] += 1
        # samples are streamed only when the exit rule is checked per sample (else a whole result suffices)
        return P.RoundAssignment(round_id, st.prompt_id, st.prompt, st.answer, size, self.buffer.lease_s,
                                 stream=self.pools.exit_check != "round", extras=self._extras(st.example_index))

    def _lease(self, a: P.RoundAssignment, st: PromptState, client: str) -> None:
        """Record round `a`, just issued for `st`, in the book: out at its producer (of `client`) until it ends."""
        fl = st.in_flight
        assert fl is not None and fl.round_id == a.round_id
        self.leases.add(a.round_id, Lease(fl.producer_id, client, "train", st.prompt_id, fl.num_samples,
                                          self.sampling.max_new_tokens, fl.deadline))

    def _extras(self, example: int) -> dict[str, Any]:
        """An example's reward extras: the optional third item of its (prompt, answer, extras) entry."""
        row = self._prompts[example]
        return row[2] if len(row) > 2 else {}

    def _cancel(self, st: PromptState, counter: str, fate: str) -> None:
        """Cancel `st`'s round in flight (counted under `counter`); its samples held, late or aborted get `fate`."""
        fl = st.in_flight
        assert fl is not None
        self.leases.remove(fl.round_id)
        st.in_flight = None
        self._counts[counter] += 1
        self._counts["samples_discarded"] += len(fl.held)  # arrived, never joined: the round starts over
        self._counts["tokens_discarded"] += sum(len(s.token_ids) for s in fl.held.values())
        self.fates.add_samples(fate, fl.held.values())
        self.fates.close(fl.round_id, fate, fl.num_samples - len(fl.arrived))
        if fl.round_index >= 0:  # some samples arrived: the stragglers are late, not duplicates
            self.pools.cut(st, fl.round_id)
        self.pools.queue(st)

    # ------------------------------------------------------------ observation

    def in_flight(self, round_id: int) -> bool:
        """Whether training round `round_id` is out at a producer (its samples may still be accepted)."""
        return self.leases.is_train(round_id)

    @property
    def learner_version(self) -> int:
        return self._learner_version

    @property
    def groups_waiting(self) -> int:
        return len(self.pools.waiting)

    def metrics(self) -> dict[str, Any]:
        """Every counter of SCHEDULER_COUNTERS, the gauges, and two dicts: `results_ignored`, `rounds_to_exit`."""
        c, pools = self._counts, self.pools
        received, released = c["samples_received"], c["released"]
        return {
            **c,
            "active": len(pools.active),
            "groups_waiting": len(pools.waiting),
            "groups_consumed": pools.groups_consumed,
            "rounds_in_flight": self.leases.num_train,
            "results_ignored": dict(self._ignored),
            # every sample received (evicted ones and those of dropped prompts too) per group released: the cost
            "samples_per_released_group": received / released if released else 0.0,
            # the pool a group was built from (its advantage statistics), on average
            "pool_size_mean": c["pool_samples_released"] / released if released else 0.0,
            "rounds_to_exit": dict(sorted(pools.rounds_to_exit.items())),
            "positive_rate": c["positives_received"] / received if received else 0.0,
            # length bias: kept samples vs their pools (sampling.exit_check "sample" keeps short ones)
            "kept_mean_len": c["tokens_kept"] / (released * self.sampling.group_size) if released else 0.0,
            "pool_mean_len": c["pool_tokens_released"] / c["pool_samples_released"] if released else 0.0,
            "deferred_share": c["deferred"] / (c["deferred"] + c["admitted"]) if c["admitted"] else 0.0,
            "examples_seen": len(self.admission.history),
            "learner_version": self._learner_version,
            "epoch": self.admission.epoch,
            "producers_alive": self.leases.alive(self._now),
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (tests call it after every event; O(state) cost)."""
        train = dict(self.leases.train())
        self.pools.check({round_id: lease.prompt_id for round_id, lease in train.items()})
        for round_id, lease in train.items():
            in_flight = self.pools.active[lease.prompt_id].in_flight
            assert in_flight is not None and in_flight.round_id == round_id, f"round {round_id} untracked"
            assert (in_flight.producer_id, in_flight.deadline, in_flight.num_samples) == \
                (lease.producer, lease.deadline, lease.num_samples), f"round {round_id}: lease and round disagree"
            assert self.round_ids.issued(round_id), f"round {round_id} was never issued"
            assert 0 < in_flight.num_samples and in_flight.arrived <= set(range(in_flight.num_samples))
        self.leases.check()

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> bytes:
        """The whole state as msgpack bytes (arrays as raw bytes); `Scheduler.restore` reads it back."""
        version, internal, gauss = self._rng.getstate()
        pools, adm = self.pools, self.admission
        return codec.encode(codec.State(
            codec.FORMAT, len(self._prompts), self.sampling.group_size, self.sampling.exit_rule,
            [version, list(internal), gauss], adm.cursor, adm.next_prompt_id, self.round_ids.next_id,
            self._learner_version, pools.groups_consumed, list(pools.active.values()), list(pools.waiting.values()),
            dict(self._counts), dict(self._ignored), dict(pools.rounds_to_exit), dict(adm.history),
            (adm.positives, adm.samples), dict(self.sampling.exit_rule_params),
        ))

    @classmethod
    def restore(
        cls,
        data: bytes,
        sampling: SamplingConfig,
        buffer: BufferConfig,
        batch_size: int,
        prompts: Sequence[PromptRow],
        *,
        round_id_offset: int = 0,
    ) -> Scheduler:
        """A scheduler resumed from `snapshot()` bytes. Rounds in flight then are re-issued by `request_work`.
        Round ids continue at the snapshot's counter plus `round_id_offset` (a crashed buffer may have issued ids
        beyond the counter: the offset keeps a late result for one of them from ever matching a new round)."""
        if round_id_offset < 0:
            raise ValueError(f"round_id_offset must be >= 0, got {round_id_offset}")
        snap = codec.decode(data, sampling, len(prompts))
        sched = cls(sampling, buffer, batch_size, prompts, seed=0,
                    round_ids=RoundIds(snap.next_round_id + round_id_offset))
        version, internal, gauss = snap.rng_state
        sched._rng.setstate((version, tuple(internal), gauss))
        sched._learner_version = snap.learner_version
        sched._counts.update({k: v for k, v in snap.counts.items() if k in SCHEDULER_COUNTERS})
        sched.admission.load(snap.cursor, snap.next_prompt_id, snap.history, *snap.observed,
                             sched._counts["deferred"])
        sched._ignored.update({k: v for k, v in snap.ignored.items() if k in IGNORE_REASONS})
        sched.pools.groups_consumed = snap.groups_consumed
        sched.pools.rounds_to_exit = dict(snap.rounds_to_exit)
        sched.pools.load(snap.active, snap.waiting)
        return sched
