"""Who the buffer is serving: a bounded table of the producers' connections, and the lease of every round out.

A peer is a connection identity (the ZeroMQ routing id) that sent producer messages; its name, `peer_name`, is
what the buffer calls that producer everywhere (scheduler, stats, progress): a producer is named by its
connection, never by what its messages claim. A `Lease` records the identity and ZAP User-Id (under CurveZMQ
"<role>:<public key>") a round was handed to, and what a result for it must match (checks.py).

Invariants:
- at most `max_peers` identities are tracked; a newcomer evicts the least recently heard peer that holds no lease
  (or is refused when every tracked peer holds one), and a peer silent for `idle_s` without a lease is expired;
  either way its entries in `stats` and `samples` go, and `forget` is called with its name so the caller's
  tables keyed by producer go too: every per-producer table stays within the bound;
- every round handed out has exactly one Lease until its holder answers, or it is aborted or expires (the
  caller releases it then); `leases_held[identity]` counts the leases of each peer, and a peer with one is never
  forgotten;
- `peer_name` is injective: two identities never share a name (a non-UTF-8 or "#"-led identity becomes "#<hex>").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline import protocol as P
from pipeline.auth import LEARNER

MAX_PEERS = 1024  # producer identities tracked at once (a few hundred producers is already a large run)


@dataclass(frozen=True, slots=True)
class Conn:
    """What the socket side knows of the connection a message came on (see pipeline/auth.py)."""

    role: str
    user: str = ""  # ZAP User-Id under CurveZMQ ("<role>:<public key>"), else ""


IN_PROCESS = Conn(LEARNER)  # callers in the same process (tests, benchmarks) are trusted as the learner


def peer_name(identity: bytes) -> str:
    """A printable name for a connection identity, distinct for distinct identities."""
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and text.isprintable() and not text.startswith("#"):
        return text
    return "#" + identity.hex()


@dataclass(frozen=True, slots=True)
class Lease:
    """One round out at a producer: who holds it, and what its result must match."""

    owner: bytes  # the ZeroMQ identity it was handed to
    user: str  # that connection's ZAP User-Id ("" without CurveZMQ)
    kind: str  # "train" | "eval"
    prompt_id: int
    num_samples: int
    max_new_tokens: int  # completion tokens per sample at most (the round's own for eval rounds)
    deadline: float

    def held_by(self, identity: bytes, user: str) -> bool:
        return identity == self.owner and user == self.user


class Peers:
    """The tracked producer connections and the leases; see the module docstring."""

    def __init__(self, forget: Callable[[bytes, str], None], counts: dict[str, int], max_peers: int = MAX_PEERS,
                 idle_s: float = 60.0) -> None:
        """`forget(identity, name)` is called for every peer let go; `counts` gets peers_refused, peers_evicted
        and peers_expired added up (the caller's counters)."""
        assert max_peers >= 1 and idle_s > 0
        self.forget, self.counts, self.max_peers, self.idle_s = forget, counts, max_peers, idle_s
        self.last_seen: OrderedDict[bytes, float] = OrderedDict()  # least recently heard first
        self.leases_held: dict[bytes, int] = {}  # identity -> leases it holds (only peers holding one)
        self.leases: dict[int, Lease] = {}  # round id -> its lease
        self.stats: dict[str, dict[str, float]] = {}  # name -> its last heartbeat's stats (and version, seen)
        self.samples: dict[str, int] = {}  # name -> samples received from it (training and evaluation)

    def touch(self, identity: bytes, now: float) -> str | None:
        """`identity` was heard from at `now`: its name, or None when it cannot be tracked (refused)."""
        if identity in self.last_seen:
            self.last_seen.move_to_end(identity)
        elif len(self.last_seen) >= self.max_peers and not self._evict_one():
            self.counts["peers_refused"] += 1
            return None
        self.last_seen[identity] = now
        return peer_name(identity)

    def count_samples(self, name: str, num_samples: int) -> None:
        self.samples[name] = self.samples.get(name, 0) + num_samples

    def lease(self, identity: bytes, user: str, rounds: Iterable[P.RoundAssignment], now: float,
              max_new_tokens: int) -> None:
        """Record the rounds just handed to `identity` (max_new_tokens: the run's, for a round that has none)."""
        for r in rounds:
            assert r.round_id not in self.leases, f"round {r.round_id} leased twice"
            self.leases[r.round_id] = Lease(identity, user, r.kind, r.prompt_id, r.num_samples,
                                            r.max_new_tokens or max_new_tokens, now + r.lease_s)
            self.leases_held[identity] = self.leases_held.get(identity, 0) + 1

    def release(self, round_ids: Iterable[int]) -> None:
        """The rounds are no longer out (answered, aborted or expired); unknown ids are skipped."""
        for round_id in round_ids:
            lease = self.leases.pop(round_id, None)
            if lease is not None:
                left = self.leases_held[lease.owner] - 1
                if left:
                    self.leases_held[lease.owner] = left
                else:
                    del self.leases_held[lease.owner]

    def expire(self, now: float) -> int:
        """Forget peers silent for idle_s that hold no lease; release leases past their deadline by more than
        idle_s (none should be: the caller releases every expired round). Returns those leases' count."""
        for identity, seen in list(self.last_seen.items()):
            if now - seen <= self.idle_s:
                break  # ordered by last heard: the rest are more recent
            if identity not in self.leases_held:
                self._drop(identity)
                self.counts["peers_expired"] += 1
        stuck = [rid for rid, lease in self.leases.items() if now > lease.deadline + self.idle_s]
        self.release(stuck)
        return len(stuck)

    def _evict_one(self) -> bool:
        for identity in self.last_seen:  # least recently heard first
            if identity not in self.leases_held:
                self._drop(identity)
                self.counts["peers_evicted"] += 1
                return True
        return False

    def _drop(self, identity: bytes) -> None:
        del self.last_seen[identity]
        name = peer_name(identity)
        self.stats.pop(name, None)
        self.samples.pop(name, None)
        self.forget(identity, name)
