"""The learner's wait for a batch (consumer/fetch.py) against a scripted buffer double on a simulated clock:
it keeps waiting while producers make progress, says why every 30 s, and gives up only after
learner.batch_timeout_s without a new sample."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.consumer.fetch import WAIT_LOG_S, LearnerError, fetch_batch

TIMEOUT_S = 300.0


def group(prompt_id: int) -> P.Group:
    sample = P.Sample(np.array([3, 4], np.int32), np.array([-0.5, -0.7], np.float32), 1.0, 0, "stop")
    return P.Group(prompt_id, np.array([1, 2], np.int32), [sample], [0.0], 8, 1, True)


class ScriptedBuffer:
    """Answers each BatchRequest after its full wait on a simulated clock, with `reply(now)`: an empty Batch whose
    metrics carry the buffer's counters, or the batch once it is ready."""

    def __init__(self, reply, control=()):
        self.now = 1000.0
        self.reply = reply
        self.control = list(control)
        self.requests: list[P.BatchRequest] = []
        self.heartbeats = 0

    def clock(self) -> float:
        return self.now

    def poll_control(self, timeout_s: float = 0.0) -> list:
        return [self.control.pop(0)] if self.control else []

    def send(self, msg) -> None:
        assert isinstance(msg, P.Heartbeat) and msg.role == "learner"
        self.heartbeats += 1

    def request(self, msg, reply_type, timeout_s):
        assert isinstance(msg, P.BatchRequest) and reply_type is P.Batch
        assert timeout_s > msg.timeout_ms / 1000  # the reply is awaited longer than the buffer may hold it
        self.requests.append(msg)
        self.now += msg.timeout_ms / 1000
        return self.reply(self.now - 1000.0, msg)


def counters(samples: float, waiting: int = 18, tokens_per_s: float = 2345.0) -> dict[str, float]:
    return {"buffer/samples_received": samples, "buffer/groups_waiting": float(waiting),
            "producers/tokens_per_s": tokens_per_s}


def fetch(buf: ScriptedBuffer, version: int = 3) -> P.Batch | None:
    return fetch_batch(buf, "learner-t", version, 32, TIMEOUT_S, clock=buf.clock)


def test_keeps_waiting_while_producers_generate_and_says_why(caplog):
    ready_at = 2.5 * TIMEOUT_S  # far past the timeout, but samples keep arriving all along

    def reply(t, req):
        if t >= ready_at:
            return P.Batch(req.learner_version, [group(i) for i in range(32)], counters(t * 41 // 1))
        return P.Batch(req.learner_version, [], counters(t * 41 // 1))  # ~205 samples per 5 s poll

    buf = ScriptedBuffer(reply)
    with caplog.at_level(logging.INFO, logger="pipeline.consumer.fetch"):
        batch = fetch(buf)
    assert batch is not None and len(batch.groups) == 32
    assert buf.now - 1000.0 >= ready_at and buf.heartbeats == len(buf.requests)
    assert all(r.learner_version == 3 and r.num_groups == 32 and r.timeout_ms == 5000 for r in buf.requests)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(lines) == pytest.approx(ready_at / WAIT_LOG_S, abs=1)  # one line every 30 s
    assert lines[1] == ("waiting for 32 groups at version 3: 18 released so far, producers generating "
                        "(1,230 samples received in the last 30 s, 2,345 tokens/s)")


def test_gives_up_once_no_sample_arrived_for_the_timeout(caplog):
    def reply(t, req):  # producers generate for 100 s, then nothing more reaches the buffer
        return P.Batch(req.learner_version, [], counters(min(t, 100.0) * 10))

    buf = ScriptedBuffer(reply)
    with caplog.at_level(logging.INFO, logger="pipeline.consumer.fetch"):
        with pytest.raises(LearnerError) as err:
            fetch(buf)
    assert buf.now - 1000.0 == pytest.approx(100.0 + TIMEOUT_S)  # the timeout counts from the last new sample
    msg = str(err.value)
    assert msg.startswith("no batch arrived for 300 s (learner.batch_timeout_s) at version 3, and producers made "
                          "no progress in that time: no new sample reached the buffer (it has received 1,000 "
                          "samples in all; waited 400 s in all)")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert "producers generating" in lines[0]
    assert lines[-1].endswith("no new sample for 290 s: the learner gives up after 300 s without progress "
                              "(learner.batch_timeout_s)")


def test_a_buffer_without_counters_times_out_as_before():
    buf = ScriptedBuffer(lambda t, req: P.Batch(req.learner_version, [], {}))
    no_count = r"made no progress .*\(the buffer did not answer, or answered without a sample count; waited 300 s"
    with pytest.raises(LearnerError, match=no_count):
        fetch(buf)
    assert buf.now - 1000.0 == pytest.approx(TIMEOUT_S)


def test_a_silent_buffer_times_out_and_a_late_request_never_overlaps():
    buf = ScriptedBuffer(lambda t, req: None)  # no reply at all
    with pytest.raises(LearnerError, match="no batch arrived for 300 s"):
        fetch(buf)
    assert buf.now - 1000.0 == pytest.approx(TIMEOUT_S)


def test_shutdown_and_batches_for_another_version():
    buf = ScriptedBuffer(None, control=[P.Heartbeat("x", "p", 0, {})])  # control messages other than Shutdown
    replies = iter([P.Batch(2, [group(0)], counters(5)), P.Batch(3, [group(1)], counters(6))])
    buf.reply = lambda t, req: next(replies)
    batch = fetch(buf)  # the batch for version 2 is dropped, the one for 3 returned
    assert batch is not None and batch.learner_version == 3 and batch.groups[0].prompt_id == 1
    assert fetch(ScriptedBuffer(lambda t, req: None, control=[P.Shutdown("run over")])) is None
