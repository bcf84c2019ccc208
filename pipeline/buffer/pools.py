"""Where every admitted, unsettled prompt is: sampling (active), or released and waiting for the learner.

`Pools` owns what happens to a prompt's pool: the samples of its round in flight received (each once, those
already too stale evicted), the exit rule checked as they join the pool, the release decision (exit rule, the
allocation policy's budget, the hard cap), downsampling and advantages, waiting groups re-opened when a sample
goes stale, and the FIFO hand-off. The Scheduler decides who gets which round and when, and keeps the rounds in
flight and the learner version. Transitions are counted in the counters dict the Scheduler passes in (its
SCHEDULER_COUNTERS).

When samples join a pool (sampling.exit_check; a rule with `whole_rounds`, GRPO, always uses "round"):
- "round": all of a round's samples, in issue order, once its last one arrived; the exit rule is checked then;
- "prefix": one at a time along the longest finished prefix of the round in issue order, the exit rule checked
  after each: which samples a group can keep then depends on rewards only, never on how long a sample took;
- "sample": each as it arrives, the exit rule checked after each: exits soonest, but a pool then favours the
  samples that finished first, the short ones.
Once the rule holds, the round's samples that have not joined are discarded (counted, with their tokens) and the
ones still running are cut (the Scheduler aborts them).

The ledger (ledger.py): every sample that leaves a pool, or never joins one, is given its fate here (`fates`):
trained and downsampled at hand-off, stale at eviction, dropped and zero_variance with their prompt, exit_cut when
discarded, refused when a duplicate; a round cut by the exit rule is remembered so that its stragglers are too.

Invariants (`check`):
- admitted == (released - reopened) + dropped_unresolved + dropped_zero_variance + active, and
  released - reopened == waiting + groups_consumed: no admitted prompt is lost or counted twice;
- every active prompt is either in flight or queued for its next round (in admission order);
- `accepted_rounds` is exactly the accepted round ids of the live (active or waiting) prompts, `cut_rounds` those
  of them closed before all their samples arrived (cut by the exit rule, or cancelled: a straggler is late, not
  a duplicate);
- every waiting group has n samples and advantages equal to the formula over its retained pool; a resolved one
  satisfies the exit rule on its pool;
- the ledger's arrived samples less those given a fate are exactly what the live pools and the held samples of
  rounds in flight hold, in samples and in tokens.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

import msgspec
import numpy as np

from pipeline import protocol as P
from pipeline.buffer.ledger import Fates, num_tokens
from pipeline.buffer.policy import Allocation, ExitRule, Prior, downsample, has_signal, is_positive
from pipeline.buffer.state import History, InFlight, PromptState
from pipeline.config import BufferConfig, SamplingConfig


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    """What `Scheduler.submit_result` did with a result."""

    status: str  # "accepted" | "duplicate" | "late" | "unknown" | "rejected"
    group: P.Group | None = None  # the group this result released, if any
    dropped: bool = False  # this result ended the prompt without a group (zero variance under "drop")
    num_evicted: int = 0  # samples of the result that were already too stale
    aborted: tuple[int, ...] = ()  # rounds the exit rule cut short: their running samples must be aborted

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

    def __init__(self, sampling: SamplingConfig, buffer: BufferConfig, rule: ExitRule, policy: Allocation,
                 rng: random.Random, counts: dict[str, int], *,
                 context: Callable[[PromptState], tuple[History, Prior]]) -> None:
        """`context(st)`: what the policy needs besides `st`'s pool to decide whether to give up on it (its
        example's history, the population prior); the Scheduler's, which keeps both."""
        self.sampling, self.buffer, self.rule, self.policy, self.rng, self.counts = \
            sampling, buffer, rule, policy, rng, counts
        self.context = context
        self.exit_check = "round" if rule.whole_rounds else sampling.exit_check
        self.active: dict[int, PromptState] = {}
        self.waiting: dict[int, Released] = {}  # insertion order = release order (FIFO)
        self.accepted_rounds: set[int] = set()  # accepted round ids of live prompts (duplicate vs late)
        self.cut_rounds: set[int] = set()  # those closed before all their samples arrived
        self.rounds_to_exit: dict[int, int] = {}  # accepted rounds -> prompts released after that many
        self.groups_consumed = 0
        self.fates = Fates(counts)  # the ledger's counts (ledger.py)
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

    def receive(self, st: PromptState, indices: Sequence[int], samples: Sequence[P.Sample],
                prompt_token_ids: np.ndarray, min_version: int) -> tuple[SubmitOutcome, bool]:
        """Samples `indices` of `st`'s round in flight arrived (indices checked by the caller: in range). Returns
        the outcome and whether the round is over (complete, or cut by the exit rule: `st.in_flight` is then
        None and, if cut, the outcome names it in `aborted`)."""
        fl = st.in_flight
        assert fl is not None
        new = {}
        for i, s in zip(indices, samples):
            if i not in fl.arrived and i not in new:
                new[i] = s
        if len(new) < len(samples):  # indices that arrived before, or twice in this message
            self.fates.add("refused", len(samples) - len(new),
                           num_tokens(samples) - num_tokens(new.values()))
        if not new:
            return SubmitOutcome("duplicate"), False
        if fl.round_index < 0:
            fl.round_index = st.open_round(fl.round_id)
            self.accepted_rounds.add(fl.round_id)
        if st.prompt_token_ids.size == 0 and prompt_token_ids.size:
            st.prompt_token_ids = np.asarray(prompt_token_ids, dtype=np.int32)
        c, threshold = self.counts, self.sampling.positive_threshold
        c["samples_received"] += len(new)
        c["positives_received"] += sum(is_positive(s.reward, threshold) for s in new.values())
        c["tokens_received"] += sum(len(s.token_ids) for s in new.values())
        st.num_received += len(new)
        fl.arrived.update(new)
        fl.held.update(new)
        evicted, exited = self._join(st, fl, list(new), min_version)
        if exited or fl.complete:
            st.in_flight = None
            cut = fl.num_samples - len(fl.arrived)
            discarded = list(fl.held.values())
            c["samples_discarded"] += len(discarded)
            c["tokens_discarded"] += sum(len(s.token_ids) for s in discarded)
            self.fates.add_samples("exit_cut", discarded)  # held back, and the exit rule held first
            c["rounds_cut"] += cut > 0
            c["samples_cut"] += cut
            if cut:
                self.cut(st, fl.round_id)
                self.fates.close(fl.round_id, "exit_cut", cut)
            group, dropped = self._release(st, resolved=True) if exited else self._settle(st)
            return SubmitOutcome("accepted", group, dropped, evicted, (fl.round_id,) if cut else ()), True
        return SubmitOutcome("accepted", num_evicted=evicted), False

    def _join(self, st: PromptState, fl: InFlight, arrived: list[int], min_version: int) -> tuple[int, bool]:
        """Move held samples into the pool as sampling.exit_check says; returns (evicted, the exit rule holds)."""
        if self.exit_check == "round":
            if not fl.complete:
                return 0, False
            order = sorted(fl.held)
        elif self.exit_check == "prefix":
            order = []
            while fl.next_index + len(order) in fl.held:
                order.append(fl.next_index + len(order))
        else:
            order = arrived
        batch = [fl.held[i] for i in order]
        if self.rule.whole_rounds and any(s.version < min_version for s in batch):
            min_version = 1 << 62  # a partly stale round of a whole-rounds rule loses all of its samples
        evicted, threshold, n = 0, self.sampling.positive_threshold, self.sampling.group_size
        for i, s in zip(order, batch):
            del fl.held[i]
            fl.next_index = max(fl.next_index, i + 1)
            if s.version < min_version:
                evicted += 1
                self.fates.add("stale", 1, len(s.token_ids))
                continue
            st.join(s, fl.round_index, threshold)
            if self.exit_check != "round" and len(st.pool) >= n and self.rule.reached(st.num_pos, st.num_neg, n):
                self.counts["stale_evictions"] += evicted
                return evicted, True
        self.counts["stale_evictions"] += evicted
        return evicted, self.exit_check == "round" and self._exit_holds(st)

    def _exit_holds(self, st: PromptState) -> bool:
        n = self.sampling.group_size
        return len(st.pool) >= n and self.rule.reached(st.num_pos, st.num_neg, n)

    def drop(self, st: PromptState, reason: str = "") -> None:
        """Give up on an active prompt without a group (counted as dropped_unresolved, and under `reason`)."""
        del self.active[st.prompt_id]
        self.counts["dropped_unresolved"] += 1
        self.fates.add_samples("dropped", st.pool)
        if reason:
            self.counts[reason] += 1
        self._untrack(st)

    def evict_stale(self, min_version: int) -> None:
        """Evict samples older than `min_version` from active pools (a round that loses all its samples is
        refunded) and re-open waiting groups that hold one (evicted from their full pool, then settled again)."""
        for st in self.active.values():
            self._evict(st, min_version)
        for prompt_id, rel in list(self.waiting.items()):
            if any(s.version < min_version for s in rel.group.samples):
                del self.waiting[prompt_id]
                self.counts["reopened"] += 1
                st = rel.state
                self._evict(st, min_version)
                self.active[prompt_id] = st
                self._settle(st)  # may release it again at once if its fresh samples still suffice

    def _evict(self, st: PromptState, min_version: int) -> None:
        tokens = num_tokens(st.pool)
        num = st.evict_older_than(min_version, whole_rounds=self.rule.whole_rounds)
        if num:
            self.counts["stale_evictions"] += num
            self.fates.add("stale", num, tokens - num_tokens(st.pool))

    def take(self, num_groups: int, learner_version: int) -> list[P.Group] | None:
        """Exactly `num_groups` waiting groups (FIFO), or None if fewer wait."""
        if len(self.waiting) < num_groups:
            return None
        groups = []
        for prompt_id in list(islice(self.waiting, num_groups)):
            rel = self.waiting.pop(prompt_id)
            self._untrack(rel.state)  # only live prompts are tracked
            for s in rel.group.samples:
                assert learner_version - s.version <= self.buffer.max_staleness, (prompt_id, s.version)
            groups.append(rel.group)
            kept = set(rel.kept)
            self.fates.add_samples("trained", rel.group.samples)
            self.fates.add_samples("downsampled", (s for i, s in enumerate(rel.state.pool) if i not in kept))
        self.groups_consumed += num_groups
        return groups

    def load(self, active: Sequence[PromptState], waiting: Sequence[Released]) -> None:
        """Fill empty pools from a snapshot: active prompts are queued (their rounds in flight, if any, are
        counted as re-issued: the producers that held them may be gone)."""
        assert not self.active and not self.waiting
        for st in active:
            if st.in_flight is not None:
                self.fates.add_samples("reissued", st.in_flight.held.values())  # arrived, never joined
                st.in_flight = None
                self.counts["rounds_reissued"] += 1
            self.active[st.prompt_id] = st
            self._track(st)
            self.queue(st)
        self.waiting = {rel.state.prompt_id: rel for rel in waiting}
        for rel in waiting:
            self._track(rel.state)

    def cut(self, st: PromptState, round_id: int) -> None:
        """Accepted round `round_id` of `st` closed before all its samples arrived."""
        st.cut_round_ids.append(round_id)
        self.cut_rounds.add(round_id)

    def _track(self, st: PromptState) -> None:
        self.accepted_rounds.update(st.accepted_round_ids)
        self.cut_rounds.update(st.cut_round_ids)

    def _untrack(self, st: PromptState) -> None:
        self.accepted_rounds.difference_update(st.accepted_round_ids)
        self.cut_rounds.difference_update(st.cut_round_ids)

    def _settle(self, st: PromptState) -> tuple[P.Group | None, bool]:
        """`st` has no round in flight: release it (exit rule, or budget spent), drop it, or queue it."""
        n = self.sampling.group_size
        if self._exit_holds(st):
            return self._release(st, resolved=True)
        # Samples lost to staleness do not count toward the budget, so a hard prompt is not given up on because
        # the learner moved on; but every sample received is evidence, and past the policy's hard cap the prompt
        # is settled with what its pool holds.
        capped = self.policy.capped(st)
        if (self.policy.exhausted(st) or capped) and len(st.pool) >= n:
            return self._release(st, resolved=False)
        if capped:  # not even n fresh samples left: drop it (counted as unresolved)
            self.drop(st)
            return None, True
        if not self.policy.exhausted(st) and self.policy.give_up(st, *self.context(st)):
            if len(st.pool) >= n:  # the policy found the rest of the visit not worth its samples
                return self._release(st, resolved=False)
            self.drop(st)
            return None, True
        self.queue(st)
        return None, False

    def _release(self, st: PromptState, resolved: bool) -> tuple[P.Group | None, bool]:
        del self.active[st.prompt_id]
        rewards = st.rewards()
        if not has_signal(rewards) and self.buffer.unresolved == "drop":
            self.counts["dropped_zero_variance" if resolved else "dropped_unresolved"] += 1
            self.fates.add_samples("zero_variance" if resolved else "dropped", st.pool)
            self._untrack(st)
            return None, True
        kept = downsample(rewards, st.versions(), self.sampling.group_size, self.buffer.downsample,
                                self.sampling.positive_threshold, self.rng)
        group = st.build_group(kept, self.rule.advantages(rewards, kept, self.buffer.normalize_std), resolved)
        self.waiting[st.prompt_id] = Released(st, group, kept)
        self.counts["released"] += 1
        self.counts["released_partial"] += not resolved
        self.counts["released_signal"] += has_signal(rewards)
        self.counts["pool_samples_released"] += len(rewards)
        self.counts["pool_tokens_released"] += sum(len(s.token_ids) for s in st.pool)
        self.counts["tokens_kept"] += sum(len(s.token_ids) for s in group.samples)
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
        assert self.cut_rounds == {r for st in live for r in st.cut_round_ids} <= self.accepted_rounds, "cut ids"
        held = [s for st in live for s in st.pool] + [s for st in self.active.values() if st.in_flight is not None
                                                     for s in st.in_flight.held.values()]
        assert self.fates.pooled() == (len(held), num_tokens(held)), "ledger: pooled samples or tokens"
        n = self.sampling.group_size
        for rel in self.waiting.values():
            rewards = rel.state.rewards()
            assert len(rel.group.samples) == n == len(rel.kept)
            assert [s.reward for s in rel.group.samples] == [rewards[i] for i in rel.kept]
            assert self.buffer.unresolved == "keep" or has_signal(rewards), "zero-variance pool released"
            st = rel.state
            assert not rel.group.resolved or self.rule.reached(st.num_pos, st.num_neg, n), "resolved, rule unmet"
            expected = self.rule.advantages(rewards, rel.kept, self.buffer.normalize_std)
            assert all(abs(a - b) <= 1e-9 for a, b in zip(rel.group.advantages, expected)), "advantage formula"
