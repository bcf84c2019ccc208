"""Exit rules as objects (pipeline/buffer/policy/exit_rules.py): each rule's condition, round size, eviction and
advantages, the registry that `sampling.exit_rule` picks from, and a new rule plugged in without touching the
Scheduler."""

import numpy as np
import pytest

from pipeline.buffer import Scheduler, group_advantages, pool_advantages
from pipeline.buffer.policy.exit_rules import (
    EXIT_RULES,
    RULES,
    Balance,
    ExitRule,
    Fixed,
    KPos,
    Mixed,
    Pos,
    exit_reached,
    make_exit_rule,
)
from pipeline.config import BufferConfig, SamplingConfig
from pipeline.protocol import Sample


def test_registry_names_every_rule_and_make_picks_by_name():
    assert EXIT_RULES == ("balance", "pos", "mixed", "kpos", "fixed")
    assert {name: type(make_exit_rule(name)) for name in EXIT_RULES} == {"balance": Balance, "pos": Pos,
                                                                           "mixed": Mixed, "kpos": KPos,
                                                                           "fixed": Fixed}
    assert all(issubclass(cls, ExitRule) and cls.name == name for name, cls in RULES.items())
    with pytest.raises(ValueError, match="balance, pos, mixed, kpos, fixed"):
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
    assert Balance().nominal_round(sampling) == Pos().nominal_round(sampling) == 8
    assert Fixed().nominal_round(sampling) == 4  # GRPO: one round of exactly n
    assert Fixed.whole_rounds and not Balance.whole_rounds and not Pos.whole_rounds
    pool = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert Balance().advantages(pool, [0, 1, 2, 4], False) == pool_advantages(pool, [0, 1, 2, 4], False)
    group = [1.0, 0.0, 0.0, 1.0]
    assert Fixed().advantages(group, [0, 1, 2, 3], True) == group_advantages(group, True)


class AtLeastTwo(ExitRule):
    """A rule written for this test: two positives, whatever the negatives."""

    name = "two_pos"
    summary = "two positives"

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= 2


def test_a_new_rule_is_a_class_and_a_registry_entry(monkeypatch):
    """The config accepts the new name (and documents it) without any edit of the schema."""
    from pipeline.config import reference_markdown

    monkeypatch.setitem(RULES, AtLeastTwo.name, AtLeastTwo)
    assert '"two_pos" (two positives)' in reference_markdown()
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


def test_the_config_offers_exactly_the_registered_rules():
    from pipeline.config.base import allowed_values, fields

    assert allowed_values(fields(SamplingConfig)["exit_rule"].type) == EXIT_RULES


@pytest.mark.parametrize("pos,neg", [(a, b) for a in range(4) for b in range(4)])
def test_mixed_needs_one_of_each_class(pos, neg):
    rule = Mixed()
    assert rule.reached(pos, neg, 4) == (pos >= 1 and neg >= 1)
    more_pos, more_neg = rule.needed(pos, neg, 4)
    assert rule.reached(pos + more_pos, neg + more_neg, 4)
    assert more_pos == 0 or not rule.reached(pos + more_pos - 1, neg + more_neg, 4)


def test_mixed_releases_a_lopsided_group_balance_would_keep_sampling():
    """1 positive and 3 negatives: `mixed` releases the group after one round, `balance` (n // 2 each) does not;
    `pos` would have released an all-positive round too, `mixed` does not."""
    rounds = {"mixed": [1.0, 0.0, 0.0, 0.0], "balance": [1.0, 0.0, 0.0, 0.0]}
    for rule, rewards in rounds.items():
        s = Scheduler(SamplingConfig(round_size=4, group_size=4, exit_rule=rule), BufferConfig(downsample="first"),
                      1, [("q", "1")], seed=0)
        (a,) = s.request_work("p", 1, 0.0)
        samples = [Sample(np.array([i], np.int32), np.zeros(1, np.float32), r, 0, "stop")
                   for i, r in enumerate(rewards)]
        group = s.submit_result("p", a.round_id, np.zeros(1, np.int32), samples, 0.0).group
        assert (group is not None) == (rule == "mixed")
        if group is not None:
            assert group.resolved and group.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25])
        s.check_invariants()
    s = Scheduler(SamplingConfig(round_size=4, group_size=4, exit_rule="mixed"), BufferConfig(downsample="first"),
                  1, [("q", "1")], seed=0)
    (a,) = s.request_work("p", 1, 0.0)
    samples = [Sample(np.array([i], np.int32), np.zeros(1, np.float32), 1.0, 0, "stop") for i in range(4)]
    assert s.submit_result("p", a.round_id, np.zeros(1, np.int32), samples, 0.0).group is None  # all right: sample on


def test_rules_are_values_and_key_the_posterior_cache():
    from pipeline.buffer.policy.posterior import outlook

    assert Balance() == Balance() and hash(Balance()) == hash(Balance()) and Balance() != Pos()
    assert outlook(2.0, 2.0, 0, 0, 16, Mixed(), 4) is outlook(2.0, 2.0, 0, 0, 16, Mixed(), 4)  # cached by value
    easy, mixed = outlook(2.0, 2.0, 0, 0, 16, Balance(), 4), outlook(2.0, 2.0, 0, 0, 16, Mixed(), 4)
    assert mixed.exit_by(4) >= easy.exit_by(4)  # one of each comes no later than two of each


def test_a_rules_config_errors_are_the_configs_load_errors():
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="allocation"):
        SamplingConfig(exit_rule="fixed", allocation="est").check()
    with pytest.raises(ConfigError, match="round_size"):
        SamplingConfig(exit_rule="mixed", round_size=1, max_rounds=2, group_size=4).check()
    SamplingConfig(exit_rule="fixed", round_size=1, max_rounds=1, group_size=4).check()  # its round is n


def test_a_rules_settings_come_from_exit_rule_params_and_unknown_ones_are_load_errors():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"sampling.exit_rule_params: exit rule 'balance' has no setting k; it "
                                          r"takes none"):
        load_config(None, ["--sampling.exit_rule_params", "{k = 3}"])
    with pytest.raises(ValueError, match="has no setting"):
        make_exit_rule("pos", {"k": 1})


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("pos,neg", [(a, b) for a in range(5) for b in range(5)])
def test_kpos_waits_for_k_positives_whatever_the_negatives(k, pos, neg):
    rule = KPos(k=k)
    assert rule.reached(pos, neg, 4) == (pos >= k)
    more_pos, more_neg = rule.needed(pos, neg, 4)
    assert more_neg == 0 and rule.reached(pos + more_pos, neg, 4)
    assert more_pos == 0 or not rule.reached(pos + more_pos - 1, neg + 10, 4)  # the fewest
    assert KPos(k=k) == KPos(k=k) and KPos(k=k) != KPos(k=k + 1) and hash(KPos(k=k)) == hash(KPos(k=k))


def test_kpos_takes_k_from_the_config_and_releases_once_k_positives_joined():
    from pipeline.config import ConfigError, load_config

    cfg = load_config(None, ["--sampling.exit_rule", "kpos", "--sampling.exit_rule_params", "{k = 3}",
                             "--sampling.round_size", "4", "--sampling.group_size", "4"])
    s = Scheduler(cfg.sampling, BufferConfig(downsample="first"), 1, [("q", "1")], seed=0)
    assert s.rule == KPos(k=3) and s.policy.rule is s.rule
    rounds = [[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]  # 2 positives after one round, 3 after two
    for i, rewards in enumerate(rounds):
        (a,) = s.request_work("p", 1, 0.0)
        samples = [Sample(np.array([i, j], np.int32), np.zeros(2, np.float32), r, 0, "stop")
                   for j, r in enumerate(rewards)]
        group = s.submit_result("p", a.round_id, np.zeros(1, np.int32), samples, 0.0).group
        s.check_invariants()
        assert (group is not None) == (i == 1)
    assert group.resolved and [x.reward for x in group.samples] == [1.0, 1.0, 0.0, 0.0]
    # exit_check "prefix": the rule holds at the 2nd sample of round 2, so the pool is 6 samples with 3 positives
    # (the last 2 are discarded) and the baseline is its mean, 1/2
    assert s.metrics()["samples_discarded"] == 2
    assert group.advantages == pytest.approx([0.5, 0.5, -0.5, -0.5])
    assert make_exit_rule("kpos") == KPos(k=2)  # the default
    with pytest.raises(ConfigError, match="sampling.exit_rule_params: .*integer >= 1"):
        load_config(None, ["--sampling.exit_rule", "kpos", "--sampling.exit_rule_params", "{k = 0}"])
    with pytest.raises(ConfigError, match="sampling.exit_rule_params: k = 40 positives can never be drawn"):
        load_config(None, ["--sampling.exit_rule", "kpos", "--sampling.exit_rule_params", "{k = 40}"])
