"""Bad input and handler errors at the buffer: each counted (in all, per sender, per rejection reason) and logged
at a bounded rate, so that a flood of hostile messages can neither fill the log nor grow a table without bound.

Invariants: the per-sender and per-reason tables hold at most MAX_TRACKED_SENDERS keys each (further senders
are counted under "(other)"); of the events of one counter, the first 20 and then every 1000th are logged; a
handler error is logged with the sender, the message kind, the traceback and the scheduler's state (its
counts and whether its invariants still hold), which is what debugging one needs.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.buffer.peers import peer_name
from pipeline.buffer.scheduler import Scheduler

log = logging.getLogger(__name__)

MAX_TRACKED_SENDERS = 1000  # per-sender counts beyond this many senders go to "(other)"
TABLES = ("malformed_by_sender", "rejected_by_sender", "rejected_by_reason")
_STATE_KEYS = ("learner_version", "active", "groups_waiting", "rounds_in_flight", "admitted", "released",
               "reopened", "dropped_unresolved", "dropped_zero_variance")


def log_now(count: int) -> bool:
    """Whether the `count`-th event of a kind is logged."""
    return count <= 20 or count % 1000 == 0


def bump(table: dict[str, int], key: str) -> None:
    """Count `key` in a bounded table."""
    key = key if key in table or len(table) < MAX_TRACKED_SENDERS else "(other)"
    table[key] = table.get(key, 0) + 1


class Incidents:
    """Counts into the buffer's `counters` (metrics.SERVICE_COUNTERS) and keeps the tables of TABLES."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self.tables: dict[str, dict[str, int]] = {name: {} for name in TABLES}

    def bad(self, counter: str, sender: bytes, why: str, table: str, reason: str = "") -> None:
        """A message from `sender` dropped as `counter` (in `table` per sender, and per `reason` if given)."""
        self.counters[counter] += 1
        name = peer_name(sender)
        bump(self.tables[table], name)
        if reason:
            bump(self.tables["rejected_by_reason"], reason)
        count = self.counters[counter]
        if log_now(count):
            log.warning("dropped %s message #%d from %s: %s", counter, count, name[:80], why)

    def handler_error(self, sender: bytes, kind: str, exc: Exception, scheduler: Scheduler,
                      extra: dict[str, Any]) -> None:
        """A handler (or a timer, kind "timer") raised on a message from `sender`: counted and logged."""
        self.counters["handler_errors"] += 1
        count = self.counters["handler_errors"]
        if not log_now(count):
            return
        try:
            scheduler.check_invariants()
            consistent = "the scheduler's invariants hold"
        except AssertionError as broken:
            consistent = f"the scheduler's invariants are BROKEN: {broken!r}"
        m = scheduler.metrics()
        state = {**{k: m[k] for k in _STATE_KEYS}, **extra}
        what = "an internal invariant failed" if isinstance(exc, AssertionError) else "the handler raised"
        log.error("dropped a %s from %s (handler error #%d; the buffer keeps serving): %s: %r; %s; state %s", kind,
                  peer_name(sender)[:80], count, what, exc, consistent, state, exc_info=exc)
