"""Doubles of the processes around the one under test: buffers that serve a real learner or a real producer
over real ZeroMQ sockets from a script, and the producer worker's engine, reward pool and buffer client."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import zmq

from pipeline import protocol as P
from pipeline.producer.engine import Completion, RoundAborted, RoundOutput
from pipeline.transport import free_port_pair

# ---------------------------------------------------------------- buffers


class LearnerBuffer:
    """A buffer double for the learner, in a thread: answers BatchRequests with `batches` (then empty ones),
    records the rest.

    With `progress_s`, it first answers for that long with empty Batches (each held 0.2 s, as the real buffer
    holds a request) whose `buffer/samples_received` rises: producers generating, no batch ready yet. With
    `version`, it answers MetricsRequests as a buffer at that learner version (else not at all)."""

    def __init__(self, batches, progress_s: float = 0.0, version: int | None = None):
        self.port = free_port_pair()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port + 1}")
        self.batches = list(batches)
        self.progress_s = progress_s
        self.version = version
        self.first_request: float | None = None
        self.received: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        enc, dec = P.Encoder(), P.Decoder(P.ToBuffer)
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            ident, *frames = self.router.recv_multipart()
            msg = dec.decode(frames)
            self.received.append(msg)
            if isinstance(msg, P.MetricsRequest) and self.version is not None:
                self.router.send_multipart([ident, *enc.encode(P.MetricsSnapshot({"learner_version": self.version}))])
            if isinstance(msg, P.BatchRequest):
                self.first_request = self.first_request or time.monotonic()
                if time.monotonic() - self.first_request < self.progress_s:
                    time.sleep(min(0.2, msg.timeout_ms / 1000))
                    metrics = {"buffer/samples_received": 10.0 * len(self.received)}
                    self.router.send_multipart([ident, *enc.encode(P.Batch(msg.learner_version, [], metrics))])
                    continue
                groups = self.batches.pop(0) if self.batches else []
                reply = P.Batch(msg.learner_version, groups, {"eval/acc": 0.25} if groups else {})
                self.router.send_multipart([ident, *enc.encode(reply)])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


class ProducerBuffer:
    """A buffer double for a producer process: the buffer's two sockets, driven by the test (`pump`, `wait`); it
    answers WorkRequests from `todo` and records the rest."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.pub = self.ctx.socket(zmq.PUB)
        self.control_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.dec, self.enc = P.Decoder(P.ToBuffer), P.Encoder()
        self.todo: list[P.RoundAssignment] = []
        self.requests: list[P.WorkRequest] = []
        self.beats: list[P.Heartbeat] = []
        self.results: dict[int, list[P.RoundResult]] = {}

    def pump(self, timeout_s: float) -> None:
        """Serve the producer for `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.router.poll(int(left * 1000) + 1):
                continue
            ident, *frames = self.router.recv_multipart()
            msg = self.dec.decode(frames)
            if isinstance(msg, P.WorkRequest):
                self.requests.append(msg)
                reply = self.assign(msg)
                if not reply.rounds:
                    time.sleep(0.05)  # a short long-poll
                self.router.send_multipart([ident] + self.enc.encode(reply))
            elif isinstance(msg, P.Heartbeat):
                self.beats.append(msg)
            elif isinstance(msg, P.RoundResult):
                self.results.setdefault(msg.round_id, []).append(msg)

    def assign(self, msg: P.WorkRequest) -> P.Assignments:
        """The reply to a WorkRequest: the next rounds of `todo`."""
        rounds, self.todo = self.todo[: msg.max_rounds], self.todo[msg.max_rounds:]
        return P.Assignments(rounds, 0)

    def wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump(0.1)

    def publish(self, msg) -> None:
        self.pub.send_multipart(self.enc.encode(msg))

    def close(self):
        self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


# ---------------------------------------------------------------- the producer worker's parts


class FakeEngine:
    """A scripted engine: a round takes `delay_s` and returns one token per sample; abort ends it at once. A
    streamed round (`on_sample`) hands sample i over after (i + 1) * delay_s / num_samples; an abort then cuts
    the rest (each had generated i + 1 tokens)."""

    def __init__(self, delay_s: float = 0.05, slots: int = 4):
        self.delay_s, self.slots = delay_s, slots
        self.version, self.last_load_seconds, self.is_dead = 0, 0.0, False
        self.on_sample_done = None
        self.running: dict[int, asyncio.Event] = {}
        self.loads: list[tuple[str, int]] = []

    @property
    def live_samples(self):
        return len(self.running)

    def free_samples(self):
        return max(0, self.slots - len(self.running))

    async def generate_round(self, a, on_sample=None):
        version, aborted = self.version, asyncio.Event()
        self.running[a.round_id] = aborted
        comps = [Completion(np.array([i + 4], np.int32), np.array([-0.5], np.float32), a.answer if i == 0 else "x",
                            "stop", version) for i in range(a.num_samples)]
        prompt = np.array([1, 5], np.int32)
        try:
            steps = a.num_samples if on_sample else 1
            for i in range(steps):
                try:
                    await asyncio.wait_for(aborted.wait(), self.delay_s / steps)
                    cut = range(i, a.num_samples) if on_sample else range(a.num_samples)
                    raise RoundAborted(str(a.round_id), len(cut), sum(k + 1 for k in cut))
                except TimeoutError:
                    if on_sample:
                        on_sample(i, comps[i], prompt)
        finally:
            del self.running[a.round_id]
        return RoundOutput(prompt, comps)

    async def abort(self, round_id):
        if round_id in self.running:
            self.running[round_id].set()

    async def load_weights(self, path, version):
        self.loads.append((path, version))
        self.version = version
        return 0.001


class FakePool:
    num_workers = 1

    def __init__(self):
        self.extras: list = []  # the extras each sample was scored with

    async def ascore(self, completions, answers, extras=None):
        self.extras += list(extras or [None] * len(completions))
        return [float(c == a) for c, a in zip(completions, answers)]

    def metrics(self):
        return {"reward_errors": 0}


class FakeClient:
    """Records what the producer sends; the test feeds replies and control messages."""

    def __init__(self):
        self.sent: list = []
        self.replies: asyncio.Queue = asyncio.Queue()
        self.control: asyncio.Queue = asyncio.Queue()

    async def send(self, msg):
        # through the real codec, so every message is wire-valid
        self.sent.append(P.Decoder(P.ToBuffer).decode([bytes(f) for f in P.Encoder().encode(msg)]))

    async def recv(self):
        return await self.replies.get()

    async def recv_control(self):
        return await self.control.get()

    def of(self, kind):
        return [m for m in self.sent if isinstance(m, kind)]


async def until(cond, timeout=5.0):
    """Wait (asyncio) until `cond()` holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
