"""Exit rules: when a prompt stops sampling, how big its rounds are, and which baseline its advantages use.

This is the one place a new rule goes: a subclass of `ExitRule` below with its `name` and `summary`, and an entry
in `RULES`. The config offers exactly the names in `RULES` (sampling.exit_rule, with each `summary` in its
doc), and a rule's settings come from sampling.exit_rule_params as keyword arguments of its constructor, so a
new rule needs no edit of the config schema. Nothing outside this package tests a rule's name: the Scheduler,
the pools, the allocation policies and their posterior ask the rule object, and the config's checks of the
sampling section are the rule's `config_errors`.

Invariants:
- a rule is a value: it carries every setting it uses, and two rules of one class with equal settings are equal
  (and hash equal: the posterior's cache is keyed by the rule);
- `reached` depends only on the pool's positive and negative counts and n (the Scheduler checks it after every
  sample that joins a pool, or after a whole round with sampling.exit_check = "round", and releases the prompt
  once it holds and the pool has >= n samples); `needed` is the fewest further samples of each class for it;
- `advantages` returns one value per kept index, in the order given;
- a rule with `whole_rounds` never keeps part of a round: a round that loses a sample to staleness loses all of
  them (GRPO's group must be exactly one complete round).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pipeline.buffer.policy.advantages import group_advantages, pool_advantages
from pipeline.config import SamplingConfig
from pipeline.config.base import toml_value


class ExitRule(ABC):
    """When a prompt may stop sampling, and the advantage baseline of the group it releases."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what it does, in a few words: the config reference lists it with the name
    whole_rounds: ClassVar[bool] = False  # stale eviction removes whole rounds, never part of one

    def __eq__(self, other: object) -> bool:  # rules are values: equal when of one class with equal settings
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:  # so that a rule can key a cache (posterior.outlook)
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def config_errors(self, sampling: SamplingConfig) -> list[tuple[str, str]]:
        """(key, problem) for each sampling setting this rule cannot run with; [] when it can (the config's
        load-time check, so a bad combination fails before any process starts)."""
        if self.nominal_round(sampling) * sampling.max_rounds < sampling.group_size:
            return [("round_size", f"`round_size` * `max_rounds` must be >= `group_size` ({sampling.group_size})")]
        return []

    def nominal_round(self, sampling: SamplingConfig) -> int:
        """The rule's round: M (the sampling.round_size setting) unless the rule fixes it; the allocation policy
        sizes each actual round (Allocation.next_round)."""
        return sampling.round_size

    @abstractmethod
    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        """Whether a pool with `num_pos` positives and `num_neg` negatives may stop sampling (group size n)."""

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        """The fewest further (positives, negatives) after which `reached` holds (allocation policies size rounds
        from it; the pool must also hold n samples, which the caller adds). This default searches up to 4n of
        each class, with plenty of the other; a rule that is never reached there needs (4n, 4n)."""
        plenty = 4 * n
        pos = next((k for k in range(plenty + 1) if self.reached(num_pos + k, num_neg + plenty, n)), plenty)
        neg = next((k for k in range(plenty + 1) if self.reached(num_pos + plenty, num_neg + k, n)), plenty)
        return pos, neg

    def advantages(self, pool_rewards: Sequence[float], kept: Sequence[int], normalize_std: bool) -> list[float]:
        """The kept samples' advantages: Reinforce-Ada's r_i - mean(whole pool), optionally / std(whole pool)."""
        return pool_advantages(pool_rewards, kept, normalize_std)


class Balance(ExitRule):
    """Reinforce-Ada-balance: at least n // 2 positives and at least n - n // 2 negatives."""

    name = "balance"
    summary = "n/2 positives and n - n/2 negatives"

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= n // 2 and num_neg >= n - n // 2

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        return max(0, n // 2 - num_pos), max(0, n - n // 2 - num_neg)


class Pos(ExitRule):
    """Reinforce-Ada-pos: at least one positive."""

    name = "pos"
    summary = "one positive"

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= 1

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        return max(0, 1 - num_pos), 0


class Mixed(ExitRule):
    """Sample until the pool holds both a right and a wrong answer, whatever their ratio: the condition of DAPO's
    dynamic sampling (a group with a non-zero advantage), reached adaptively per prompt instead of by
    over-sampling the batch. Between "pos" (which also exits on all-positive pools) and "balance" (which waits
    for n // 2 of each)."""

    name = "mixed"
    summary = "one positive and one negative"

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= 1 and num_neg >= 1

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        return max(0, 1 - num_pos), max(0, 1 - num_neg)


class KPos(ExitRule):
    """At least k positives, whatever the negatives: "pos" with a larger k waits for a surer sign that a prompt
    is solvable (the pool then holds up to k positives for n // 2 kept, and a baseline from more samples)."""

    name = "kpos"
    summary = "k positives, whatever the negatives"

    def __init__(self, k: int = 2) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f'exit rule "kpos" needs k, an integer >= 1 (positives to wait for), got {k!r}')
        self.k = k

    def config_errors(self, sampling: SamplingConfig) -> list[tuple[str, str]]:
        budget = sampling.round_size * sampling.max_rounds
        if self.k > budget:
            return [("exit_rule_params", f"k = {self.k} positives can never be drawn within `round_size` * "
                                         f"`max_rounds` = {budget} samples: lower k")]
        return super().config_errors(sampling)

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos >= self.k

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        return max(0, self.k - num_pos), 0


class Fixed(ExitRule):
    """GRPO: one round of exactly n samples, advantages from the group's own statistics."""

    name = "fixed"
    summary = "GRPO: one round of n samples"
    whole_rounds = True

    def nominal_round(self, sampling: SamplingConfig) -> int:
        return sampling.group_size

    def reached(self, num_pos: int, num_neg: int, n: int) -> bool:
        return num_pos + num_neg >= n

    def needed(self, num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
        return 0, 0  # any n samples: the pool size, which the caller adds, is all that is needed

    def advantages(self, pool_rewards: Sequence[float], kept: Sequence[int], normalize_std: bool) -> list[float]:
        assert len(pool_rewards) == len(kept), "a fixed (GRPO) pool is exactly one round of n"
        return group_advantages([pool_rewards[i] for i in kept], normalize_std)


RULES: dict[str, type[ExitRule]] = {rule.name: rule for rule in (Balance, Pos, Mixed, KPos, Fixed)}
EXIT_RULES = tuple(RULES)


def exit_rule_choices() -> dict[str, str]:
    """Every rule's name and summary, with its settings: what the config offers for sampling.exit_rule."""
    return {name: cls.summary + "".join(f"; {p} = {toml_value(d)} by default" for p, d in _settings(cls).items())
            for name, cls in RULES.items()}


def _settings(cls: type[ExitRule]) -> dict[str, Any]:
    """A rule's settings (its constructor's keyword arguments) and their defaults."""
    return {p.name: p.default for p in inspect.signature(cls).parameters.values()
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}


def make_exit_rule(name: str, params: Mapping[str, Any] | None = None) -> ExitRule:
    """The rule called `name` (sampling.exit_rule) with settings `params` (sampling.exit_rule_params). Raises
    ValueError naming the known rules, or the rule's settings."""
    try:
        cls = RULES[name]
    except KeyError:
        raise ValueError(f"unknown exit rule {name!r}; use one of {', '.join(EXIT_RULES)}") from None
    settings = _settings(cls)
    unknown = sorted(set(params or {}) - set(settings))
    if unknown:
        takes = f"it takes {', '.join(settings)}" if settings else "it takes none"
        raise ValueError(f"exit rule {name!r} has no setting {', '.join(unknown)}; {takes}")
    return cls(**dict(params or {}))


def exit_reached(num_pos: int, num_neg: int, rule: str, n: int) -> bool:
    """Whether a pool with `num_pos` positives and `num_neg` negatives may stop sampling under the rule named
    `rule`, with its default settings (each rule's condition is its class's docstring)."""
    return make_exit_rule(rule).reached(num_pos, num_neg, n)
