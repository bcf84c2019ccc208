"""A real buffer process serves scripted producer processes and a scripted learner process over ZeroMQ."""

import json
import subprocess
import time

import pytest

from pipeline import protocol as P
from pipeline.testing.processes import buffer_command, scripted_command, start, wait_for_buffer
from pipeline.transport import BufferClient, free_port_pair

pytestmark = pytest.mark.slow


def _buffer_cmd(router, run_dir):
    return buffer_command(router, run_dir, "--buffer.heartbeat_timeout_s", "3")


@pytest.fixture
def ports():
    port = free_port_pair()
    return port, port + 1


def test_buffer_serves_scripted_producers_and_learner(tmp_path, ports):
    router, control = ports
    buf = start(_buffer_cmd(router, tmp_path), tmp_path / "buffer.log")
    procs = []
    try:
        wait_for_buffer(router)
        procs = [subprocess.Popen(scripted_command("producer", router, "--id", f"p{i}", "--round-seconds", "0.02"))
                 for i in range(2)]
        out = tmp_path / "summary.json"
        learner = subprocess.run(scripted_command("learner", router, "--steps", "6", "--batch", "8", "--out", str(out)),
                                 timeout=120)
        assert learner.returncode == 0
        summary = json.loads(out.read_text())
        assert summary["steps"] == 6 and summary["versions"] == [1, 2, 3, 4, 5, 6]
        assert summary["groups"] == 48
        assert summary["bad_group_size"] == 0
        assert summary["max_staleness_seen"] <= 1
        assert summary["resolved_groups"] > 0 and summary["resolved_mixed"] == summary["resolved_groups"]
        assert len(set(summary["prompt_ids"])) == 48  # no prompt trained twice
        m = summary["buffer"]
        assert m["released"] >= 48 and m["samples_received"] > 48 * 4
        assert m["admitted"] == m["released"] - m["reopened"] + m["dropped_unresolved"] + \
            m["dropped_zero_variance"] + m["active"]
        assert buf.wait(timeout=20) == 0  # the learner's Shutdown stops the buffer
    finally:
        for p in procs + [buf]:
            p.kill()
            p.wait()


def test_malformed_messages_are_counted_and_dropped(tmp_path, ports):
    import zmq

    router, control = ports
    buf = start(_buffer_cmd(router, tmp_path), tmp_path / "buffer.log")
    ctx = zmq.Context()
    client = None
    try:
        wait_for_buffer(router)
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.IDENTITY, b"evil")
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(f"tcp://127.0.0.1:{router}")
        bad = [[b"garbage"], [b"\x93\xa7Unknown\x01\x02"], [P.encode(P.Shutdown("x"))[0][:3]],
               P.encode(P.WorkRequest("evil", 1, 0)) + [b"extra"]]
        for frames in bad:
            evil.send_multipart(frames)
        # not wait_for_buffer's "probe": the router refuses an identity whose last connection it has not yet seen
        # close, which a loaded machine can delay past every request of this loop
        client = BufferClient(f"tcp://127.0.0.1:{router}", f"tcp://127.0.0.1:{control}", "malformed-probe")
        deadline = time.monotonic() + 20  # a loaded machine may take a while to deliver and count all four
        while True:
            snap = client.request(P.MetricsRequest("malformed-probe"), P.MetricsSnapshot, 5.0)
            if (snap is not None and snap.metrics["buffer/malformed"] >= 4) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert snap is not None, "the buffer did not answer a metrics request"
        assert snap.metrics["buffer/malformed"] == 4
        assert snap.metrics["malformed_by_sender"] == {"evil": 4}
        assert buf.poll() is None  # still serving
        client.send(P.Shutdown("test over"))
        assert buf.wait(timeout=20) == 0
    finally:
        if client is not None:
            client.close()
        ctx.destroy(linger=0)  # a context left to the garbage collector blocks in term() at an arbitrary point
        buf.kill()
        buf.wait()
