"""Rank 0 asks the buffer for the next batch and waits until it comes.

Invariant: never two BatchRequests in flight: each reply is awaited for the request's own wait plus
REPLY_MARGIN_S, so a late answer is never mistaken for the answer to a newer request.
"""

from __future__ import annotations

import logging
import time

from pipeline import protocol as P
from pipeline.transport import BufferClient

log = logging.getLogger(__name__)

POLL_S = 5.0  # how long one BatchRequest may wait at the buffer
REPLY_MARGIN_S = 30.0  # extra wait for the reply: never send a second request while the first may be answered


class LearnerError(RuntimeError):
    """A fatal learner condition (no data for too long); the message says what to check."""


def fetch_batch(client: BufferClient, learner_id: str, version: int, num_groups: int, timeout_s: float
                ) -> P.Batch | None:
    """The next non-empty Batch for `version`, or None when a Shutdown arrived. Raises LearnerError on timeout."""
    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    while True:
        for msg in client.poll_control():
            if isinstance(msg, P.Shutdown):
                log.info("shutdown from the buffer: %s", msg.reason)
                return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise LearnerError(f"no batch arrived for {timeout_s:.0f} s (learner.batch_timeout_s) at version "
                               f"{version}: is the buffer running and are producers generating? Check their logs")
        wait_s = min(left, POLL_S)
        client.send(P.Heartbeat(learner_id, "learner", version, {}))
        reply = client.request(P.BatchRequest(learner_id, version, num_groups, int(wait_s * 1000)),
                               P.Batch, wait_s + REPLY_MARGIN_S)
        if reply is not None and reply.learner_version == version and reply.groups:
            return reply
        if reply is not None and reply.learner_version != version:
            log.warning("dropping a batch for version %d at version %d", reply.learner_version, version)
        if time.monotonic() - last_note > 60:
            log.info("waiting for a batch at version %d (%.0f s left)", version, deadline - time.monotonic())
            last_note = time.monotonic()
