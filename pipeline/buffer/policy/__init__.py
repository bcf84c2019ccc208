"""The sampler's policy: every decision of Reinforce-Ada that a variant may change, as objects built from the
config and asked through one interface each. Nothing outside this package tests a rule's or a policy's name.

Where things are (every module; tests/test_layout.py holds this list complete):
- `exit_rules.py`: `ExitRule`, when a prompt stops sampling, whether its rounds are kept whole, and which
  baseline its advantages use (sampling.exit_rule; a new rule is a subclass there and an entry in `RULES`);
- `allocation.py`: `Allocation`, how many samples a round gets, which examples wait, when a visit's budget is
  spent (sampling.allocation; a new policy is a subclass there and an entry in `POLICIES`);
- `build.py`: the rule and the policy that the sampling section names, and the config's check of them;
- `posterior.py`: what a prompt's pass-rate posterior predicts about the rest of its visit (the allocation
  policies' math);
- `advantages.py`: which sample is positive, whether a pool has a signal, the pool's and the group's advantages;
- `downsample.py`: which n samples of a released pool its group keeps (buffer.downsample).

Invariants:
- a rule or a policy is a value built from the sampling section alone (`build`): it carries every setting it
  uses, and two built from equal settings are equal;
- the config's choices of sampling.exit_rule and sampling.allocation are the registries' keys (`EXIT_RULES`,
  `ALLOCATIONS`, read by pipeline/config through `exit_rule_choices` and `allocation_choices`), and a rule's
  settings are sampling.exit_rule_params: a new rule or policy needs no edit outside this package.
"""

from pipeline.buffer.policy.advantages import MIN_STD, group_advantages, has_signal, is_positive, pool_advantages
from pipeline.buffer.policy.allocation import (
    ALLOCATIONS,
    DEFAULT_WASTE,
    MAX_DEFERRALS,
    MAX_ROUNDS_FACTOR,
    Allocation,
    Prior,
    allocation_choices,
    make_allocation,
)
from pipeline.buffer.policy.build import build, config_errors
from pipeline.buffer.policy.downsample import DOWNSAMPLE_ORDERS, downsample
from pipeline.buffer.policy.exit_rules import EXIT_RULES, ExitRule, exit_reached, exit_rule_choices, make_exit_rule

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_WASTE",
    "DOWNSAMPLE_ORDERS",
    "EXIT_RULES",
    "MAX_DEFERRALS",
    "MAX_ROUNDS_FACTOR",
    "MIN_STD",
    "Allocation",
    "ExitRule",
    "Prior",
    "allocation_choices",
    "build",
    "config_errors",
    "downsample",
    "exit_reached",
    "exit_rule_choices",
    "group_advantages",
    "has_signal",
    "is_positive",
    "make_allocation",
    "make_exit_rule",
    "pool_advantages",
]
