"""Who the buffer is serving: a bounded table of the producers' connections.

A peer is a connection identity (the ZeroMQ routing id) that sent producer messages; its name, `peer_name`, is
what the buffer calls that producer everywhere (scheduler, leases, stats, progress): a producer is named by its
connection, never by what its messages claim. Which rounds a peer holds is not kept here: the one book of rounds
out at producers is leases.py's (`Leases`), which this table asks.

Invariants:
- at most `max_peers` identities are tracked; a newcomer evicts the least recently heard peer that holds no lease
  (or is refused when every tracked peer holds one), and a peer silent for `idle_s` without a lease is expired;
  either way its entries in `stats` and `samples` go, and `forget` is called with its name so the caller's
  tables keyed by producer go too: every per-producer table stays within the bound;
- a peer that holds a lease (of either kind, per the book) is never forgotten;
- `peer_name` is injective: two identities never share a name (a non-UTF-8 or "#"-led identity becomes "#<hex>").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.auth import LEARNER
from pipeline.buffer.leases import Leases

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


class Peers:
    """The tracked producer connections; see the module docstring."""

    def __init__(self, leases: Leases, forget: Callable[[bytes, str], None], counts: dict[str, int],
                 max_peers: int = MAX_PEERS, idle_s: float = 60.0) -> None:
        """`leases`: the book of rounds out, asked whether a peer holds one; `forget(identity, name)` is called
        for every peer let go; `counts` gets peers_refused, peers_evicted and peers_expired added up (the caller's
        counters)."""
        assert max_peers >= 1 and idle_s > 0
        self.leases, self.forget, self.counts, self.max_peers, self.idle_s = leases, forget, counts, max_peers, idle_s
        self.last_seen: OrderedDict[bytes, float] = OrderedDict()  # least recently heard first
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

    def holds_lease(self, identity: bytes) -> bool:
        return self.leases.holds(peer_name(identity))

    def expire(self, now: float) -> None:
        """Forget peers silent for idle_s that hold no lease."""
        for identity, seen in list(self.last_seen.items()):
            if now - seen <= self.idle_s:
                break  # ordered by last heard: the rest are more recent
            if not self.holds_lease(identity):
                self._drop(identity)
                self.counts["peers_expired"] += 1

    def _evict_one(self) -> bool:
        for identity in self.last_seen:  # least recently heard first
            if not self.holds_lease(identity):
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
