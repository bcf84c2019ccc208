"""Hostile input and access control at the buffer: binds refused without keys, CurveZMQ on both sockets (one key
per role), thousands of fuzzed messages, oversized frames, a client that never reads, and nothing unpickled on
the wire. The adversarial suite of issue #13 (forged results, a client acting as the learner, poisoned values,
floods) is in test_adversarial_*.py."""

import asyncio
import json
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from pipeline import protocol as P
from pipeline.auth import LEARNER, create_token, learner_token_path
from pipeline.buffer.checks import check_message, out_of_vocab
from pipeline.buffer.main import read_vocab_size
from pipeline.buffer.service import max_frames
from pipeline.config import load_config
from pipeline.testing.processes import buffer_command, start, wait_for_buffer
from pipeline.transport import (
    AsyncBufferClient,
    BufferClient,
    SecurityError,
    check_bind,
    free_port_pair,
    make_keys,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32


# ---------------------------------------------------------------- binds and keys


def test_check_bind_needs_keys_off_loopback():
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, "")
    check_bind("0.0.0.0", "/some/keys")
    with pytest.raises(SecurityError, match="reinforce-ada keys --out"):
        check_bind("0.0.0.0", "")


@pytest.mark.slow
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_buffer_cli_refuses_a_public_bind_without_keys(tmp_path, host):
    port = free_port_pair()
    cmd = buffer_command(port, tmp_path, "--endpoints.host", host)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2, run.stderr
    assert "reinforce-ada keys --out" in run.stderr and "keys_dir" in run.stderr
    assert "Traceback" not in run.stderr


def _client_dir(tmp_path: Path, name: str, client_from: Path, server_from: Path) -> Path:
    """A client's keys directory: its producer pair from `client_from`, the server's public key from
    `server_from`."""
    d = tmp_path / name
    d.mkdir()
    for f in ("producer.key", "producer.key_secret"):
        (d / f).write_bytes((client_from / f).read_bytes())
    (d / "producer.key_secret").chmod(0o600)  # a readable secret key is refused (load_pair)
    (d / "server.key").write_bytes((server_from / "server.key").read_bytes())
    return d


@pytest.mark.slow
def test_curve_keys_gate_requests_and_the_control_channel(tmp_path, procs):
    keys = make_keys(tmp_path / "keys")
    stranger = make_keys(tmp_path / "stranger")  # a valid key pair the buffer never authorized
    port = free_port_pair()
    buf = start(buffer_command(port, tmp_path, "--endpoints.keys_dir", str(keys)), tmp_path / "buffer.log")
    procs.append(buf)
    urls = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    good = BufferClient(*urls, "good", str(keys))  # the producer key
    learner = BufferClient(*urls, "learner", str(keys), role=LEARNER)
    # refused outright (ZeroMQ gives up on these connections): the client says so instead of hanging
    refused = {
        "no keys": (BufferClient(*urls, "nokeys", ""), "keys on one side only"),
        "unauthorized client key": (BufferClient(*urls, "stranger", str(_client_dir(tmp_path, "c1", stranger,
                                                                                     keys))), "authorized"),
    }
    # a wrong server key looks like a buffer that is down: no reply, ever
    wrong_server = BufferClient(*urls, "wrongserver", str(_client_dir(tmp_path, "c2", keys, stranger)))
    try:
        snap = None
        end = time.monotonic() + 30
        while snap is None and time.monotonic() < end:
            assert buf.poll() is None, (tmp_path / "buffer.log").read_text()
            snap = good.request(P.MetricsRequest("good"), P.MetricsSnapshot, 1.0)
        assert snap is not None, "an authorized client must be served"
        for name, (client, why) in refused.items():
            with pytest.raises(SecurityError, match=why):
                for _ in range(5):
                    assert client.request(P.MetricsRequest(name), P.MetricsSnapshot, 1.0) is None, name
        for _ in range(2):
            assert wrong_server.request(P.MetricsRequest("wrongserver"), P.MetricsSnapshot, 1.0) is None
        asyncio.run(_async_clients(urls, keys))
        # the control channel (PUB) is keyed too: only the authorized subscriber hears the broadcast; and only
        # the learner's key may announce a version (the producer key's attempt is refused and counted)
        good.send(P.VersionUpdate(7))
        for version in (1, 2, 3):
            learner.send(P.VersionUpdate(version))
            time.sleep(0.2)
        heard = [m.version for m in good.poll_control(2.0) if isinstance(m, P.VersionUpdate)]
        assert heard and heard[-1] == 3, "the authorized subscriber hears version updates"
        assert 7 not in heard
        for name, client in [*((n, c) for n, (c, _) in refused.items()), ("wrong server key", wrong_server)]:
            assert client.poll_control(0.5) == [], name
        # nothing the refused clients sent got through: only the authorized client moved the version
        while good.recv(0.3) is not None:  # late replies to the probes above
            pass
        snap = good.request(P.MetricsRequest("good"), P.MetricsSnapshot, 5.0)
        assert snap.metrics["learner_version"] == 3
        assert snap.metrics["buffer/malformed"] == 0 and snap.metrics["buffer/invalid"] == 0
        assert snap.metrics["buffer/refused_role"] == 1 and snap.metrics["rejected_by_sender"] == {"good": 1}
    finally:
        for client in [good, learner, wrong_server, *(c for c, _ in refused.values())]:
            client.close()


async def _async_clients(urls, keys) -> None:
    """The producers' asyncio client: served with the keys, a SecurityError from recv() without them."""
    good = AsyncBufferClient(*urls, "async-good", str(keys))
    refused = AsyncBufferClient(*urls, "async-nokeys", "")
    try:
        await good.send(P.WorkRequest("async-good", 1, 0))
        assert isinstance(await asyncio.wait_for(good.recv(), 10), P.Assignments)
        # the refusal surfaces at the first call after the handshake failed: send() when it was that quick
        with pytest.raises(SecurityError, match="keys on one side only"):
            await refused.send(P.WorkRequest("async-nokeys", 1, 0))
            await asyncio.wait_for(refused.recv(), 10)
    finally:
        good.close()
        refused.close()


# ---------------------------------------------------------------- nothing unpickled


def test_nothing_on_the_wire_is_unpickled():
    # every way Python code can unpickle, including torch.distributed's object collectives and numpy's opt-in
    pattern = re.compile(r"\bimport pickle\b|\bpickle\.|cPickle|cloudpickle|\bdill\b|recv_pyobj|send_pyobj|"
                         r"_object_list\(|_object\(|allow_pickle\s*=\s*True|marshal\.loads")
    hits = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                hits.append((str(path.relative_to(REPO)), lineno, line.strip()))
    # learner rank 0 shares each batch with its other ranks as the protocol's frames inside a typed msgpack
    # message (two tensor broadcasts), decoded by the typed decoder: no object collective, no pickle
    assert hits == [], hits
    source = (REPO / "pipeline/consumer/ranks.py").read_text()
    assert "P.Encoder().encode(batch)" in source and "P.Decoder(P.Batch).decode(self.frames)" in source
    assert "msgspec.msgpack.Decoder(RankMessage)" in source
    # torch.load unpickles unless weights_only=True; the checkpoints it reads are local files, but keep it safe
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for line in path.read_text().splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, (path, line)


# ---------------------------------------------------------------- input checks (unit)


def test_check_message_rejects_values_the_scheduler_cannot_take():
    ok = np.arange(3, dtype=np.int32)
    assert check_message(P.WorkRequest("p", 0, 0)) == ""
    assert "max_rounds" in check_message(P.WorkRequest("p", -1, 0))
    assert "version" in check_message(P.WorkRequest("p", 1, -1))
    assert "num_groups" in check_message(P.BatchRequest("l", 0, 0, 100))
    assert "learner_version" in check_message(P.BatchRequest("l", -1, 4, 100))
    assert "version" in check_message(P.VersionUpdate(-1))
    assert check_message(P.RoundResult("p", 1, 1, ok, [], 0.0)) == ""
    assert "negative" in check_message(P.RoundResult("p", 1, 1, np.array([3, -1], np.int32), [], 0.0))


def test_out_of_vocab():
    sample = P.Sample(np.array([0, 31], np.int32), np.zeros(2, np.float32), 1.0, 0, "stop")
    big = P.Sample(np.array([0, 32], np.int32), np.zeros(2, np.float32), 1.0, 0, "stop")
    empty = P.Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), 0.0, 0, "length")
    ids = np.array([1, 2], np.int32)
    assert out_of_vocab(P.RoundResult("p", 1, 1, ids, [sample, empty], 0.0), 32) == ""
    assert "sample 1" in out_of_vocab(P.RoundResult("p", 1, 1, ids, [sample, big], 0.0), 32)
    assert "prompt" in out_of_vocab(P.RoundResult("p", 1, 1, np.array([40], np.int32), [sample], 0.0), 32)


def test_read_vocab_size(tmp_path):
    assert read_vocab_size(str(tmp_path / "missing")) is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert read_vocab_size(str(tmp_path)) == 151936
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 262144}}))
    assert read_vocab_size(str(tmp_path)) == 262144
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        read_vocab_size(str(tmp_path))


# ---------------------------------------------------------------- fuzzing a live buffer


class _Sample(msgspec.Struct, array_like=True, tag="Sample"):
    """protocol.Sample's wire form without its checks, to put bad values on the wire."""

    token_ids: Any
    logprobs: Any
    reward: float
    version: int
    finish_reason: str


class _RoundResult(msgspec.Struct, array_like=True, tag="RoundResult"):
    producer_id: str
    round_id: int
    prompt_id: int
    prompt_token_ids: Any
    samples: list
    gen_seconds: float


def _frames(msg) -> list[bytes]:
    return [bytes(f) for f in P.Encoder().encode(msg)]


def _result(rng: random.Random, round_id: int, *, n: int = 8, tokens: Any = None, logprobs: Any = None,
            reward: float = 1.0, prompt: Any = None) -> list[bytes]:
    t = rng.randint(0, 12)
    samples = [_Sample(np.arange(t, dtype=np.int32) % VOCAB if tokens is None else tokens,
                       np.zeros(t, np.float32) if logprobs is None else logprobs, reward, 0, "stop") for _ in range(n)]
    ids = np.arange(5, dtype=np.int32) if prompt is None else prompt
    return _frames(_RoundResult("fuzz", round_id, 1, ids, samples, 0.1))


def _flip_tag(rng: random.Random, frames: list[bytes], tag: str) -> list[bytes]:
    """`frames` with one bit flipped inside the message's type tag: no other tag is one bit away from it."""
    head = bytearray(frames[0])
    at = bytes(head).index(tag.encode()) + rng.randrange(len(tag))
    head[at] ^= 1 << rng.randrange(8)
    return [bytes(head), *frames[1:]]


# What the buffer must do with each kind of message from a connection without the learner token, known from how
# the message was built (never by decoding it with the code under test): the counter it bumps ("malformed": not a
# well-formed message of a kind the buffer takes; "invalid": well-formed, with values no client sends;
# "refused_role": a kind only the learner may send), "ignored" (a result for a round never leased: counted as
# unknown or late), or "ok" (served, no counter).
MALFORMED, INVALID, REFUSED, IGNORED, OK = "malformed", "invalid", "refused_role", "ignored", "ok"


def _fuzz_messages(rng: random.Random, count: int) -> list[tuple[list[bytes], str]]:
    """Random, truncated, mutated, unknown, out-of-range and out-of-vocabulary messages, each with its fate."""
    rid = lambda: rng.randrange(10**9, 2 * 10**9)  # noqa: E731 - never a round the buffer issued
    seeds = lambda: [(_frames(P.WorkRequest("fuzz", 3, 0)), "WorkRequest"),  # noqa: E731
                     (_frames(P.Heartbeat("fuzz", "producer", 0, {"busy": 1.0})), "Heartbeat"),
                     (_frames(P.MetricsRequest("fuzz")), "MetricsRequest"), (_result(rng, rid()), "RoundResult"),
                     (_frames(P.BatchRequest("fuzz", 0, 4, 10)), "BatchRequest")]
    makers = [
        lambda: ([rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))], MALFORMED),
        # a truncated msgpack header never decodes (its array or string is cut short)
        lambda: ((lambda f: [f[0][: rng.randrange(len(f[0]))], *f[1:]])(rng.choice(seeds())[0]), MALFORMED),
        # a frame missing (an array refers to a frame past the end) or one extra (no array refers to it)
        lambda: ((lambda f: f[:-1] if len(f) > 1 else f + [b"x"])(rng.choice(seeds())[0]), MALFORMED),
        lambda: ((lambda seed: _flip_tag(rng, *seed))(rng.choice(seeds())), MALFORMED),  # a bit flip in the tag
        lambda: ([msgspec.msgpack.encode([rng.choice(["Bogus", "Exec", "Group", "Batch", "Ack"]), 1, "x", [2]])],
                 MALFORMED),  # unknown, or a kind the buffer never receives
        lambda: ([msgspec.msgpack.encode(["WorkRequest", rng.random(), None, "x"])], MALFORMED),  # wrong types
        lambda: ([msgspec.msgpack.encode(["Heartbeat", "id", "producer", 0, {"k": [[[[[[[[1]]]]]]]]}])], MALFORMED),
        lambda: (_result(rng, rid(), reward=rng.choice([float("nan"), float("inf"), -float("inf")])), MALFORMED),
        lambda: (_result(rng, rid(), tokens=np.array([3, -7], np.int32), logprobs=np.zeros(2, np.float32)),
                 MALFORMED),  # a negative token id in a sample
        lambda: (_result(rng, rid(), tokens=np.arange(5, dtype=np.int32), logprobs=np.zeros(4, np.float32)),
                 MALFORMED),  # 5 tokens, 4 log-probs
        lambda: (_result(rng, rid(), tokens=np.arange(3, dtype=np.int64), logprobs=np.zeros(3, np.float32)),
                 MALFORMED),  # int64 token ids
        lambda: (_result(rng, rid(), tokens=np.arange(4, dtype=np.int32).reshape(2, 2),
                         logprobs=np.zeros(4, np.float32).reshape(2, 2)), MALFORMED),  # 2-D arrays
        lambda: ((lambda f: f[:1] + [f[1][:-1]] + f[2:])(_result(rng, rid(), tokens=np.arange(6, dtype=np.int32),
                                                                 logprobs=np.zeros(6, np.float32))),
                 MALFORMED),  # a frame one byte short of its array
        lambda: ([msgspec.msgpack.encode(["RoundResult", "p", 1, 1, ["int32", [2**40], 1], [], 0.0]), b"\0" * 8],
                 MALFORMED),  # a shape far larger than its frame
        lambda: (_frames(P.WorkRequest("fuzz", -rng.randint(1, 10**6), 0)), INVALID),
        lambda: (_frames(P.BatchRequest("fuzz", rng.choice([-1, 0]), rng.choice([0, -3]), 10)), REFUSED),
        lambda: (_frames(P.VersionUpdate(-rng.randint(1, 10**9))), REFUSED),
        lambda: (_result(rng, rid(), prompt=np.array([1, -2], np.int32)), INVALID),  # negative prompt token
        lambda: (_result(rng, rid(), tokens=np.array([1, VOCAB + rng.randrange(10**6)], np.int32),
                         logprobs=np.zeros(2, np.float32)), IGNORED),  # out of vocabulary, for a round never leased
        lambda: (_result(rng, rid(), prompt=np.array([VOCAB], np.int32)), IGNORED),  # out of vocabulary prompt
        lambda: (_result(rng, rid()), IGNORED),  # well-formed, for a round never leased
        lambda: (_frames(P.Heartbeat("fuzz", "producer", 0, {"busy": rng.random()})), OK),
        lambda: (_frames(P.MetricsRequest("fuzz")), OK),
        lambda: ([rng.randbytes(100) for _ in range(rng.randint(50, 300))], MALFORMED),  # many frames
    ]
    return [rng.choice(makers)() for _ in range(count)]


@pytest.mark.slow
def test_fuzzed_messages_are_counted_and_the_buffer_keeps_serving(tmp_path, procs):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    create_token(learner_token_path(tmp_path / "tiny"))  # the fuzzer holds no token: it is a producer
    port = free_port_pair()
    cmd = buffer_command(port, tmp_path, "--buffer.max_message_bytes", "65536", "--buffer.heartbeat_timeout_s", "60")
    cmd[cmd.index("--model") + 1] = str(model)
    limit = max_frames(load_config(None, []))
    buf = start(cmd, tmp_path / "buffer.log")
    procs.append(buf)
    wait_for_buffer(port, proc=buf)
    urls = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    normal = BufferClient(*urls, "normal")
    ctx = zmq.Context()
    try:
        # a normal producer holds a round through the storm
        work = normal.request(P.WorkRequest("normal", 1, 0), P.Assignments, 5.0)
        assert work is not None and len(work.rounds) == 1
        rnd = work.rounds[0]

        rng = random.Random(0)
        expected = {MALFORMED: 0, INVALID: 0, REFUSED: 0, IGNORED: 0, OK: 0}
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.IDENTITY, b"evil")
        evil.connect(urls[0])
        sent = 0
        for frames, kind in _fuzz_messages(rng, 4000):
            assert len(frames) + 1 <= limit  # each is judged on its content, not cut by the frame limit
            expected[kind] += 1
            evil.send_multipart(frames)
            sent += 1
        print(f"fuzz: sent {sent} messages: {expected}")
        assert min(expected.values()) > 0 and sent == 4000
        counted = lambda m: {**{k: m[f"buffer/{k}"] for k in ("malformed", "invalid", "refused_role")},  # noqa: E731
                             "ignored": sum(m["results_ignored"].values()) + m["eval_counts"]["results_late"] +
                             m["eval_counts"]["results_unknown"]}
        want = {k: v for k, v in expected.items() if k != "ok"}
        m = wait_for_buffer(port, proc=buf, timeout_s=60, until=lambda m: counted(m) == want)
        assert m["rejected_by_sender"] == {"evil": expected["invalid"] + expected["refused_role"]}
        assert m["malformed_by_sender"] == {"evil": expected["malformed"]}
        assert m["buffer/handler_errors"] == 0 and m["learner_version"] == 0 and not m["draining"]

        # a frame over buffer.max_message_bytes: ZeroMQ drops that connection; the message is never delivered
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.IDENTITY, b"big")
        big.connect(urls[0])
        big.send_multipart(_frames(P.MetricsRequest("big")) + [b"\0" * 70_000])
        time.sleep(0.5)
        big.send_multipart(_frames(P.MetricsRequest("big")))  # it reconnects by itself and is served again
        assert big.poll(10_000), "the dropped client reconnects and is served"
        big.close(0)

        # a client that asks and never reads its replies: the buffer drops replies it cannot queue, never blocks
        deaf = ctx.socket(zmq.DEALER)
        deaf.setsockopt(zmq.IDENTITY, b"deaf")
        deaf.setsockopt(zmq.RCVHWM, 1)
        deaf.setsockopt(zmq.RCVBUF, 4096)
        deaf.connect(urls[0])
        request = _frames(P.MetricsRequest("deaf"))
        for _ in range(20_000):  # ~30 MB of replies: more than ZeroMQ's queues and the kernel's buffers hold
            deaf.send_multipart(request)
        wait_for_buffer(port, proc=buf, timeout_s=60, until=lambda m: m["buffer/unroutable"] > 0)

        # the normal client is still served: its result is accepted and it gets new work
        normal.send(P.Heartbeat("normal", "producer", 0, {}))
        samples = [P.Sample(np.arange(4, dtype=np.int32), np.zeros(4, np.float32), float(i % 2), 0, "stop")
                   for i in range(rnd.num_samples)]
        normal.send(P.RoundResult("normal", rnd.round_id, rnd.prompt_id, np.arange(3, dtype=np.int32), samples, 0.1))
        assert normal.request(P.WorkRequest("normal", 1, 0), P.Assignments, 10.0) is not None
        m = wait_for_buffer(port, proc=buf, timeout_s=30, until=lambda m: m["samples_received"] >= rnd.num_samples)
        assert m["samples_received"] == rnd.num_samples
        assert {k: v for k, v in counted(m).items() if k != "ignored"} == \
            {k: v for k, v in want.items() if k != "ignored"}  # the oversized frame never reached the loop
        assert m["buffer/unroutable"] > 0  # replies to the deaf client were dropped, not waited on
        print(f"fuzz: counters {counted(m)}, unroutable {m['buffer/unroutable']}, "
              f"ignored {m['results_ignored']}, rejected {m['results_rejected']}")
        assert buf.poll() is None
        evil.close(0)
        deaf.close(0)
    finally:
        normal.close()
        ctx.destroy(linger=0)
