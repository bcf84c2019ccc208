"""The dist transport's rendezvous under attack: a rogue client of the learner's TCPStore (it reaches the port, it
has no key) and a holder of the key (a compromised producer), each against the real DistPublisher, real DistLoader
members (in threads, with the worker-side receive of pipeline/weights/dist_receive.py and a dict for a model) and
real gloo groups.

1. The rogue steals a member's request and writes its own plan at the member's key (its own group on the
   learner's store, with its tensors; or a plan announcing 1 PiB): the plan is refused, the member's re-sent request
   reaches the learner, and the member loads the learner's tensors, none of the rogue's.
   A producer (it holds the secret) that does the same is refused too: only the learner signs plans.
2. The rogue takes rank 0's place in the group a genuine plan names and broadcasts other bytes: refused by the
   plan's digests, nothing reaches the model.
3. The rogue registers 3,000 members: all refused and counted; the honest member's group forms without them.
4. A key holder registers 50 members: at most dist_max_members are admitted, the member served lately first; the
   rest are told the group is full.
5. A sealed plan of a size the receiver's model cannot take is refused before a byte is allocated or a group
   joined.
6. An announcement whose key is not the running learner's (from before a restart) fails at once.
The secret is never in the store or the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from torch.distributed import TCPStore

from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.testing.weight_member import FakeEngine, FakeWorker
from pipeline.weights.dist import DistPublisher
from pipeline.weights.dist_group import open_group
from pipeline.weights.dist_loader import DistLoader
from pipeline.weights.dist_plan import LEARNER, REQUESTS, Plan, Request, digest, group_prefix, layout, pack, plan_key
from pipeline.weights.dist_receive import receive
from pipeline.weights.dist_sign import (
    new_secret,
    new_signing_key,
    open_signed,
    public_hex,
    seal,
    sign,
    verifier_from_hex,
)
from pipeline.weights.uris import dist_uri

# dist_timeout_s: far above what a step takes here, so that a loaded machine (CI: two workers starting vLLM engines)
# never times out an honest connection; no test below waits a timeout out
OVERRIDES = ["--weights.transport", "dist", "--weights.dist_timeout_s", "20", "--weights.dist_wait_s", "1"]
MAX_BYTES = 64 << 20  # the members' "model" takes this much


@pytest.fixture
def cfg():
    return load_config(None, OVERRIDES)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(8) as ex:
        yield ex


def honest_state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), scale), "b": torch.arange(10, dtype=torch.float32) * scale}


def member_load(cfg, ann: P.WeightAnnouncement, loader: DistLoader | None = None) -> dict[str, torch.Tensor]:
    """One member loads `ann` (blocking); its "model" afterwards. Raises what the load raised."""
    loader = loader or new_loader(cfg)
    asyncio.run(loader.load(ann))
    return loader.engine.worker.model


def new_loader(cfg, name: str = "honest") -> DistLoader:
    return DistLoader(cfg.weights, FakeEngine(FakeWorker(0.0, MAX_BYTES)), name)


def rogue_store(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False)


def rogue_rank0(port: int, prefix: str, data: list[torch.Tensor], outcome: list) -> None:
    """Be rank 0 of a 2-rank group whose rendezvous is `prefix` in the learner's store, and broadcast `data`."""
    try:
        group = open_group("gloo", rogue_store(port), prefix, 0, 2, 2.0, "127.0.0.1")
        for buf in data:
            group.broadcast(buf)
        outcome.append("sent")
    except Exception as exc:  # noqa: BLE001 - nobody joined: the attack failed
        outcome.append(f"{type(exc).__name__}")


# how a forger writes its plan: a client of the store alone (a MAC without the secret), a producer (it holds the
# secret, not the learner's signing key: the learner's seal format, or a signature with a key of its own)
FORGERS = {
    "a store client": lambda pub, key, payload: seal(b"\0" * 32, key, payload),
    "a producer, sealed": lambda pub, key, payload: seal(pub.secret, key, payload),
    "a producer, signed": lambda pub, key, payload: sign(new_signing_key(), key, payload),
}


def steal_and_forge(port: int, forge, outcome: list, stolen: threading.Event, seal_as) -> None:
    """Pop the next request (before the learner reads it) and answer it with `forge(req)` written by `seal_as(key,
    payload)`; set `stolen`."""
    try:
        store = rogue_store(port)
        raw = store.queue_pop(REQUESTS, block=True)
        req = Request.decode(raw.split(b" ", 2)[2])  # the payload is readable: only its seal is secret
        key = plan_key(req.member, req.seq)
        store.set(key, seal_as(key, forge(req)))
        outcome.append(req)
    finally:
        stolen.set()


@contextmanager
def thief_pops_first(pub: DistPublisher, stolen: threading.Event, limit_s: float = 30.0):
    """Hold the learner's request reader until the thief has popped a request (or `limit_s` passed): on a loaded
    machine the learner's pop can win the race, and the attack would not take place. A thief nearer the store wins
    such races in the field; here it wins every run."""
    deadline = time.monotonic() + limit_s
    pub._collect = lambda: (stolen.is_set() or time.monotonic() > deadline) and DistPublisher._collect(pub)
    try:
        yield
    finally:
        del pub._collect  # no cycle through pub: its store must go with it (a lingering one broke the next test)


def _sums(model: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in model.items()}


def _rogue_plan(pub: DistPublisher, req: Request, buckets, data) -> bytes:
    return Plan("rogue", 1, 1, 2, req.version, "gloo", "127.0.0.1", pub.port, 3.0, buckets,
                [digest(b) for b in data]).encode()


@pytest.mark.parametrize("forger, attack", [
    ("a store client", "its own tensors"), ("a store client", "a size of 1 PiB"),
    ("a producer, sealed", "its own tensors"), ("a producer, signed", "its own tensors")])
def test_a_stolen_request_answered_with_a_forged_plan_is_refused_and_the_learner_serves(cfg, pool, caplog, forger,
                                                                                       attack):
    caplog.set_level(logging.DEBUG)
    pub = DistPublisher(cfg.weights)
    try:
        evil = {"w": torch.full((1000,), -7.0), "b": torch.zeros(10)}
        buckets = layout(evil, 1 << 20)
        data = pack(evil, buckets)
        if attack != "its own tensors":
            buckets[0].nbytes = 1 << 50
        stolen, sent = [], []
        done = threading.Event()
        thief = pool.submit(steal_and_forge, pub.port, lambda req: _rogue_plan(pub, req, buckets, data), stolen, done,
                            lambda key, payload: FORGERS[forger](pub, key, payload))
        rank0 = pool.submit(rogue_rank0, pub.port, group_prefix("rogue", 1), data, sent)
        state = honest_state()
        with thief_pops_first(pub, done):
            ann = pub.publish(state, 1)
            model = member_load(cfg, ann)
            thief.result(timeout=10)
        assert stolen and stolen[0].version == 1  # the attack took place: it stole the first request
        assert _sums(model) == _sums(state)  # the learner's tensors, none of the rogue's
        rank0.result(timeout=10)
        assert sent and sent[0] != "sent"  # nobody joined the rogue's group
        assert pub.stats()["weight_broadcasts"] == 1 and pub.stats()["weight_broadcast_failures"] == 0
        _assert_secret_kept(pub, caplog)
    finally:
        pub.close()


def _assert_secret_kept(pub: DistPublisher, caplog) -> None:
    """The secret is in no store value and no log record."""
    store = rogue_store(pub.port)
    values = b"".join(store.get(k) for k in store.list_keys() if k != REQUESTS)
    assert pub.secret not in values and pub.secret.hex().encode() not in values
    assert pub.secret.hex() not in caplog.text


def test_a_rogue_rank0_in_the_planned_group_cannot_put_its_bytes_into_the_model(cfg, pool):
    """The group's rendezvous lies in the store, so a rogue can race rank 0 for it; here it has won: the member
    joins the rogue's rank 0 for a genuine signed plan (the test plays the learner's answer)."""
    secret, learner = b"k" * 32, TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    signing = new_signing_key()
    learner.set(LEARNER, sign(signing, LEARNER, b"s"))
    state, evil = honest_state(), honest_state(-3.0)
    buckets = layout(state, 1 << 20)
    ann = P.WeightAnnouncement(1, dist_uri("127.0.0.1", learner.port, 1), 0, secret.hex(), public_hex(signing))
    loader = new_loader(cfg)
    loading = pool.submit(member_load, cfg, ann, loader)
    raw = learner.queue_pop(REQUESTS, block=True)
    req = Request.decode(raw.split(b" ", 2)[2])
    key = plan_key(req.member, req.seq)
    genuine = Plan("s", 1, 1, 2, 1, "gloo", "127.0.0.1", learner.port, 3.0, buckets,
                   [digest(b) for b in pack(state, buckets)])
    sent: list = []
    rank0 = pool.submit(rogue_rank0, learner.port, group_prefix("s", 1), pack(evil, buckets), sent)
    learner.set(key, sign(signing, key, genuine.encode()))
    with pytest.raises(RuntimeError, match="does not match the plan's SHA-256"):
        loading.result(timeout=20)
    rank0.result(timeout=10)
    assert sent == ["sent"]  # the rogue did broadcast to the member
    assert loader.engine.worker.model == {}  # and not one of its tensors reached the model


def test_rogue_registrations_are_refused_and_the_group_forms_for_the_honest_member(cfg):
    pub = DistPublisher(cfg.weights)
    try:
        store, n = rogue_store(pub.port), 3000
        for i in range(n):  # before the honest member asks: the rogue's requests come first in the queue
            req = Request(f"rogue{i}", 1, 1, 1).encode()
            store.queue_push(REQUESTS, seal(b"\0" * 32, REQUESTS, req) if i % 2 else req)
        state = honest_state()
        t0 = time.monotonic()
        model = member_load(cfg, pub.publish(state, 1))
        assert _sums(model) == _sums(state) and time.monotonic() - t0 < 10
        stats = pub.stats()
        assert stats["weight_requests_refused"] == n and stats["weight_group_size"] == 1
        assert stats["weight_broadcast_failures"] == 0
    finally:
        pub.close()


def test_a_key_holder_registering_many_members_cannot_grow_the_group(cfg):
    """A compromised producer holds the key: it can register members, but at most dist_max_members take part
    (here 1, producers.count), the member served lately first; the rest are told the group is full."""
    pub = DistPublisher(cfg.weights, max_members=1)
    try:
        state = honest_state()
        loader = new_loader(cfg)
        member_load(cfg, pub.publish(state, 1), loader)  # the honest member, served lately from now on
        state["w"].add_(1.0)
        ann = pub.publish(state, 2)
        store, n = rogue_store(pub.port), 50
        for i in range(n):
            store.queue_push(REQUESTS, seal(pub.secret, REQUESTS, Request(f"sybil{i}", 1, 2, 1).encode()))
        model = member_load(cfg, ann, loader)
        assert _sums(model) == _sums(state)
        stats = pub.stats()
        assert stats["weight_members_refused"] == n and stats["weight_group_size"] == 1
        assert stats["weight_broadcast_failures"] == 0
        full = json.loads(store.get(plan_key("sybil0", 1)).split(b" ", 2)[2])
        assert "the weight group is full" in full["error"]
    finally:
        pub.close()


def test_a_plan_larger_than_the_model_is_refused_before_allocating_or_joining():
    worker = FakeWorker(0.0, MAX_BYTES)
    buckets = layout(honest_state(), 1 << 20)
    buckets[0].nbytes = 1 << 50  # 1 PiB: the entries still fit, so only the size bound can refuse it
    plan = Plan("s", 1, 1, 2, 1, "gloo", "127.0.0.1", 1, 3.0, buckets, ["0" * 64])
    plan = Plan.decode(plan.encode())  # within the plan's own bounds
    t0 = time.monotonic()
    result = receive(worker, plan, lambda tensors: {"n": sum(1 for _ in tensors)}, MAX_BYTES)
    assert result["ok"] is False and result["touched"] is False
    assert "more than this worker's model can take" in result["error"]
    assert time.monotonic() - t0 < 1 and worker.model == {}  # no group was joined (port 1 has no store)


@pytest.mark.parametrize("field, value, problem", [
    ("world_size", 10**9, "world_size"), ("rank", 0, "rank"), ("backend", "mpi", "backend"),
    ("timeout_s", 1e12, "timeout_s"), ("digests", [], "digests"), ("port", 70000, "port")])
def test_plan_fields_are_bounded(field, value, problem):
    buckets = layout(honest_state(), 1 << 20)
    plan = Plan("s", 1, 1, 2, 1, "gloo", "127.0.0.1", 1, 3.0, buckets, ["0" * 64])
    setattr(plan, field, value)
    with pytest.raises(ValueError, match=problem):
        Plan.decode(plan.encode())


def test_a_tensor_outside_its_bucket_is_refused():
    buckets = layout(honest_state(), 1 << 20)
    buckets[0].entries[0][2] = [10**6]  # a shape that reads past the bucket's end
    plan = Plan("s", 1, 1, 2, 1, "gloo", "127.0.0.1", 1, 3.0, buckets, ["0" * 64])
    with pytest.raises(ValueError, match="lies outside the bucket"):
        Plan.decode(plan.encode())


def test_the_key_of_another_learner_process_fails_at_once(cfg):
    """A producer that holds an announcement from before a learner restart (same port, another key) is told so at
    once, instead of waiting out dist_wait_s + 2 dist_timeout_s for an answer to requests the learner refuses."""
    pub = DistPublisher(cfg.weights)
    try:
        ann = pub.publish(honest_state(), 1)
        stale = P.WeightAnnouncement(1, ann.uri, ann.num_bytes, new_secret().hex(), public_hex(new_signing_key()))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="not the process that made this weight announcement"):
            member_load(cfg, stale)
        assert time.monotonic() - t0 < 2 and pub.stats()["weight_requests_refused"] == 0  # it did not even ask
    finally:
        pub.close()


def test_a_deleted_learner_marker_is_written_again(cfg):
    # (it was flaky in whole-suite runs while DistPublisher.close() closed the listening fd its store also closed
    # later: a double close, of whatever socket had taken that number by then)
    pub = DistPublisher(cfg.weights)
    try:
        store = rogue_store(pub.port)
        store.delete_key(LEARNER)  # every load would fail at once while it is gone
        end = time.monotonic() + 30
        while not store.check([LEARNER]):  # the sender writes it again (every MARK_S)
            assert time.monotonic() < end, "the learner marker was not written again"
            time.sleep(0.1)
        state = honest_state()
        assert _sums(member_load(cfg, pub.publish(state, 1))) == _sums(state)
    finally:
        pub.close()


def test_a_loader_refuses_an_announcement_without_a_key(cfg):
    ann = P.WeightAnnouncement(1, dist_uri("127.0.0.1", 1, 1), 0)
    with pytest.raises(ValueError, match="carries no valid key"):
        member_load(cfg, ann)



def test_an_announcement_without_the_learners_public_key_is_refused(cfg):
    ann = P.WeightAnnouncement(1, dist_uri("127.0.0.1", 1, 1), 0, new_secret().hex())
    with pytest.raises(ValueError, match="carries no valid signer"):
        member_load(cfg, ann)


def test_a_signed_value_opens_only_with_its_key_at_its_store_key_and_unchanged():
    learner, other = new_signing_key(), new_signing_key()
    verifier = verifier_from_hex(public_hex(learner))
    value = sign(learner, "ra/plan/m/1", b"payload")
    assert open_signed(verifier, "ra/plan/m/1", value) == b"payload"
    for key, raw, why in [("ra/plan/m/2", value, "bad signature"),  # moved to another key
                          ("ra/plan/m/1", value[:-1] + b"P", "bad signature"),  # payload changed
                          ("ra/plan/m/1", sign(other, "ra/plan/m/1", b"payload"), "bad signature"),
                          ("ra/plan/m/1", seal(new_secret(), "ra/plan/m/1", b"payload"), "not signed"),
                          ("ra/plan/m/1", b"rs1 " + b"zz" * 64 + b" payload", "bad signature"),
                          ("ra/plan/m/1", b"", "not signed")]:
        with pytest.raises(ValueError, match=why):
            open_signed(verifier, key, raw)
    for bad in ("", "00" * 31, "xy" * 32):
        with pytest.raises(ValueError, match="carries no valid signer"):
            verifier_from_hex(bad)
