"""Where every admitted, unsettled prompt is: sampling (active), or released and waiting for the learner.

`Pools` owns what happens to a prompt's pool: a round's samples accepted (those already too stale evicted on
arrival), the release decision (exit rule, max_rounds, the hard cap), downsampling and advantages, waiting groups
re-opened when a sample goes stale, and the FIFO hand-off. The Scheduler decides who gets which round and when,
and keeps the rounds in flight and the learner version. Transitions are counted in the counters dict the
Scheduler passes in (its COUNTERS).

Invariants (`check`):
- admitted == (released - reopened) + dropped_unresolved + dropped_zero_variance + active, and
  released - reopened == waiting + groups_consumed: no admitted prompt is lost or counted twice;
- every active prompt is either in flight or queued for its next round (in admission order);
- `accepted_rounds` is exactly the accepted round ids of the live (active or waiting) prompts;
- every waiting group has n samples and advantages equal to the formula over its retained pool.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

import msgspec
import numpy as np

from pipeline import protocol as P
from pipeline.buffer import logic
from pipeline.buffer.exit_rules import ExitRule
from pipeline.buffer.state import PromptState
from pipeline.config import BufferConfig, SamplingConfig

MAX_ROUNDS_FACTOR = 2  # hard cap: a prompt is settled after this many times max_rounds accepted rounds


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    """What `Scheduler.submit_result` did with a result."""

    status: str  # "accepted" | "duplicate" | "late" | "unknown" | "rejected"
    group: P.Group | None = None  # the group this result released, if any
    dropped: bool = False  # this result ended the prompt without a group (zero variance under "drop")
    num_evicted: int = 0  # samples of the result that were already too stale

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


class Released(msgspec.Struct):
    """A released group waiting for the learner, with the full pool it came from (needed to re-open it)."""

    state: PromptState
    group: P.Group
    kept: list[int]  # pool indices of the group's samples


class Pools:
    """The active and waiting prompts; see the module docstring."""

    def __init__(self, sampling: SamplingConfig, buffer: BufferConfig, rule: ExitRule, rng: random.Random,
                 counts: dict[str, int]) -> None:
        self.sampling, self.buffer, self.rule, self.rng, self.counts = sampling, buffer, rule, rng, counts
        self.active: dict[int, PromptState] = {}
        self.waiting: dict[int, Released] = {}  # insertion order = release order (FIFO)
        self.accepted_rounds: set[int] = set()  # accepted round ids of live prompts (duplicate vs late)
        self.rounds_to_exit: dict[int, int] = {}  # accepted rounds -> prompts released after that many
        self.groups_consumed = 0
        self._ready: list[tuple[int, int]] = []  # heap of (admitted_order, prompt_id); stale entries skipped

    def add(self, st: PromptState) -> None:
        """A newly admitted prompt (its first round is issued at once, so it is not queued)."""
        self.active[st.prompt_id] = st
        self.counts["admitted"] += 1

    def queue(self, st: PromptState) -> None:
        """`st` waits for its next round."""
        heapq.heappush(self._ready, (st.admitted_order, st.prompt_id))

    def pop_ready(self) -> PromptState | None:
        """The oldest admitted active prompt without a round in flight, if any."""
        while self._ready:
            _, prompt_id = heapq.heappop(self._ready)
            st = self.active.get(prompt_id)
            if st is not None and st.in_flight is None:
                return st
        return None

    def accept(self, st: PromptState, round_id: int, prompt_token_ids: np.ndarray, samples: Sequence[P.Sample],
               min_version: int) -> SubmitOutcome:
        """Add the samples of `st`'s round `round_id` (no longer in flight) to its pool; release or queue it."""
        self.accepted_rounds.add(round_id)
        self.counts["samples_received"] += len(samples)
        threshold = self.sampling.positive_threshold
        self.counts["positives_received"] += sum(logic.is_positive(s.reward, threshold) for s in samples)
        if st.prompt_token_ids.size == 0:
            st.prompt_token_ids = np.asarray(prompt_token_ids, dtype=np.int32)
        fresh = [s for s in samples if s.version >= min_version]
        if self.rule.whole_rounds and len(fresh) < len(samples):
            fresh = []
        evicted = len(samples) - len(fresh)
        self.counts["stale_evictions"] += evicted
        st.add_round(round_id, fresh, threshold)
        group, dropped = self._settle(st)
        return SubmitOutcome("accepted", group, dropped, evicted)

    def drop(self, st: PromptState, reason: str = "") -> None:
        """Give up on an active prompt without a group (counted as dropped_unresolved, and under `reason`)."""
        del self.active[st.prompt_id]
        self.counts["dropped_unresolved"] += 1
        if reason:
            self.counts[reason] += 1
        self.accepted_rounds.difference_update(st.accepted_round_ids)

    def evict_stale(self, min_version: int) -> None:
        """Evict samples older than `min_version` from active pools (a round that loses all its samples is
        refunded) and re-open waiting groups that hold one (evicted from their full pool, then settled again)."""
        whole = self.rule.whole_rounds
        for st in self.active.values():
            self.counts["stale_evictions"] += st.evict_older_than(min_version, whole_rounds=whole)
        for prompt_id, rel in list(self.waiting.items()):
            if any(s.version < min_version for s in rel.group.samples):
                del self.waiting[prompt_id]
                self.counts["reopened"] += 1
                st = rel.state
                self.counts["stale_evictions"] += st.evict_older_than(min_version, whole_rounds=whole)
                self.active[prompt_id] = st
                self._settle(st)  # may release it again at once if its fresh samples still suffice

    def take(self, num_groups: int, learner_version: int) -> list[P.Group] | None:
        """Exactly `num_groups` waiting groups (FIFO), or None if fewer wait."""
        if len(self.waiting) < num_groups:
            return None
        groups = []
        for prompt_id in list(islice(self.waiting, num_groups)):
            rel = self.waiting.pop(prompt_id)
            self.accepted_rounds.difference_update(rel.state.accepted_round_ids)  # only live prompts are tracked
            for s in rel.group.samples:
                assert learner_version - s.version <= self.buffer.max_staleness, (prompt_id, s.version)
            groups.append(rel.group)
        self.groups_consumed += num_groups
        return groups

    def load(self, active: Sequence[PromptState], waiting: Sequence[Released]) -> None:
        """Fill empty pools from a snapshot: active prompts are queued (their rounds in flight, if any, are
        counted as re-issued: the producers that held them may be gone)."""
        assert not self.active and not self.waiting
        for st in active:
            if st.in_flight is not None:
                st.in_flight = None
                self.counts["rounds_reissued"] += 1
            self.active[st.prompt_id] = st
            self.accepted_rounds.update(st.accepted_round_ids)
            self.queue(st)
        self.waiting = {rel.state.prompt_id: rel for rel in waiting}
        for rel in waiting:
            self.accepted_rounds.update(rel.state.accepted_round_ids)

    def _settle(self, st: PromptState) -> tuple[P.Group | None, bool]:
        n = self.sampling.group_size
        if len(st.pool) >= n and self.rule.reached(st.num_pos, st.num_neg, n):
            return self._release(st, resolved=True)
        limit = self.sampling.max_rounds
        # Refunded rounds (samples evicted as stale) do not count toward max_rounds, so a hard prompt is not given
        # up on because the learner moved on; but every accepted round is evidence, and past MAX_ROUNDS_FACTOR x
        # max_rounds of it the prompt is settled with what its pool holds (a hard cap on its cost).
        capped = st.rounds_accepted >= MAX_ROUNDS_FACTOR * limit
        if (st.rounds_completed >= limit or capped) and len(st.pool) >= n:
            return self._release(st, resolved=False)
        if capped:  # not even n fresh samples left: drop it (counted as unresolved)
            self.drop(st)
            return None, True
        self.queue(st)
        return None, False

    def _release(self, st: PromptState, resolved: bool) -> tuple[P.Group | None, bool]:
        del self.active[st.prompt_id]
        rewards = st.rewards()
        if not logic.has_signal(rewards) and self.buffer.unresolved == "drop":
            self.counts["dropped_zero_variance" if resolved else "dropped_unresolved"] += 1
            self.accepted_rounds.difference_update(st.accepted_round_ids)
            return None, True
        kept = logic.downsample(rewards, st.versions(), self.sampling.group_size, self.buffer.downsample,
                                self.sampling.positive_threshold, self.rng)
        group = st.build_group(kept, self.rule.advantages(rewards, kept, self.buffer.normalize_std), resolved)
        self.waiting[st.prompt_id] = Released(st, group, kept)
        self.counts["released"] += 1
        self.counts["released_partial"] += not resolved
        self.counts["pool_samples_released"] += len(rewards)
        # all accepted rounds, stale ones included: the cost of the prompt, not what its group was built from
        self.rounds_to_exit[st.rounds_accepted] = self.rounds_to_exit.get(st.rounds_accepted, 0) + 1
        return group, False

    def check(self, in_flight: Mapping[int, int]) -> None:
        """Assert the invariants in the module docstring; `in_flight` maps round ids in flight to prompt ids."""
        c = self.counts
        dropped = c["dropped_unresolved"] + c["dropped_zero_variance"]
        assert c["admitted"] == c["released"] - c["reopened"] + dropped + len(self.active), "a prompt was lost"
        assert c["released"] - c["reopened"] == len(self.waiting) + self.groups_consumed, "release accounting"
        queued = {pid for _, pid in self._ready}
        for prompt_id, st in self.active.items():
            st.check()
            if st.in_flight is None:
                assert prompt_id in queued, f"active prompt {prompt_id} is neither in flight nor queued"
            else:
                assert in_flight.get(st.in_flight.round_id) == prompt_id, f"round of {prompt_id} untracked"
        assert len(in_flight) == sum(st.in_flight is not None for st in self.active.values())
        live = [*self.active.values(), *(rel.state for rel in self.waiting.values())]
        assert self.accepted_rounds == {r for st in live for r in st.accepted_round_ids}, "accepted round ids"
        n = self.sampling.group_size
        for rel in self.waiting.values():
            rewards = rel.state.rewards()
            assert len(rel.group.samples) == n == len(rel.kept)
            assert [s.reward for s in rel.group.samples] == [rewards[i] for i in rel.kept]
            assert self.buffer.unresolved == "keep" or logic.has_signal(rewards), "zero-variance pool released"
            expected = logic.pool_advantages(rewards, rel.kept, self.buffer.normalize_std)
            assert all(abs(a - b) <= 1e-9 for a, b in zip(rel.group.advantages, expected)), "advantage formula"
