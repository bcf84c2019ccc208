"""The exit rule and the allocation policy that a sampling section names, built once, and the config's load-time
check of them: the only code that turns the settings' names into objects.

Invariant: `config_errors(sampling)` is [] exactly when `build(sampling)` succeeds and the rule and the policy can
run together with the other sampling settings; SamplingConfig.check() raises the first error, so a bad
combination fails before any process starts.
"""

from __future__ import annotations

from pipeline.buffer.policy.allocation import POLICIES, Allocation, make_allocation
from pipeline.buffer.policy.exit_rules import ExitRule, make_exit_rule
from pipeline.config import SamplingConfig


def build(sampling: SamplingConfig) -> tuple[ExitRule, Allocation]:
    """The exit rule (sampling.exit_rule with sampling.exit_rule_params) and the allocation policy
    (sampling.allocation) that drive a scheduler. Raises ValueError as `make_exit_rule` does."""
    rule = make_exit_rule(sampling.exit_rule, sampling.exit_rule_params)
    return rule, make_allocation(sampling, rule)


def config_errors(sampling: SamplingConfig) -> list[tuple[str, str]]:
    """(key, problem) for each way the sampling section's rule and policy cannot run; [] when they can."""
    try:
        rule = make_exit_rule(sampling.exit_rule, sampling.exit_rule_params)
    except (ValueError, TypeError) as exc:  # an unknown setting, or a value the rule's constructor refuses
        return [("exit_rule_params", str(exc))]
    errors = rule.config_errors(sampling)
    if rule.whole_rounds and POLICIES[sampling.allocation].sizes_rounds:
        fits = " or ".join(f'"{name}"' for name, cls in POLICIES.items() if not cls.sizes_rounds)
        errors.append(("allocation", f"must be {fits} with `exit_rule` = {sampling.exit_rule!r}: the rule keeps "
                                     f"whole rounds of its own size (GRPO draws one round of n samples)"))
    return errors
