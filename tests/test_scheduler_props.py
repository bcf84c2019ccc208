"""Scheduler properties over random reward streams and random event orders (hypothesis).

A driver plays a list of events against a Scheduler, under every allocation policy and every exit_check:
several producers asking for work (in rounds and samples), results submitted in any order (whole rounds, or
samples one part at a time in any order; some stale, some duplicated, some with the wrong sample count or a bad
index), expiries, version bumps, batches taken, and snapshot/restore cycles. After every event it checks the
invariants: every group has exactly n samples; a resolved "balance" group keeps n/2 positives and n - n/2
negatives; under "drop" no zero-variance group is released; no accepted sample is handed off twice; no admitted
prompt is lost; every handed-off sample meets the staleness bound; advantages equal the formula over the whole
pool; a round's size is the policy's (M under "fixed", within the visit's budget otherwise); and a replay of
the same seed and event log gives the same groups.
"""

import math
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.buffer import Scheduler, group_advantages, is_positive
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

PROMPTS = [(f"q{i}", str(i)) for i in range(7)]
TOK = np.array([3], np.int32)
REWARDS = (0.0, 0.0, 1.0, 1.0, 0.25, 0.75)  # mostly binary; fractions exercise the threshold and variance


@st.composite
def configs(draw):
    rule = draw(st.sampled_from(["balance", "pos", "fixed"]))
    n = draw(st.integers(2, 4))
    max_rounds = draw(st.integers(1, 3))
    round_size = max(draw(st.integers(1, 4)), math.ceil(n / max_rounds))
    allocation = "uniform" if rule == "fixed" else draw(st.sampled_from(["uniform", "est", "min_cost"]))
    sampling = SamplingConfig(round_size=round_size, max_rounds=max_rounds, group_size=n, exit_rule=rule,
                              allocation=allocation, exit_check=draw(st.sampled_from(["prefix", "sample", "round"])))
    buffer = BufferConfig(
        max_staleness=draw(st.integers(0, 2)),
        max_rounds_in_flight=draw(st.integers(0, 4)),
        unresolved=draw(st.sampled_from(["drop", "keep"])),
        downsample=draw(st.sampled_from(["first", "freshest", "random"])),
        normalize_std=draw(st.booleans()),
        lease_s=10.0,
        heartbeat_timeout_s=5.0,
    )
    return sampling, buffer, draw(st.integers(1, 3))


_idx = st.integers(0, 1000)
_req = st.tuples(st.just("req"), st.integers(0, 2), st.integers(1, 3), st.sampled_from([0, 0, 1, 3, 8]))
# (sub, which pending round, reward seed (0-2: all equal rewards, the zero-variance cases), version lag)
_sub = st.tuples(st.just("sub"), _idx, st.one_of(st.integers(0, 2), st.integers(3, 2**16)),
                 st.sampled_from([0, 0, 0, 1, 2]))
EVENT = st.one_of(  # weighted toward requests and results so that prompts really flow through
    _req, _req, _req,
    _sub, _sub, _sub, _sub, _sub,
    st.tuples(st.just("dup"), _idx),
    # (part, which pending round, how many of its unsent samples, reward seed, version lag)
    st.tuples(st.just("part"), _idx, st.integers(1, 3), st.integers(3, 2**16), st.sampled_from([0, 0, 1])),
    st.tuples(st.just("part"), _idx, st.integers(1, 2), st.integers(3, 2**16), st.just(0)),
    st.tuples(st.just("badidx"), _idx),
    st.tuples(st.just("unk"), st.integers(-5, 5)),
    st.tuples(st.just("bad"), _idx),
    st.tuples(st.just("exp"), st.sampled_from([0, 1, 2, 12])),  # 12 s: past the lease and the heartbeat timeout
    st.tuples(st.just("hb"), st.integers(0, 2)),
    st.tuples(st.just("ver"), st.integers(1, 2)),
    st.tuples(st.just("take"), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("take"), st.integers(1, 2), st.just(False)),
    st.tuples(st.just("snap")),
)
EVENTS = st.lists(EVENT, min_size=60, max_size=200)


class Driver:
    """Plays events and checks invariants; `log` records everything handed off, for the replay check."""

    def __init__(self, sampling: SamplingConfig, buffer: BufferConfig, batch: int, seed: int) -> None:
        self.sampling, self.buffer, self.batch = sampling, buffer, batch
        self.s = Scheduler(sampling, buffer, batch, PROMPTS, seed)
        self.now = 0.0
        self.next_token = 0
        self.pending = []  # (assignment, producer, indices already sent)
        self.submitted = []  # (round_id, producer, samples)
        self.accepted_tokens: set[int] = set()
        self.handed_tokens: set[int] = set()
        self.log = []

    def samples(self, count: int, seed: int, lag: int) -> list[Sample]:
        rng = random.Random(seed)
        version = max(0, self.s.learner_version - lag)
        out = []
        for _ in range(count):
            self.next_token += 1
            reward = (0.0, 1.0, 0.75)[seed] if seed < 3 else rng.choice(REWARDS)
            out.append(Sample(np.array([self.next_token], np.int32), np.zeros(1, np.float32), reward, version, "stop"))
        return out

    def play(self, ev: tuple) -> None:
        kind, s = ev[0], self.s
        if kind == "req":
            producer = f"p{ev[1]}"
            for a in s.request_work(producer, ev[2], self.now, max_samples=ev[3]):
                budget = self.sampling.round_size * self.sampling.max_rounds
                if self.sampling.allocation == "uniform":
                    assert a.num_samples == s.rule.nominal_round(self.sampling)
                else:
                    assert 1 <= a.num_samples <= budget
                assert a.lease_s == self.buffer.lease_s and a.stream == (s.pools.exit_check != "round")
                self.pending.append((a, producer, set()))
        elif kind == "sub" and self.pending:  # the rest of a round at once (a whole result if nothing was sent)
            a, producer, sent = self.pending.pop(ev[1] % len(self.pending))
            indices = [i for i in range(a.num_samples) if i not in sent]
            samples = self.samples(len(indices), ev[2], ev[3])
            if sent:
                out = s.submit_samples(producer, a.round_id, indices, samples, TOK, self.now)
            else:
                out = s.submit_result(producer, a.round_id, TOK, samples, self.now)
            self.record(out, a.round_id, producer, indices, samples)
        elif kind == "part" and self.pending:  # a few of a round's samples, in any order
            i = ev[1] % len(self.pending)
            a, producer, sent = self.pending[i]
            todo = [k for k in range(a.num_samples) if k not in sent]
            indices = random.Random(ev[3]).sample(todo, min(ev[2], len(todo)))
            samples = self.samples(len(indices), ev[3], ev[4])
            out = s.submit_samples(producer, a.round_id, indices, samples, TOK, self.now)
            sent.update(indices)
            if len(sent) == a.num_samples or out.status != "accepted" or a.round_id in out.aborted:
                self.pending.pop(i)
            self.record(out, a.round_id, producer, indices, samples)
        elif kind == "bad" and self.pending:
            a, producer, sent = self.pending.pop(ev[1] % len(self.pending))
            out = s.submit_result(producer, a.round_id, TOK, self.samples(a.num_samples + 1, 0, 0), self.now)
            assert out.status in ("rejected", "late")
        elif kind == "badidx" and self.pending:
            a, producer, sent = self.pending.pop(ev[1] % len(self.pending))
            out = s.submit_samples(producer, a.round_id, [a.num_samples], self.samples(1, 0, 0), TOK, self.now)
            assert out.status in ("rejected", "late")
        elif kind == "dup" and self.submitted:
            round_id, producer, indices, samples = self.submitted[ev[1] % len(self.submitted)]
            status = s.submit_samples(producer, round_id, indices, samples, TOK, self.now).status
            assert status in ("duplicate", "late")
        elif kind == "unk":
            assert s.submit_result("p0", 10**6 + ev[1], TOK, [], self.now).status == "unknown"
        elif kind == "exp":
            self.now += ev[1]
            s.expire(self.now)
        elif kind == "hb":
            s.heartbeat(f"p{ev[1]}", self.now)
        elif kind == "ver":
            s.set_learner_version(s.learner_version + ev[1], self.now)
        elif kind == "take":
            version = s.learner_version + ev[2]
            s.set_learner_version(version, self.now)
            groups = s.take_batch(version, ev[1], self.now)
            if groups is not None:
                assert len(groups) == ev[1]
                for g in groups:
                    self.check_group(g)
                    for x in g.samples:
                        assert version - x.version <= self.buffer.max_staleness
                        token = int(x.token_ids[0])
                        assert token in self.accepted_tokens and token not in self.handed_tokens
                        self.handed_tokens.add(token)
                    self.log.append((g.prompt_id, [int(x.token_ids[0]) for x in g.samples], g.advantages))
        elif kind == "snap":
            self.s = Scheduler.restore(s.snapshot(), self.sampling, self.buffer, self.batch, PROMPTS)
            self.pending.clear()  # rounds in flight are re-issued under new ids after a restore
        self.s.check_invariants()
        m = self.s.metrics()
        dropped = m["dropped_unresolved"] + m["dropped_zero_variance"]
        assert m["admitted"] == m["released"] - m["reopened"] + dropped + m["active"]
        assert m["released"] - m["reopened"] == m["groups_waiting"] + m["groups_consumed"]

    def record(self, out, round_id, producer, indices, samples) -> None:
        assert out.status in ("accepted", "late", "duplicate"), out.status
        if out.accepted:
            self.submitted.append((round_id, producer, indices, samples))
            self.accepted_tokens.update(int(x.token_ids[0]) for x in samples)
        assert out.aborted in ((), (round_id,))
        if out.group is not None:
            self.check_group(out.group)

    def check_group(self, g) -> None:
        n, thr = self.sampling.group_size, self.sampling.positive_threshold
        rewards = [x.reward for x in g.samples]
        assert len(g.samples) == len(g.advantages) == n and g.pool_size >= n
        if self.sampling.exit_rule == "balance" and g.resolved:  # the exit rule: n/2 of each class, kept
            assert sum(is_positive(r, thr) for r in rewards) == n // 2
        if self.buffer.unresolved == "drop":
            # the pool had variance (the kept n may all be equal yet differ from the pool mean): some signal
            assert any(a != 0 for a in g.advantages)
        if self.sampling.exit_rule == "fixed":
            assert g.advantages == group_advantages(rewards, self.buffer.normalize_std)
        elif not self.buffer.normalize_std:
            baseline = [r - a for r, a in zip(rewards, g.advantages)]  # = the pool mean, the same for all
            assert max(baseline) - min(baseline) <= 1e-9


@settings(max_examples=150, deadline=None)
@given(configs(), EVENTS, st.integers(0, 3))
def test_random_event_orders_keep_every_invariant_and_replay(cfg, events, seed):
    sampling, buffer, batch = cfg
    first = Driver(sampling, buffer, batch, seed)
    for ev in events:
        first.play(ev)
    second = Driver(sampling, buffer, batch, seed)
    for ev in events:
        second.play(ev)
    assert first.log == second.log and first.s.metrics() == second.s.metrics()


@settings(max_examples=40, deadline=None)
@given(configs(), st.integers(0, 2**32 - 1))
def test_a_busy_random_run_makes_progress_and_keeps_invariants(cfg, seed):
    """Three producers working in a random interleaving always deliver batches (liveness), invariants hold."""
    sampling, buffer, batch = cfg
    d = Driver(sampling, buffer, batch, seed)
    rng = random.Random(seed)
    batches = 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.3:
            d.play(("req", rng.randrange(3), rng.randrange(1, 4), rng.choice([0, 2, 8])))
        elif roll < 0.6:
            d.play(("sub", rng.randrange(1000), rng.randrange(2**16), 0))
        elif roll < 0.8:
            d.play(("part", rng.randrange(1000), rng.randrange(1, 3), rng.randrange(3, 2**16), 0))
        elif roll < 0.85:
            d.play(("dup", rng.randrange(1000)))
        elif roll < 0.88:
            d.play(("exp", rng.randrange(3)))
        else:
            before = len(d.log)
            d.play(("take", batch, False))
            if len(d.log) > before:
                batches += 1
                d.play(("ver", 1))
    assert batches >= 3, d.s.metrics()
