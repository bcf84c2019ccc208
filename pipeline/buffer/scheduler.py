"""The rollout buffer's decisions: which prompt gets the next round, when a prompt is released, what the learner gets.

`Scheduler` is synchronous, deterministic and clock-free: every event carries the caller's `now`, and the same
seed plus the same event log always produce the same groups. `BufferCore` wraps it; nothing here does I/O. The
exit rule is an object (`exit_rules.py`): the scheduler asks it for the round size, the exit condition, whether
rounds are kept whole, and the advantages.

Life of a prompt:
1. Admission. Prompts are handed out in the given order, wrapping around for further epochs; every admission
   gets a fresh prompt_id. A new prompt is admitted only while
       groups_waiting + prompts_active < (learner_version + max_staleness + 1) * batch_size - groups_consumed
   (AReaL's bound: with one batch consumed per version this is (max_staleness + 1) * batch_size groups
   generated but not yet trained; max_staleness = 0 is fully synchronous on-policy training).
2. Rounds. `request_work` first gives rounds to active prompts without a round in flight (oldest admitted first),
   then admits new prompts. A prompt has at most one round in flight; a round is the rule's round size (M; n for
   "fixed"). Round ids come from a `RoundIds` allocator that evaluation rounds share: no id serves two rounds.
3. Results. Only the result of a prompt's current round is accepted; duplicates (of a round already accepted,
   while its prompt is in the buffer), late results (after a re-issue, an abort or the prompt's exit) and unknown
   round ids are ignored and counted by reason. A result with the wrong number of samples is rejected and its
   round re-issued (`reject` does the same for a result the caller found unusable). Samples already too stale on
   arrival are evicted (whole rounds under a `whole_rounds` rule such as "fixed"). Then: exit rule holds (and
   the pool has >= n samples) -> release; rounds_completed >= max_rounds -> unresolved; otherwise the prompt
   waits for its next round (a pool that lost samples to staleness may need a round beyond max_rounds to hold
   the n samples a group needs).
4. Release. The pool is downsampled to n (buffer.downsample, with the scheduler's seeded rng) and advantages use
   the whole pool's mean (and std when normalize_std), or whatever the rule's `advantages` says ("fixed": the
   group's own statistics, pool == group).
   - A resolved pool whose rewards are all equal (e.g. "pos" with every sample correct, or a "fixed" group)
     carries no signal: dropped under unresolved="drop" (dropped_zero_variance), released under "keep"
     (the reference behaviour: a zero-advantage group).
   - An unresolved pool that still has signal is released with resolved=False (released_partial): dropping it
     would bias training toward easy prompts that exit fast. One with zero variance is dropped under "drop"
     (dropped_unresolved) and released (resolved=False, released_partial) under "keep".
5. Hand-off. `take_batch` gives exactly num_groups groups FIFO, or nothing. Every handed-out sample satisfies
   learner_version - sample.version <= max_staleness. The learner version moves only through
   `set_learner_version`, which returns the rounds it aborts.

Staleness: when the learner version rises, stale samples are evicted from active pools (a round that loses all
its samples is refunded, so staleness never exhausts a prompt's rounds); a waiting group holding a stale sample
is re-opened (its prompt goes back to active, with the stale samples evicted from its full pool, which is kept
until hand-off for this reason); rounds in flight issued at a now-stale version are aborted and re-issued.
Expiry: a round whose lease passed, or whose producer was silent for heartbeat_timeout_s, is re-issued.

The prompts' pools, their release and the hand-off live in `Pools` (pools.py); the Scheduler keeps admission,
the rounds in flight, the producers' liveness and the learner version.

Invariants (`check_invariants`): those of `Pools` (no admitted prompt is lost or counted twice; every waiting
group has n samples and the formula's advantages), and every round in flight belongs to exactly one active
prompt, every other active prompt being queued for one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pipeline import protocol as P
from pipeline.buffer.exit_rules import make_exit_rule
from pipeline.buffer.pools import MAX_ROUNDS_FACTOR, Pools, Released, SubmitOutcome
from pipeline.buffer.state import InFlight, PromptState, RoundIds, dec_hook, enc_hook
from pipeline.config import BufferConfig, SamplingConfig

__all__ = ["COUNTERS", "MAX_REJECTIONS", "MAX_ROUNDS_FACTOR", "Released", "Scheduler", "SubmitOutcome"]

SNAPSHOT_FORMAT = 1
MAX_REJECTIONS = 3  # a prompt whose results are rejected this often is given up on (counted as unservable)
COUNTERS = {  # every counter, declared once: metrics() reports each under its name
    "admitted": "prompts admitted (a new prompt id each time an example is served)",
    "released": "groups released (re-releases of re-opened groups included)",
    "released_partial": "groups released without the exit rule holding (after max_rounds)",
    "dropped_unresolved": "prompts given up on without a group (zero variance after max_rounds, or unservable)",
    "dropped_zero_variance": "prompts whose exit rule held on a pool with no signal, dropped (unresolved=drop)",
    "stale_evictions": "samples evicted from pools as too stale",
    "reopened": "waiting groups re-opened because a sample went stale",
    "rounds_issued": "rounds handed out (re-issues included)",
    "rounds_reissued": "rounds cancelled and offered again (expired, aborted, rejected, resumed)",
    "rounds_expired": "rounds whose lease ran out or whose producer went silent",
    "rounds_aborted": "rounds cancelled because their samples would be stale or their prompt was given up on",
    "results_rejected": "results with the wrong number of samples, or found unusable by the caller",
    "samples_received": "samples of accepted results",
    "positives_received": "positive samples of accepted results",
    "pool_samples_released": "pool samples behind the released groups",
    "prompts_unservable": "prompts dropped because producers could not serve them",
}
IGNORE_REASONS = ("duplicate", "late", "unknown")


class _Snapshot(msgspec.Struct):
    format: int
    num_prompts: int
    group_size: int
    exit_rule: str
    rng_state: list[Any]
    cursor: int
    next_prompt_id: int
    next_round_id: int
    learner_version: int
    groups_consumed: int
    active: list[PromptState]
    waiting: list[Released]
    counts: dict[str, int]
    ignored: dict[str, int]
    rounds_to_exit: dict[int, int]


class Scheduler:
    """The buffer's pure state machine. See the module docstring for the rules it follows."""

    def __init__(
        self,
        sampling: SamplingConfig,
        buffer: BufferConfig,
        batch_size: int,
        prompts: Sequence[tuple[str, str]],
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
        self.rule = make_exit_rule(sampling.exit_rule)
        self.round_size = self.rule.round_size(sampling)
        self.round_ids = RoundIds() if round_ids is None else round_ids
        self._prompts = prompts
        self._rng = random.Random(seed)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.pools = Pools(sampling, buffer, self.rule, self._rng, self._counts)
        self._cursor = 0  # prompts admitted so far; example index = cursor % len(prompts)
        self._next_prompt_id = 0
        self._learner_version = 0
        self._rounds: dict[int, int] = {}  # round_id in flight -> prompt_id, in issue order
        self._last_seen: dict[str, float] = {}
        self._now = -math.inf
        self._ignored = dict.fromkeys(IGNORE_REASONS, 0)
        self._rejections: dict[int, int] = {}  # prompt id -> results rejected (not snapshotted)

    # ------------------------------------------------------------ events

    def request_work(self, producer_id: str, max_rounds: int, now: float) -> list[P.RoundAssignment]:
        """Up to `max_rounds` rounds for `producer_id`: waiting active prompts first, then new admissions."""
        if max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
        self.heartbeat(producer_id, now)
        cap = self.buffer.max_rounds_in_flight
        out: list[P.RoundAssignment] = []
        while len(out) < max_rounds and (cap == 0 or len(self._rounds) < cap):
            st = self.pools.pop_ready()
            if st is None:
                if not self._admission_open():
                    break
                st = self._admit(now)
            out.append(self._issue(st, producer_id, now))
        return out

    def submit_result(
        self, producer_id: str, round_id: int, prompt_token_ids: np.ndarray, samples: list[P.Sample], now: float
    ) -> SubmitOutcome:
        """Accept (or ignore, or reject) the result of one round, and release the prompt if it is done."""
        self.heartbeat(producer_id, now)
        st = self._round_prompt(round_id)
        if st is None:
            return SubmitOutcome(self._ignore(round_id))
        if len(samples) != self.round_size:
            return self._reject(st, cannot_serve=not samples)
        del self._rounds[round_id]
        st.in_flight = None
        min_version = self._learner_version - self.buffer.max_staleness
        return self.pools.accept(st, round_id, prompt_token_ids, samples, min_version)

    def reject(self, producer_id: str, round_id: int, now: float) -> SubmitOutcome:
        """Reject the result of round `round_id` as unusable (e.g. a token id outside the vocabulary): the round is
        re-issued, and its prompt given up on after MAX_REJECTIONS. Ignored like any result if not in flight."""
        self.heartbeat(producer_id, now)
        st = self._round_prompt(round_id)
        return SubmitOutcome(self._ignore(round_id)) if st is None else self._reject(st, cannot_serve=False)

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
        for round_id, prompt_id in list(self._rounds.items()):  # in issue order
            st = self.pools.active[prompt_id]
            if version - st.in_flight.issued_version > self.buffer.max_staleness:
                aborted.append(round_id)
                self._counts["rounds_aborted"] += 1
                self._cancel(st, "rounds_reissued")
        self.pools.evict_stale(version - self.buffer.max_staleness)
        return aborted

    def heartbeat(self, producer_id: str, now: float) -> None:
        """Record that `producer_id` is alive at `now`."""
        self._tick(now)
        self._last_seen[producer_id] = max(now, self._last_seen.get(producer_id, -math.inf))

    def forget(self, producer_id: str) -> None:
        """Forget when `producer_id` was last heard of: the buffer bounds how many producers it keeps track of
        and lets idle ones go. Rounds it still held would then count as silent and expire."""
        self._last_seen.pop(producer_id, None)

    def is_silent(self, producer_id: str, now: float) -> bool:
        """Whether `producer_id` has not been heard of for more than buffer.heartbeat_timeout_s."""
        return now - self._last_seen.get(producer_id, -math.inf) > self.buffer.heartbeat_timeout_s

    def expire(self, now: float) -> list[int]:
        """Cancel rounds whose lease passed or whose producer went silent; returns their ids (re-offered later)."""
        self._tick(now)
        expired = []
        for round_id, prompt_id in list(self._rounds.items()):
            st = self.pools.active[prompt_id]
            assert st.in_flight is not None and st.in_flight.round_id == round_id
            if now > st.in_flight.deadline or self.is_silent(st.in_flight.producer_id, now):
                expired.append(round_id)
                self._counts["rounds_expired"] += 1
                self._cancel(st, "rounds_reissued")
        return expired

    # ------------------------------------------------------------ internals

    def _tick(self, now: float | None) -> None:
        if now is not None:
            self._now = max(self._now, now)

    def _round_prompt(self, round_id: int) -> PromptState | None:
        prompt_id = self._rounds.get(round_id)
        return None if prompt_id is None else self.pools.active[prompt_id]

    def _ignore(self, round_id: int) -> str:
        if round_id in self.pools.accepted_rounds:
            reason = "duplicate"
        elif self.round_ids.issued(round_id):
            reason = "late"  # re-issued, aborted, or its prompt exited before it arrived
        else:
            reason = "unknown"
        self._ignored[reason] += 1
        return reason

    def _reject(self, st: PromptState, cannot_serve: bool) -> SubmitOutcome:
        self._counts["results_rejected"] += 1
        # An empty result is the producer saying it cannot serve this prompt at all (e.g. longer than the
        # engine's max_model_len); a prompt rejected again and again would otherwise be re-issued forever.
        rejections = self._rejections[st.prompt_id] = self._rejections.get(st.prompt_id, 0) + 1
        if cannot_serve or rejections >= MAX_REJECTIONS:
            self._cancel(st, "rounds_aborted")
            del self._rejections[st.prompt_id]
            self.pools.drop(st, "prompts_unservable")
            return SubmitOutcome("rejected", dropped=True)
        self._cancel(st, "rounds_reissued")
        return SubmitOutcome("rejected")

    def _admission_open(self) -> bool:
        pools = self.pools
        bound = (self._learner_version + self.buffer.max_staleness + 1) * self.batch_size - pools.groups_consumed
        return len(pools.waiting) + len(pools.active) < bound

    def _admit(self, now: float) -> PromptState:
        example = self._cursor % len(self._prompts)
        prompt, answer = self._prompts[example]
        prompt_id = self._next_prompt_id
        self._next_prompt_id += 1
        self._cursor += 1
        st = PromptState(prompt_id, example, prompt, answer, admitted_at=now, admitted_order=prompt_id)
        self.pools.add(st)
        return st

    def _issue(self, st: PromptState, producer_id: str, now: float) -> P.RoundAssignment:
        round_id = self.round_ids.take()
        st.in_flight = InFlight(round_id, producer_id, self._learner_version, now + self.buffer.lease_s)
        st.rounds_issued += 1
        self._rounds[round_id] = st.prompt_id
        self._counts["rounds_issued"] += 1
        return P.RoundAssignment(round_id, st.prompt_id, st.prompt, st.answer, self.round_size, self.buffer.lease_s)

    def _cancel(self, st: PromptState, counter: str) -> None:
        assert st.in_flight is not None
        del self._rounds[st.in_flight.round_id]
        st.in_flight = None
        self._counts[counter] += 1
        self.pools.queue(st)

    # ------------------------------------------------------------ observation

    @property
    def learner_version(self) -> int:
        return self._learner_version

    @property
    def groups_waiting(self) -> int:
        return len(self.pools.waiting)

    def metrics(self) -> dict[str, Any]:
        """Every counter of COUNTERS, the gauges, and two dicts: `results_ignored`, `rounds_to_exit`."""
        c, pools = self._counts, self.pools
        received, released = c["samples_received"], c["released"]
        return {
            **c,
            "active": len(pools.active),
            "groups_waiting": len(pools.waiting),
            "groups_consumed": pools.groups_consumed,
            "rounds_in_flight": len(self._rounds),
            "results_ignored": dict(self._ignored),
            # every sample received (evicted ones and those of dropped prompts too) per group released: the cost
            "samples_per_released_group": received / released if released else 0.0,
            # the pool a group was built from (its advantage statistics), on average
            "pool_size_mean": c["pool_samples_released"] / released if released else 0.0,
            "rounds_to_exit": dict(sorted(pools.rounds_to_exit.items())),
            "positive_rate": c["positives_received"] / received if received else 0.0,
            "learner_version": self._learner_version,
            "epoch": self._cursor // len(self._prompts),
            "producers_alive": sum(not self.is_silent(p, self._now) for p in self._last_seen),
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (tests call it after every event; O(state) cost)."""
        self.pools.check(self._rounds)
        for round_id, prompt_id in self._rounds.items():
            in_flight = self.pools.active[prompt_id].in_flight
            assert in_flight is not None and in_flight.round_id == round_id, f"round {round_id} untracked"
            assert self.round_ids.issued(round_id), f"round {round_id} was never issued"

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> bytes:
        """The whole state as msgpack bytes (arrays as raw bytes); `Scheduler.restore` reads it back."""
        version, internal, gauss = self._rng.getstate()
        pools = self.pools
        snap = _Snapshot(
            SNAPSHOT_FORMAT, len(self._prompts), self.sampling.group_size, self.sampling.exit_rule,
            [version, list(internal), gauss], self._cursor, self._next_prompt_id, self.round_ids.next_id,
            self._learner_version, pools.groups_consumed, list(pools.active.values()), list(pools.waiting.values()),
            dict(self._counts), dict(self._ignored), dict(pools.rounds_to_exit),
        )
        return msgspec.msgpack.encode(snap, enc_hook=enc_hook)

    @classmethod
    def restore(
        cls,
        data: bytes,
        sampling: SamplingConfig,
        buffer: BufferConfig,
        batch_size: int,
        prompts: Sequence[tuple[str, str]],
        *,
        round_id_offset: int = 0,
    ) -> Scheduler:
        """A scheduler resumed from `snapshot()` bytes. Rounds in flight then are re-issued by `request_work`.
        Round ids continue at the snapshot's counter plus `round_id_offset` (a crashed buffer may have issued ids
        beyond the counter: the offset keeps a late result for one of them from ever matching a new round)."""
        if round_id_offset < 0:
            raise ValueError(f"round_id_offset must be >= 0, got {round_id_offset}")
        try:
            snap = msgspec.msgpack.decode(data, type=_Snapshot, dec_hook=dec_hook)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"not a buffer snapshot (or a corrupt one): {exc}") from None
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"snapshot format {snap.format} is not {SNAPSHOT_FORMAT}; start a fresh buffer")
        if snap.num_prompts != len(prompts):
            raise ValueError(f"the snapshot was taken over {snap.num_prompts} prompts but {len(prompts)} were given; "
                             "resume with the same data config and seed")
        if (snap.group_size, snap.exit_rule) != (sampling.group_size, sampling.exit_rule):
            raise ValueError(f"the snapshot used group_size={snap.group_size}, exit_rule={snap.exit_rule!r}; "
                             "resume with the same sampling.group_size and sampling.exit_rule")
        sched = cls(sampling, buffer, batch_size, prompts, seed=0,
                    round_ids=RoundIds(snap.next_round_id + round_id_offset))
        version, internal, gauss = snap.rng_state
        sched._rng.setstate((version, tuple(internal), gauss))
        sched._cursor, sched._next_prompt_id, sched._learner_version = snap.cursor, snap.next_prompt_id, \
            snap.learner_version
        sched._counts.update({k: v for k, v in snap.counts.items() if k in COUNTERS})
        sched._ignored.update({k: v for k, v in snap.ignored.items() if k in IGNORE_REASONS})
        sched.pools.groups_consumed = snap.groups_consumed
        sched.pools.rounds_to_exit = dict(snap.rounds_to_exit)
        sched.pools.load(snap.active, snap.waiting)
        return sched
