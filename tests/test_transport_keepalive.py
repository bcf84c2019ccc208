"""A client whose control channel is not read while the buffer floods it and then goes away must survive.

With ZMTP heartbeats (what the sockets used before), libzmq 4.3.5 aborted such a client's whole process
("Assertion failed: !_io_error (src/stream_engine_base.cpp:310)"): the supervisor died after 80 steps of an
Ada-balance run (thousands of Abort broadcasts it never reads). Dead peers are detected by TCP keepalive now."""

import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from pipeline.transport import DEAD_PEER_S, MAXRT_MS, apply_keepalive

REPO = Path(__file__).parents[1]
BUFFER = r'''
import sys, time, zmq
from pipeline import protocol as P
from pipeline.transport import apply_keepalive
ctx = zmq.Context()
router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
for s in (router, pub):
    apply_keepalive(s)
router.bind(f"tcp://127.0.0.1:{sys.argv[1]}")
pub.bind(f"tcp://127.0.0.1:{int(sys.argv[1]) + 1}")
time.sleep(0.5)
for i in range(5000):  # more than the subscriber's receive queue holds (RCVHWM 1000)
    pub.send_multipart(P.encode(P.Abort([i], "flood")))
time.sleep(0.5)
'''
CLIENT = r'''
import subprocess, sys, time
from pipeline.transport import BufferClient, free_port_pair
port = free_port_pair()
buffer = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(port)])
client = BufferClient(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", "probe")  # never reads control
assert buffer.wait(30) == 0
time.sleep(3.0)  # a ZMTP heartbeat timer would fire here on the connection whose peer is gone
client.close()
print("survived")
'''


def test_keepalive_options():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        apply_keepalive(sock)
        assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1 and sock.getsockopt(zmq.TCP_MAXRT) == MAXRT_MS
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0  # no ZMTP heartbeat timers (see the module docstring)
        assert DEAD_PEER_S <= 15
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.slow
def test_an_unread_flooded_control_channel_does_not_abort_the_client_when_the_buffer_exits():
    proc = subprocess.run([sys.executable, "-c", CLIENT, BUFFER], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-2000:]
