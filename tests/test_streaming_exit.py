"""Per-sample streaming exit (sampling.exit_check): samples of a round arriving one by one, the exit rule checked
as they join the pool, the rest of the round cut; exact waste accounting; round sizes and sample budgets."""

import numpy as np
import pytest

from pipeline.buffer import Scheduler
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample

TOK = np.array([7, 8], np.int32)
PROMPTS = [(f"q{i}", str(i)) for i in range(6)]


def smp(reward, length=1, version=0):
    return Sample(np.zeros(length, np.int32), np.zeros(length, np.float32), float(reward), version, "stop")


def make(batch=1, exit_check="prefix", **kw):
    s = {k: kw.pop(k) for k in list(kw) if k in SamplingConfig.__struct_fields__}
    sampling = SamplingConfig(**{"round_size": 8, "max_rounds": 4, "exit_check": exit_check, **s})
    return Scheduler(sampling, BufferConfig(**{"downsample": "first", **kw}), batch, PROMPTS, seed=0)


def send(s, a, index, reward, length=1, version=0):
    return s.submit_samples("p", a.round_id, [index], [smp(reward, length, version)], TOK, 1.0)


def test_prefix_holds_samples_until_the_prefix_fills_and_cuts_the_rest():
    s = make()
    (a,) = s.request_work("p", 1, 0.0)
    assert a.num_samples == 8
    for i, r in [(3, 1), (2, 0), (5, 1), (1, 0)]:  # index 0 is still running: nothing can join yet
        out = send(s, a, i, r, length=10)
        assert out.accepted and out.group is None and out.aborted == ()
    assert s.pools.active[a.prompt_id].pool == []
    out = send(s, a, 0, 1, length=10)  # prefix 0..3 = [1, 0, 0, 1]: balance holds at index 3
    g = out.group
    assert g is not None and g.resolved and [x.reward for x in g.samples] == [1, 0, 0, 1] and g.pool_size == 4
    assert out.aborted == (a.round_id,)  # indices 4, 6, 7 never arrived: the caller aborts them
    m = s.metrics()
    assert (m["samples_received"], m["samples_discarded"], m["tokens_discarded"]) == (5, 1, 10)  # index 5 held
    assert (m["rounds_cut"], m["samples_cut"], m["tokens_received"]) == (1, 3, 50)
    assert send(s, a, 4, 0).status == "late" and s.metrics()["samples_late"] == 1
    s.check_invariants()


def test_sample_mode_joins_in_arrival_order():
    s = make(exit_check="sample")
    (a,) = s.request_work("p", 1, 0.0)
    for i, r in [(7, 1), (6, 0), (5, 0)]:
        assert send(s, a, i, r).group is None
    out = send(s, a, 4, 1)
    assert [x.reward for x in out.group.samples] == [1, 0, 0, 1] and out.aborted == (a.round_id,)
    assert s.metrics()["samples_cut"] == 4 and s.metrics()["samples_discarded"] == 0
    s.check_invariants()


def test_round_mode_waits_for_the_whole_round():
    s = make(exit_check="round", round_size=4)
    (a,) = s.request_work("p", 1, 0.0)
    for i, r in [(0, 1), (1, 0), (2, 0)]:
        assert send(s, a, i, r).group is None and not s.pools.active[a.prompt_id].pool
    out = send(s, a, 3, 1)
    assert out.group.pool_size == 4 and out.aborted == ()
    s.check_invariants()


def test_a_round_that_ends_without_the_exit_queues_the_prompt_and_the_next_round_continues_the_pool():
    s = make(round_size=2, max_rounds=3)
    (a,) = s.request_work("p", 1, 0.0)
    send(s, a, 1, 0)
    assert send(s, a, 0, 0).group is None  # round complete: queued for round 2
    (b,) = s.request_work("p", 1, 0.0)
    assert b.prompt_id == a.prompt_id
    send(s, b, 0, 1)
    out = send(s, b, 1, 1)
    assert out.group.resolved and out.group.num_rounds == 2 and out.aborted == ()
    s.check_invariants()


def test_duplicates_bad_indices_and_whole_results_of_the_wrong_size():
    s = make(round_size=4)
    (a,) = s.request_work("p", 1, 0.0)
    assert send(s, a, 0, 0).accepted
    assert send(s, a, 0, 0).status == "duplicate" and s.metrics()["results_ignored"]["duplicate"] == 1
    assert send(s, a, 4, 0).status == "rejected"  # index beyond the round's 4 samples: re-issued
    (b,) = s.request_work("p", 1, 0.0)
    assert b.prompt_id == a.prompt_id and b.round_id != a.round_id
    assert s.submit_result("p", b.round_id, TOK, [smp(0)] * 3, 1.0).status == "rejected"
    assert s.submit_samples("p", 10**9, [0], [smp(0)], TOK, 1.0).status == "unknown"
    s.check_invariants()


def test_grpo_keeps_whole_rounds_whatever_exit_check_says():
    s = make(exit_rule="fixed", exit_check="sample", max_staleness=0)
    (a,) = s.request_work("p", 1, 0.0)
    assert a.num_samples == 4
    for i in range(3):
        assert send(s, a, i, i % 2).group is None and not s.pools.active[a.prompt_id].pool
    assert send(s, a, 3, 1).group.pool_size == 4


def test_cancelled_round_discards_its_held_samples_and_aborted_tokens_are_counted():
    s = make(max_staleness=0)
    (a,) = s.request_work("p", 1, 0.0)
    send(s, a, 2, 1, length=5)  # held: index 0 has not arrived
    assert s.set_learner_version(1, 0.0) == [a.round_id]  # stale: the round is cancelled
    m = s.metrics()
    assert (m["samples_discarded"], m["tokens_discarded"]) == (1, 5)
    s.report_aborted(a.round_id, 7, 300)
    s.report_aborted(10**9, 5, 5)  # never issued: ignored
    assert (s.metrics()["samples_aborted"], s.metrics()["tokens_aborted"]) == (7, 300)
    with pytest.raises(ValueError, match=">= 0"):
        s.report_aborted(a.round_id, -1, 0)
    s.check_invariants()


def test_length_metrics_show_what_the_groups_kept():
    s = make(exit_check="sample", round_size=6)
    (a,) = s.request_work("p", 1, 0.0)
    outs = [send(s, a, i, r, length=n) for i, (r, n) in enumerate([(1, 2), (1, 2), (1, 2), (0, 6), (0, 8)])]
    assert outs[-1].group is not None  # 3 positives, then the second negative
    m = s.metrics()
    assert m["kept_mean_len"] == pytest.approx((2 + 2 + 6 + 8) / 4) and m["pool_mean_len"] == pytest.approx(4.0)


def test_sample_budget_and_fair_share_of_rounds():
    s = make(batch=4, round_size=3, max_staleness=1)  # admission bound: 8 prompts
    assert [a.num_samples for a in s.request_work("p", 10, 0.0, max_samples=7)] == [3, 3]  # a third would be 9
    assert len(s.request_work("p", 10, 0.0, max_samples=1)) == 1  # the first round is given even if larger
    assert s.request_work("q", 0, 0.0) == []  # two producers ask for work: each may hold ceil(8 / 2) = 4 rounds
    assert len(s.request_work("p", 10, 0.0)) == 1 and len(s.request_work("q", 10, 0.0)) == 4
    assert s.metrics()["rounds_in_flight"] == 8
    with pytest.raises(ValueError, match="max_samples"):
        s.request_work("p", 1, 0.0, max_samples=-1)
    s.check_invariants()
