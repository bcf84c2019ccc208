"""Issue #21, the buffer: each attack played against a real `reinforce-ada buffer` process over real ZeroMQ, and
shown to fail (or, where the answer is a documented limit, the limit shown): a greedy work request and many
identities of one key, identities taken before the learner and the supervisor connect, one producer's reward-0
samples stopping the run, oversized heartbeats and frames, prompt tokens the buffer did not assign, token ids
beyond the tokenizer's vocabulary, and samples of a version the learner has not announced."""

import json
import shutil
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from pipeline import protocol as P
from pipeline.auth import LEARNER, create_token, learner_token_path, make_keys
from pipeline.buffer.service import max_frame_bytes
from pipeline.config import load_config
from pipeline.exits import EXIT_FATAL
from pipeline.testing.processes import buffer_command, buffer_metrics, send_shutdown, start
from pipeline.transport import BufferClient, free_port_pair, unique_identity

pytestmark = pytest.mark.slow
BATCH = 8  # groups per learner step; the admission window is (max_staleness + 1) * BATCH = 16 rounds


def _buffer(tmp_path: Path, procs: list, *overrides: str, model: Path | None = None, keys_dir: str = ""):
    """A real buffer on loopback with a learner token (or CurveZMQ keys); returns (port, proc, token file)."""
    if model is None:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps({"vocab_size": 32}))
    token = None if keys_dir else create_token(learner_token_path(tmp_path / "tiny"))
    port = free_port_pair()
    cmd = buffer_command(port, tmp_path, "--buffer.heartbeat_timeout_s", "30", *overrides, batch=BATCH,
                         model=str(model))
    if keys_dir:
        cmd += ["--endpoints.keys_dir", keys_dir]
    buf = start(cmd, tmp_path / "buffer.log")
    procs.append(buf)
    _wait(port, buf, keys_dir=keys_dir)
    return port, buf, token


def _wait(port: int, buf, until=lambda m: True, keys_dir: str = "", timeout_s: float = 30.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if buf.poll() is not None:
            raise RuntimeError(f"the buffer exited with code {buf.returncode}")
        m = buffer_metrics(port, 1.0, keys_dir=keys_dir)
        if m is not None and until(m):
            return m
        time.sleep(0.1)
    raise TimeoutError("the buffer did not get there in time")


def _urls(port: int) -> tuple[str, str]:
    return f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"


def _result(a: P.RoundAssignment, prompt_ids: np.ndarray, reward: float = 0.0, tokens=(3, 4, 5),
            version: int = 0) -> P.RoundResult:
    ids = np.array(tokens, np.int32)
    samples = [P.Sample(ids, np.full(ids.size, -0.3, np.float32), reward, version, "stop")
               for _ in range(a.num_samples)]
    return P.RoundResult("x", a.round_id, a.prompt_id, prompt_ids, samples, 0.1)


def _chars(a: P.RoundAssignment) -> np.ndarray:
    return np.array([ord(c) % 32 for c in a.prompt], np.int32)


def _work(client: BufferClient, n: int = 10**12) -> list[P.RoundAssignment]:
    reply = client.request(P.WorkRequest(client.identity, n, 0), P.Assignments, 10)
    assert reply is not None
    return reply.rounds


# ---------------------------------------------------------------- greedy work requests


def test_a_greedy_work_request_takes_only_its_share_of_the_window(tmp_path, procs):
    port, buf, token = _buffer(tmp_path, procs, "--producers.count", "2")
    greedy, honest = BufferClient(*_urls(port), "greedy"), BufferClient(*_urls(port), "honest")
    try:
        taken = _work(greedy)  # first, alone, for every round there is: half the window (the run starts 2)
        assert len(taken) == BATCH, len(taken)
        assert _work(greedy) == []  # asking again gets nothing more
        assert len(_work(honest, 64)) == BATCH  # the honest producer gets its half at once, not after the leases
        send_shutdown(port, token_file=token)
        assert buf.wait(timeout=20) == 0
    finally:
        greedy.close()
        honest.close()


def test_without_keys_fairness_is_per_identity_and_identities_are_bounded(tmp_path, procs):
    """The documented limit: without keys a client is its connection, so one process with many identities takes
    that many shares (and the buffer tracks 1,024 identities at most, refusing newcomers while all hold rounds)."""
    port, buf, token = _buffer(tmp_path, procs, "--producers.count", "1")
    many = [BufferClient(*_urls(port), f"sybil{i}") for i in range(4)]
    try:
        got = [len(_work(c)) for c in many]
        assert got[0] == 2 * BATCH and sum(got) == 2 * BATCH  # the first alone took the window: 1 producer started
        m = _wait(port, buf)
        assert m["peers"]["tracked"] >= 4
        send_shutdown(port, token_file=token)
        assert buf.wait(timeout=20) == 0
    finally:
        for c in many:
            c.close()


def _second_producer_key(keys_dir: Path, tmp_path: Path) -> Path:
    """A second producer key pair, admitted, in a directory of its own (as given to another machine)."""
    other = tmp_path / "other-keys"
    other.mkdir(mode=0o700)
    shutil.copy(keys_dir / "server.key", other / "server.key")
    zmq.auth.create_certificates(other, "producer")
    (other / "producer.key_secret").chmod(0o600)
    shutil.copy(other / "producer.key", keys_dir / "authorized" / "producer" / "other.key")
    return other


def test_with_keys_fairness_is_per_key_whatever_the_identities(tmp_path, procs):
    keys = make_keys(tmp_path / "keys")
    other = _second_producer_key(keys, tmp_path)
    port, buf, _ = _buffer(tmp_path, procs, "--producers.count", "0", keys_dir=str(keys))
    greedy = [BufferClient(*_urls(port), f"g{i}", str(other)) for i in range(5)]  # one key, five identities
    honest = BufferClient(*_urls(port), "honest", str(keys))
    try:
        got = [len(_work(c)) for c in greedy]
        assert sum(got) == BATCH, got  # two producer keys admitted: the greedy key's half of the window, no more
        assert len(_work(honest, 64)) == BATCH
        stopper = BufferClient(*_urls(port), "stopper", str(keys), role=LEARNER)
        stopper.send(P.Shutdown("done"))
        stopper.close()
        assert buf.wait(timeout=20) == 0
    finally:
        for c in [*greedy, honest]:
            c.close()


# ---------------------------------------------------------------- fixed identities


def test_identities_taken_first_do_not_block_the_learner_or_the_supervisor(tmp_path, procs):
    port, buf, token = _buffer(tmp_path, procs)
    ctx = zmq.Context()
    squatters = []
    try:
        for name in (b"learner-tiny", b"supervisor"):  # the names they connected as before: taken first
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, name)
            s.connect(_urls(port)[0])
            squatters.append(s)
        time.sleep(0.3)
        ids = {unique_identity("learner-tiny") for _ in range(3)}
        assert len(ids) == 3 and not ids & {"learner-tiny"}  # per process and random: nothing to take first
        learner = BufferClient(*_urls(port), unique_identity("learner-tiny"), role=LEARNER, token_file=token)
        supervisor = BufferClient(*_urls(port), unique_identity("supervisor"), subscribe=False)
        try:
            assert learner.request(P.BatchRequest("l", 0, 1, 100), P.Batch, 5.0) is not None  # served as learner
            assert supervisor.request(P.MetricsRequest("s"), P.MetricsSnapshot, 5.0) is not None
            learner.send(P.Shutdown("done"))
        finally:
            learner.close()
            supervisor.close()
        assert buf.wait(timeout=20) == 0
    finally:
        for s in squatters:
            s.close(0)
        ctx.term()
    # the learner and the supervisor connect under such identities (their role is their token or key)
    root = Path(__file__).resolve().parents[1] / "pipeline"
    assert 'unique_identity(f"learner-{cfg.run.name}")' in (root / "consumer" / "loop.py").read_text()
    assert 'unique_identity("supervisor")' in (root / "supervisor" / "main.py").read_text()


# ---------------------------------------------------------------- one producer stopping the run


def test_one_producers_reward_0_samples_do_not_stop_the_run_but_two_consistent_producers_do(tmp_path, procs):
    limit = 64
    port, buf, token = _buffer(tmp_path, procs, "--producers.count", "2", "--buffer.stop_without_signal",
                               str(limit), "--buffer.max_staleness", "100")
    attacker, honest = BufferClient(*_urls(port), "attacker"), BufferClient(*_urls(port), "honest")
    try:
        sent = 0
        while sent < 4 * limit:  # far past the limit, every sample reward 0, before any honest sample
            for a in _work(attacker, 4):
                attacker.send(_result(a, _chars(a)))
                sent += a.num_samples
        for a in _work(honest, 1):  # one honest round, also all wrong (early in a run, likely)
            honest.send(_result(a, _chars(a)))
        _wait(port, buf, until=lambda m: m["samples_received"] >= sent + 8)
        time.sleep(2.5)  # the buffer looks every second
        assert buf.poll() is None, "one producer's samples stopped the run"
        # the honest producer's own samples, consistent with the attacker's, reach half the limit: now it stops
        honest_sent = 8
        while honest_sent < limit // 2 and buf.poll() is None:
            for a in _work(honest, 4):
                honest.send(_result(a, _chars(a)))
                honest_sent += a.num_samples
        assert buf.wait(timeout=20) == EXIT_FATAL
        assert "reward never fired" in (tmp_path / "buffer.log").read_text()
    finally:
        attacker.close()
        honest.close()


# ---------------------------------------------------------------- message size


def test_oversized_heartbeats_are_refused_undecoded_and_frames_are_bounded_by_what_the_run_needs(tmp_path, procs):
    port, buf, token = _buffer(tmp_path, procs)
    cfg = load_config(None, ["--learner.batch_prompts", str(BATCH)])
    limit = max_frame_bytes(cfg)
    assert limit < cfg.buffer.max_message_bytes // 64  # about 1 MiB here, not 256 MiB
    ctx = zmq.Context()
    hb, big = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        hb.setsockopt(zmq.IDENTITY, b"hb")
        hb.connect(_urls(port)[0])
        stats = {f"k{i}": 1.0 for i in range(40_000)}  # ~0.5 MB on the wire, ~20x that as Python objects
        header = msgspec.msgpack.encode(["Heartbeat", "hb", "producer", 0, stats])
        assert len(header) < limit
        hb.send(header)
        m = _wait(port, buf, until=lambda m: m["buffer/malformed"] >= 1)
        assert m["malformed_by_sender"] == {"hb": 1} and m["producers"] == {}
        # a frame one byte over the limit: ZeroMQ drops the connection before the buffer sees any of it
        big.setsockopt(zmq.IDENTITY, b"big")
        big.connect(_urls(port)[0])
        big.send_multipart([P.encode(P.MetricsRequest("big"))[0], b"\0" * (limit + 1)])
        assert not big.poll(1500), "a message with an oversized frame is answered"
        m = _wait(port, buf)
        assert m["buffer/malformed"] == 1  # never reached the loop
        send_shutdown(port, token_file=token)
        assert buf.wait(timeout=20) == 0
    finally:
        hb.close(0)
        big.close(0)
        ctx.term()


# ---------------------------------------------------------------- prompt tokens, vocabulary, versions


def test_prompt_tokens_are_the_buffers_own_and_token_ids_are_bounded_by_the_tokenizer(tmp_path, procs,
                                                                                      tiny_model_dir):
    """The buffer tokenizes each prompt it serves (the tiny model's tokenizer; config.json without vocab_size, so
    the tokenizer's size bounds the ids): a result whose prompt tokens differ is rejected and counted, one with
    ids beyond the tokenizer refused, one of a version the learner has not announced refused, the honest one
    accepted."""
    from transformers import AutoTokenizer

    model = tmp_path / "tok-model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, model / name)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no vocab_size
    tok = AutoTokenizer.from_pretrained(str(model))
    port, buf, token = _buffer(tmp_path, procs, "--data.max_prompts", "64", model=model)
    producer = BufferClient(*_urls(port), "p0")
    try:
        rounds = _work(producer, 5)
        assert len(rounds) == 5
        own = [np.array(tok(a.prompt, add_special_tokens=True)["input_ids"], np.int32) for a in rounds]
        other = own[1] if not np.array_equal(own[1], own[0]) else np.concatenate([own[0], own[0][-1:]])
        producer.send(_result(rounds[0], other))  # another prompt's tokens, as the first round of its prompt
        producer.send(_result(rounds[1], own[1], tokens=(3, len(tok))))  # an id the tokenizer does not have
        producer.send(_result(rounds[2], own[2], version=1))  # the learner is at version 0
        producer.send(_result(rounds[3], own[3], reward=1.0))  # honest
        m = _wait(port, buf, until=lambda m: m["samples_received"] >= 8 and
                  sum(m["rejected_by_reason"].values()) >= 3)
        assert m["rejected_by_reason"] == {"prompt": 1, "oov": 1, "version": 1}, m["rejected_by_reason"]
        assert m["samples_received"] == rounds[3].num_samples
        send_shutdown(port, token_file=token)
        assert buf.wait(timeout=20) == 0
    finally:
        producer.close()
    assert "token ids checked against vocab_size 99" in (tmp_path / "buffer.log").read_text()


def _plan(tmp_path: Path, *overrides: str):
    """`reinforce-ada train`'s plan of a run (its directory, config and keys; nothing started)."""
    from pipeline.supervisor.plan import plan_run

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 32}))
    cfg = load_config(None, ["--run.dir", str(tmp_path / "runs"), "--model.path", str(model),
                             "--endpoints.router_port", "0", *overrides])
    return plan_run(cfg)


def test_the_run_directory_and_its_keys_are_private(tmp_path):
    """It holds the run's keys, checkpoints (weights), logs and samples: mode 0700, also when reused; every secret
    key 0600, and the run's config names the keys, so every child (restarted or resumed too) uses them."""
    import stat

    for reuse in (False, True):
        run_dir = tmp_path / "runs" / "tiny"
        if reuse:
            run_dir.chmod(0o755)
        plan = _plan(tmp_path, "--producers.count", "2")
        assert stat.S_IMODE(plan.run_dir.stat().st_mode) == 0o700
        keys = plan.run_dir / "keys"
        assert stat.S_IMODE(keys.stat().st_mode) == 0o700
        secrets_ = sorted(p.name for p in keys.glob("*.key_secret"))
        assert secrets_ == ["learner.key_secret", "producer-0.key_secret", "producer-1.key_secret",
                            "server.key_secret"], secrets_
        assert all(stat.S_IMODE((keys / n).stat().st_mode) == 0o600 for n in secrets_)
        assert load_config(plan.run_dir / "config.toml").endpoints.keys_dir == str(keys.resolve())
        assert not learner_token_path(plan.run_dir).exists()  # the learner's key holds its role


def test_a_buffer_that_is_not_the_runs_gets_nothing_from_its_clients(tmp_path, procs):
    """A process that takes the buffer's port while the run's buffer is down (a buffer without keys, or with keys
    of its own) is believed by none of the run's clients: their handshake with it fails (the server key is not the
    run's), so no work request or batch request of theirs is answered by it. The run's own buffer on the same keys
    serves the same clients, each producer with a key of its own (one client each: a share of the window each)."""
    from pipeline.auth import authorized_keys
    from pipeline.transport import SecurityError

    plan = _plan(tmp_path, "--producers.count", "2")
    keys = plan.cfg.endpoints.keys_dir
    assert sorted(authorized_keys(keys).values()) == [LEARNER, "producer", "producer"]
    impostors = {"no keys": "", "keys of its own": str(make_keys(tmp_path / "other", ["producer-0"]))}
    for what, impostor_keys in impostors.items():
        (tmp_path / what.replace(" ", "-")).mkdir()
        port, _, _ = _buffer(tmp_path / what.replace(" ", "-"), procs, keys_dir=impostor_keys)
        for role, identity in (("producer", "producer-0"), (LEARNER, unique_identity("learner"))):
            client = BufferClient(*_urls(port), identity, keys, role=role)
            try:
                msg = P.WorkRequest(identity, 4, 0) if role == "producer" else P.BatchRequest(identity, 0, 1, 1000)
                try:
                    reply = client.request(msg, P.Assignments if role == "producer" else P.Batch, 3.0)
                except SecurityError as exc:  # no keys at all: the handshake fails at once
                    assert what == "no keys" and "keys on one side only" in str(exc), (what, exc)
                    reply = None
                assert reply is None, (what, role, reply)
            finally:
                client.close()
    (tmp_path / "run").mkdir()
    port, buf, _ = _buffer(tmp_path / "run", procs, keys_dir=keys)
    for name in ("producer-0", "producer-1"):
        client = BufferClient(*_urls(port), name, keys)
        try:
            reply = client.request(P.WorkRequest(name, 64, 0), P.Assignments, 10.0)
        finally:
            client.close()
        assert reply is not None and 0 < len(reply.rounds) <= 2 * BATCH // 2, (name, reply)  # a share each
    send_shutdown(port, keys_dir=keys)
    assert buf.wait(timeout=20) == 0
