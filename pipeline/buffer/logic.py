"""The Reinforce-Ada algorithm core: downsampling and advantages, as pure functions (exit rules: exit_rules.py).

Reinforce-Ada (arXiv 2510.04996) samples a prompt in rounds until its pool of samples holds enough signal, then
keeps a balanced group of n of them and computes each kept sample's advantage from the statistics of the whole
pool. Nothing here keeps state, reads the clock or touches a socket; `pools.py` (downsampling and release) and
`exit_rules.py` (advantages) call these functions.

Legend: n = group_size (samples kept per released group), M = round_size (samples per round), a pool is every
sample a prompt has collected so far, in generation order.

Invariants:
- `downsample` returns exactly n distinct pool indices, sorted ascending, whenever the pool holds >= n samples;
- it keeps min(n // 2, #pos) positives and fills the rest with negatives, then any shortfall from positives again,
  so a pool that holds both classes always yields a group that holds both;
- a pool whose rewards are all equal carries no learning signal (every advantage is 0): `has_signal` is False.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

DOWNSAMPLE_POLICIES = ("first", "freshest", "random")
MIN_STD = 1e-6  # std clamp: a near-constant pool must not blow the advantages up


def is_positive(reward: float, threshold: float) -> bool:
    """True when `reward` counts as a positive (correct) sample: strictly above `threshold`."""
    return reward > threshold


def downsample(
    rewards: Sequence[float],
    versions: Sequence[int],
    n: int,
    policy: str,
    threshold: float,
    rng: random.Random | None = None,
) -> list[int]:
    """Indices (into the pool, ascending) of the n samples a released pool keeps.

    Keeps min(n // 2, #pos) positives and min(n - kept_pos, #neg) negatives, then fills any shortfall from
    the other class. Inside a class the preference order is the policy's: "first" = earliest generated (the
    reference implementation), "freshest" = highest policy version first (ties: earliest), "random" = a
    shuffle with `rng` (required; the caller seeds it, so the choice is reproducible).
    Raises ValueError when the pool holds fewer than n samples or the arguments disagree.
    """
    if n < 1:
        raise ValueError(f"group size n must be >= 1, got {n}")
    if len(versions) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(versions)} versions: give one version per sample")
    if len(rewards) < n:
        raise ValueError(f"a pool of {len(rewards)} samples cannot be downsampled to n = {n}; sample more first")
    pos = [i for i, r in enumerate(rewards) if is_positive(r, threshold)]
    neg = [i for i, r in enumerate(rewards) if not is_positive(r, threshold)]
    if policy == "first":
        pass  # pool order is generation order already
    elif policy == "freshest":
        pos.sort(key=lambda i: (-versions[i], i))
        neg.sort(key=lambda i: (-versions[i], i))
    elif policy == "random":
        if rng is None:
            raise ValueError('downsample policy "random" needs rng (a seeded random.Random)')
        rng.shuffle(pos)  # both classes are always shuffled, so rng use does not depend on the counts
        rng.shuffle(neg)
    else:
        raise ValueError(f"unknown downsample policy {policy!r}; use one of {', '.join(DOWNSAMPLE_POLICIES)}")
    kept_pos = min(n // 2, len(pos))
    kept_neg = min(n - kept_pos, len(neg))
    kept_pos = min(len(pos), n - kept_neg)  # too few negatives: fill from the positives
    kept = sorted(pos[:kept_pos] + neg[:kept_neg])
    assert len(kept) == n, (len(kept), n)
    return kept


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
