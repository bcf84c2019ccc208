"""The rollout buffer's decisions: which prompt gets the next round, when a prompt is released, what the learner gets.

`Scheduler` is synchronous, deterministic and clock-free: every event carries the caller's `now`, and the same
seed plus the same event log always produce the same groups. The ZeroMQ service wraps it; nothing here does I/O.

Life of a prompt:
1. Admission. Prompts are handed out in the given order, wrapping around for further epochs; every admission
   gets a fresh prompt_id. A new prompt is admitted only while
       groups_waiting + prompts_active < (learner_version + max_staleness + 1) * batch_size - groups_consumed
   (AReaL's bound: with one batch consumed per version this is (max_staleness + 1) * batch_size groups
   generated but not yet trained; max_staleness = 0 is fully synchronous on-policy training).
2. Rounds. `request_work` first gives rounds to active prompts without a round in flight (oldest admitted first),
   then admits new prompts. A prompt has at most one round in flight; a round is M samples (n for "fixed").
3. Results. Only the result of a prompt's current round is accepted; duplicates (of a round already accepted,
   while its prompt is in the buffer), late results (after a re-issue, an abort or the prompt's exit) and unknown
   round ids are ignored and counted by reason. A result with the wrong number of samples is
   rejected and its round re-issued. Samples already too stale on arrival are evicted (for "fixed", with their
   whole round). Then: exit rule holds (and the pool has >= n samples) -> release; rounds_completed >= max_rounds
   -> unresolved; otherwise the prompt waits for its next round (a pool that lost samples to staleness may
   need a round beyond max_rounds to hold the n samples a group needs).
4. Release. The pool is downsampled to n (buffer.downsample, with the scheduler's seeded rng) and advantages use
   the whole pool's mean (and std when normalize_std); "fixed" uses the group's own statistics (pool == group).
   - A resolved pool whose rewards are all equal (e.g. "pos" with every sample correct, or a "fixed" group)
     carries no signal: dropped under unresolved="drop" (dropped_zero_variance), released under "keep"
     (the reference behaviour: a zero-advantage group).
   - An unresolved pool that still has signal is released with resolved=False (released_partial): dropping it
     would bias training toward easy prompts that exit fast. One with zero variance is dropped under "drop"
     (dropped_unresolved) and released (resolved=False, released_partial) under "keep".
5. Hand-off. `take_batch` gives exactly num_groups groups FIFO, or nothing. Every handed-out sample satisfies
   learner_version - sample.version <= max_staleness.

Staleness: when the learner version rises, stale samples are evicted from active pools (a round that loses all
its samples is refunded, so staleness never exhausts a prompt's rounds); a waiting group holding a stale sample
is re-opened (its prompt goes back to active, with the stale samples evicted from its full pool, which is kept
until hand-off for this reason); rounds in flight issued at a now-stale version are aborted and re-issued.
Expiry: a round whose lease passed, or whose producer was silent for heartbeat_timeout_s, is re-issued.

Invariants (`check_invariants`):
- admitted == (released - reopened) + dropped_unresolved + dropped_zero_variance + active, and
  released - reopened == groups_waiting + groups_consumed: no admitted prompt is lost or counted twice;
- every waiting group has n samples and advantages equal to the formula over its retained pool;
- every round in flight belongs to exactly one active prompt, and every other active prompt is queued for one.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import msgspec
import numpy as np

from pipeline.buffer import logic
from pipeline.buffer.state import InFlight, PromptState, dec_hook, enc_hook
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Group, RoundAssignment, Sample

SNAPSHOT_FORMAT = 1
MAX_ROUNDS_FACTOR = 2  # hard cap: a prompt is settled after this many times max_rounds accepted rounds
MAX_REJECTIONS = 3  # a prompt whose results are rejected this often is given up on (counted as unservable)
_COUNTERS = (
    "admitted", "released", "released_partial", "dropped_unresolved", "dropped_zero_variance", "stale_evictions",
    "reopened", "rounds_issued", "rounds_reissued", "rounds_expired", "rounds_aborted", "results_rejected",
    "samples_received", "positives_received", "pool_samples_released", "prompts_unservable",
)
_IGNORE_REASONS = ("duplicate", "late", "unknown")


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    """What `submit_result` did with a result."""

    status: str  # "accepted" | "duplicate" | "late" | "unknown" | "rejected"
    group: Group | None = None  # the group this result released, if any
    dropped: bool = False  # this result ended the prompt without a group (zero variance under "drop")
    num_evicted: int = 0  # samples of the result that were already too stale

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


class Released(msgspec.Struct):
    """A released group waiting for the learner, with the full pool it came from (needed to re-open it)."""

    state: PromptState
    group: Group
    kept: list[int]  # pool indices of the group's samples


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
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (groups per learner step), got {batch_size}")
        if len(prompts) == 0:
            raise ValueError("the scheduler needs at least one (prompt, answer) pair; check data.train_files")
        self.sampling = sampling
        self.buffer = buffer
        self.batch_size = batch_size
        self._prompts = prompts
        self._fixed = sampling.exit_rule == "fixed"
        self.round_size = sampling.group_size if self._fixed else sampling.round_size
        self._rng = random.Random(seed)
        self._cursor = 0  # prompts admitted so far; example index = cursor % len(prompts)
        self._next_prompt_id = 0
        self._next_round_id = 0
        self._learner_version = 0
        self._groups_consumed = 0
        self._active: dict[int, PromptState] = {}
        self._waiting: dict[int, Released] = {}  # insertion order = release order (FIFO)
        self._rounds: dict[int, int] = {}  # round_id in flight -> prompt_id, in issue order
        self._accepted_rounds: set[int] = set()  # accepted round ids of live prompts (duplicate vs late)
        self._ready: list[tuple[int, int]] = []  # heap of (admitted_order, prompt_id); stale entries skipped
        self._last_seen: dict[str, float] = {}
        self._now = -math.inf
        self._pending_aborts: list[int] = []
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._ignored = dict.fromkeys(_IGNORE_REASONS, 0)
        self._rounds_to_exit: dict[int, int] = {}
        self._rejections: dict[int, int] = {}  # prompt id -> results rejected (not snapshotted)

    # ------------------------------------------------------------ events

    def request_work(self, producer_id: str, max_rounds: int, now: float) -> list[RoundAssignment]:
        """Up to `max_rounds` rounds for `producer_id`: waiting active prompts first, then new admissions."""
        if max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
        self.heartbeat(producer_id, now)
        cap = self.buffer.max_rounds_in_flight
        out: list[RoundAssignment] = []
        while len(out) < max_rounds and (cap == 0 or len(self._rounds) < cap):
            st = self._pop_ready()
            if st is None:
                if not self._admission_open():
                    break
                st = self._admit(now)
            out.append(self._issue(st, producer_id, now))
        return out

    def submit_result(
        self, producer_id: str, round_id: int, prompt_token_ids: np.ndarray, samples: list[Sample], now: float
    ) -> SubmitOutcome:
        """Accept (or ignore, or reject) the result of one round, and release the prompt if it is done."""
        self.heartbeat(producer_id, now)
        prompt_id = self._rounds.get(round_id)
        if prompt_id is None:
            if round_id in self._accepted_rounds:
                reason = "duplicate"
            elif 0 <= round_id < self._next_round_id:
                reason = "late"  # re-issued, aborted, or its prompt exited before it arrived
            else:
                reason = "unknown"
            self._ignored[reason] += 1
            return SubmitOutcome(reason)
        st = self._active[prompt_id]
        if len(samples) != self.round_size:
            self._counts["results_rejected"] += 1
            # An empty result is the producer saying it cannot serve this prompt at all (e.g. longer than the
            # engine's max_model_len); a prompt rejected again and again would otherwise be re-issued forever.
            self._rejections[prompt_id] = self._rejections.get(prompt_id, 0) + 1
            if not samples or self._rejections[prompt_id] >= MAX_REJECTIONS:
                self._cancel(st, "rounds_aborted")
                self._drop(st, "prompts_unservable")
                return SubmitOutcome("rejected", dropped=True)
            self._cancel(st, "rounds_reissued")
            return SubmitOutcome("rejected")
        del self._rounds[round_id]
        st.in_flight = None
        self._accepted_rounds.add(round_id)
        self._counts["samples_received"] += len(samples)
        self._counts["positives_received"] += sum(
            logic.is_positive(s.reward, self.sampling.positive_threshold) for s in samples
        )
        if st.prompt_token_ids.size == 0:
            st.prompt_token_ids = np.asarray(prompt_token_ids, dtype=np.int32)
        min_version = self._learner_version - self.buffer.max_staleness
        fresh = [s for s in samples if s.version >= min_version]
        if self._fixed and len(fresh) < len(samples):
            fresh = []  # a GRPO group is one whole round
        evicted = len(samples) - len(fresh)
        self._counts["stale_evictions"] += evicted
        st.add_round(round_id, fresh, self.sampling.positive_threshold)
        group, dropped = self._after_update(st)
        return SubmitOutcome("accepted", group, dropped, evicted)

    def take_batch(self, learner_version: int, num_groups: int, now: float | None = None) -> list[Group] | None:
        """Exactly `num_groups` waiting groups (FIFO) trainable at `learner_version`, or None if fewer wait.

        Sets the learner version first, like `set_learner_version`; the rounds that aborts are queued for
        `pop_aborts` (this method's return value has no room for them).
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self._pending_aborts.extend(self.set_learner_version(learner_version, now))
        if len(self._waiting) < num_groups:
            return None
        groups = []
        for prompt_id in list(islice(self._waiting, num_groups)):
            rel = self._waiting.pop(prompt_id)
            self._accepted_rounds.difference_update(rel.state.accepted_round_ids)  # only live prompts are tracked
            group = rel.group
            for s in group.samples:
                assert self._learner_version - s.version <= self.buffer.max_staleness, (prompt_id, s.version)
            groups.append(group)
        self._groups_consumed += num_groups
        return groups

    def set_learner_version(self, version: int, now: float | None = None) -> list[int]:
        """Raise the learner version: evict stale samples, re-open stale waiting groups, abort stale rounds.

        Returns the round ids aborted (their results will be ignored; their prompts get new rounds). A version
        not above the current one is ignored.
        """
        if version < 0:
            raise ValueError(f"learner version must be >= 0, got {version}")
        self._tick(now)
        if version <= self._learner_version:
            return []
        self._learner_version = version
        min_version = version - self.buffer.max_staleness
        for st in self._active.values():
            self._counts["stale_evictions"] += st.evict_older_than(min_version, whole_rounds=self._fixed)
        aborted = []
        for round_id, prompt_id in list(self._rounds.items()):  # in issue order
            st = self._active[prompt_id]
            if version - st.in_flight.issued_version > self.buffer.max_staleness:
                aborted.append(round_id)
                self._counts["rounds_aborted"] += 1
                self._cancel(st, "rounds_reissued")
        for prompt_id, rel in list(self._waiting.items()):
            if any(s.version < min_version for s in rel.group.samples):
                del self._waiting[prompt_id]
                self._counts["reopened"] += 1
                st = rel.state
                self._counts["stale_evictions"] += st.evict_older_than(min_version, whole_rounds=self._fixed)
                self._active[prompt_id] = st
                self._after_update(st)  # may release it again at once if its fresh samples still suffice
        return aborted

    def heartbeat(self, producer_id: str, now: float) -> None:
        """Record that `producer_id` is alive at `now`."""
        self._tick(now)
        self._last_seen[producer_id] = max(now, self._last_seen.get(producer_id, -math.inf))

    def expire(self, now: float) -> list[int]:
        """Cancel rounds whose lease passed or whose producer went silent; returns their ids (re-offered later)."""
        self._tick(now)
        expired = []
        for round_id, prompt_id in list(self._rounds.items()):
            st = self._active[prompt_id]
            assert st.in_flight is not None and st.in_flight.round_id == round_id
            silent = now - self._last_seen.get(st.in_flight.producer_id, -math.inf)
            if now > st.in_flight.deadline or silent > self.buffer.heartbeat_timeout_s:
                expired.append(round_id)
                self._counts["rounds_expired"] += 1
                self._cancel(st, "rounds_reissued")
        return expired

    def pop_aborts(self) -> list[int]:
        """Round ids aborted inside `take_batch` since the last call (the service broadcasts an Abort for them)."""
        out, self._pending_aborts = self._pending_aborts, []
        return out

    # ------------------------------------------------------------ internals

    def _tick(self, now: float | None) -> None:
        if now is not None:
            self._now = max(self._now, now)

    def _admission_open(self) -> bool:
        bound = (self._learner_version + self.buffer.max_staleness + 1) * self.batch_size - self._groups_consumed
        return len(self._waiting) + len(self._active) < bound

    def _admit(self, now: float) -> PromptState:
        example = self._cursor % len(self._prompts)
        prompt, answer = self._prompts[example]
        prompt_id = self._next_prompt_id
        self._next_prompt_id += 1
        self._cursor += 1
        st = PromptState(prompt_id, example, prompt, answer, admitted_at=now, admitted_order=prompt_id)
        self._active[prompt_id] = st
        self._counts["admitted"] += 1
        return st

    def _issue(self, st: PromptState, producer_id: str, now: float) -> RoundAssignment:
        round_id = self._next_round_id
        self._next_round_id += 1
        st.in_flight = InFlight(round_id, producer_id, self._learner_version, now + self.buffer.lease_s)
        st.rounds_issued += 1
        self._rounds[round_id] = st.prompt_id
        self._counts["rounds_issued"] += 1
        return RoundAssignment(round_id, st.prompt_id, st.prompt, st.answer, self.round_size, self.buffer.lease_s)

    def _pop_ready(self) -> PromptState | None:
        while self._ready:
            _, prompt_id = heapq.heappop(self._ready)
            st = self._active.get(prompt_id)
            if st is not None and st.in_flight is None:
                return st
        return None

    def _queue(self, st: PromptState) -> None:
        heapq.heappush(self._ready, (st.admitted_order, st.prompt_id))

    def _cancel(self, st: PromptState, counter: str) -> None:
        assert st.in_flight is not None
        del self._rounds[st.in_flight.round_id]
        st.in_flight = None
        self._counts[counter] += 1
        self._queue(st)

    def _after_update(self, st: PromptState) -> tuple[Group | None, bool]:
        n = self.sampling.group_size
        if len(st.pool) >= n and logic.exit_reached(st.num_pos, st.num_neg, self.sampling.exit_rule, n):
            return self._release(st, resolved=True)
        limit = self.sampling.max_rounds
        # Refunded rounds (samples evicted as stale) do not count toward max_rounds, so a hard prompt is not given
        # up on because the learner moved on; but every accepted round is evidence, and past MAX_ROUNDS_FACTOR x
        # max_rounds of it the prompt is settled with what its pool holds (a hard cap on its cost).
        capped = st.rounds_accepted >= MAX_ROUNDS_FACTOR * limit
        if (st.rounds_completed >= limit or capped) and len(st.pool) >= n:
            return self._release(st, resolved=False)
        if capped:  # not even n fresh samples left: drop it (counted as unresolved)
            self._drop(st)
            return None, True
        self._queue(st)
        return None, False

    def _drop(self, st: PromptState, reason: str = "") -> None:
        """Give up on an active prompt without a group (counted as dropped_unresolved, and under `reason`)."""
        del self._active[st.prompt_id]
        self._rejections.pop(st.prompt_id, None)
        self._counts["dropped_unresolved"] += 1
        if reason:
            self._counts[reason] += 1
        self._accepted_rounds.difference_update(st.accepted_round_ids)

    def _release(self, st: PromptState, resolved: bool) -> tuple[Group | None, bool]:
        del self._active[st.prompt_id]
        rewards = st.rewards()
        if not logic.has_signal(rewards) and self.buffer.unresolved == "drop":
            self._counts["dropped_zero_variance" if resolved else "dropped_unresolved"] += 1
            self._accepted_rounds.difference_update(st.accepted_round_ids)
            return None, True
        n = self.sampling.group_size
        kept = logic.downsample(
            rewards, st.versions(), n, self.buffer.downsample, self.sampling.positive_threshold, self._rng
        )
        if self._fixed:
            assert len(rewards) == n, "a fixed (GRPO) pool is exactly one round of n"
            advantages = logic.group_advantages([rewards[i] for i in kept], self.buffer.normalize_std)
        else:
            advantages = logic.pool_advantages(rewards, kept, self.buffer.normalize_std)
        group = st.build_group(kept, advantages, resolved)
        self._waiting[st.prompt_id] = Released(st, group, kept)
        self._counts["released"] += 1
        self._counts["released_partial"] += not resolved
        self._counts["pool_samples_released"] += len(rewards)
        # all accepted rounds, stale ones included: the cost of the prompt, not what its group was built from
        self._rounds_to_exit[st.rounds_accepted] = self._rounds_to_exit.get(st.rounds_accepted, 0) + 1
        return group, False

    # ------------------------------------------------------------ observation

    @property
    def learner_version(self) -> int:
        return self._learner_version

    @property
    def groups_waiting(self) -> int:
        return len(self._waiting)

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges; `results_ignored` and `rounds_to_exit` are dicts (see `flat_metrics`)."""
        c = self._counts
        hb = self.buffer.heartbeat_timeout_s
        return {
            "active": len(self._active),
            "admitted": c["admitted"],
            "released": c["released"],
            "released_partial": c["released_partial"],
            "dropped_unresolved": c["dropped_unresolved"],
            "dropped_zero_variance": c["dropped_zero_variance"],
            "stale_evictions": c["stale_evictions"],
            "reopened": c["reopened"],
            "groups_waiting": len(self._waiting),
            "groups_consumed": self._groups_consumed,
            "rounds_in_flight": len(self._rounds),
            "rounds_issued": c["rounds_issued"],
            "rounds_reissued": c["rounds_reissued"],
            "rounds_expired": c["rounds_expired"],
            "rounds_aborted": c["rounds_aborted"],
            "results_rejected": c["results_rejected"],
            "prompts_unservable": c["prompts_unservable"],
            "results_ignored": dict(self._ignored),
            "samples_received": c["samples_received"],
            # every sample received (evicted ones and those of dropped prompts too) per group released: the cost
            "samples_per_released_group": c["samples_received"] / c["released"] if c["released"] else 0.0,
            # the pool a group was built from (its advantage statistics), on average
            "pool_size_mean": c["pool_samples_released"] / c["released"] if c["released"] else 0.0,
            "rounds_to_exit": dict(sorted(self._rounds_to_exit.items())),
            "positive_rate": c["positives_received"] / c["samples_received"] if c["samples_received"] else 0.0,
            "positives_received": c["positives_received"],
            "learner_version": self._learner_version,
            "epoch": self._cursor // len(self._prompts),
            "producers_alive": sum(self._now - t <= hb for t in self._last_seen.values()),
        }

    def flat_metrics(self) -> dict[str, float]:
        """`metrics()` with the dicts flattened (`results_ignored.late`, `rounds_to_exit.2`), all floats."""
        out: dict[str, float] = {}
        for key, value in self.metrics().items():
            if isinstance(value, dict):
                out.update({f"{key}.{k}": float(v) for k, v in value.items()})
            else:
                out[key] = float(value)
        return out

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (tests call it after every event; O(state) cost)."""
        c = self._counts
        dropped = c["dropped_unresolved"] + c["dropped_zero_variance"]
        assert c["admitted"] == c["released"] - c["reopened"] + dropped + len(self._active), "a prompt was lost"
        assert c["released"] - c["reopened"] == len(self._waiting) + self._groups_consumed, "release accounting"
        queued = {pid for _, pid in self._ready}
        for prompt_id, st in self._active.items():
            st.check()
            if st.in_flight is None:
                assert prompt_id in queued, f"active prompt {prompt_id} is neither in flight nor queued"
            else:
                assert self._rounds.get(st.in_flight.round_id) == prompt_id, f"round of {prompt_id} untracked"
        assert len(self._rounds) == sum(st.in_flight is not None for st in self._active.values())
        live = [st for st in self._active.values()] + [rel.state for rel in self._waiting.values()]
        assert self._accepted_rounds == {r for st in live for r in st.accepted_round_ids}, "accepted round ids"
        n = self.sampling.group_size
        for rel in self._waiting.values():
            rewards = rel.state.rewards()
            assert len(rel.group.samples) == n == len(rel.kept)
            assert [s.reward for s in rel.group.samples] == [rewards[i] for i in rel.kept]
            assert self.buffer.unresolved == "keep" or logic.has_signal(rewards), "zero-variance pool released"
            expected = logic.pool_advantages(rewards, rel.kept, self.buffer.normalize_std)
            assert all(abs(a - b) <= 1e-9 for a, b in zip(rel.group.advantages, expected)), "advantage formula"

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> bytes:
        """The whole state as msgpack bytes (arrays as raw bytes); `Scheduler.restore` reads it back."""
        version, internal, gauss = self._rng.getstate()
        snap = _Snapshot(
            SNAPSHOT_FORMAT, len(self._prompts), self.sampling.group_size, self.sampling.exit_rule,
            [version, list(internal), gauss], self._cursor, self._next_prompt_id, self._next_round_id,
            self._learner_version, self._groups_consumed, list(self._active.values()), list(self._waiting.values()),
            dict(self._counts), dict(self._ignored), dict(self._rounds_to_exit),
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
    ) -> Scheduler:
        """A scheduler resumed from `snapshot()` bytes. Rounds in flight then are re-issued by `request_work`."""
        try:
            snap = msgspec.msgpack.decode(data, type=_Snapshot, dec_hook=dec_hook)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"not a buffer snapshot (or a corrupt one): {exc}") from None
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"snapshot format {snap.format} is not {SNAPSHOT_FORMAT}; start a fresh buffer")
        if snap.num_prompts != len(prompts):
            raise ValueError(
                f"the snapshot was taken over {snap.num_prompts} prompts but {len(prompts)} were given; "
                "resume with the same data config and seed"
            )
        if (snap.group_size, snap.exit_rule) != (sampling.group_size, sampling.exit_rule):
            raise ValueError(
                f"the snapshot used group_size={snap.group_size}, exit_rule={snap.exit_rule!r}; "
                "resume with the same sampling.group_size and sampling.exit_rule"
            )
        sched = cls(sampling, buffer, batch_size, prompts, seed=0)
        version, internal, gauss = snap.rng_state
        sched._rng.setstate((version, tuple(internal), gauss))
        sched._cursor, sched._next_prompt_id = snap.cursor, snap.next_prompt_id
        sched._next_round_id, sched._learner_version = snap.next_round_id, snap.learner_version
        sched._groups_consumed = snap.groups_consumed
        sched._counts.update(snap.counts)
        sched._ignored.update(snap.ignored)
        sched._rounds_to_exit = dict(snap.rounds_to_exit)
        for st in snap.active:
            if st.in_flight is not None:
                st.in_flight = None  # its producer may be gone: the round is simply issued again
                sched._counts["rounds_reissued"] += 1
            sched._active[st.prompt_id] = st
            sched._accepted_rounds.update(st.accepted_round_ids)
            sched._queue(st)
        sched._waiting = {rel.state.prompt_id: rel for rel in snap.waiting}
        for rel in snap.waiting:
            sched._accepted_rounds.update(rel.state.accepted_round_ids)
        return sched
