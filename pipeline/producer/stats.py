"""The producer's gauges and counters, as sent in its heartbeats.

The ledger's counters (pipeline/buffer/ledger.py): `gen_samples` / `gen_tokens` count every training sample that
left the engine, finished or aborted, exactly once, with the completion tokens the engine reported for it;
`gen_eval_samples` / `gen_eval_tokens` the same for evaluation rounds. `started_at` (wall clock) tells the buffer a
restarted process under the same name from the one before it.
"""

from __future__ import annotations

import collections
import time

RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window
PRODUCER_COUNTERS = ("rounds_done", "rounds_aborted", "rounds_failed", "samples_done", "tokens_done",
                     "weight_loads", "weight_load_errors", "weight_load_refused", "request_timeouts", "engine_errors",
                     "gen_samples", "gen_tokens", "gen_eval_samples", "gen_eval_tokens")  # always present, from 0


class ProducerStats:
    """Counters since start, tokens/s over the last RATE_WINDOW_S, and the busy fraction between snapshots."""

    def __init__(self) -> None:
        self.counts = collections.Counter({k: 0 for k in PRODUCER_COUNTERS})
        self._started = self._last_snapshot = time.monotonic()
        self.started_at = time.time()
        self._token_log: collections.deque = collections.deque()  # (finish time, tokens)
        self._busy_s = 0.0
        self._busy_since: float | None = None

    def round_done(self, num_samples: int, num_tokens: int) -> None:
        self._token_log.append((time.monotonic(), num_tokens))
        self.counts["rounds_done"] += 1
        self.counts["samples_done"] += num_samples
        self.counts["tokens_done"] += num_tokens

    def generated(self, kind: str, num_samples: int, num_tokens: int) -> None:
        """`num_samples` samples of a round of `kind` ("train" | "eval") left the engine with `num_tokens` tokens."""
        prefix = "gen_eval" if kind == "eval" else "gen"
        self.counts[f"{prefix}_samples"] += num_samples
        self.counts[f"{prefix}_tokens"] += num_tokens

    def set_busy(self, busy: bool) -> None:
        """Busy = at least one round running; called whenever that may have changed."""
        now = time.monotonic()
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None

    def snapshot(self, **gauges: float) -> dict[str, float]:
        """Counters, tokens_per_s, busy_fraction (since the previous snapshot) and the given gauges."""
        now = time.monotonic()
        while self._token_log and self._token_log[0][0] < now - RATE_WINDOW_S:
            self._token_log.popleft()
        window = max(min(RATE_WINDOW_S, now - self._started), 1e-9)
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        interval = max(now - self._last_snapshot, 1e-9)
        self._busy_s, self._last_snapshot = 0.0, now
        if self._busy_since is not None:
            self._busy_since = now
        return {
            "tokens_per_s": sum(n for _, n in self._token_log) / window,
            "busy_fraction": min(1.0, busy / interval),
            "started_at": self.started_at,
            **{k: float(v) for k, v in gauges.items()},
            **{k: float(v) for k, v in self.counts.items()},
        }
