"""Rounds out at producers: which prompt each round in flight serves, how many rounds each producer holds, and
whether producers are alive. The Scheduler decides what to issue; `Leases` only keeps the books.

Invariants:
- `rounds` maps every round id in flight to its prompt id, in issue order;
- `rounds_held[p]` is the number of rounds in flight issued to producer p (no entry for 0);
- a producer is alive while it was heard of within buffer.heartbeat_timeout_s; `room` divides the rounds the
  admission bound allows among the alive clients that ask for work, at least `expected` of them, and a client's
  share among its alive producers, so one request never takes them all, nor does one client through many
  producers (identities). A client is a CurveZMQ key (every producer connected with it), else one producer.
"""

from __future__ import annotations

import math

from pipeline.config import BufferConfig


class Leases:
    """The books of the rounds in flight and of the producers' liveness; see the module docstring."""

    def __init__(self, buffer: BufferConfig) -> None:
        self.buffer = buffer
        self.rounds: dict[int, int] = {}  # round_id in flight -> prompt_id, in issue order
        self.rounds_held: dict[str, int] = {}  # producer -> rounds in flight it holds
        self.last_seen: dict[str, float] = {}
        self.requesters: set[str] = set()  # producers that asked for work (the ones sharing it)
        self.client_of: dict[str, str] = {}  # producer -> its client (its CurveZMQ key), for those that have one
        self.expected = 1  # clients the rounds are shared among at least (those the run starts or admits)

    def add(self, round_id: int, prompt_id: int, producer_id: str) -> None:
        assert round_id not in self.rounds, round_id
        self.rounds[round_id] = prompt_id
        self.rounds_held[producer_id] = self.rounds_held.get(producer_id, 0) + 1

    def remove(self, round_id: int, producer_id: str) -> None:
        del self.rounds[round_id]
        left = self.rounds_held[producer_id] - 1
        if left:
            self.rounds_held[producer_id] = left
        else:
            del self.rounds_held[producer_id]

    def heartbeat(self, producer_id: str, now: float) -> None:
        self.last_seen[producer_id] = max(now, self.last_seen.get(producer_id, -math.inf))

    def forget(self, producer_id: str) -> None:
        self.last_seen.pop(producer_id, None)
        self.requesters.discard(producer_id)
        self.client_of.pop(producer_id, None)

    def is_silent(self, producer_id: str, now: float) -> bool:
        return now - self.last_seen.get(producer_id, -math.inf) > self.buffer.heartbeat_timeout_s

    def alive(self, now: float) -> int:
        return sum(not self.is_silent(p, now) for p in self.last_seen)

    def room(self, producer_id: str, bound: int, now: float, client: str = "") -> int:
        """Rounds `producer_id` (asking for work now, for `client`: "" = itself) may still take: its fair share of
        `bound` rounds, less what it holds; and its client's share less what the client's producers hold."""
        self.requesters.add(producer_id)
        if client:
            self.client_of[producer_id] = client
        mine = self.client_of.get(producer_id, producer_id)
        clients: dict[str, int] = {}  # alive client -> its alive producers asking for work
        for p in self.requesters:
            if p == producer_id or not self.is_silent(p, now):
                key = self.client_of.get(p, p)
                clients[key] = clients.get(key, 0) + 1
        client_share = -(-bound // max(self.expected, len(clients)))
        share = -(-client_share // clients[mine])
        held_by_client = self.rounds_held.get(producer_id, 0) if not client else sum(
            n for p, n in self.rounds_held.items() if self.client_of.get(p, p) == mine)
        return min(share - self.rounds_held.get(producer_id, 0), client_share - held_by_client)

    def check(self, producer_of: dict[int, str]) -> None:
        """Assert the invariants; `producer_of` maps each round in flight to the producer its prompt records."""
        assert producer_of.keys() == self.rounds.keys(), "rounds in flight"
        held: dict[str, int] = {}
        for producer in producer_of.values():
            held[producer] = held.get(producer, 0) + 1
        assert held == self.rounds_held, "rounds held per producer"
