"""Rank 0 asks the buffer for the next batch and waits until it comes, or until producers stop making progress.

Invariants:
- never two BatchRequests in flight: each reply is awaited for the request's own wait plus REPLY_MARGIN_S, so a
  late answer is never mistaken for the answer to a newer request;
- the learner gives up (LearnerError) only when no producer made progress for learner.batch_timeout_s. The
  buffer answers a request that waited in vain with an empty Batch whose metrics carry
  `buffer/samples_received` (cumulative samples it accepted): while that number rises, producers are generating
  (adaptive sampling may need many rounds before enough groups are released), and the learner keeps waiting,
  saying why every WAIT_LOG_S. No answer, or an answer without the counter, is no progress.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from pipeline import protocol as P
from pipeline.transport import BufferClient

log = logging.getLogger(__name__)

POLL_S = 5.0  # how long one BatchRequest may wait at the buffer
REPLY_MARGIN_S = 30.0  # extra wait for the reply: never send a second request while the first may be answered
WAIT_LOG_S = 30.0  # a waiting learner says why this often
SAMPLES_KEY = "buffer/samples_received"


class LearnerError(RuntimeError):
    """A fatal learner condition (no data for too long); the message says what to check."""


class ProducerProgress:
    """The buffer's cumulative sample count as its replies report it: when it last rose, and by how much lately."""

    def __init__(self, now: float) -> None:
        self.started = now
        self.last_rise = now  # no rise seen yet: the wait itself started the clock
        self.samples: float | None = None
        self.tokens_per_s = 0.0
        self._seen: deque[tuple[float, float]] = deque()  # (time, count) of the last WAIT_LOG_S, plus one before

    def observe(self, metrics: Mapping[str, float], now: float) -> None:
        value = metrics.get(SAMPLES_KEY)
        if value is None:
            return
        if self.samples is not None and value > self.samples:
            self.last_rise = now
        self.samples = value  # a lower count (a buffer restarted without its snapshot) is a new baseline
        self.tokens_per_s = float(metrics.get("producers/tokens_per_s", 0.0))
        self._seen.append((now, value))
        while len(self._seen) > 1 and self._seen[1][0] <= now - WAIT_LOG_S:
            self._seen.popleft()

    def received_lately(self) -> float:
        """Samples received between the oldest count kept (about WAIT_LOG_S ago) and the newest."""
        return max(0.0, self._seen[-1][1] - self._seen[0][1]) if self._seen else 0.0


def fetch_batch(client: BufferClient, learner_id: str, version: int, num_groups: int, timeout_s: float,
                clock: Callable[[], float] = time.monotonic) -> P.Batch | None:
    """The next non-empty Batch for `version`, or None when a Shutdown arrived. Raises LearnerError once no
    producer made progress for `timeout_s` (learner.batch_timeout_s)."""
    progress = ProducerProgress(clock())
    next_note = progress.started + WAIT_LOG_S
    metrics: Mapping[str, float] = {}
    while True:
        for msg in client.poll_control():
            if isinstance(msg, P.Shutdown):
                log.info("shutdown from the buffer: %s", msg.reason)
                return None
        left = progress.last_rise + timeout_s - clock()
        if left <= 0:
            raise LearnerError(_stalled(version, timeout_s, progress, clock()))
        wait_s = min(left, POLL_S)
        client.send(P.Heartbeat(learner_id, "learner", version, {}))
        reply = client.request(P.BatchRequest(learner_id, version, num_groups, int(wait_s * 1000)),
                               P.Batch, wait_s + REPLY_MARGIN_S)
        now = clock()
        if reply is not None:
            if reply.learner_version == version and reply.groups:
                return reply
            if reply.learner_version != version:
                log.warning("dropping a batch for version %d at version %d", reply.learner_version, version)
            progress.observe(reply.metrics, now)
            metrics = reply.metrics
        if now >= next_note:
            log.info("%s", _waiting(version, num_groups, timeout_s, progress, metrics, now))
            next_note = now + WAIT_LOG_S


def _waiting(version: int, num_groups: int, timeout_s: float, progress: ProducerProgress,
             metrics: Mapping[str, float], now: float) -> str:
    """Why the learner is still waiting, e.g. "waiting for 32 groups at version 3: 18 released so far,
    producers generating (1,240 samples received in the last 30 s, 2,345 tokens/s)"."""
    head = f"waiting for {num_groups} groups at version {version}"
    if "buffer/groups_waiting" in metrics:
        head += f": {metrics['buffer/groups_waiting']:,.0f} released so far"
    give_up = f"the learner gives up after {timeout_s:,.0f} s without progress (learner.batch_timeout_s)"
    if progress.samples is None:
        return f"{head}; the buffer has reported no sample count yet: {give_up}"
    if progress.last_rise > progress.started and now - progress.last_rise < WAIT_LOG_S:
        return (f"{head}, producers generating ({progress.received_lately():,.0f} samples received in the last "
                f"{WAIT_LOG_S:.0f} s, {progress.tokens_per_s:,.0f} tokens/s)")
    return f"{head}; no new sample for {now - progress.last_rise:,.0f} s: {give_up}"


def _stalled(version: int, timeout_s: float, progress: ProducerProgress, now: float) -> str:
    if progress.samples is None:
        seen = "the buffer did not answer, or answered without a sample count"
    else:
        seen = f"it has received {progress.samples:,.0f} samples in all"
    return (f"no batch arrived for {timeout_s:.0f} s (learner.batch_timeout_s) at version {version}, and producers "
            f"made no progress in that time: no new sample reached the buffer ({seen}; waited "
            f"{now - progress.started:,.0f} s in all). Is the buffer running and are producers generating? "
            "Check their logs")
