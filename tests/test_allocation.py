"""Allocation policies (pipeline/buffer/policy/allocation.py) and the posterior behind them (posterior.py): round sizes,
budgets, deferral with bounded retries, the per-example history across epochs and snapshots."""

import numpy as np
import pytest

from pipeline.buffer import Scheduler
from pipeline.buffer.policy.allocation import ALLOCATIONS, MAX_DEFERRALS, Est, MinCost, Prior, make_allocation
from pipeline.buffer.policy.exit_rules import Balance, make_exit_rule
from pipeline.buffer.policy.posterior import outlook
from pipeline.buffer.state import History, PromptState
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.config.base import allowed_values, fields
from pipeline.protocol import Sample

TOK = np.array([1], np.int32)


def smp(reward, version=0):
    return Sample(np.zeros(1, np.int32), np.zeros(1, np.float32), float(reward), version, "stop")


def state(pos=0, neg=0):
    st = PromptState(0, 0, "q", "a", admitted_at=0.0, admitted_order=0)
    st.add_round(0, [smp(1)] * pos + [smp(0)] * neg, 0.5)
    return st


def test_registry_matches_the_config_choices():
    choices = allowed_values(fields(SamplingConfig)["allocation"].type)
    assert ALLOCATIONS == choices == ("uniform", "est", "min_cost")
    for name in ALLOCATIONS:
        assert make_allocation(SamplingConfig(allocation=name), make_exit_rule("balance")).name == name


def test_outlook_is_a_distribution_and_matches_a_known_pass_rate():
    look = outlook(1e5, 1e5, 0, 0, 32, Balance(), 4)  # p = 0.5 for sure: exit at 4 needs 2 + 2 of 4
    assert look.exit_at[4] == pytest.approx(6 / 16, abs=1e-3)
    assert sum(look.exit_at) + look.unresolved == pytest.approx(1.0)
    assert look.exit_by(3) == 0.0 and look.overshoot(4) == 0.0 and look.overshoot(5) == pytest.approx(6 / 16, 1e-3)
    hard = outlook(0.1, 40, 0, 0, 32, Balance(), 4)
    assert hard.unresolved > 0.9 and hard.useful < 0.1
    # 3 negatives: the first positive exits and the pool has a signal
    pos = outlook(1, 1, 0, 3, 5, make_exit_rule("pos"), 4)
    assert pos.useful == pytest.approx(1 - pos.unresolved)
    with pytest.raises(ValueError, match="Beta"):
        outlook(0, 1, 0, 0, 4, make_exit_rule("pos"), 4)


def test_est_asks_for_what_the_rule_needs_over_the_estimated_rate():
    est = Est(SamplingConfig(allocation="est"), make_exit_rule("balance"))
    even = History(pos=49, neg=49)  # with the Beta(1, 1) prior: p_hat = 50 / 100
    assert est.next_round(state(), even, Prior()) == 4  # 2 / 0.5 positives and 2 / 0.5 negatives
    hard = History(pos=9, neg=89)  # p_hat = 10 / 100
    assert est.next_round(state(), hard, Prior()) == 20
    assert est.next_round(state(0, 28), hard, Prior()) == 4  # clipped to what is left of the 32-sample budget
    assert est.next_round(state(2, 1), even, Prior()) == 2


def test_min_cost_sizes_rounds_from_the_posterior_and_respects_the_budget():
    mc = MinCost(SamplingConfig(allocation="min_cost"), make_exit_rule("balance"))
    sizes = {p: mc.next_round(state(), History(pos=200 * p, neg=200 * (1 - p)), Prior()) for p in (0.5, 0.2, 0.08)}
    assert 4 <= sizes[0.5] < sizes[0.2] < sizes[0.08] <= 32
    assert mc.next_round(state(0, 30), History(pos=1, neg=30), Prior()) <= 2
    assert mc.next_round(state(1, 2), History(pos=50, neg=50), Prior()) >= 1
    cheap_rounds = mc.next_round(state(), History(pos=40, neg=160), Prior(waste=1.0))
    assert cheap_rounds <= sizes[0.2]  # the more a cut sample costs, the smaller the round


def test_min_cost_defers_hopeless_examples_at_most_max_deferrals_in_a_row():
    mc = MinCost(SamplingConfig(allocation="min_cost"), make_exit_rule("balance"))
    prior = Prior.from_counts(30, 100, yield_rate=0.05)  # the run releases a group per 20 samples
    assert mc.admit(History(), prior)  # never seen: always tried once
    hopeless = History(pos=0, neg=400, visits=9)
    assert not mc.admit(hopeless, prior)
    assert mc.admit(History(pos=0, neg=400, visits=9, deferred=MAX_DEFERRALS), prior)
    assert mc.admit(History(pos=16, neg=16, visits=1), prior)
    assert mc.admit(hopeless, Prior.from_counts(30, 100))  # no yield measured yet: nothing is deferred


def test_min_cost_gives_up_on_a_visit_without_a_signal_that_is_not_worth_its_samples():
    mc = MinCost(SamplingConfig(allocation="min_cost"), make_exit_rule("balance"))
    prior = Prior.from_counts(30, 100, yield_rate=0.05)
    hard = History(pos=0, neg=300, visits=5)
    assert mc.give_up(state(0, 16), hard, prior)
    assert not mc.give_up(state(1, 15), hard, prior)  # a signal is there: go on toward the exit rule
    assert not mc.give_up(state(0, 4), History(pos=40, neg=40), prior)
    assert not mc.give_up(state(0, 16), hard, Prior.from_counts(30, 100))
    assert not Est(SamplingConfig(allocation="est"), make_exit_rule("balance")).give_up(state(0, 16), hard, prior)


def drive(s, p_of, steps, rng):
    """Every round answered sample by sample with rewards drawn from the example's pass rate."""
    for _ in range(steps):
        for a in s.request_work("p", 16, 0.0):
            example = int(a.prompt[1:])
            for i in range(a.num_samples):
                x = smp(rng.random() < p_of[example], s.learner_version)
                out = s.submit_samples("p", a.round_id, [i], [x], TOK, 0.0)
                if out.status != "accepted" or not s.in_flight(a.round_id):
                    break
        while s.groups_waiting:
            s.take_batch(s.learner_version, 1)
            s.set_learner_version(s.learner_version + 1, 0.0)
        s.check_invariants()


@pytest.mark.parametrize("policy", ALLOCATIONS)
def test_every_policy_resolves_prompts_and_min_cost_defers_the_unsolvable_one(policy):
    prompts = [(f"q{i}", str(i)) for i in range(6)]
    p_of = [0.5, 0.3, 0.0, 0.6, 0.4, 0.5]  # example 2 is never solved
    s = Scheduler(SamplingConfig(allocation=policy), BufferConfig(max_staleness=0), 1, prompts, seed=0)
    drive(s, p_of, 300, np.random.default_rng(0))
    m = s.metrics()
    assert m["groups_consumed"] > 20 and m["epoch"] >= 5
    hist = s.admission.history[2]
    if policy == "min_cost":
        assert hist.deferrals > 0 and m["deferred"] == sum(h.deferrals for h in s.admission.history.values())
        assert hist.visits >= m["epoch"] // (MAX_DEFERRALS + 1)  # retried at least every MAX_DEFERRALS + 1 epochs
        assert 0 < m["deferred_share"] < 1
    else:
        assert hist.deferrals == 0 and m["deferred"] == 0
    assert all(h.pos + h.neg > 0 for h in s.admission.history.values())


def test_history_survives_epochs_and_a_snapshot():
    prompts = [(f"q{i}", str(i)) for i in range(3)]
    s = Scheduler(SamplingConfig(allocation="min_cost"), BufferConfig(max_staleness=0), 1, prompts, seed=0)
    drive(s, [0.5, 0.0, 0.5], 60, np.random.default_rng(1))
    r = Scheduler.restore(s.snapshot(), s.sampling, s.buffer, 1, prompts)
    assert r.admission.history == s.admission.history and r.admission.cursor == s.admission.cursor
    assert (r.admission.positives, r.admission.samples) == (s.admission.positives, s.admission.samples)
    assert r.metrics()["deferred"] == s.metrics()["deferred"] and r.admission.deferrals == s.admission.deferrals
    restored = {k: v for k, v in r.metrics().items() if k != "producers_alive"}
    assert restored == {k: v for k, v in s.metrics().items() if k != "producers_alive"}


def test_grpo_takes_no_other_policy():
    with pytest.raises(ValueError, match="allocation"):
        SamplingConfig(exit_rule="fixed", allocation="min_cost")
