"""Per-prompt state of the rollout buffer: the pool of samples a prompt has collected and its round bookkeeping,
and the round id allocator that training and evaluation rounds share.

A `PromptState` lives from the prompt's admission until its group is handed to the learner (or it is dropped).
Its pool holds samples in generation order; `num_pos` / `num_neg` / `rounds_completed` are caches of the pool.

Invariants (checked by `PromptState.check`):
- num_pos + num_neg == len(pool), and num_pos counts the pool's positives;
- rounds_completed == the number of distinct rounds that still have a sample in the pool, so evicting stale
  samples refunds a round only when it lost all of them (a prompt never runs out of rounds because its
  samples went stale);
- at most one round is in flight (`in_flight`), and it is the only round whose samples may be accepted; it
  records its own size (`num_samples`), which results are validated against, and which of its samples arrived
  (each is accepted once); a round gets its `round_index` when its first sample arrives;
- a round id is never handed out twice, whatever the round's kind (`RoundIds`): producers key running rounds by
  id, and an Abort names ids;
- `History` outlives prompts: one per training example, across epochs and restarts (it is in the snapshot).

Structs here are msgspec Structs so a scheduler snapshot is one msgpack encode; numpy arrays go through
`enc_hook` / `dec_hook` as [dtype, shape, bytes].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pipeline import protocol as P
from pipeline.buffer.policy.advantages import is_positive


def _empty_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


# a training example: (templated prompt, gold answer) or (prompt, answer, extras: reward.fn's keyword arguments)
PromptRow = tuple[str, str] | tuple[str, str, dict[str, Any]]


class PoolSample(msgspec.Struct, gc=False):
    """One accepted sample in a prompt's pool. It keeps the decoded wire Sample itself (validated once, its arrays
    still views on the received frames), so handing it to the learner copies nothing."""

    sample: P.Sample
    round_index: int  # which accepted round of this prompt it came from (0, 1, ...; never reused)
    positive: bool  # is_positive(reward, threshold), fixed at acceptance

    @property
    def token_ids(self) -> np.ndarray:  # int32 [T]
        return self.sample.token_ids

    @property
    def logprobs(self) -> np.ndarray:  # float32 [T] behaviour log-probs
        return self.sample.logprobs

    @property
    def reward(self) -> float:
        return self.sample.reward

    @property
    def version(self) -> int:  # policy version that generated it (the oldest one, if weights changed mid-sample)
        return self.sample.version

    @property
    def finish_reason(self) -> str:
        return self.sample.finish_reason

    def to_sample(self) -> P.Sample:
        return self.sample


class RoundIds:
    """The one round id allocator of a buffer, shared by the Scheduler (training) and Evals (evaluation)."""

    def __init__(self, next_id: int = 0) -> None:
        assert next_id >= 0, next_id
        self.next_id = next_id

    def take(self) -> int:
        """A fresh round id."""
        round_id = self.next_id
        self.next_id += 1
        return round_id

    def issued(self, round_id: int) -> bool:
        """Whether `round_id` was ever handed out (by this allocator, of either kind)."""
        return 0 <= round_id < self.next_id


class InFlight(msgspec.Struct, gc=False):
    """The one round of a prompt that is out at a producer, and the samples of it that arrived so far."""

    round_id: int
    producer_id: str
    issued_version: int  # learner version when the round was issued
    deadline: float  # lease end: re-issued after this time
    num_samples: int = 0  # the round's own size (the allocation policy's choice): results are checked against it
    arrived: set[int] = set()  # sample indices received (a second copy of one is a duplicate)
    held: dict[int, P.Sample] = {}  # arrived but not in the pool yet (sampling.exit_check "prefix" and "round")
    next_index: int = 0  # "prefix": the next sample index, in issue order, that may join the pool
    round_index: int = -1  # the prompt's accepted-round index, set when the round's first sample arrives

    @property
    def complete(self) -> bool:
        return len(self.arrived) == self.num_samples


class History(msgspec.Struct, array_like=True, gc=False):
    """What the buffer remembers about one training example across its visits (epochs) and restarts: the
    evidence on its pass rate that allocation policies read (weighted down at each new visit by the policy's
    `decay`), and its deferrals."""

    pos: float = 0.0  # positive samples seen (every sample that arrived, of every visit, discounted)
    neg: float = 0.0  # negative samples seen
    visits: int = 0  # admissions
    deferred: int = 0  # deferrals since the last admission (admitted at the latest after MAX_DEFERRALS)
    deferrals: int = 0  # deferrals in all


class PromptState(msgspec.Struct):
    """Everything the buffer knows about one admitted prompt (one admission = one prompt_id)."""

    prompt_id: int
    example_index: int  # index into the training prompts (the same example gets a new prompt_id each epoch)
    prompt: str
    answer: str
    admitted_at: float
    admitted_order: int  # admission sequence number: older prompts get their next round first
    prompt_token_ids: np.ndarray = msgspec.field(default_factory=_empty_ids)  # from the first accepted result
    pool: list[PoolSample] = []
    num_pos: int = 0
    num_neg: int = 0
    rounds_issued: int = 0  # every issue, re-issues included
    rounds_completed: int = 0  # accepted rounds that still have a sample in the pool
    rounds_accepted: int = 0  # accepted rounds ever (the next round_index)
    accepted_round_ids: list[int] = []  # to tell a duplicate result from a late one while the prompt lives
    in_flight: InFlight | None = None
    num_received: int = 0  # samples that arrived for its rounds (stale ones too): the visit's cost
    cut_round_ids: list[int] = []  # accepted rounds closed before all their samples arrived (stragglers: late)

    def open_round(self, round_id: int) -> int:
        """Record that round `round_id` is accepted (its first sample arrived); returns its round index."""
        index = self.rounds_accepted
        self.rounds_accepted += 1
        self.accepted_round_ids.append(round_id)
        return index

    def join(self, sample: P.Sample, round_index: int, threshold: float) -> None:
        """Append one sample (already checked for staleness) of accepted round `round_index` to the pool."""
        # a round's samples join contiguously (one round in flight), so the round is new to the pool exactly
        # when the pool's last sample is of another round
        if not self.pool or self.pool[-1].round_index != round_index:
            self.rounds_completed += 1
        positive = is_positive(sample.reward, threshold)
        self.pool.append(PoolSample(sample, round_index, positive))
        self.num_pos += positive
        self.num_neg += not positive

    def add_round(self, round_id: int, samples: Sequence[P.Sample], threshold: float) -> None:
        """Record accepted round `round_id` and append its samples (already filtered for staleness) to the pool."""
        index = self.open_round(round_id)
        for s in samples:
            self.join(s, index, threshold)

    def evict_older_than(self, min_version: int, whole_rounds: bool = False) -> int:
        """Remove samples with version < min_version; returns how many were removed.

        `whole_rounds` also removes the other samples of any round that lost one: GRPO ("fixed") needs its group
        to be exactly one complete round, so a partly stale round is regenerated rather than patched.
        """
        stale = {i for i, s in enumerate(self.pool) if s.version < min_version}
        if not stale:
            return 0
        if whole_rounds:
            rounds = {self.pool[i].round_index for i in stale}
            stale = {i for i, s in enumerate(self.pool) if s.round_index in rounds}
        self.pool = [s for i, s in enumerate(self.pool) if i not in stale]
        self.num_pos = sum(s.positive for s in self.pool)
        self.num_neg = len(self.pool) - self.num_pos
        self.rounds_completed = len({s.round_index for s in self.pool})
        return len(stale)

    def rewards(self) -> list[float]:
        return [s.reward for s in self.pool]

    def versions(self) -> list[int]:
        return [s.version for s in self.pool]

    def build_group(self, kept: Sequence[int], advantages: Sequence[float], resolved: bool) -> P.Group:
        """The protocol Group of the kept pool indices (in pool order) with their advantages."""
        return P.Group(
            prompt_id=self.prompt_id,
            prompt_token_ids=self.prompt_token_ids,
            samples=[self.pool[i].to_sample() for i in kept],
            advantages=[float(a) for a in advantages],
            pool_size=len(self.pool),
            num_rounds=self.rounds_completed,
            resolved=resolved,
            answer=self.answer,
        )

    def check(self) -> None:
        """Assert the invariants in the module docstring (tests call this after every event)."""
        assert self.num_pos == sum(s.positive for s in self.pool), (self.prompt_id, self.num_pos)
        assert self.num_pos + self.num_neg == len(self.pool), (self.prompt_id, self.num_neg)
        assert self.rounds_completed == len({s.round_index for s in self.pool}), (self.prompt_id, "rounds")
        assert self.rounds_completed <= self.rounds_accepted <= self.rounds_issued, (self.prompt_id, "counters")
        assert len(self.accepted_round_ids) == self.rounds_accepted, (self.prompt_id, "accepted ids")


# ---------------------------------------------------------------- snapshot codec


def enc_hook(obj: Any) -> Any:
    """msgspec enc_hook: a numpy array as [dtype, shape, bytes] (never pickled)."""
    if isinstance(obj, np.ndarray):
        return [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
    raise TypeError(f"cannot snapshot objects of type {type(obj).__name__}")


def dec_hook(typ: type, obj: Any) -> Any:
    """msgspec dec_hook: the inverse of `enc_hook`."""
    if typ is np.ndarray and isinstance(obj, list) and len(obj) == 3:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise TypeError(f"cannot restore {typ} from {type(obj).__name__}")
