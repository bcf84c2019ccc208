"""Rewards to learning signal, as pure functions: which sample is positive, whether a pool has a signal, and the
advantages of the samples a released group keeps (the exit rules in exit_rules.py pick one baseline or the other).

Reinforce-Ada (arXiv 2510.04996) samples a prompt in rounds until its pool of samples holds enough signal, then
keeps a group of n of them (downsample.py) and computes each kept sample's advantage from the statistics of the
whole pool. Nothing here keeps state, reads the clock or touches a socket; `ExitRule.advantages` calls the
advantage functions, the pools (pools.py) and the prompt state (state.py) the others.

Legend: n = group_size (samples kept per released group), a pool is every sample a prompt has collected so far,
in generation order.

Invariants:
- the advantages are one value per kept index, in the order given;
- a pool whose rewards are all equal carries no learning signal (every advantage is 0): `has_signal` is False.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_STD = 1e-6  # std clamp: a near-constant pool must not blow the advantages up


def is_positive(reward: float, threshold: float) -> bool:
    """True when `reward` counts as a positive (correct) sample: strictly above `threshold`."""
    return reward > threshold


def _mean_std(rewards: Sequence[float]) -> tuple[float, float]:
    """Mean and unbiased (ddof=1) std, clamped at MIN_STD; a single sample has std 1 (nothing to scale by)."""
    mean = math.fsum(rewards) / len(rewards)
    if len(rewards) < 2:
        return mean, 1.0
    var = math.fsum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
    return mean, max(math.sqrt(var), MIN_STD)


def pool_advantages(pool_rewards: Sequence[float], kept: Sequence[int], normalize_std: bool) -> list[float]:
    """Reinforce-Ada advantages of the kept samples: r_i - mean(whole pool), optionally / std(whole pool).

    The baseline uses every sample the prompt drew, not only the kept n: that is the paper's estimator, and it
    is less noisy than the group's own mean. std is unbiased (ddof=1), clamped at 1e-6; a pool of one has std 1.
    """
    if not pool_rewards:
        raise ValueError("advantages of an empty pool are undefined: the pool needs at least one sample")
    mean, std = _mean_std(pool_rewards)
    scale = std if normalize_std else 1.0
    return [(pool_rewards[i] - mean) / scale for i in kept]


def group_advantages(rewards: Sequence[float], normalize_std: bool) -> list[float]:
    """GRPO advantages (the "fixed" rule): each reward minus the group's own mean, optionally / its std.

    For "fixed" the pool IS the group of n, so this equals `pool_advantages(rewards, range(n), ...)`; it is kept
    as its own function because it names the baseline being computed.
    """
    return pool_advantages(rewards, range(len(rewards)), normalize_std)


def has_signal(rewards: Sequence[float]) -> bool:
    """False when every reward is equal: all advantages are then 0 and the pool teaches nothing."""
    return any(r != rewards[0] for r in rewards)
