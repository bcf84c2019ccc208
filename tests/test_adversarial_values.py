"""Issue #13, the values side, on the socket-free core (pipeline/buffer/core.py): forged and poisoned results,
messages from the wrong role, a handler that raises, floods of identities, and afterwards an honest producer and
learner that finish with exact accounting and no forged value in any released group. The wire side (real
sockets, real processes) is in test_adversarial_wire.py; files, keys and tokens in test_adversarial_files.py."""

import logging
import tracemalloc

import numpy as np
import pytest

from bench.flood import poisoned_results
from pipeline import protocol as P
from pipeline.auth import LEARNER, PRODUCER
from pipeline.buffer.core import WORK_POLL_S, BufferCore
from pipeline.buffer.incidents import MAX_TRACKED_SENDERS
from pipeline.buffer.peers import MAX_PEERS, Conn, peer_name
from pipeline.config import load_config
from pipeline.prompts import Prompt
from pipeline.testing.processes import prompts_accounted
from pipeline.testing.scripted import poisoned

TRAIN = [(f"{i}+{i}=", str(2 * i)) for i in range(300)]
EVALS = [Prompt(f"e{i}=", str(i), "held-out") for i in range(4)]
AS_PRODUCER = Conn(PRODUCER)
AS_LEARNER = Conn(LEARNER)
MAX_NEW = 64
REASON = {"reward": "reward", "logprob": "logprob", "logprob+": "logprob", "logprob-inf": "logprob",
          "version": "version", "length": "length", "length0": "length", "prompt": "prompt",
          "prompt_id": "prompt_id", "finish_reason": "finish_reason", "samples": "samples"}


def make(tmp_path, *overrides, evals=(), **kw):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.batch_prompts", "4", "--learner.mini_batches",
                             "1", "--learner.eval_every", "0", "--learner.num_steps", "100", "--eval.k", "2",
                             "--sampling.max_new_tokens", str(MAX_NEW), "--buffer.heartbeat_timeout_s", "5",
                             "--buffer.lease_s", "30", *overrides])
    return BufferCore(cfg, TRAIN, list(evals), now=0.0, vocab_size=32, **kw)


def send(core, who: str, msg, now: float, conn: Conn = AS_PRODUCER) -> list:
    return core.handle(who.encode(), msg, now, conn)


def work(core, who: str, n: int, now: float, version: int = 0) -> list[P.RoundAssignment]:
    outs = send(core, who, P.WorkRequest(who, n, version), now)
    replies = [o.msg for o in outs if o.to == who.encode() and isinstance(o.msg, P.Assignments)]
    return replies[0].rounds if replies else []


def prompt_ids(a: P.RoundAssignment) -> np.ndarray:
    """What an honest producer's tokenizer makes of the round's prompt: the same for every round of it."""
    return np.array([ord(c) % 32 for c in a.prompt], np.int32)


def honest(a: P.RoundAssignment, who: str, version: int = 0, rewards=None) -> P.RoundResult:
    rewards = [float(i % 2) for i in range(a.num_samples)] if rewards is None else rewards
    samples = [P.Sample(np.arange(5, dtype=np.int32), np.full(5, -0.7, np.float32), float(r), version, "stop")
               for r in rewards]
    return P.RoundResult(who, a.round_id, a.prompt_id, prompt_ids(a), samples, 0.1, a.kind)


def finish_honestly(core, steps: int, now: float) -> list[P.Group]:
    """An honest producer and learner train `steps` steps; returns every group the learner got."""
    groups: list[P.Group] = []
    for _ in range(steps):
        batch = None
        for _ in range(1000):
            now += 0.1
            for a in work(core, "honest", 8, now, core.learner_version):
                assert send(core, "honest", honest(a, "honest", core.learner_version), now) == []
            outs = send(core, "learner", P.BatchRequest("learner", core.learner_version, 4, 0), now, AS_LEARNER)
            batch = next((o.msg for o in outs if isinstance(o.msg, P.Batch) and o.msg.groups), None)
            if batch is not None:
                break
        assert batch is not None, "the honest learner got no batch"
        groups += batch.groups
        send(core, "learner", P.VersionUpdate(core.learner_version + 1), now, AS_LEARNER)
    return groups


def assert_clean(core, groups: list[P.Group]) -> None:
    """Accounting exact, invariants hold, and no forged or poisoned value reached a released group."""
    core.scheduler.check_invariants()
    m = core.metrics(1e6)
    assert prompts_accounted(m), m
    assert m["buffer/handler_errors"] == 0
    assert groups and sum(poisoned(g, core.learner_version) for g in groups) == 0
    for g in groups:  # every sample is the honest producer's: its prompt tokens, its 5 tokens, its log-probs
        assert all(s.token_ids.size == 5 and float(s.logprobs.max()) == np.float32(-0.7) for s in g.samples)
        assert g.prompt_token_ids.size and g.prompt_token_ids.max() < 32


# ---------------------------------------------------------------- ownership


def test_a_forged_result_is_counted_as_foreign_and_never_applied(tmp_path):
    core = make(tmp_path)
    rounds = work(core, "p0", 2, 0.0)
    a, b = rounds
    send(core, "thief", honest(a, "p0", rewards=[1.0] * a.num_samples), 0.1)  # well formed, claims to be p0
    send(core, "thief", P.RoundResult("p0", b.round_id, b.prompt_id, P.empty_array("int32"), [], 0.1), 0.1)
    m = core.metrics(0.2)
    assert m["buffer/results_foreign"] == 2 and m["rejected_by_sender"] == {"thief": 2}
    assert m["samples_received"] == 0 and m["rounds_in_flight"] == 2 and m["dropped_unresolved"] == 0
    for r in rounds:  # the holder's own results still count: not duplicates, not late
        send(core, "p0", honest(r, "p0"), 0.3)
    m = core.metrics(0.4)
    assert m["samples_received"] == 2 * a.num_samples and m["results_ignored"] == {"duplicate": 0, "late": 0,
                                                                                  "unknown": 0}
    assert m["released"] == 2 and not core.leases
    core.scheduler.check_invariants()


def test_a_producer_is_named_by_its_connection_not_by_its_messages(tmp_path):
    core = make(tmp_path)
    (a,) = work(core, "evil", 1, 0.0)  # its WorkRequest says producer_id "evil"; now another claim:
    send(core, "evil", P.Heartbeat("victim", "producer", 0, {"tokens_per_s": 1e9}), 0.1)
    assert "victim" not in core.producer_stats and core.producer_stats["evil"]["tokens_per_s"] == 1e9
    send(core, "victim", honest(a, "evil"), 0.2)  # the victim's connection claiming the thief's name
    assert core.counters["results_foreign"] == 1 and core.leases.get(a.round_id).producer == "evil"
    # a ZAP User-Id is part of the lease: the same identity under another key is someone else
    send(core, "evil", honest(a, "evil"), 0.3, Conn(PRODUCER, "producer:otherkey"))
    assert core.counters["results_foreign"] == 2
    send(core, "evil", honest(a, "evil"), 0.4)
    assert core.scheduler.metrics()["samples_received"] == a.num_samples
    # names are injective: no two identities share one (a lease holder cannot be impersonated by a look-alike)
    names = [peer_name(i) for i in (b"\xff", b"\xfe", b"#ff", b"ff", b"a b", b"", b"\x00\x01", b"\n")]
    assert len(set(names)) == len(names) and all(n.isprintable() for n in names)


def test_eval_results_count_only_from_their_holder_and_only_with_sound_values(tmp_path):
    core = make(tmp_path, "--eval.max_new_tokens", "8", evals=EVALS)
    core.evals.start(0, 0.0)
    evals = [a for a in work(core, "p0", 8, 0.0) if a.kind == "eval"]
    assert len(evals) == 4 and all(a.max_new_tokens == 8 for a in evals)
    for a in evals:
        send(core, "thief", honest(a, "p0", rewards=[1.0, 1.0]), 0.1)
    assert core.counters["results_foreign"] == 4 and core.evals.counts["results_late"] == 0
    long = honest(evals[0], "p0")
    long.samples[0] = P.Sample(np.zeros(9, np.int32), np.zeros(9, np.float32), 1.0, 0, "length")  # > 8 tokens
    send(core, "p0", long, 0.2)
    assert core.counters["rejected_values"] == 1 and core.incidents.tables["rejected_by_reason"] == {"length": 1}
    assert core.evals.counts["rounds_reissued"] == 1  # its problem is queued again, under a new round id
    again = [a for a in work(core, "p1", 8, 0.3) if a.kind == "eval"]
    assert [a.prompt_id for a in again] == [evals[0].prompt_id]
    for a, who in [*((a, "p0") for a in evals[1:]), (again[0], "p1")]:
        send(core, who, honest(a, who, rewards=[1.0, 0.0]), 0.4)
    (row,) = core.evals.pop_rows() or [core.last_eval]
    assert row["accuracy"] == 0.5 and row["failed"] == 0


# ---------------------------------------------------------------- roles


def test_learner_only_messages_need_the_learner_role(tmp_path):
    core = make(tmp_path)
    for a in work(core, "p0", 8, 0.0):
        send(core, "p0", honest(a, "p0"), 0.0)
    uri = str(core.cfg.weights_dir / "v000005.safetensors")
    attacks = [P.BatchRequest("thief", 0, 4, 0), P.VersionUpdate(5, P.WeightAnnouncement(5, uri, 1)),
               P.Shutdown("stolen"), P.Heartbeat("learner", "learner", 9, {"loss": 0.0})]
    for msg in attacks:
        assert send(core, "thief", msg, 0.1) == []  # no batch, no broadcast
    m = core.metrics(0.2)
    assert m["buffer/refused_role"] == 4 and m["rejected_by_sender"] == {"thief": 4}
    assert core.learner_version == 0 and core.latest_weights is None and core.stop_reason is None
    assert core.learner_stats == {} and m["groups_waiting"] == 8 and m["groups_consumed"] == 0
    # the learner itself is served
    (out,) = send(core, "learner", P.BatchRequest("learner", 0, 4, 0), 0.3, AS_LEARNER)
    assert len(out.msg.groups) == 4
    (out,) = send(core, "learner", attacks[1], 0.4, AS_LEARNER)
    assert out.to is None and out.msg.weights.uri == uri and core.learner_version == 5
    send(core, "learner", P.Shutdown("done"), 0.5, AS_LEARNER)
    assert core.stop_reason == "done"


def test_weights_are_announced_only_from_the_weights_directory_and_of_their_version(tmp_path):
    core = make(tmp_path)
    root = core.cfg.weights_dir
    refused = [P.WeightAnnouncement(1, "/etc/passwd", 1), P.WeightAnnouncement(1, f"{root}/../x/v1", 1),
               P.WeightAnnouncement(1, "v000001.safetensors", 1), P.WeightAnnouncement(1, "tcp://evil:1/v1", 1),
               P.WeightAnnouncement(1, f"{root}/sub/v000001.safetensors", 1),
               P.WeightAnnouncement(2, f"{root}/v000002.safetensors", 1)]  # not of the version it is announced with
    for ann in refused:  # the file transport (the default)
        (out,) = send(core, "learner", P.VersionUpdate(1, ann), 0.0, AS_LEARNER)
        assert out.msg.version == 1 and out.msg.weights is None  # the version counts; the file is not passed on
    assert core.counters["weights_refused"] == len(refused) and core.latest_weights is None
    good = P.WeightAnnouncement(1, f"{root}/v000001.safetensors", 1)
    (out,) = send(core, "learner", P.VersionUpdate(1, good), 0.1, AS_LEARNER)
    assert out.msg.weights == good and core.latest_weights == good
    # the dist transport: only this run's learner rendezvous (weights.dist_host) is passed on
    core = make(tmp_path / "dist", "--weights.transport", "dist", "--weights.dist_host", "10.0.0.2")
    for uri in ("dist://10.9.9.9:29500/v000001", f"{root}/v000001.safetensors", "dist://10.0.0.2:29500/v000002"):
        (out,) = send(core, "learner", P.VersionUpdate(1, P.WeightAnnouncement(1, uri, 1)), 0.0, AS_LEARNER)
        assert out.msg.weights is None, uri
    good = P.WeightAnnouncement(1, "dist://10.0.0.2:29500/v000001", 1)
    (out,) = send(core, "learner", P.VersionUpdate(1, good), 0.1, AS_LEARNER)
    assert out.msg.weights == good and core.counters["weights_refused"] == 3


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("kind", sorted(REASON))
def test_a_poisoned_result_is_rejected_by_reason_and_its_round_reissued(tmp_path, kind):
    core = make(tmp_path)
    (a,) = work(core, "attacker", 1, 0.0)
    send(core, "attacker", poisoned_results(a, prompt_ids(a), MAX_NEW)[kind], 0.1)
    m = core.metrics(0.2)
    assert m["buffer/rejected_values"] == 1 and m["rejected_by_reason"] == {REASON[kind]: 1}, m
    assert m["samples_received"] == 0 and m["results_rejected"] == 1 and m["active"] == 1
    assert m["rejected_by_sender"] == {"attacker": 1}
    (again,) = work(core, "p1", 1, 0.3)
    assert again.prompt_id == a.prompt_id and again.round_id != a.round_id  # re-issued, under a new id
    send(core, "p1", honest(again, "p1"), 0.4)
    assert core.metrics(0.5)["released"] == 1
    core.scheduler.check_invariants()


def test_prompt_tokens_must_be_those_of_the_prompts_earlier_rounds_and_tokens_in_the_vocabulary(tmp_path):
    core = make(tmp_path)
    (a,) = work(core, "p0", 1, 0.0)
    send(core, "p0", honest(a, "p0", rewards=[0.0] * a.num_samples), 0.1)  # no positive: the prompt goes on
    (b,) = work(core, "p0", 1, 0.2)
    assert b.prompt_id == a.prompt_id
    other = honest(b, "p0")
    other.prompt_token_ids = prompt_ids(b)[::-1].copy()
    send(core, "p0", other, 0.3)
    (c,) = work(core, "p0", 1, 0.4)  # the same prompt's round again, under a new id
    oov = honest(c, "p0")
    oov.samples[3] = P.Sample(np.array([1, 32], np.int32), np.zeros(2, np.float32), 1.0, 0, "stop")
    send(core, "p0", oov, 0.5)
    assert c.prompt_id == a.prompt_id and core.incidents.tables["rejected_by_reason"] == {"prompt": 1, "oov": 1}
    assert core.counters["rejected_values"] == 1 and core.counters["rejected_oov"] == 1


def test_no_sample_of_a_version_the_learner_has_not_announced_is_accepted(tmp_path):
    core = make(tmp_path)
    a, b, c = work(core, "p0", 3, 0.0)
    send(core, "p0", honest(a, "p0", version=0), 0.1)
    send(core, "p0", honest(b, "p0", version=1), 0.1)  # one ahead: no producer can hold it yet
    assert core.scheduler.metrics()["samples_received"] == a.num_samples
    assert core.incidents.tables["rejected_by_reason"] == {"version": 1}
    core.scheduler.set_learner_version(1, 0.2)  # announced: now it may be (round c is not stale at staleness 1)
    send(core, "p0", honest(c, "p0", version=1), 0.4)
    assert core.scheduler.metrics()["samples_received"] == 2 * a.num_samples


# ---------------------------------------------------------------- nothing a message does stops the buffer


def test_a_handler_that_raises_is_counted_logged_with_the_state_and_the_buffer_keeps_serving(tmp_path, caplog,
                                                                                             monkeypatch):
    core = make(tmp_path)
    rounds = work(core, "p0", 4, 0.0)
    real = core.scheduler.submit_result

    def broken(*args, **kw):
        raise OverflowError("as a reward of 1e200 once did in the advantages")

    monkeypatch.setattr(core.scheduler, "submit_result", broken)
    assert send(core, "p0", honest(rounds[0], "p0"), 0.1) == []
    monkeypatch.setattr(core.scheduler, "submit_result", lambda *a, **k: (_ for _ in ()).throw(AssertionError("x")))
    send(core, "p0", honest(rounds[1], "p0"), 0.1)
    monkeypatch.setattr(core.scheduler, "expire", lambda now: 1 / 0)
    assert core.tick(0.2) == []
    assert core.counters["handler_errors"] == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "RoundResult from p0" in errors[0] and "OverflowError" in errors[0] and "rounds_in_flight" in errors[0]
    assert "an internal invariant failed" in errors[1] and "timer" in errors[2]
    monkeypatch.setattr(core.scheduler, "submit_result", real)
    monkeypatch.undo()
    for a in rounds[2:]:  # still serving: later results count
        send(core, "p0", honest(a, "p0"), 0.3)
    assert core.scheduler.metrics()["samples_received"] == 2 * rounds[0].num_samples
    with pytest.raises(TypeError, match="no handler for Ack"):  # a kind no decoder yields: the caller's bug
        core.handle(b"x", P.Ack(True), 0.4)


# ---------------------------------------------------------------- bounded per client


def test_a_flood_of_identities_is_bounded_and_memory_stays_flat(tmp_path):
    core = make(tmp_path)
    peers = core.peers.max_peers = 128  # the bound scaled down (MAX_PEERS in a real buffer) to keep this fast
    rng = np.random.default_rng(0)
    forged = [P.Sample(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), 1.0, 0, "stop")] * 8

    def flood(first: int, count: int, now: float) -> float:
        for i in range(first, first + count):
            who = f"flood-{i}"
            send(core, who, P.WorkRequest(who, 0, 0), now)
            send(core, who, P.Heartbeat(who, "producer", 0, {f"k{j}": 1.0 for j in range(30)}), now)
            guess = int(rng.integers(0, 200))
            send(core, who, P.RoundResult(who, guess, guess, np.arange(3, dtype=np.int32), forged, 0.1), now)
            send(core, who, P.Shutdown("x"), now)
            core.malformed(who.encode(), "garbage")
            if i % 20 == 0:
                now += WORK_POLL_S / 5
                send(core, "honest", P.Heartbeat("honest", "producer", 0, {}), now)
                core.tick(now)
        return now

    honest_rounds = work(core, "honest", 8, 0.0)  # a lease holder (and alive): never forgotten
    tracemalloc.start()  # traces what is allocated from here on: the tables fill, then must stay as they are
    warm = MAX_TRACKED_SENDERS + 2 * peers  # enough to fill every table, the per-sender counts included
    now = flood(0, warm, 0.1)
    core.tick(now + WORK_POLL_S)
    full = tracemalloc.get_traced_memory()[0]
    now = flood(warm, 3 * warm, now)
    core.tick(now + WORK_POLL_S)
    grown = tracemalloc.get_traced_memory()[0] - full
    tracemalloc.stop()
    m = core.metrics(now)
    print(f"flood: {4 * warm} identities; {full / 1024:.0f} KiB once the tables filled, then "
          f"{grown / 1024:+.0f} KiB; {m['peers']}")
    assert grown < 64 * 1024, grown  # flat: nothing kept per identity beyond the bounds
    assert m["peers"]["tracked"] <= peers and len(core.producer_stats) <= peers and len(core.parked_work) <= peers
    assert len(core.scheduler.leases.last_seen) <= peers
    assert all(len(t) <= MAX_TRACKED_SENDERS + 1 for t in core.incidents.tables.values())
    assert m["buffer/peers_evicted"] >= 4 * warm - peers and m["buffer/peers_refused"] == 0
    assert b"honest" in core.peers.last_seen  # it holds leases: kept through the flood
    assert MAX_PEERS >= 8 * peers  # the real bound
    for a in honest_rounds:  # and its results still count
        send(core, "honest", honest(a, "honest"), now)
    assert core.scheduler.metrics()["samples_received"] == 8 * honest_rounds[0].num_samples


def test_idle_producers_are_forgotten_and_lease_holders_never(tmp_path):
    core = make(tmp_path)
    send(core, "idle", P.Heartbeat("idle", "producer", 0, {"tokens_per_s": 5.0}), 0.0)
    work(core, "holder", 1, 0.0)
    idle_s = core.peers.idle_s
    core.tick(idle_s - 1)
    assert "idle" in core.producer_stats
    core.tick(idle_s + 2)
    assert "idle" not in core.producer_stats and "idle" not in core.scheduler.leases.last_seen
    assert core.counters["peers_expired"] >= 1 and b"idle" not in core.peers.last_seen
    # the silent holder's round expired (heartbeat_timeout_s) long before: then it was let go as well
    assert core.scheduler.metrics()["rounds_expired"] == 1 and b"holder" not in core.peers.last_seen
    # a full table of lease holders refuses a newcomer rather than forget a holder
    core.peers.max_peers = 2
    for who in ("h1", "h2"):
        assert work(core, who, 1, idle_s + 3)
    assert send(core, "newcomer", P.WorkRequest("newcomer", 1, 0), idle_s + 3) == []
    assert core.counters["peers_refused"] == 1 and b"newcomer" not in core.peers.last_seen


@pytest.mark.parametrize("stats,why", [({f"k{i}": 1.0 for i in range(65)}, "65 keys"), ({"k" * 65: 1.0}, "long key"),
                                       ({"x": float("nan")}, "NaN"), ({"x": float("inf")}, "inf")])
def test_heartbeat_payloads_are_bounded(tmp_path, stats, why):
    core = make(tmp_path)
    send(core, "p0", P.Heartbeat("p0", "producer", 0, stats), 0.0)
    assert core.counters["invalid"] == 1 and core.producer_stats == {}, why


# ---------------------------------------------------------------- all of it, then an honest run


def test_after_every_attack_an_honest_producer_and_learner_finish_with_exact_accounting(tmp_path):
    core = make(tmp_path, evals=EVALS)
    core.evals.start(0, 0.0)
    now = 0.0
    for i in range(6):
        now += 1.0
        for a in work(core, "attacker", 16, now):  # poisons on rounds it holds, one of each kind per round
            kinds = sorted(REASON)
            send(core, "attacker", poisoned_results(a, prompt_ids(a), MAX_NEW)[kinds[i % len(kinds)]], now)
        victim = work(core, "victim", 2, now)
        for a in victim:  # forged for the victim's rounds, then the victim answers honestly
            send(core, "thief", honest(a, "victim", rewards=[1.0] * a.num_samples), now)
            send(core, "victim", honest(a, "victim"), now)
        for msg in (P.BatchRequest("thief", 0, 4, 0), P.VersionUpdate(99), P.Shutdown("x"),
                    P.Heartbeat("x", "producer", 0, {f"k{j}": 1.0 for j in range(100)}), P.WorkRequest("x", -1, 0)):
            send(core, "thief", msg, now)
        core.malformed(b"thief", "garbage")
        core.tick(now)
    m = core.metrics(now)
    for counter in ("results_foreign", "rejected_values", "refused_role", "invalid", "malformed"):
        assert m[f"buffer/{counter}"] > 0, counter
    assert core.learner_version == 0 and core.stop_reason is None
    groups = finish_honestly(core, 5, now)
    assert core.learner_version == 5 and len(groups) == 20
    assert_clean(core, groups)
