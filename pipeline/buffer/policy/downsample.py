"""Downsampling: which n samples of a released pool its group keeps (buffer.downsample picks the order).

Invariants:
- `downsample` returns exactly n distinct pool indices, sorted ascending, whenever the pool holds >= n samples;
- it keeps min(n // 2, #pos) positives and fills the rest with negatives, then any shortfall from positives again,
  so a pool that holds both classes always yields a group that holds both.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pipeline.buffer.policy.advantages import is_positive

DOWNSAMPLE_ORDERS = ("first", "freshest", "random")


def downsample(
    rewards: Sequence[float],
    versions: Sequence[int],
    n: int,
    order: str,
    threshold: float,
    rng: random.Random | None = None,
) -> list[int]:
    """Indices (into the pool, ascending) of the n samples a released pool keeps.

    Keeps min(n // 2, #pos) positives and min(n - kept_pos, #neg) negatives, then fills any shortfall from
    the other class. Inside a class the preference is `order`'s: "first" = earliest generated (the
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
    if order == "first":
        pass  # pool order is generation order already
    elif order == "freshest":
        pos.sort(key=lambda i: (-versions[i], i))
        neg.sort(key=lambda i: (-versions[i], i))
    elif order == "random":
        if rng is None:
            raise ValueError('downsample order "random" needs rng (a seeded random.Random)')
        rng.shuffle(pos)  # both classes are always shuffled, so rng use does not depend on the counts
        rng.shuffle(neg)
    else:
        raise ValueError(f"unknown downsample order {order!r}; use one of {', '.join(DOWNSAMPLE_ORDERS)}")
    kept_pos = min(n // 2, len(pos))
    kept_neg = min(n - kept_pos, len(neg))
    kept_pos = min(len(pos), n - kept_neg)  # too few negatives: fill from the positives
    kept = sorted(pos[:kept_pos] + neg[:kept_neg])
    assert len(kept) == n, (len(kept), n)
    return kept
