"""Weight transports (pipeline/weights/): the bucket layout, the checks on an announcement, the file transport, the
producer's refusals, and the dist publisher with real member processes (gloo, no vLLM): group reuse, a late joiner,
and a member killed mid-broadcast. The vLLM producers over dist are in test_weights_dist.py."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.testing.doubles import FakeClient, FakeEngine, FakePool, until
from pipeline.testing.weight_member import request_line
from pipeline.weights import uri_problem, version_problem
from pipeline.weights.dist_plan import ALIGN, Plan, digest, layout, pack, unpack
from pipeline.weights.file import FileLoader, FilePublisher, iter_file
from pipeline.weights.uris import dist_uri, file_uri_problem, parse_dist_uri, weights_path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- buckets


def test_buckets_round_trip_every_dtype_aligned_and_bounded():
    state = {"w": torch.randn(300, 7), "bf": torch.randn(33).to(torch.bfloat16), "h": torch.randn(5, 2).half(),
             "i": torch.arange(9, dtype=torch.int64), "b": torch.tensor([True, False, True]),
             "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "big": torch.randn(2000)}
    buckets = layout(state, bucket_bytes=4096)
    assert [e[0] for b in buckets for e in b.entries] == list(state)  # every tensor once, in order
    for b in buckets:
        assert all(offset % ALIGN == 0 for _, _, _, offset in b.entries)
        assert b.nbytes <= 4096 or len(b.entries) == 1  # a tensor larger than a bucket travels alone
    assert any(b.entries[0][0] == "big" and b.nbytes == 8000 for b in buckets)
    before = {k: v.clone() for k, v in state.items()}
    data = pack(state, buckets)
    state["w"].add_(1.0)  # the packed copy does not alias the state
    back = dict(item for buf, b in zip(data, buckets) for item in unpack(buf, b))
    assert back.keys() == state.keys()
    for k, v in back.items():
        assert v.dtype == before[k].dtype and v.shape == before[k].shape and torch.equal(v, before[k]), k
    plan = Plan("s", 1, 1, 3, 7, "gloo", "127.0.0.1", 1234, 5.0, buckets, [digest(buf) for buf in data])
    assert Plan.decode(plan.encode()) == plan and plan.num_bytes == sum(b.nbytes for b in buckets)
    with pytest.raises(RuntimeError, match="refused"):
        Plan.decode(b'{"error": "no"}')


# ---------------------------------------------------------------- what a producer (and the buffer) accepts


def test_file_uri_must_be_the_version_file_directly_in_the_weights_dir(tmp_path):
    wdir = tmp_path / "weights"
    wdir.mkdir()
    good = weights_path(wdir, 3)
    assert file_uri_problem(str(good), wdir, 3) == ""
    assert file_uri_problem(f"file://{good}", wdir, 3) == ""
    assert "version 4" in file_uri_problem(str(good), wdir, 4)
    assert "directly in" in file_uri_problem(str(tmp_path / "v000003.safetensors"), wdir)
    assert "directly in" in file_uri_problem(str(wdir / "sub" / "v000003.safetensors"), wdir)
    assert "directly in" in file_uri_problem(str(wdir / "../weights2/v000003.safetensors"), wdir)
    assert "directly in" in file_uri_problem(str(wdir / "model.safetensors"), wdir)
    assert "absolute" in file_uri_problem("weights/v000003.safetensors", wdir)
    assert "dist" in file_uri_problem("dist://127.0.0.1:5/v000003", wdir)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x")
    (wdir / "v000005.safetensors").symlink_to(outside)  # a link in the directory to a file outside it
    assert "directly in" in file_uri_problem(str(wdir / "v000005.safetensors"), wdir, 5)


def test_dist_uri_names_the_configured_learner_and_the_version():
    cfg = load_config(None, ["--weights.transport", "dist", "--weights.dist_host", "10.0.0.2"])
    ann = P.WeightAnnouncement(7, dist_uri("10.0.0.2", 40001, 7), 10)
    assert parse_dist_uri(ann.uri) == ("10.0.0.2", 40001, 7) and uri_problem(ann, cfg) == ""
    assert "host" in uri_problem(P.WeightAnnouncement(7, dist_uri("10.0.0.9", 40001, 7), 10), cfg)
    assert "version 8" in uri_problem(P.WeightAnnouncement(8, ann.uri, 10), cfg)
    assert "dist://HOST:PORT" in uri_problem(P.WeightAnnouncement(7, "/dev/shm/v000007.safetensors", 10), cfg)
    assert "dist://HOST:PORT" in uri_problem(P.WeightAnnouncement(7, "dist://10.0.0.2:99999/v000007", 10), cfg)
    fixed = load_config(None, ["--weights.transport", "dist", "--weights.dist_host", "10.0.0.2",
                               "--weights.dist_port", "40002"])
    assert "port 40001" in uri_problem(ann, fixed)
    file_cfg = load_config(None, ["--weights.dir", "/dev/shm/w"])
    assert "local safetensors" in uri_problem(ann, file_cfg)


def test_version_bound_is_the_buffers_learner_version_plus_one():
    ann = P.WeightAnnouncement(5, "/dev/shm/w/v000005.safetensors", 1)
    assert version_problem(ann, 4) == "" and version_problem(ann, 57) == ""  # a restarted engine catches up
    assert "ahead" in version_problem(ann, 3)
    assert "version 0" in version_problem(P.WeightAnnouncement(0, ann.uri, 1), 4)


# ---------------------------------------------------------------- the file transport


def test_file_publisher_and_loader(tmp_path):
    pub = FilePublisher(tmp_path / "w", keep=2)
    state = {"a": torch.randn(3), "b": torch.randn(2, 2).to(torch.bfloat16)}
    for v in (1, 2, 3):
        ann = pub.publish(state, v)
    assert ann.uri == str(weights_path(tmp_path / "w", 3)) and pub.stats()["weight_publishes"] == 3
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000002.safetensors", "v000003.safetensors"]
    assert all(torch.equal(t, state[k]) for k, t in iter_file(ann.uri))
    with pytest.raises(FileNotFoundError, match="pruned"):
        iter_file(weights_path(tmp_path / "w", 1))  # raised before any tensor is asked for
    engine = FakeEngine()
    seconds = asyncio.run(FileLoader(engine, tmp_path / "w").load(ann))
    assert seconds > 0 and engine.loads == [(os.path.realpath(ann.uri), 3)] and engine.version == 3


def test_producer_refuses_counts_and_retries_weights():
    async def scenario():
        engine, client = FakeEngine(), FakeClient()
        cfg = load_config(None, ["--weights.dir", "/dev/shm/w"])
        from pipeline.producer.worker import Producer

        prod = Producer(cfg, client, engine, FakePool(), "p0", heartbeat_s=0.05)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        bad = [P.WeightAnnouncement(2, "/etc/v000002.safetensors", 1),  # not in the weights directory
               P.WeightAnnouncement(2, "/dev/shm/w/v000001.safetensors", 1),  # not the file of its version
               P.WeightAnnouncement(9, "/dev/shm/w/v000009.safetensors", 1)]  # beyond the learner's version + 1
        for w in bad:
            await client.control.put(P.VersionUpdate(2, w))
            await asyncio.sleep(0.05)
        await until(lambda: client.of(P.Heartbeat) and client.of(P.Heartbeat)[-1].stats["weight_load_refused"] == 3)
        assert engine.loads == [] and engine.version == 0
        failing = [True]

        async def flaky_load(path, version):  # the first attempt fails (a file not there yet, a broken broadcast)
            if failing.pop() if failing else False:
                raise OSError("not yet")
            engine.loads.append((path, version))
            engine.version = version
            return 0.001

        engine.load_weights = flaky_load
        await client.control.put(P.VersionUpdate(2, P.WeightAnnouncement(2, "/dev/shm/w/v000002.safetensors", 1)))
        await until(lambda: engine.version == 2, timeout=10.0)  # tried again after RETRY_S
        prod.stop("test")
        assert await asyncio.wait_for(task, 5) == 0
        beat = client.of(P.Heartbeat)[-1]
        assert beat.stats["weight_load_errors"] == 1 and beat.stats["weight_loads"] == 1
        assert beat.stats["weight_load_refused"] == 3

    asyncio.run(scenario())


def test_a_failing_announcement_repeated_in_every_reply_is_tried_once_per_retry_interval():
    """A buffer names a stale producer's missing weights in every reply; the producer must not retry (and log) on
    each of them, a tight loop that wrote 43,000 log lines in 2 minutes."""
    async def scenario():
        engine, client = FakeEngine(), FakeClient()
        cfg = load_config(None, ["--weights.dir", "/dev/shm/w"])
        from pipeline.producer.worker import Producer

        prod = Producer(cfg, client, engine, FakePool(), "p0", heartbeat_s=0.05)
        attempts = []

        async def missing(path, version):
            attempts.append(version)
            raise FileNotFoundError(path)

        engine.load_weights = missing
        task = asyncio.create_task(prod.run())
        w = P.WeightAnnouncement(1, "/dev/shm/w/v000001.safetensors", 1)
        for _ in range(20):
            await client.replies.put(P.Assignments([], 1, w))
            await asyncio.sleep(0.02)
        assert attempts == [1]  # once, then its retry waits RETRY_S
        prod.stop("test")
        assert await asyncio.wait_for(task, 5) == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------- dist: the publisher and member processes


def test_dist_publisher_names_an_address_it_cannot_listen_on():
    from pipeline.weights.dist import DistPublisher

    cfg = load_config(None, ["--weights.transport", "dist", "--weights.dist_host", "192.0.2.1"])  # TEST-NET-1
    with pytest.raises(ValueError, match="dist_host must be an address of the learner"):
        DistPublisher(cfg.weights)


class Member:
    """A member process (pipeline/testing/weight_member.py) driven line by line."""

    def __init__(self, name: str, overrides: list[str], slow: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.testing.weight_member", name, "--slow", str(slow), "--", *overrides],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def load(self, ann: P.WeightAnnouncement) -> None:
        self.proc.stdin.write(request_line(ann))
        self.proc.stdin.flush()

    def result(self, timeout: float = 60.0) -> dict:
        while True:
            msg = self.lines.get(timeout=timeout)
            if "receiving" not in msg:
                return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _sums(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


@pytest.fixture
def dist_cfg():
    return load_config(None, ["--weights.transport", "dist", "--weights.bucket_mb", "1",
                              "--weights.dist_timeout_s", "5", "--weights.dist_wait_s", "2"])


OVERRIDES = ["--weights.transport", "dist", "--weights.dist_timeout_s", "5", "--weights.dist_wait_s", "2"]


def _sent(stats: dict[str, float]) -> float:
    return stats["weight_broadcasts"] + stats["weight_broadcast_failures"]


def _counted(pub, before: float, timeout_s: float = 30.0) -> dict[str, float]:
    """The publisher's stats once its sender counted the broadcast the members just finished (rank 0 counts it when
    its last send returns, which can come after the members hold their tensors) and nothing moves any more."""
    end = time.monotonic() + timeout_s
    while True:
        stats = pub.stats()
        if _sent(stats) > before:
            time.sleep(0.3)
            if pub.stats() == stats:
                return stats
        assert time.monotonic() < end, f"the sender never counted the broadcast: {stats}"
        time.sleep(0.05)


@pytest.mark.slow
def test_dist_group_is_kept_while_its_members_stay_and_reformed_for_a_late_joiner(dist_cfg):
    from pipeline.weights.dist import DistPublisher

    pub = DistPublisher(dist_cfg.weights)
    members = [Member(n, OVERRIDES) for n in ("a", "b")]
    try:
        state = {"x": torch.randn(300_000), "y": torch.randn(1000).to(torch.bfloat16)}  # 3 buckets of 1 MiB
        history = []
        for v in (1, 2, 3):  # version 1 meets the members as they start, one by one or together
            state["x"].add_(1.0)
            before = _sent(pub.stats())
            ann = pub.publish(state, v)
            assert ann.uri == dist_uri("127.0.0.1", pub.port, v) and ann.num_bytes >= 1_200_000
            for m in members:
                m.load(ann)
            for m in members:
                assert m.result() == {"ok": True, "version": v, "sums": _sums(state)}
            history.append(_counted(pub, before))
        # both asked for version 3 as members of the group that version 2 formed: one broadcast, same group
        assert history[2]["weight_broadcasts"] == history[1]["weight_broadcasts"] + 1
        assert history[2]["weight_group_forms"] == history[1]["weight_group_forms"]
        assert history[2]["weight_group_size"] == 2
        late = Member("c", OVERRIDES)
        members.append(late)
        late.load(ann)  # catches up to version 3 alone: a new group with just it
        assert late.result() == {"ok": True, "version": 3, "sums": _sums(state)}
        assert pub.stats()["weight_group_forms"] == history[2]["weight_group_forms"] + 1
        state["x"].mul_(-1.0)
        before = _sent(pub.stats())
        ann = pub.publish(state, 4)
        for m in members:
            m.load(ann)
        for m in members:  # version 4 re-forms the group with all three
            assert m.result() == {"ok": True, "version": 4, "sums": _sums(state)}
        stats = _counted(pub, before)
        assert stats["weight_group_forms"] == history[2]["weight_group_forms"] + 2 and stats["weight_group_size"] == 3
        assert stats["weight_broadcast_failures"] == 0
    finally:
        for m in members:
            m.close()
        pub.close()


@pytest.mark.slow
def test_dist_member_killed_mid_broadcast_does_not_stop_the_learner(dist_cfg):
    from pipeline.weights.dist import DistPublisher

    pub = DistPublisher(dist_cfg.weights)
    healthy, victim = Member("healthy", OVERRIDES), Member("victim", OVERRIDES, slow=3.0)
    members = [healthy, victim]
    try:
        state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(32)}  # 128 MiB in 32 buckets
        ann = pub.publish(state, 1)
        healthy.load(ann)
        victim.load(ann)
        assert victim.lines.get(timeout=60) == {"receiving": 1}
        victim.proc.kill()  # mid-broadcast: it holds one tensor and sleeps; the rest is still being sent
        t0 = time.monotonic()
        while pub.stats()["weight_broadcast_failures"] < 1:
            assert time.monotonic() - t0 < 30, "the learner never noticed the dead member"
            time.sleep(0.1)
        first = healthy.result()  # its broadcast broke too (or completed before the failure)
        # what the healthy member holds afterwards: either the whole of version 1, or a failure it reports as one;
        # never version 1 with some tensors missing or from elsewhere
        assert first == {"ok": True, "version": 1, "sums": _sums(state)} or (
            first["ok"] is False and first.get("error")), first
        state["t0"].add_(1.0)
        ann = pub.publish(state, 2)  # the learner goes on; the next version re-forms without the dead member
        healthy.load(ann)
        assert healthy.result() == {"ok": True, "version": 2, "sums": _sums(state)}, first
        restarted = Member("victim", OVERRIDES)
        members.append(restarted)
        restarted.load(ann)
        assert restarted.result() == {"ok": True, "version": 2, "sums": _sums(state)}
    finally:
        for m in members:
            m.close()
        pub.close()
