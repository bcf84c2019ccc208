"""Allocation policies: how many samples a prompt's next round gets, whether to admit it at all, and when its
visit's budget is spent. `sampling.allocation` picks one; a new policy is a subclass here with its `name` and
`summary`, and an entry in `POLICIES` (the config offers exactly those names). A policy carries its settings,
read from the sampling section once when it is built.

A policy is pure: it reads the prompt's pool (a `PromptState`), the example's `History` (every sample of every
visit, kept by the Scheduler across epochs and restarts) and the population `Prior`, and never changes them.

- `uniform`: the paper's Reinforce-Ada: rounds of M samples (n under the "fixed" exit rule), at most N rounds.
- `est`: the authors' estimation-based variant: a Beta posterior on the pass rate p from every sample of every
  visit; each round asks for about what the exit rule still needs at p_hat (n/2 positives take n/2 / p_hat
  samples), clipped to the visit's remaining budget of M*N samples.
- `min_cost`: each round's size k minimises the expected cost of the rest of the visit under the posterior, if
  it went on in rounds of k: `round_cost` per round plus, for the samples that the exit makes unnecessary (cut or
  discarded), `waste` of a sample each (the buffer measures it: tokens of cut samples over tokens of finished
  ones). The size is chosen again for every round, from the updated posterior. An example whose next visit
  is expected to yield groups with a signal per sample below `yield_floor` (sampling.yield_floor) times the
  run's average is deferred to a later epoch, at most MAX_DEFERRALS times in a row (then tried again: its
  evidence grows, no example is starved for good); a visit whose pool has no signal yet is given up on, by the
  same measure, when the rest of its budget is not worth spending.

Invariants:
- `next_round` is >= 1 and, for budgeted policies, at most the visit's remaining budget (so a visit never
  draws more than M*N samples into its pool);
- `admit` is True for an example never seen and for one deferred MAX_DEFERRALS times in a row: every example is
  tried at least once every MAX_DEFERRALS + 1 epochs;
- `uniform` decides exactly as the Scheduler did before policies existed (tests/test_reference_diff.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pipeline.buffer.policy.exit_rules import ExitRule
from pipeline.buffer.policy.posterior import Outlook, outlook
from pipeline.config import SamplingConfig

if TYPE_CHECKING:  # annotations only: state.py imports this package (is_positive)
    from pipeline.buffer.state import History, PromptState

MAX_ROUNDS_FACTOR = 2  # hard cap: a visit is settled after this many times its budget (rounds or samples)
MAX_DEFERRALS = 2  # an example is deferred at most this many epochs in a row
PRIOR_STRENGTH = 2.0  # the population prior counts as this many samples
DEFAULT_WASTE = 0.5  # min_cost: share of a sample an aborted one costs, until the buffer has measured it


@dataclass(frozen=True, slots=True)
class Prior:
    """The population's Beta(a, b) prior on a prompt's pass rate, and the measured cost of a cut sample."""

    a: float = 1.0
    b: float = 1.0
    waste: float = DEFAULT_WASTE  # tokens of an aborted or discarded sample / tokens of a finished one
    yield_rate: float = 0.0  # groups with a signal released per sample received so far (0: not known yet)

    @classmethod
    def from_counts(cls, positives: float, samples: float, waste: float = DEFAULT_WASTE,
                    yield_rate: float = 0.0) -> Prior:
        """A weak prior (PRIOR_STRENGTH samples) centred on the pass rate of every sample seen so far."""
        mean = (positives + 1.0) / (samples + 2.0)
        return cls(PRIOR_STRENGTH * mean, PRIOR_STRENGTH * (1.0 - mean), min(1.0, max(0.0, waste)), yield_rate)


class Allocation(ABC):
    """How a prompt's visit spends its samples; see the module docstring."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what it does, in a few words: the config reference lists it with the name
    decay: ClassVar[float] = 1.0  # weight of earlier visits' evidence when a new visit starts
    sizes_rounds: ClassVar[bool] = True  # False: every round is the rule's nominal round

    def __init__(self, sampling: SamplingConfig, rule: ExitRule) -> None:
        self.rule = rule
        self.n = sampling.group_size
        self.nominal_round = rule.nominal_round(sampling)  # M, or the rule's own (n under "fixed")
        self.max_rounds = sampling.max_rounds  # N
        self.budget = sampling.round_size * sampling.max_rounds  # samples per visit (M*N)

    def admit(self, hist: History, prior: Prior) -> bool:
        """Whether to admit the example now (False: defer it to its next turn, a later epoch)."""
        return True

    @abstractmethod
    def next_round(self, st: PromptState, hist: History, prior: Prior) -> int:
        """Samples for `st`'s next round (`hist` already holds the samples of its pool)."""

    def exhausted(self, st: PromptState) -> bool:
        """Whether the visit's budget is spent (the prompt is then settled with what its pool holds)."""
        return len(st.pool) >= self.budget

    def capped(self, st: PromptState) -> bool:
        """Whether the visit hit the hard cap on its cost (samples lost to staleness are refunded up to it)."""
        return st.num_received >= MAX_ROUNDS_FACTOR * self.budget

    def give_up(self, st: PromptState, hist: History, prior: Prior) -> bool:
        """Whether to end the visit now, before its budget is spent (asked between rounds)."""
        return False

    def remaining(self, st: PromptState) -> int:
        return max(1, self.budget - len(st.pool))

    def posterior(self, hist: History, prior: Prior) -> tuple[float, float]:
        return prior.a + hist.pos, prior.b + hist.neg

    def outlook(self, st: PromptState | None, hist: History, prior: Prior) -> Outlook:
        """The predicted rest of the visit (a visit not started yet when `st` is None)."""
        a, b = self.posterior(hist, prior)
        pos, neg, drawn = (0, 0, 0) if st is None else (st.num_pos, st.num_neg, len(st.pool))
        return outlook(a, b, pos, neg, max(0, self.budget - drawn), self.rule, self.n)


class Uniform(Allocation):
    """M samples per round (n under the "fixed" exit rule), at most N rounds: the paper's schedule."""

    name = "uniform"
    summary = "M per round, N rounds"
    sizes_rounds = False

    def next_round(self, st: PromptState, hist: History, prior: Prior) -> int:
        return self.nominal_round

    def exhausted(self, st: PromptState) -> bool:
        return st.rounds_completed >= self.max_rounds

    def capped(self, st: PromptState) -> bool:
        return st.rounds_accepted >= MAX_ROUNDS_FACTOR * self.max_rounds


class Est(Allocation):
    """The authors' estimation-based budget: what the exit rule still needs, divided by the estimated rate."""

    name = "est"
    summary = "about 1/pass-rate estimate, from a Beta posterior over every visit; at most M*N samples per visit"

    def next_round(self, st: PromptState, hist: History, prior: Prior) -> int:
        a, b = self.posterior(hist, prior)
        floor = 1.0 / (2 * self.budget)  # p_hat = 0 or 1 would ask for an infinite budget
        p = min(1.0 - floor, max(floor, a / (a + b)))
        need_pos, need_neg = self.rule.needed(st.num_pos, st.num_neg, self.n)
        want = max(need_pos / p, need_neg / (1.0 - p), self.n - len(st.pool), 1.0)
        return max(1, min(self.remaining(st), math.ceil(want)))


class MinCost(Allocation):
    """Rounds sized to minimise expected cut samples plus rounds under the posterior; hopeless prompts deferred."""

    name = "min_cost"
    summary = ("the round size that minimises expected aborted samples plus rounds under the posterior; defers "
               "prompts unlikely to resolve, see yield_floor; at most M*N samples per visit")
    decay = 0.8  # pass rates move as the policy learns: earlier visits count 0.8 at each new one
    round_cost = 1.0  # a further round costs as much as this many samples (prefill, latency, a round trip)

    def __init__(self, sampling: SamplingConfig, rule: ExitRule) -> None:
        super().__init__(sampling, rule)
        self.yield_floor = sampling.yield_floor  # see _worth_it

    def admit(self, hist: History, prior: Prior) -> bool:
        if hist.visits == 0 or hist.deferred >= MAX_DEFERRALS:
            return True
        return self._worth_it(self.outlook(None, hist, prior), 0.0, prior)

    def give_up(self, st: PromptState, hist: History, prior: Prior) -> bool:
        if st.num_pos and st.num_neg:  # a group with a signal is there: go on toward the exit rule
            return False
        return not self._worth_it(self.outlook(st, hist, prior), 0.0, prior)

    def _worth_it(self, look: Outlook, have: float, prior: Prior) -> bool:
        """Whether the rest of a visit yields groups with a signal per sample at least sampling.yield_floor times
        as well as the run does on average (`have`: the chance of one without further samples)."""
        floor = self.yield_floor * prior.yield_rate
        if floor <= 0:
            return True
        samples = sum(j * p for j, p in enumerate(look.exit_at)) + look.unresolved * (len(look.exit_at) - 1)
        return look.useful - have >= floor * max(samples, 1.0)

    def next_round(self, st: PromptState, hist: History, prior: Prior) -> int:
        look = self.outlook(st, hist, prior)
        remaining = self.remaining(st)
        need_pos, need_neg = self.rule.needed(st.num_pos, st.num_neg, self.n)
        lowest = min(remaining, max(1, need_pos + need_neg, self.n - len(st.pool)))  # fewer cannot exit
        costs = {k: self.expected_cost(look, k, remaining, prior.waste) for k in range(lowest, remaining + 1)}
        return min(costs, key=lambda k: (costs[k], k))

    def expected_cost(self, look: Outlook, k: int, remaining: int, waste: float) -> float:
        """Expected cost of the rest of the visit in rounds of k (the last one clipped to the budget): `round_cost`
        per round plus `waste` per sample that the exit makes unnecessary (cut or discarded)."""
        cost = look.unresolved * self.round_cost * -(-remaining // k)
        for j in range(1, remaining + 1):
            p = look.exit_at[j]
            if p:
                rounds = -(-j // k)
                cost += p * (self.round_cost * rounds + waste * (min(rounds * k, remaining) - j))
        return cost


POLICIES: dict[str, type[Allocation]] = {cls.name: cls for cls in (Uniform, Est, MinCost)}
ALLOCATIONS = tuple(POLICIES)


def allocation_choices() -> dict[str, str]:
    """Every policy's name and summary: what the config offers for sampling.allocation."""
    return {name: cls.summary for name, cls in POLICIES.items()}


def make_allocation(sampling: SamplingConfig, rule: ExitRule) -> Allocation:
    """The policy named by sampling.allocation. Raises ValueError naming the known policies."""
    try:
        cls = POLICIES[sampling.allocation]
    except KeyError:
        raise ValueError(f"unknown allocation policy {sampling.allocation!r}; use one of {', '.join(ALLOCATIONS)}") \
            from None
    return cls(sampling, rule)
