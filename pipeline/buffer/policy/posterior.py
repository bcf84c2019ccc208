"""What a prompt's pass-rate posterior predicts about the rest of its visit: the pure math behind `allocation.py`.

A prompt's pass rate p has a Beta(a, b) posterior (a population prior plus every sample of the prompt seen so
far, its current pool included). Its further samples are then a Polya urn: the next one is positive with
probability (a + k) / (a + b + m) after k positives among m further samples. `outlook` runs that urn forward
sample by sample, stopping wherever the exit rule holds, up to the visit's remaining budget.

Invariants:
- `Outlook.exit_at[j]` is the probability that the exit rule first holds after exactly j further samples
  (exit_at[0] = 0), and sum(exit_at) + unresolved == 1 (up to float rounding);
- `useful` <= 1 is the probability that the visit ends with both rewards in its pool (a group with a signal):
  at the exit, or when the budget is spent without it; `resolved` <= useful counts only the first;
- results depend only on the arguments (cached, with `a` and `b` rounded to 1/GRID).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pipeline.buffer.policy.exit_rules import ExitRule

GRID = 64  # posterior parameters are rounded to 1/GRID for the cache (a change far below any decision's scale)


@dataclass(frozen=True, slots=True)
class Outlook:
    """The predicted rest of a visit (see the module docstring)."""

    exit_at: tuple[float, ...]  # [j] = P(the exit rule first holds after exactly j further samples)
    unresolved: float  # P(the budget is spent without the exit rule holding)
    useful: float  # P(the visit ends with both rewards in its pool)
    resolved: float  # P(the exit rule holds with both rewards in the pool)

    def exit_by(self, k: int) -> float:
        """P(the exit rule holds within k further samples)."""
        return sum(self.exit_at[: k + 1])

    def overshoot(self, k: int) -> float:
        """E[(k - T)+]: samples of a round of k that the exit makes unnecessary (T = samples to the exit)."""
        return sum(p * (k - j) for j, p in enumerate(self.exit_at[: k + 1]))


def outlook(a: float, b: float, num_pos: int, num_neg: int, budget: int, rule: ExitRule, n: int) -> Outlook:
    """The Outlook of a pool with `num_pos` / `num_neg` samples, a Beta(a, b) posterior and `budget` further
    samples at most, under exit rule `rule` with group size n."""
    if a <= 0 or b <= 0:
        raise ValueError(f"a Beta posterior needs a > 0 and b > 0, got a={a}, b={b}")
    if budget < 0 or num_pos < 0 or num_neg < 0:
        raise ValueError(f"budget and counts must be >= 0, got {budget}, {num_pos}, {num_neg}")
    return _outlook(round(a * GRID) / GRID or 1 / GRID, round(b * GRID) / GRID or 1 / GRID, num_pos, num_neg,
                    budget, rule, n)


@functools.lru_cache(maxsize=1 << 16)
def _outlook(a: float, b: float, num_pos: int, num_neg: int, budget: int, rule: ExitRule, n: int) -> Outlook:
    exit_at = [0.0] * (budget + 1)
    resolved = 0.0
    layer = {0: 1.0}  # further positives -> probability, among paths that have not exited yet
    for j in range(1, budget + 1):
        nxt: dict[int, float] = {}
        for k, pr in layer.items():
            q = (a + k) / (a + b + j - 1)
            nxt[k + 1] = nxt.get(k + 1, 0.0) + pr * q
            nxt[k] = nxt.get(k, 0.0) + pr * (1.0 - q)
        layer = {}
        for k, pr in nxt.items():
            pos, neg = num_pos + k, num_neg + j - k
            if pos + neg >= n and rule.reached(pos, neg, n):
                exit_at[j] += pr
                resolved += pr if pos and neg else 0.0
            else:
                layer[k] = pr
    unresolved = sum(layer.values())
    useful = resolved + sum(pr for k, pr in layer.items() if num_pos + k and num_neg + budget - k)
    return Outlook(tuple(exit_at), unresolved, min(1.0, useful), min(1.0, resolved))
