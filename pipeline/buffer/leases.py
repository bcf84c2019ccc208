"""The one book of rounds out at producers: every round handed out, training and evaluation, with whom it is out
at and what its result must match (a `Lease`), and the producers' liveness. The Scheduler records and ends the
leases of its training rounds; the service (core.py, intake.py) those of evaluation rounds, which Evals issues;
peers.py asks the book whether a connection holds any, and intake.py whether a result comes from the holder.

A producer is named by its connection (peers.peer_name, injective), so a lease's `producer` with its `user` (the
ZAP User-Id under CurveZMQ, "" without) identifies the connection it was handed to.

Invariants (`check`):
- `leases` maps every round id out at a producer to its lease, in issue order; a round's lease ends exactly once:
  when its result is in, or it is aborted, expired or rejected;
- `rounds_held[p]` is the number of training rounds out at producer p (no entry for 0), `leases_held[p]` that of
  rounds of either kind, `num_train` that of training rounds;
- a producer is alive while it was heard of within buffer.heartbeat_timeout_s; `room` divides the rounds the
  admission bound allows among the alive clients that ask for work, at least `expected` of them, and a client's
  share among its alive producers, so one request never takes them all, nor does one client through many
  producers (identities). A client is a CurveZMQ key (every producer connected with it), else one producer.
  Only training rounds count toward a share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.config import BufferConfig


@dataclass(frozen=True, slots=True)
class Lease:
    """One round out at a producer: who holds it, and what its result must match."""

    producer: str  # the holder's name (its connection's, peers.peer_name)
    user: str  # that connection's ZAP User-Id ("" without CurveZMQ); its client, when it has one
    kind: str  # "train" | "eval"
    prompt_id: int
    num_samples: int
    max_new_tokens: int  # completion tokens per sample at most (the round's own for eval rounds)
    deadline: float

    def held_by(self, producer: str, user: str) -> bool:
        return producer == self.producer and user == self.user


class Leases:
    """The book of rounds out at producers and of the producers' liveness; see the module docstring."""

    def __init__(self, buffer: BufferConfig) -> None:
        self.buffer = buffer
        self.leases: dict[int, Lease] = {}  # round id out at a producer -> its lease, in issue order
        self.rounds_held: dict[str, int] = {}  # producer -> training rounds it holds
        self.leases_held: dict[str, int] = {}  # producer -> rounds of either kind it holds
        self.num_train = 0  # training rounds out
        self.last_seen: dict[str, float] = {}
        self.requesters: set[str] = set()  # producers that asked for work (the ones sharing it)
        self.client_of: dict[str, str] = {}  # producer -> its client (its CurveZMQ key), for those that have one
        self.expected = 1  # clients the rounds are shared among at least (those the run starts or admits)

    # ------------------------------------------------------------ the rounds out

    def add(self, round_id: int, lease: Lease) -> None:
        assert round_id not in self.leases, f"round {round_id} leased twice"
        self.leases[round_id] = lease
        _count(self.leases_held, lease.producer, 1)
        if lease.kind == "train":
            _count(self.rounds_held, lease.producer, 1)
            self.num_train += 1

    def remove(self, round_id: int) -> Lease | None:
        """End the lease of `round_id` (its result is in, or it was aborted, expired or rejected); None if none."""
        lease = self.leases.pop(round_id, None)
        if lease is not None:
            _count(self.leases_held, lease.producer, -1)
            if lease.kind == "train":
                _count(self.rounds_held, lease.producer, -1)
                self.num_train -= 1
        return lease

    def get(self, round_id: int) -> Lease | None:
        return self.leases.get(round_id)

    def train(self) -> Iterator[tuple[int, Lease]]:
        """The training rounds out, in issue order (a copy: the caller may end leases as it goes)."""
        return iter([(rid, lease) for rid, lease in self.leases.items() if lease.kind == "train"])

    def is_train(self, round_id: int) -> bool:
        lease = self.leases.get(round_id)
        return lease is not None and lease.kind == "train"

    def holds(self, producer: str) -> bool:
        """Whether `producer` holds any round (of either kind)."""
        return producer in self.leases_held

    def __contains__(self, round_id: int) -> bool:
        return round_id in self.leases

    def __len__(self) -> int:
        return len(self.leases)

    # ------------------------------------------------------------ liveness and fair shares

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
        """Training rounds `producer_id` (asking for work now, for `client`: "" = itself) may still take: its fair
        share of `bound` rounds, less what it holds; and its client's share less what the client's producers hold."""
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

    def check(self) -> None:
        """Assert the counts agree with the leases (the module docstring's invariants)."""
        held: dict[str, int] = {}
        train: dict[str, int] = {}
        for lease in self.leases.values():
            _count(held, lease.producer, 1)
            if lease.kind == "train":
                _count(train, lease.producer, 1)
        assert held == self.leases_held, "rounds held per producer"
        assert train == self.rounds_held, "training rounds held per producer"
        assert self.num_train == sum(train.values()), "training rounds out"


def _count(table: dict[str, int], key: str, delta: int) -> None:
    """Add `delta` to `table[key]`, keeping no entry for 0."""
    n = table.get(key, 0) + delta
    assert n >= 0, key
    if n:
        table[key] = n
    else:
        table.pop(key, None)
