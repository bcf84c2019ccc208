"""Differential test: the streaming Scheduler against a round-synchronous re-implementation of the reference.

The reference (RLHFlow/Reinforce-Ada on verl) samples a whole batch in lockstep: round 1 for every prompt, check
each prompt's exit rule, round 2 for the rest, ... up to N rounds; prompts that never exit are still trained
(zero-advantage if their pool is constant); each pool is downsampled keeping the earliest samples of each class;
advantages use the whole pool's mean (GRPO, "fixed": one round of n and the group's own statistics).

With downsample="first", unresolved="keep", max_staleness=0, allocation="uniform" and exit_check="round" the
Scheduler must give the same groups on the same per-prompt reward streams (prompt i's k-th sample always gets
reward stream[i][k]), whatever the order in which results arrive.

With exit_check="prefix" it must give the groups of the same reference with the exit rule checked after every
sample in issue order (the pool stops at the first sample where the rule holds), whatever the order in which
single samples arrive: a prefix pool depends on rewards only, never on which sample finished first.
"""

import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.buffer import Scheduler
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

THRESHOLD = 0.5
REWARDS = [0.0, 1.0, 0.0, 1.0, 0.3, 0.8]


def reference_batch(streams, rule, n, m, max_rounds, normalize_std, per_sample=False):
    """Reinforce-Ada as the reference runs it, one batch of prompts in lockstep rounds (with `per_sample`, a
    round's samples join the pool one by one and the pool stops where the exit rule first holds).

    Returns, per prompt: (kept rewards in pool order, advantages, pool size, rounds, resolved).
    """
    size, rounds_allowed = (n, 1) if rule == "fixed" else (m, max_rounds)
    pools = [[] for _ in streams]
    rounds = [0] * len(streams)
    resolved = [False] * len(streams)
    for _ in range(rounds_allowed):
        for i, stream in enumerate(streams):
            if resolved[i]:
                continue
            start = len(pools[i])
            rounds[i] += 1
            for k in range(start + 1 if per_sample and rule != "fixed" else start + size, start + size + 1):
                pools[i] = stream[:k]
                num_pos = sum(r > THRESHOLD for r in pools[i])
                num_neg = len(pools[i]) - num_pos
                if rule == "balance":
                    resolved[i] = num_pos >= n // 2 and num_neg >= n - n // 2 and k >= n
                elif rule == "pos":
                    resolved[i] = num_pos >= 1 and k >= n
                else:
                    resolved[i] = len(pools[i]) >= n
                if resolved[i]:
                    break
    out = []
    for i, pool in enumerate(pools):
        pos = [j for j, r in enumerate(pool) if r > THRESHOLD]
        neg = [j for j, r in enumerate(pool) if r <= THRESHOLD]
        want_pos = min(n // 2, len(pos))
        want_neg = min(n - want_pos, len(neg))
        want_pos = n - want_neg  # the pool always holds >= n samples here, so positives cover the rest
        kept = sorted(pos[:want_pos] + neg[:want_neg])
        mean = statistics.fmean(pool)
        std = max(statistics.stdev(pool), 1e-6) if normalize_std else 1.0
        out.append(([pool[j] for j in kept], [(pool[j] - mean) / std for j in kept], len(pool), rounds[i], resolved[i]))
    return out


def scheduler_batches(streams, rule, n, m, max_rounds, normalize_std, batch, num_batches, order_seed,
                      exit_check="round"):
    """The same streams through the Scheduler, two producers, results submitted in a shuffled order (whole rounds;
    with exit_check="prefix", single samples of all rounds in flight, shuffled together)."""
    sampling = SamplingConfig(round_size=m, max_rounds=max_rounds, group_size=n, exit_rule=rule,
                              positive_threshold=THRESHOLD, allocation="uniform", exit_check=exit_check)
    buffer = BufferConfig(max_staleness=0, unresolved="keep", downsample="first", normalize_std=normalize_std)
    prompts = [(f"q{i}", str(i)) for i in range(5)]
    sched = Scheduler(sampling, buffer, batch, prompts, seed=order_seed)
    drawn = [0] * len(streams)
    rng = random.Random(order_seed)
    out = []
    for version in range(num_batches):
        sched.set_learner_version(version, now=float(version))
        while sched.groups_waiting < batch:
            work = sched.request_work("p0", rng.randint(1, 3), 0.0) + sched.request_work("p1", 1000, 0.0)
            assert work, "the scheduler stalled"
            rng.shuffle(work)
            singles = []
            for a in work:
                k = drawn[a.prompt_id]
                drawn[a.prompt_id] += a.num_samples
                samples = [
                    Sample(np.array([a.prompt_id], np.int32), np.zeros(1, np.float32), r, version, "stop")
                    for r in streams[a.prompt_id][k : k + a.num_samples]
                ]
                if exit_check == "round":
                    assert sched.submit_result("p0", a.round_id, np.zeros(1, np.int32), samples, 0.0).accepted
                else:
                    singles += [(a.round_id, i, x) for i, x in enumerate(samples)]
            rng.shuffle(singles)
            for round_id, i, x in singles:  # a round cut by the exit rule ignores the rest as late
                status = sched.submit_samples("p0", round_id, [i], [x], np.zeros(1, np.int32), 0.0).status
                assert status in ("accepted", "late")
        groups = sched.take_batch(version, batch)
        assert groups is not None and sched.groups_waiting == 0
        assert sorted(g.prompt_id for g in groups) == list(range(version * batch, (version + 1) * batch))
        out.append(sorted(groups, key=lambda g: g.prompt_id))
    sched.check_invariants()
    return out


@st.composite
def cases(draw):
    rule = draw(st.sampled_from(["balance", "pos", "fixed"]))
    n = draw(st.integers(2, 6))
    max_rounds = draw(st.integers(1, 4))
    lowest_m = n if rule == "pos" else -(-n // max_rounds)  # "pos" may exit after one round: it needs M >= n
    m = draw(st.integers(max(1, lowest_m), 8))
    batch = draw(st.integers(1, 4))
    num_batches = draw(st.integers(1, 3))
    length = n if rule == "fixed" else m * max_rounds
    streams = draw(st.lists(st.lists(st.sampled_from(REWARDS), min_size=length, max_size=length),
                            min_size=batch * num_batches, max_size=batch * num_batches))
    return rule, n, m, max_rounds, draw(st.booleans()), batch, num_batches, streams, draw(st.integers(0, 99))


@settings(max_examples=200, deadline=None)
@given(cases())
def test_scheduler_matches_round_synchronous_reference(case):
    rule, n, m, max_rounds, normalize_std, batch, num_batches, streams, order_seed = case
    got = scheduler_batches(streams, rule, n, m, max_rounds, normalize_std, batch, num_batches, order_seed)
    for b, groups in enumerate(got):
        want = reference_batch(streams[b * batch : (b + 1) * batch], rule, n, m, max_rounds, normalize_std)
        for g, (rewards, advantages, pool_size, num_rounds, resolved) in zip(groups, want):
            assert [s.reward for s in g.samples] == rewards
            assert g.advantages == pytest.approx(advantages, abs=1e-9)
            assert (g.pool_size, g.num_rounds, g.resolved) == (pool_size, num_rounds, resolved)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_prefix_exit_matches_the_per_sample_reference_whatever_the_arrival_order(case):
    rule, n, m, max_rounds, normalize_std, batch, num_batches, streams, order_seed = case
    got = scheduler_batches(streams, rule, n, m, max_rounds, normalize_std, batch, num_batches, order_seed,
                            exit_check="prefix")
    for b, groups in enumerate(got):
        want = reference_batch(streams[b * batch : (b + 1) * batch], rule, n, m, max_rounds, normalize_std,
                               per_sample=True)
        for g, (rewards, advantages, pool_size, num_rounds, resolved) in zip(groups, want):
            assert [s.reward for s in g.samples] == rewards
            assert g.advantages == pytest.approx(advantages, abs=1e-9)
            assert (g.pool_size, g.num_rounds, g.resolved) == (pool_size, num_rounds, resolved)


def test_reference_example_by_hand():
    """One balance prompt exiting in round 2, one that never exits (kept, resolved=False)."""
    streams = [[1, 0, 0, 0, 1, 0, 0, 0], [0] * 8]
    want = reference_batch(streams, "balance", 4, 4, 2, False)
    assert want[0] == ([1, 0, 0, 1], [0.75, -0.25, -0.25, 0.75], 8, 2, True)
    assert want[1] == ([0, 0, 0, 0], [0.0] * 4, 8, 2, False)
    got = scheduler_batches(streams, "balance", 4, 4, 2, False, 2, 1, 0)[0]
    assert [[s.reward for s in g.samples] for g in got] == [want[0][0], want[1][0]]
