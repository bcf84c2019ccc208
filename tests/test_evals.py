"""Evaluation rounds (pipeline/buffer/evals.py), pure and on a fake clock: per-benchmark Ave@k and pass@k rows,
rows in version order whatever order evaluations finish in, lost rounds re-issued under new ids, results that are
late or unknown ignored, and round ids shared with the Scheduler."""

import math

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.buffer import RoundIds, Scheduler
from pipeline.buffer.evals import Evals, pass_at_k
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.prompts import Prompt

PROMPTS = [Prompt(f"p{i}", str(i), "small" if i < 2 else "large") for i in range(6)]


def evals(k=4, lease_s=10.0, ids=None, prompts=PROMPTS):
    return Evals(prompts, k, lease_s, max_new_tokens=4096, threshold=0.5, round_ids=ids or RoundIds())


def result(rewards):
    return [P.Sample(np.zeros(1, np.int32), np.zeros(1, np.float32), float(r), 0, "stop") for r in rewards]


def answer_all(e, rounds, correct):
    """Answer every round; problem i gets `correct[i]` correct samples out of k."""
    for a in rounds:
        assert e.submit(a.round_id, result([1] * correct[a.prompt_id] + [0] * (e.k - correct[a.prompt_id])), 5.0) \
            == "accepted"


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    assert pass_at_k(2, 1, 4) == 1.0  # fewer samples than k: any correct one counts


def test_rounds_carry_kind_k_and_max_new_tokens_and_a_row_per_benchmark():
    e = evals()
    assert e.start(0, now=1.0) and not e.start(0, now=2.0)  # once per version
    rounds = e.take(100, "p0", now=1.0)
    assert [a.prompt_id for a in rounds] == list(range(6)) and e.available == 0
    assert all(a.kind == "eval" and a.num_samples == 4 and a.max_new_tokens == 4096 and a.lease_s == 10.0
               for a in rounds)
    assert [a.prompt for a in rounds] == [p.text for p in PROMPTS] and len({a.round_id for a in rounds}) == 6
    correct = [4, 0, 1, 2, 0, 0]
    answer_all(e, rounds[:-1], correct)
    assert e.pop_rows() == [] and e.in_progress() == [{"version": 0, "done": 5, "problems": 6}]
    answer_all(e, rounds[-1:], correct)
    (row,) = e.pop_rows()
    assert e.outstanding == 0 and e.pop_rows() == []
    assert row["version"] == 0 and row["k"] == 4 and row["problems"] == 6 and row["failed"] == 0
    assert row["seconds"] == 4.0  # started at 1.0, last result at 5.0
    assert row["accuracy"] == pytest.approx(sum(correct) / 4 / 6)  # Ave@4 over all problems
    assert row["pass_at_k"] == pytest.approx(3 / 6)  # problems with at least one correct sample
    assert row["correct"] == correct  # per problem, in the held-out set's order: rows pair problem by problem
    assert row["benchmarks"] == {
        "small": {"problems": 2, "ave_at_k": pytest.approx(0.5), "pass_at_k": pytest.approx(0.5)},
        "large": {"problems": 4, "ave_at_k": pytest.approx(3 / 16), "pass_at_k": pytest.approx(0.5)},
    }
    # overall = size-weighted over the benchmarks
    b = row["benchmarks"]
    assert row["accuracy"] == pytest.approx((2 * b["small"]["ave_at_k"] + 4 * b["large"]["ave_at_k"]) / 6)


def test_rows_come_out_in_version_order_when_evaluations_finish_out_of_order():
    e = evals(k=1)
    e.start(0, 0.0)
    first = e.take(3, "p0", 0.0)  # version 0 is half done ...
    e.start(30, 1.0)
    e.start(60, 2.0)
    rest = e.take(100, "p1", 2.0)
    late_v0, v30, v60 = rest[:3], rest[3:9], rest[9:]  # the oldest evaluation's rounds are handed out first
    assert [a.prompt_id for a in late_v0] == [3, 4, 5] and len(rest) == 3 + 6 + 6
    answer_all(e, v60, [1] * 6)  # ... while 60, then 30 finish first
    assert e.pop_rows() == []
    answer_all(e, v30, [0] * 6)
    assert e.pop_rows() == []  # 30 and 60 are held until 0 is written
    answer_all(e, first + late_v0, [1, 0, 1, 0, 1, 0])
    assert [(r["version"], r["accuracy"]) for r in e.pop_rows()] == [(0, 0.5), (30, 0.0), (60, 1.0)]


def test_lost_rounds_are_reissued_under_new_ids_and_their_late_results_ignored():
    e = evals(lease_s=10.0)
    e.start(5, 0.0)
    a, b, *others = e.take(100, "p0", 0.0)
    answer_all(e, others, [0, 0, 1, 1, 1, 1])
    silent = set()
    assert e.expire(5.0, silent.__contains__) == []
    silent.add("p0")  # its producer went silent: both rounds it holds are lost
    assert e.expire(6.0, silent.__contains__) == [a.round_id, b.round_id]
    assert e.available == 2 and e.counts["rounds_reissued"] == 2
    assert e.submit(a.round_id, result([1, 1, 1, 1]), 7.0) == "late"  # its replacement counts, not this
    a2, b2 = e.take(5, "p1", 7.0)
    assert (a2.prompt_id, b2.prompt_id) == (a.prompt_id, b.prompt_id) and a2.round_id > b.round_id
    assert e.expire(17.5, lambda p: False) == [a2.round_id, b2.round_id]  # the lease passed
    a3, b3 = e.take(5, "p1", 18.0)
    answer_all(e, [a3, b3], [4, 0])
    assert e.submit(b2.round_id, result([1] * 4), 20.0) == "late"
    assert e.submit(10**9, result([1]), 20.0) == "unknown"
    (row,) = e.pop_rows()
    assert row["pass_at_k"] == pytest.approx(5 / 6) and row["accuracy"] == pytest.approx((4 + 4 * 1) / 4 / 6)
    assert (e.counts["results_late"], e.counts["results_unknown"]) == (2, 1)


def test_an_empty_result_counts_the_problem_as_failed_and_unsolved():
    e = evals(k=2, prompts=PROMPTS[:2])
    e.start(0, 0.0)
    a, b = e.take(2, "p0", 0.0)
    assert e.submit(a.round_id, [], 1.0) == "accepted"
    assert e.submit(b.round_id, result([1, 0]), 1.0) == "accepted"
    (row,) = e.pop_rows()
    assert row["failed"] == 1 and row["accuracy"] == 0.25 and row["pass_at_k"] == 0.5


def test_round_ids_are_shared_with_the_scheduler():
    ids = RoundIds()
    s = Scheduler(SamplingConfig(round_size=2), BufferConfig(), 4, [("q", "1")] * 4, seed=0, round_ids=ids)
    e = evals(ids=ids)
    e.start(0, 0.0)
    mixed = s.request_work("p", 2, 0.0) + e.take(2, "p", 0.0) + s.request_work("p", 2, 0.0)
    assert [a.round_id for a in mixed] == list(range(6)) and ids.next_id == 6
    assert not e.owns(mixed[0].round_id) and e.owns(mixed[2].round_id)
    assert e.submit(mixed[0].round_id, result([1, 1, 1, 1]), 1.0) == "late"  # a training id: not an eval round
    assert s.submit_result("p", mixed[2].round_id, np.zeros(1, np.int32), result([1, 0]), 1.0).status == "late"


def test_no_held_out_prompts_means_no_evaluation():
    e = evals(prompts=[])
    assert not e.start(0, 0.0) and e.take(8, "p", 0.0) == [] and e.outstanding == 0
    with pytest.raises(ValueError, match="eval.k"):
        evals(k=0)


def test_every_evaluation_samples_a_problem_with_the_same_seeds():
    """Common random numbers: a problem's rounds carry its index as their seed key, in every evaluation and every
    re-issue, and the engine's seeds follow the key, not the (always new) round id."""
    from pipeline.producer.engine import round_seed

    e = evals()
    e.start(0, 0.0)
    first = e.take(100, "p0", 0.0)
    e.start(5, 1.0)
    second = e.take(100, "p0", 1.0)
    assert [a.seed_key for a in first] == [a.seed_key for a in second] == list(range(len(PROMPTS)))
    assert {a.round_id for a in first}.isdisjoint(a.round_id for a in second)
    seeds = [round_seed(0, a.round_id, a.seed_key) for a in first]
    assert seeds == [round_seed(0, a.round_id, a.seed_key) for a in second] and len(set(seeds)) == len(seeds)
    # training rounds (no key) still get a seed per round id, apart from the keys' seeds
    assert round_seed(0, 3) != round_seed(0, 4) and round_seed(0, 3) != round_seed(0, 99, 3)
