"""Buffer logic by hand-computed cases: exit rules, downsampling, advantages, prompt state and the Scheduler's
events (admission, rounds, results, release, staleness, expiry, snapshots)."""

import math
import random

import numpy as np
import pytest

from pipeline.buffer import (
    PromptState,
    Scheduler,
    downsample,
    exit_reached,
    group_advantages,
    has_signal,
    is_positive,
    pool_advantages,
)
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

_ids = iter(range(1, 10**9))


def smp(reward, version=0, sid=None):
    """A tiny sample; its single token id is a unique id (so tests can trace samples)."""
    sid = next(_ids) if sid is None else sid
    return Sample(np.array([sid], np.int32), np.array([-0.5], np.float32), float(reward), version, "stop")


def rounds(samples_rewards, version=0):
    return [smp(r, version) for r in samples_rewards]


PROMPTS = [(f"q{i}", str(i)) for i in range(5)]
TOK = np.array([7, 8], np.int32)


def make(batch=2, **kw):
    """A Scheduler; the hand-computed cases below check pools of whole rounds, so exit_check is "round" unless
    a test says otherwise (tests/test_streaming_exit.py covers "prefix" and "sample")."""
    kw.setdefault("exit_check", "round")
    s = {k: kw.pop(k) for k in list(kw) if k in SamplingConfig.__struct_fields__}
    b = BufferConfig(**kw)
    return Scheduler(SamplingConfig(**s), b, batch, PROMPTS, seed=0)


# ---------------------------------------------------------------- logic


def test_is_positive_is_strict():
    assert is_positive(1.0, 0.5) and not is_positive(0.5, 0.5) and not is_positive(0.0, 0.5)


@pytest.mark.parametrize(
    "pos,neg,rule,n,want",
    [
        (2, 2, "balance", 4, True), (2, 1, "balance", 4, False), (1, 5, "balance", 4, False),
        (1, 2, "balance", 3, True), (1, 1, "balance", 3, False),  # n=3: 1 positive, 2 negatives
        (1, 0, "pos", 4, True), (0, 9, "pos", 4, False),
        (0, 4, "fixed", 4, True), (1, 2, "fixed", 4, False),
    ],
)
def test_exit_reached(pos, neg, rule, n, want):
    assert exit_reached(pos, neg, rule, n) is want


def test_exit_reached_rejects_unknown_rule():
    with pytest.raises(ValueError, match="balance"):
        exit_reached(1, 1, "both", 4)


def test_downsample_first_keeps_half_and_half_in_generation_order():
    r = [0, 1, 0, 0, 1, 1, 0, 1]
    assert downsample(r, [0] * 8, 4, "first", 0.5) == [0, 1, 2, 4]


def test_downsample_fills_from_the_other_class():
    assert downsample([0, 0, 1, 0, 0], [0] * 5, 4, "first", 0.5) == [0, 1, 2, 3]  # 1 pos + 3 neg
    assert downsample([1, 1, 0, 1, 1], [0] * 5, 4, "first", 0.5) == [0, 1, 2, 3]  # 3 pos + 1 neg
    assert downsample([1, 1, 1, 1, 1], [0] * 5, 4, "first", 0.5) == [0, 1, 2, 3]
    assert downsample([0, 1, 0], [0] * 3, 3, "first", 0.5) == [0, 1, 2]  # n odd: 1 pos, 2 neg


def test_downsample_freshest_prefers_high_versions_then_earliest():
    r = [1, 1, 1, 0, 0, 0]
    v = [0, 2, 2, 1, 3, 1]
    assert downsample(r, v, 4, "freshest", 0.5) == [1, 2, 3, 4]  # pos v2 (1,2); neg v3 (4) then v1 earliest (3)


def test_downsample_random_is_seeded_and_balanced():
    r = [1, 0] * 10
    a = downsample(r, [0] * 20, 4, "random", 0.5, random.Random(3))
    b = downsample(r, [0] * 20, 4, "random", 0.5, random.Random(3))
    assert a == b and a == sorted(a) and sum(r[i] for i in a) == 2
    with pytest.raises(ValueError, match="rng"):
        downsample(r, [0] * 20, 4, "random", 0.5)


def test_downsample_errors():
    with pytest.raises(ValueError, match="cannot be downsampled"):
        downsample([1, 0], [0, 0], 4, "first", 0.5)
    with pytest.raises(ValueError, match="versions"):
        downsample([1, 0], [0], 1, "first", 0.5)
    with pytest.raises(ValueError, match="freshest"):
        downsample([1, 0], [0, 0], 2, "newest", 0.5)


def test_pool_advantages_use_whole_pool_mean_and_std():
    pool = [1, 0, 0, 0, 1, 0, 0, 0]
    assert pool_advantages(pool, [0, 1, 2, 4], False) == [0.75, -0.25, -0.25, 0.75]
    std = math.sqrt(sum((x - 0.25) ** 2 for x in pool) / 7)  # ddof = 1
    got = pool_advantages(pool, [0, 1], True)
    assert got == pytest.approx([0.75 / std, -0.25 / std])


def test_std_is_clamped_and_single_sample_pool_has_std_one():
    assert pool_advantages([1.0, 1.0 + 1e-9], [1], True) == pytest.approx([0.5e-9 / 1e-6])
    assert pool_advantages([3.0], [0], True) == [0.0]
    assert pool_advantages([1, 1, 1], [0, 1], True) == [0.0, 0.0]
    with pytest.raises(ValueError, match="empty"):
        pool_advantages([], [], False)


def test_group_advantages_equal_pool_advantages_over_the_group():
    g = [1.0, 0.0, 0.0, 1.0]
    assert group_advantages(g, True) == pool_advantages(g, range(4), True)
    assert group_advantages(g, False) == [0.5, -0.5, -0.5, 0.5]


def test_has_signal():
    assert not has_signal([1, 1, 1]) and has_signal([1, 0]) and not has_signal([0.0])


# ---------------------------------------------------------------- prompt state


def test_prompt_state_add_and_evict_refund_rounds():
    st = PromptState(0, 0, "q", "a", admitted_at=0.0, admitted_order=0)
    st.rounds_issued = 3
    st.add_round(10, rounds([1, 0], version=0), 0.5)
    st.add_round(11, rounds([1, 1], version=1), 0.5)
    st.add_round(12, [smp(0, 0), smp(0, 2)], 0.5)
    assert (st.num_pos, st.num_neg, st.rounds_completed) == (3, 3, 3)
    assert st.evict_older_than(1) == 3  # round 0 loses everything (refunded); round 2 keeps one sample
    assert (st.num_pos, st.num_neg, st.rounds_completed) == (2, 1, 2)
    st.check()
    assert st.evict_older_than(2, whole_rounds=True) == 2  # round 1 entirely stale; round 2's v2 sample left
    assert (st.num_pos, st.num_neg, st.rounds_completed, len(st.pool)) == (0, 1, 1, 1)
    st.check()


# ---------------------------------------------------------------- scheduler


def submit(s, a, rewards, version=0, producer="p"):
    return s.submit_result(producer, a.round_id, TOK, rounds(rewards, version), now=1.0)


def test_admission_bound_and_assignment_fields():
    s = make(batch=2, max_staleness=1, round_size=4, lease_s=30.0)
    work = s.request_work("p", 10, now=0.0)
    assert len(work) == 4  # (0 + 1 + 1) * 2 groups
    assert [a.prompt for a in work] == ["q0", "q1", "q2", "q3"]
    assert len({a.round_id for a in work}) == 4 and all(a.num_samples == 4 and a.lease_s == 30.0 for a in work)
    assert s.request_work("p", 10, now=0.0) == []  # one round per prompt in flight, admission closed
    s.check_invariants()


def test_balance_round_two_goes_to_the_waiting_prompt_first_and_releases():
    s = make(batch=1, max_staleness=0, round_size=4, max_rounds=3, downsample="first")
    (a,) = s.request_work("p", 5, 0.0)
    out = submit(s, a, [1, 0, 0, 0])
    assert out.accepted and out.group is None
    (b,) = s.request_work("p", 5, 0.0)
    assert b.prompt_id == a.prompt_id and b.round_id != a.round_id
    out = submit(s, b, [1, 0, 0, 0])
    g = out.group
    assert [x.reward for x in g.samples] == [1, 0, 0, 1]
    assert g.advantages == [0.75, -0.25, -0.25, 0.75]
    assert (g.pool_size, g.num_rounds, g.resolved, g.answer) == (8, 2, True, "0")
    assert np.array_equal(g.prompt_token_ids, TOK)
    assert s.take_batch(0, 2) is None
    assert s.take_batch(0, 1)[0] is g
    m = s.metrics()
    assert m["rounds_to_exit"] == {2: 1} and m["samples_per_released_group"] == 8 and m["positive_rate"] == 0.25
    s.check_invariants()


def test_ignored_results_are_classified():
    s = make(batch=1, round_size=4, max_rounds=2)
    (a,) = s.request_work("p", 1, 0.0)
    assert submit(s, a, [1, 0, 0, 0]).status == "accepted"
    assert submit(s, a, [1, 0, 0, 0]).status == "duplicate"
    (b,) = s.request_work("p", 1, 0.0)
    assert s.expire(now=1000.0) == [b.round_id]
    assert submit(s, b, [1, 1, 0, 0]).status == "late"
    assert s.submit_result("p", 999, TOK, [], 1.0).status == "unknown"
    m = s.metrics()
    assert m["results_ignored"] == {"duplicate": 1, "late": 1, "unknown": 1} and m["rounds_expired"] == 1
    (c,) = s.request_work("p", 1, 1000.0)
    assert c.prompt_id == a.prompt_id  # the expired prompt is offered again
    s.check_invariants()


def test_wrong_sample_count_is_rejected_and_reissued():
    s = make(batch=1, round_size=4)
    (a,) = s.request_work("p", 1, 0.0)
    assert submit(s, a, [1, 0]).status == "rejected"
    (b,) = s.request_work("p", 1, 0.0)
    assert b.prompt_id == a.prompt_id and b.round_id > a.round_id
    assert s.metrics()["results_rejected"] == 1 and s.metrics()["rounds_reissued"] == 1


@pytest.mark.parametrize("unresolved", ["drop", "keep"])
def test_unresolved_with_signal_is_released_partial(unresolved):
    s = make(batch=1, round_size=2, max_rounds=2, unresolved=unresolved, downsample="first")
    (a,) = s.request_work("p", 1, 0.0)
    submit(s, a, [1, 0])
    (b,) = s.request_work("p", 1, 0.0)
    g = submit(s, b, [0, 0]).group
    assert not g.resolved and [x.reward for x in g.samples] == [1, 0, 0, 0] and g.advantages == [0.75] + [-0.25] * 3
    assert s.metrics()["released_partial"] == 1


def test_unresolved_zero_variance_drop_or_keep():
    s = make(batch=1, round_size=4, max_rounds=1, unresolved="drop")
    (a,) = s.request_work("p", 1, 0.0)
    out = submit(s, a, [0, 0, 0, 0])
    assert out.dropped and s.metrics()["dropped_unresolved"] == 1 and s.metrics()["active"] == 0
    s = make(batch=1, round_size=4, max_rounds=1, unresolved="keep")
    (a,) = s.request_work("p", 1, 0.0)
    g = submit(s, a, [0, 0, 0, 0]).group
    assert not g.resolved and g.advantages == [0.0] * 4 and s.metrics()["released_partial"] == 1
    s.check_invariants()


def test_pos_rule_all_positive_is_zero_variance():
    s = make(batch=1, exit_rule="pos", round_size=4, unresolved="drop")
    (a,) = s.request_work("p", 1, 0.0)
    assert submit(s, a, [1, 1, 1, 1]).dropped
    assert s.metrics()["dropped_zero_variance"] == 1
    (b,) = s.request_work("p", 1, 0.0)  # a freed slot admits the next prompt
    g = submit(s, b, [0, 0, 1, 0]).group
    assert g.resolved and [x.reward for x in g.samples] == [0, 0, 1, 0]  # 1 positive + 3 negatives


def test_fixed_is_one_round_of_n_with_group_stats():
    s = make(batch=1, exit_rule="fixed", group_size=4, round_size=8, normalize_std=True)
    (a,) = s.request_work("p", 1, 0.0)
    assert a.num_samples == 4
    g = submit(s, a, [1, 0, 0, 1]).group
    std = math.sqrt(1 / 3)
    assert g.advantages == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert (g.pool_size, g.num_rounds) == (4, 1)


def test_stale_results_are_evicted_on_arrival():
    s = make(batch=1, max_staleness=1, round_size=2, max_rounds=2)
    (a,) = s.request_work("p", 1, 0.0)
    s.set_learner_version(2, 0.0)  # a was issued at 0: aborted
    (b,) = s.request_work("p", 1, 0.0)
    out = s.submit_result("p", b.round_id, TOK, [smp(1, 0), smp(0, 1)], 1.0)  # v0 is 2 behind: evicted
    assert out.num_evicted == 1 and s.metrics()["stale_evictions"] == 1
    assert submit(s, a, [1, 0], version=2).status == "late"
    s.check_invariants()


def test_version_bump_evicts_refunds_reopens_and_aborts():
    s = make(batch=2, max_staleness=0, round_size=2, max_rounds=2, downsample="first")
    a, b = s.request_work("p", 2, 0.0)
    submit(s, a, [1, 0])  # balance with n = 4 needs 2 + 2: a waits for round 2
    submit(s, a2 := s.request_work("p", 1, 0.0)[0], [0, 1])
    assert s.groups_waiting == 1 and a2.prompt_id == a.prompt_id
    submit(s, b, [1, 0])
    assert s.set_learner_version(1, 0.0) == []  # nothing in flight
    m = s.metrics()
    assert m["reopened"] == 1 and m["groups_waiting"] == 0 and m["stale_evictions"] == 6 and m["active"] == 2
    c, d = s.request_work("p", 2, 0.0)
    assert (c.prompt_id, d.prompt_id) == (a.prompt_id, b.prompt_id)  # oldest admitted first
    assert s.set_learner_version(2, 0.0) == [c.round_id, d.round_id]
    assert s.set_learner_version(1, 0.0) == []  # versions only go up
    assert s.metrics()["rounds_aborted"] == 2
    s.check_invariants()


def test_take_batch_is_fifo_and_checks_staleness():
    s = make(batch=3, max_staleness=1, round_size=4, max_rounds=1, unresolved="keep")
    work = s.request_work("p", 3, 0.0)
    for a in reversed(work):
        submit(s, a, [1, 1, 0, 0])
    s.set_learner_version(1, 0.0)
    groups = s.take_batch(1, 2)
    assert [g.prompt_id for g in groups] == [work[2].prompt_id, work[1].prompt_id]
    assert s.metrics()["groups_consumed"] == 2
    s.set_learner_version(2, 0.0)
    assert s.take_batch(2, 1) is None  # v0 samples are 2 behind: the last group was re-opened
    assert s.metrics()["reopened"] == 1 and s.metrics()["active"] == 1
    with pytest.raises(ValueError, match="num_groups"):
        s.take_batch(2, 0)


def test_max_rounds_in_flight_cap():
    s = make(batch=8, max_rounds_in_flight=3, round_size=4)
    assert len(s.request_work("p", 10, 0.0)) == 3
    assert s.request_work("q", 10, 0.0) == []


def test_silent_producer_loses_its_rounds():
    s = make(batch=2, heartbeat_timeout_s=5.0, lease_s=100.0)
    a, b = s.request_work("p", 1, 0.0) + s.request_work("q", 1, 0.0)
    s.heartbeat("q", 4.0)
    assert s.expire(4.0) == []
    assert s.expire(6.0) == [a.round_id]  # p silent 6 s; q heard at 4
    assert s.metrics()["producers_alive"] == 1
    s.heartbeat("q", 100.0)
    assert s.expire(99.0) == [] and s.expire(100.5) == [b.round_id]  # q is alive but its 100 s lease ran out


def test_epochs_wrap_with_fresh_prompt_ids():
    s = Scheduler(SamplingConfig(round_size=4), BufferConfig(unresolved="drop"), 1, PROMPTS[:2], seed=0)
    seen = []
    for _ in range(5):
        (a,) = s.request_work("p", 1, 0.0)
        seen.append((a.prompt_id, a.prompt))
        assert submit(s, a, [0, 0, 0, 0]).status == "accepted"
        for _ in range(3):
            (a,) = s.request_work("p", 1, 0.0)
            submit(s, a, [0, 0, 0, 0])
    assert seen == [(0, "q0"), (1, "q1"), (2, "q0"), (3, "q1"), (4, "q0")]
    assert s.metrics()["epoch"] == 2 and s.metrics()["dropped_unresolved"] == 5


def test_snapshot_restore_resumes_identically():
    cfg = {"batch": 2, "round_size": 2, "max_rounds": 3, "downsample": "random"}

    def drive(s, rng, steps):
        taken = []
        for _ in range(steps):
            for a in s.request_work("p", 2, 0.0):
                submit(s, a, [rng.random() < 0.5 for _ in range(2)], version=s.learner_version)
            if s.groups_waiting:  # the learner at version v trains one group and publishes v + 1
                taken += s.take_batch(s.learner_version, 1)
                s.set_learner_version(s.learner_version + 1, 0.0)
        return [(g.prompt_id, [x.reward for x in g.samples], g.advantages) for g in taken]

    s1, rng = make(**cfg), random.Random(1)
    assert drive(s1, rng, 5)
    data, rng_state, m1 = s1.snapshot(), rng.getstate(), s1.metrics()
    rest = drive(s1, rng, 10)
    s2 = Scheduler.restore(data, s1.sampling, s1.buffer, 2, PROMPTS)
    assert s2.metrics() == {**m1, "producers_alive": 0}  # nothing was in flight; producers re-register
    rng.setstate(rng_state)
    assert rest and drive(s2, rng, 10) == rest
    s2.check_invariants()


def test_restore_reissues_rounds_in_flight_and_validates():
    s = make(batch=2, round_size=2)
    a, b = s.request_work("p", 2, 0.0)
    data = s.snapshot()
    r = Scheduler.restore(data, s.sampling, s.buffer, 2, PROMPTS)
    assert r.metrics()["rounds_in_flight"] == 0 and r.metrics()["rounds_reissued"] == 2
    assert [x.prompt_id for x in r.request_work("p", 5, 0.0)[:2]] == [a.prompt_id, b.prompt_id]
    assert submit(r, a, [1, 0]).status == "late"
    with pytest.raises(ValueError, match="prompts"):
        Scheduler.restore(data, s.sampling, s.buffer, 2, PROMPTS[:3])
    with pytest.raises(ValueError, match="group_size"):
        Scheduler.restore(data, SamplingConfig(group_size=2), s.buffer, 2, PROMPTS)
    kpos = [SamplingConfig(group_size=s.sampling.group_size, exit_rule="kpos", exit_rule_params={"k": k})
            for k in (1, 2)]
    data = make(batch=2, round_size=2, exit_rule="kpos", exit_rule_params={"k": 1}).snapshot()
    with pytest.raises(ValueError, match="exit_rule_params"):  # the rule's settings count, not only its name
        Scheduler.restore(data, kpos[1], s.buffer, 2, PROMPTS)
    assert Scheduler.restore(data, kpos[0], s.buffer, 2, PROMPTS)
    with pytest.raises(ValueError, match="snapshot"):
        Scheduler.restore(b"\x01\x02", s.sampling, s.buffer, 2, PROMPTS)


def test_constructor_and_request_errors():
    with pytest.raises(ValueError, match="batch_size"):
        Scheduler(SamplingConfig(), BufferConfig(), 0, PROMPTS, 0)
    with pytest.raises(ValueError, match="prompt"):
        Scheduler(SamplingConfig(), BufferConfig(), 1, [], 0)
    with pytest.raises(ValueError, match="max_rounds"):
        make().request_work("p", -1, 0.0)


def test_reopened_group_is_released_again_from_its_fresh_samples():
    s = make(batch=1, max_staleness=1, round_size=4, max_rounds=3, downsample="first")
    (a,) = s.request_work("p", 1, 0.0)
    submit(s, a, [1, 0, 0, 0], version=0)
    s.set_learner_version(1, 0.0)
    (b,) = s.request_work("p", 1, 0.0)
    g = submit(s, b, [1, 1, 0, 0], version=1).group
    assert [x.version for x in g.samples] == [0, 0, 0, 1]  # "first" kept round 1's samples
    s.set_learner_version(2, 0.0)  # v0 is now 2 behind: re-open, evict round 1, and round 2 alone suffices
    m = s.metrics()
    assert (m["reopened"], m["released"], m["groups_waiting"], m["stale_evictions"]) == (1, 2, 1, 4)
    (g2,) = s.take_batch(2, 1)
    assert g2.prompt_id == g.prompt_id and [x.reward for x in g2.samples] == [1, 1, 0, 0]
    assert (g2.pool_size, g2.num_rounds, g2.advantages) == (4, 1, [0.5, 0.5, -0.5, -0.5])
    assert submit(s, b, [1, 1, 0, 0]).status == "late"  # handed off: its prompt is gone, so not "duplicate"
    s.check_invariants()


def test_only_set_learner_version_moves_the_version_and_it_returns_the_aborts():
    s = make(batch=1, max_staleness=0, round_size=4)
    (a,) = s.request_work("p", 1, 0.0)
    with pytest.raises(ValueError, match="set_learner_version"):
        s.take_batch(1, 1)  # a learner ahead of the scheduler: the version is not moved behind its back
    assert s.learner_version == 0 and s.metrics()["rounds_aborted"] == 0
    assert s.set_learner_version(1, 0.0) == [a.round_id] and s.set_learner_version(1, 0.0) == []
    assert s.take_batch(1, 1) is None and s.take_batch(0, 1) is None  # a learner behind may still ask


def test_rounds_lost_to_staleness_are_refunded_but_capped():
    """A hard prompt whose samples keep going stale gets its rounds back, but not more than
    MAX_ROUNDS_FACTOR x max_rounds accepted rounds in all: then it is settled (dropped here, all negative)."""
    from pipeline.buffer.scheduler import MAX_ROUNDS_FACTOR

    s = make(batch=1, max_staleness=0, round_size=4, max_rounds=2)
    version = 0
    for i in range(MAX_ROUNDS_FACTOR * 2):
        (a,) = s.request_work("p", 1, 0.0)
        out = submit(s, a, [0, 0, 0, 0], version=version)
        assert out.accepted
        if i < MAX_ROUNDS_FACTOR * 2 - 1:
            assert s.metrics()["active"] == 1
            version += 1
            s.set_learner_version(version, 0.0)  # the pool goes stale: the round is refunded
    m = s.metrics()
    assert m["dropped_unresolved"] == 1 and m["rounds_to_exit"] == {}
    assert m["samples_received"] == 4 * MAX_ROUNDS_FACTOR * 2
    s.check_invariants()


def test_empty_or_repeatedly_rejected_results_give_up_on_the_prompt():
    from pipeline.buffer.scheduler import MAX_REJECTIONS

    s = make(batch=2, round_size=4)
    a, b = s.request_work("p", 2, 0.0)
    out = s.submit_result("p", a.round_id, TOK, [], now=1.0)  # the producer cannot serve this prompt
    assert out.status == "rejected" and out.dropped
    for _ in range(MAX_REJECTIONS):
        (rb,) = [r for r in s.request_work("p", 2, 0.0) if r.prompt_id == b.prompt_id] or [b]
        out = s.submit_result("p", rb.round_id, TOK, rounds([1, 0]), now=1.0)  # wrong count: 2 of 4
        assert out.status == "rejected"
    assert out.dropped
    m = s.metrics()
    assert m["prompts_unservable"] == 2 and m["dropped_unresolved"] == 2 and m["results_rejected"] == 1 + MAX_REJECTIONS
    s.check_invariants()


def test_reject_reissues_the_round_and_gives_up_after_max_rejections():
    from pipeline.buffer.scheduler import MAX_REJECTIONS

    s = make(batch=1, round_size=4)
    (a,) = s.request_work("p", 1, 0.0)
    assert s.reject("p", 10**6, 1.0).status == "unknown" and s.reject("p", a.round_id, 1.0).status == "rejected"
    assert s.reject("p", a.round_id, 1.0).status == "late"  # no longer in flight
    for i in range(1, MAX_REJECTIONS):
        (b,) = s.request_work("p", 1, 0.0)
        assert b.prompt_id == a.prompt_id  # re-issued, under a new id
        out = s.reject("p", b.round_id, 1.0)
        assert out.status == "rejected" and out.dropped == (i == MAX_REJECTIONS - 1)
    m = s.metrics()
    assert m["results_rejected"] == MAX_REJECTIONS and m["prompts_unservable"] == 1 and m["active"] == 0
    s.check_invariants()
