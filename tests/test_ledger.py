"""The ledger of every generated sample and token by fate (pipeline/buffer/ledger.py), on the socket-free buffer
core: scripted producers report what they generated in heartbeats, stream samples and report aborts, and each test
checks every fate to the sample and token against hand-counted numbers, and that the fates sum to what the
producers generated. (The property tests of test_scheduler_props.py check after every event that the pooled term
equals what the pools hold; test_e2e.py checks the conservation on a real multi-process run.)"""

import json

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.buffer.core import BufferCore
from pipeline.buffer.ledger import COUNTED, FATES, Fates, Generation, compact, ledger, table
from pipeline.config import load_config

TRAIN = [(f"{i}+{i}=", str(2 * i)) for i in range(50)]


def make(tmp_path, *overrides):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.batch_prompts", "1", "--learner.mini_batches",
                             "1", "--learner.eval_every", "0", "--buffer.lease_s", "10", *overrides])
    return BufferCore(cfg, TRAIN, [], now=0.0)


def sample(reward, tokens, version=0):
    return P.Sample(np.arange(tokens, dtype=np.int32), np.zeros(tokens, np.float32), float(reward), version, "stop")


class Producer:
    """A scripted producer: counts what it 'generates' as a real one does (stats.py), sends it, reports aborts."""

    def __init__(self, core, name="p0", started_at=1.0):
        self.core, self.name, self.started_at = core, name, started_at
        self.gen = [0, 0]

    def heartbeat(self, now, final=False):
        stats = {"started_at": self.started_at, "gen_samples": self.gen[0], "gen_tokens": self.gen[1],
                 "gen_eval_samples": 0.0, "gen_eval_tokens": 0.0, "final": float(final)}
        return self.core.handle(self.name.encode(), P.Heartbeat(self.name, "producer", 0, stats), now)

    def work(self, now, n=1):
        outs = self.core.handle(self.name.encode(), P.WorkRequest(self.name, n, self.core.learner_version), now)
        return [a for o in outs if isinstance(o.msg, P.Assignments) for a in o.msg.rounds]

    def send(self, a, now, samples: dict, aborted=(0, 0)):
        """Generate and stream `samples` ({index: (reward, tokens)}) of round `a`, and report `aborted`."""
        made = {i: sample(r, t, self.core.learner_version) for i, (r, t) in samples.items()}
        self.generated(len(made), sum(t for _, t in samples.values()))
        self.generated(*aborted)
        part = P.RoundSamples(a.round_id, a.prompt_id, np.arange(2, dtype=np.int32), list(made), list(made.values()),
                              *aborted)
        return self.core.handle(self.name.encode(), P.SampleResults(self.name, [part]), now)

    def generated(self, num, tokens):
        self.gen[0] += num
        self.gen[1] += tokens


def fates(core, now):
    led = core.ledger(now)
    core.scheduler.check_invariants()
    for unit in ("samples", "tokens"):
        assert sum(led[f"{f}_{unit}"] for f in FATES) == led[f"generated_{unit}"]
    return {f: (led[f"{f}_samples"], led[f"{f}_tokens"]) for f in FATES if led[f"{f}_samples"] or led[f"{f}_tokens"]}


def test_exit_cut_downsampled_trained_and_pooled_to_the_token(tmp_path):
    core = make(tmp_path)
    p = Producer(core)
    p.heartbeat(0.0)
    (a,) = p.work(0.1)
    # prefix: 0..4 join (3 positives, then 2 negatives: balance holds with a pool of 5), 5 arrived but is discarded
    outs = p.send(a, 0.2, {0: (1, 2), 1: (1, 3), 2: (1, 4), 3: (0, 5), 4: (0, 6), 5: (1, 7)})
    assert [o.msg.round_ids for o in outs if isinstance(o.msg, P.Abort)] == [[a.round_id]]
    p.send(a, 0.3, {6: (0, 8)}, aborted=(1, 9))  # a straggler that finished anyway, and the aborted last sample
    p.heartbeat(0.4)
    assert fates(core, 0.4) == {"exit_cut": (3, 7 + 8 + 9), "pooled": (5, 20)}
    (out,) = core.handle(b"l", P.BatchRequest("l", 0, 1, 1000), 0.5)
    assert len(out.msg.groups) == 1
    # the group keeps 2 positives and 2 negatives of the pool of 5: one positive is downsampled away
    kept = sum(len(s.token_ids) for s in out.msg.groups[0].samples)
    assert fates(core, 0.5) == {"trained": (4, kept), "downsampled": (1, 20 - kept), "exit_cut": (3, 24)}
    # the learner's row carries the same ledger, flat
    assert out.msg.metrics["ledger/trained_samples"] == 4 and out.msg.metrics["ledger/generated_tokens"] == 44
    assert not any(k.startswith(("buffer/fate_", "buffer/arrived_")) for k in out.msg.metrics)


def test_stale_zero_variance_and_refused(tmp_path):
    core = make(tmp_path, "--buffer.max_staleness", "0", "--sampling.exit_rule", "pos", "--learner.batch_prompts", "2")
    p = Producer(core)
    a, b = p.work(0.0, n=2)
    p.send(a, 0.1, {0: (0, 3)})  # joins a's pool
    p.send(b, 0.1, {1: (0, 4)})  # held: index 0 of b has not arrived
    outs = core.handle(b"l", P.VersionUpdate(1), 0.2)  # both rounds would be stale: aborted, the pool evicted
    assert sorted(rid for o in outs if isinstance(o.msg, P.Abort) for rid in o.msg.round_ids) == [a.round_id,
                                                                                                  b.round_id]
    p.send(a, 0.3, {}, aborted=(7, 10))  # the producer reports what it cut of both rounds
    p.send(b, 0.3, {0: (0, 5)}, aborted=(6, 6))  # and one that finished before the abort reached it
    p.heartbeat(0.4)
    assert fates(core, 0.4) == {"stale": (1 + 1 + 7 + 1 + 6, 3 + 4 + 10 + 5 + 6)}
    # "pos" with every sample right: the rule holds on a pool with no signal, dropped with its 4 samples
    (c,) = p.work(1.0)
    p.send(c, 1.1, {0: (1, 2)})
    p.send(c, 1.1, {0: (1, 2)})  # a duplicate of a sample that already arrived
    p.send(c, 1.1, {i: (1, 2) for i in range(1, 4)})
    # a result for a round never issued, and one for another producer's round
    p.send(P.RoundAssignment(10**6, 0, "", "", 1, 1.0), 1.2, {0: (1, 9)})
    (d,) = p.work(1.3)
    intruder = Producer(core, "p1")
    intruder.send(d, 1.4, {0: (1, 11)})
    p.heartbeat(1.5)
    intruder.heartbeat(1.5)
    got = fates(core, 1.5)
    assert got == {"stale": (16, 28), "zero_variance": (4, 8), "refused": (3, 2 + 9 + 11)}
    assert core.counters["results_foreign"] == 1


def test_a_dead_producer_loses_what_it_never_delivered_and_its_round_is_reissued(tmp_path):
    core = make(tmp_path)
    p = Producer(core)
    p.heartbeat(0.0)
    (a,) = p.work(0.1)
    p.send(a, 0.2, {1: (1, 4), 2: (0, 5)})  # held: index 0 never came
    p.generated(5, 50)  # generated and never sent: the producer dies
    p.heartbeat(0.3)
    assert fates(core, 0.3) == {"pooled": (2, 9), "unreported": (5, 50)}  # alive: maybe still on its way
    outs = core.tick(20.0)  # silent past buffer.heartbeat_timeout_s: its round expires and is re-issued
    assert any(isinstance(o.msg, P.Abort) and o.msg.round_ids == [a.round_id] for o in outs)
    assert fates(core, 20.0) == {"reissued": (2, 9), "lost": (5, 50)}
    # it comes back as a new process under the same name: the old one's loss stays, the new one starts at 0
    q = Producer(core, started_at=2.0)
    q.heartbeat(21.0)
    assert fates(core, 21.0) == {"reissued": (2, 9), "lost": (5, 50)}


def test_the_final_reports_complete_the_ledger(tmp_path):
    core = make(tmp_path)
    p, q = Producer(core, "p0"), Producer(core, "p1")
    p.heartbeat(0.0)
    q.heartbeat(0.0)
    (a,) = p.work(0.1)
    p.send(a, 0.2, {0: (1, 3)})
    assert not core.reports_complete(0.3)
    # at the end the producer aborts its running round (its lease still held: stopped), sends it, then its last
    p.send(a, 0.4, {}, aborted=(7, 14))
    p.heartbeat(0.5, final=True)
    assert not core.reports_complete(0.5)  # p1 is still heard from and has not sent its final heartbeat
    assert core.reports_complete(20.0)  # ... until it is silent
    q.heartbeat(0.6, final=True)
    assert core.reports_complete(0.6)
    led = core.write_ledger(0.6)
    assert fates(core, 0.6) == {"stopped": (7, 14), "pooled": (1, 3)}
    written = json.loads((tmp_path / "tiny" / "ledger.json").read_text())
    assert written == {**led, "complete": True}
    assert core.metrics(0.6)["ledger"] == led


def test_stragglers_take_the_fate_their_round_closed_with_and_unknown_ones_are_refused():
    counts = dict.fromkeys(["arrived_samples", "arrived_tokens",
                            *(f"fate_{f}_{u}" for f in COUNTED for u in ("samples", "tokens"))], 0)
    f = Fates(counts)
    f.close(1, "exit_cut", 3)
    f.close(2, "stale", 0)  # nothing outstanding: not remembered
    for rid, num, tokens in ((1, 2, 10), (1, 1, 4), (1, 1, 5), (2, 1, 7)):
        f.arrive(num, tokens)
        f.straggler(rid, num, tokens)
    assert counts["fate_exit_cut_samples"] == 3 and counts["fate_exit_cut_tokens"] == 14
    assert counts["fate_refused_samples"] == 2 and counts["fate_refused_tokens"] == 12  # after the 3, and round 2
    assert f.pooled() == (0, 0) and not f.closed


def test_generation_per_process_and_the_ledger_and_its_lines():
    g = Generation()
    stats = {"started_at": 1.0, "gen_samples": 10, "gen_tokens": 100, "gen_eval_samples": 4, "gen_eval_tokens": 8}
    g.heartbeat("p0", stats)
    g.reported("p0", 6, 60)
    g.heartbeat("p0", {**stats, "started_at": 2.0, "gen_samples": 1, "gen_tokens": 5})  # restarted
    g.heartbeat("old", {"tokens_per_s": 3.0})  # a producer without counters is not counted
    t = g.totals(lambda name: False)
    assert (t["train_samples"], t["train_tokens"], t["lost_samples"], t["lost_tokens"]) == (11, 105, 4, 40)
    assert (t["eval_samples"], t["eval_tokens"]) == (8, 16)
    m = {"arrived_samples": 6, "arrived_tokens": 60,
         **{f"fate_{f}_{u}": 0 for f in COUNTED for u in ("samples", "tokens")}}
    m["fate_trained_samples"], m["fate_trained_tokens"] = 4, 40
    led = ledger(m, t)
    assert led["generated_samples"] == 19 and led["pooled_samples"] == 2 and led["unreported_samples"] == 1
    assert sum(led[f"{f}_tokens"] for f in FATES) == led["generated_tokens"] == 121
    assert table(led)[0] == ("trained", 4, 40, pytest.approx(40 / 121))
    assert compact(led).startswith("121 tokens: trained 33% | pooled 17% | eval 13% | lost 33%")
    # mid-run, unreported can dip below zero by a result that arrived before its heartbeat: never "-0%"
    assert "unreported" not in compact({**led, "generated_tokens": 10_000, "unreported_tokens": -1})
    assert "unreported -6%" in compact({**led, "generated_tokens": 10_000, "unreported_tokens": -600})  # still shown
