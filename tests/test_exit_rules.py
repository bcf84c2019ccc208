"""Exit rules as objects (pipeline/buffer/exit_rules.py): each rule's condition, round size, eviction and
advantages, the registry that `sampling.exit_rule` picks from, and a new rule plugged in without touching the
Scheduler."""

import numpy as np
import pytest

from pipeline.buffer import Scheduler, group_advantages, pool_advantages
from pipeline.buffer.exit_rules import EXIT_RULES, RULES, Balance, ExitRule, Fixed, Pos, exit_reached, make_exit_rule
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample


def test_registry_names_every_rule_and_make_picks_by_name():
    assert EXIT_RULES == ("balance", "pos", "fixed")
    assert {name: type(make_exit_rule(name)) for name in EXIT_RULES} == {"balance": Balance, "pos": Pos, "fixed": Fixed}
    assert all(issubclass(cls, ExitRule) and cls.name == name for name, cls in RULES.items())
    with pytest.raises(ValueError, match="balance, pos, fixed"):
        make_exit_rule("both")


@pytest.mark.parametrize("pos,neg,n", [(a, b, n) for n in (2, 3, 4) for a in range(5) for b in range(5)])
def test_each_rule_matches_its_definition(pos, neg, n):
    assert Balance().reached(pos, neg, n) == (pos >= n // 2 and neg >= n - n // 2)
    assert Pos().reached(pos, neg, n) == (pos >= 1)
    assert Fixed().reached(pos, neg, n) == (pos + neg >= n)
    for name in EXIT_RULES:
        assert exit_reached(pos, neg, name, n) == make_exit_rule(name).reached(pos, neg, n)


def test_round_size_whole_rounds_and_advantages():
    sampling = SamplingConfig(round_size=8, group_size=4)
    assert Balance().round_size(sampling) == Pos().round_size(sampling) == 8
    assert Fixed().round_size(sampling) == 4  # GRPO: one round of exactly n
    assert Fixed.whole_rounds and not Balance.whole_rounds and not Pos.whole_rounds
    pool = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert Balance().advantages(pool, [0, 1, 2, 4], False) == pool_advantages(pool, [0, 1, 2, 4], False)
    group = [1.0, 0.0, 0.0, 1.0]
    assert Fixed().advantages(group, [0, 1, 2, 3], True) == group_advantages(group, True)


class AtLeastTwo(ExitRule):
    """A rule written for this test: two positives, whatever the negatives."""

    name = "two_pos"

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= 2


def test_a_new_rule_is_a_class_and_a_registry_entry(monkeypatch):
    monkeypatch.setitem(RULES, AtLeastTwo.name, AtLeastTwo)
    s = Scheduler(SamplingConfig(round_size=4, group_size=4, exit_rule="two_pos"), BufferConfig(downsample="first"),
                  1, [("q", "1")], seed=0)
    assert isinstance(s.rule, AtLeastTwo)
    (a,) = s.request_work("p", 1, 0.0)
    samples = [Sample(np.array([i], np.int32), np.zeros(1, np.float32), r, 0, "stop") for i, r in
               enumerate([1.0, 0.0, 0.0, 0.0])]
    assert s.submit_result("p", a.round_id, np.zeros(1, np.int32), samples, 0.0).group is None  # one positive
    (b,) = s.request_work("p", 1, 0.0)
    samples = [Sample(np.array([9], np.int32), np.zeros(1, np.float32), r, 0, "stop") for r in [1.0, 0.0, 0.0, 0.0]]
    group = s.submit_result("p", b.round_id, np.zeros(1, np.int32), samples, 0.0).group
    assert group is not None and group.resolved and sum(x.reward for x in group.samples) == 2
    s.check_invariants()
