"""Rounds out at producers: which prompt each round in flight serves, how many rounds each producer holds, and
whether producers are alive. The Scheduler decides what to issue; `Leases` only keeps the books.

Invariants:
- `rounds` maps every round id in flight to its prompt id, in issue order;
- `held[p]` is the number of rounds in flight issued to producer p (no entry for 0);
- a producer is alive while it was heard of within buffer.heartbeat_timeout_s; `room` divides the rounds the
  admission bound allows among the alive producers that ask for work (at least one), so one request never takes
  them all.
"""

from __future__ import annotations

import math

from pipeline.config import BufferConfig


class Leases:
    """The books of the rounds in flight and of the producers' liveness; see the module docstring."""

    def __init__(self, buffer: BufferConfig) -> None:
        self.buffer = buffer
        self.rounds: dict[int, int] = {}  # round_id in flight -> prompt_id, in issue order
        self.held: dict[str, int] = {}  # producer -> rounds in flight it holds
        self.last_seen: dict[str, float] = {}
        self.requesters: set[str] = set()  # producers that asked for work (the ones sharing it)

    def add(self, round_id: int, prompt_id: int, producer_id: str) -> None:
        assert round_id not in self.rounds, round_id
        self.rounds[round_id] = prompt_id
        self.held[producer_id] = self.held.get(producer_id, 0) + 1

    def remove(self, round_id: int, producer_id: str) -> None:
        del self.rounds[round_id]
        left = self.held[producer_id] - 1
        if left:
            self.held[producer_id] = left
        else:
            del self.held[producer_id]

    def heartbeat(self, producer_id: str, now: float) -> None:
        self.last_seen[producer_id] = max(now, self.last_seen.get(producer_id, -math.inf))

    def forget(self, producer_id: str) -> None:
        self.last_seen.pop(producer_id, None)
        self.requesters.discard(producer_id)

    def is_silent(self, producer_id: str, now: float) -> bool:
        return now - self.last_seen.get(producer_id, -math.inf) > self.buffer.heartbeat_timeout_s

    def alive(self, now: float) -> int:
        return sum(not self.is_silent(p, now) for p in self.last_seen)

    def room(self, producer_id: str, bound: int, now: float) -> int:
        """Rounds `producer_id` (asking for work now) may still take: its fair share of `bound` rounds, less what
        it holds."""
        self.requesters.add(producer_id)
        share = -(-bound // max(1, sum(not self.is_silent(p, now) for p in self.requesters)))
        return share - self.held.get(producer_id, 0)

    def check(self, producer_of: dict[int, str]) -> None:
        """Assert the invariants; `producer_of` maps each round in flight to the producer its prompt records."""
        assert producer_of.keys() == self.rounds.keys(), "rounds in flight"
        held: dict[str, int] = {}
        for producer in producer_of.values():
            held[producer] = held.get(producer, 0) + 1
        assert held == self.held, "rounds held per producer"
