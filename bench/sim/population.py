"""Prompt populations for the sampling benchmarks: who is hard, and how that changes over training.

The selected population (the paper's, and `reinforce-ada select-prompts --set easy`): a prompt is kept when the base
model solved 1 to 5 of 16 samples. Base-model pass rates p0 ~ Beta(0.5, 1) (U-shaped, as for math problem sets),
kept when k ~ Binomial(16, p0) lies in [1, 5]. Training moves every prompt on the logit scale:
    logit p = logit p0 + delta(step) + sigma(step) * z_prompt,    sigma(step) = 0.6 + 1.2 * step / 600,
where delta(step) sets the mean pass rate to the paper's training reward at that step (Fig. 3, Qwen2.5-Math-1.5B,
the reward of the first round; GRPO and Ada each follow their own curve) and sigma, the spread of progress
between prompts (RL sharpens: some prompts become certain, others stay unsolved), was fitted to one curve only:
Ada-pos's extra samples per step in Fig. 5 (left). Ada-balance's extra samples (Fig. 5 left) and its unresolved
prompts (Fig. 5 middle) are then predictions, compared in `bench.table2`'s output.

Also here: the older early/late populations of `bench.sampling` (an unsolvable share plus a Beta), kept for it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

SELECT_SAMPLES, SELECT_MIN, SELECT_MAX = 16, 1, 5  # select-prompts --set easy: pass rate in [1/16, 0.313]
PRIOR = (0.5, 1.0)  # base-model pass rates before selection
SPREAD = (0.6, 1.2)  # sigma(step) = SPREAD[0] + SPREAD[1] * step / RUN_STEPS (fitted to Fig. 5 left, Ada-pos)
RUN_STEPS = 600  # the paper trains 600 steps; Table 2 is the average step time over the run

# Fig. 3 (training reward vs step, read off the paper's vector figure; beyond step 419 extended at half the
# slope of steps 300-400)
REWARD_CURVES = {
    "fixed": ((19, 0.13), (50, 0.19), (100, 0.23), (150, 0.26), (200, 0.28), (300, 0.33), (400, 0.37),
              (500, 0.39), (600, 0.41)),
    "ada": ((29, 0.145), (50, 0.205), (100, 0.265), (150, 0.305), (200, 0.335), (300, 0.385), (400, 0.43),
            (500, 0.46), (600, 0.48)),
}
# Fig. 5 (moving averages over 20 steps, read off the vector figures): left, samples in rounds 2-4 per step
FIG5_EXTRA = {
    "pos": ((29, 3620), (50, 2732), (100, 1940), (150, 1664), (200, 1518), (300, 1355), (400, 1278), (477, 1244)),
    "balance": ((29, 6084), (50, 4869), (100, 3712), (150, 3381), (200, 3159), (300, 3234), (400, 3427),
                (500, 3730), (600, 4045)),
}
# middle: Ada-balance prompts still unresolved after 4 rounds, lacking positives / lacking negatives
FIG5_UNRESOLVED = ((54, 45, 34), (200, 26, 27), (300, 27, 30), (500, 24, 51))
TABLE2_STEPS = (50, 150, 250, 350, 450, 550)  # the run in six phases of 100 steps (their midpoints)


def curve_at(points: tuple[tuple[float, float], ...], step: float) -> float:
    """Linear interpolation of (step, value) points, flat beyond the ends."""
    xs, ys = zip(*points)
    return float(np.interp(step, xs, ys))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return np.log(p / (1 - p))


def _expit(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def selected_base_rates(num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` base-model pass rates of prompts that pass the selection (1..5 correct of 16)."""
    out: list[np.ndarray] = []
    have = 0
    while have < num:
        p0 = rng.beta(*PRIOR, 4 * num)
        k = rng.binomial(SELECT_SAMPLES, p0)
        kept = p0[(k >= SELECT_MIN) & (k <= SELECT_MAX)]
        out.append(kept)
        have += len(kept)
    return np.concatenate(out)[:num]


def spread(step: float) -> float:
    return SPREAD[0] + SPREAD[1] * step / RUN_STEPS


@lru_cache(maxsize=64)
def _shift(mean: float, sigma: float) -> float:
    """delta such that the population's mean pass rate is `mean` (on a fixed large calibration sample)."""
    rng = np.random.default_rng(12345)
    base = _logit(selected_base_rates(50_000, rng)) + sigma * rng.standard_normal(50_000)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _expit(base + mid).mean() < mean else (lo, mid)
    return (lo + hi) / 2


def pass_rates(step: float, curve: str, num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` pass rates of the selected population at training `step`, on `curve` ("fixed" = GRPO's run,
    "ada" = Reinforce-Ada's)."""
    if curve not in REWARD_CURVES:
        raise ValueError(f"unknown reward curve {curve!r}; use one of {', '.join(REWARD_CURVES)}")
    if not 0 <= step <= 2 * RUN_STEPS:
        raise ValueError(f"step must be in [0, {2 * RUN_STEPS}], got {step}")
    sigma = spread(step)
    delta = _shift(round(curve_at(REWARD_CURVES[curve], step), 6), round(sigma, 6))
    base = _logit(selected_base_rates(num, rng))
    return _expit(base + delta + sigma * rng.standard_normal(num))


# ---------------------------------------------------------------- bench.sampling's older populations


def _beta_moment(a: float, b: float, k: int, j: int) -> float:
    """E[p^k (1-p)^j] for p ~ Beta(a, b)."""
    lg = math.lgamma
    return math.exp(lg(a + k) + lg(b + j) + lg(a + b) - lg(a) - lg(b) - lg(a + b + k + j))


def early_population(pass1: float = 0.265, pass256: float = 0.81, a: float = 1.0) -> tuple[float, float, float]:
    """(unsolvable fraction, a, b) with mean pass@1 = pass1 and pass@256 = pass256 for p ~ w0*delta_0 + Beta(a, b)."""
    lo, hi = 1e-3, 1e3  # bisect b on the ratio pass1 / pass256, which does not depend on w0
    for _ in range(100):
        b = math.sqrt(lo * hi)
        if (a / (a + b)) / (1 - _beta_moment(a, b, 0, 256)) > pass1 / pass256:
            lo = b
        else:
            hi = b
    return 1 - pass256 / (1 - _beta_moment(a, b, 0, 256)), a, b


def late_population(unsolvable: float, all4: float = 0.35, b: float = 1.0) -> tuple[float, float, float]:
    """(unsolvable, a, b) with P(all 4 correct) = all4 for p ~ unsolvable*delta_0 + Beta(a, b)."""
    lo, hi = 1e-3, 1e3
    for _ in range(100):
        a = math.sqrt(lo * hi)
        lo, hi = (a, hi) if (1 - unsolvable) * _beta_moment(a, b, 4, 0) < all4 else (lo, a)
    return unsolvable, a, b


def draw_pass_rates(params: tuple[float, float, float], num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` pass rates: Beta(a, b) draws, each replaced by 0 (unsolvable) with probability w0."""
    w0, a, b = params
    p = rng.beta(a, b, num)
    p[rng.random(num) < w0] = 0.0
    return p


def population_stats(p: np.ndarray) -> dict[str, float]:
    """Expected pass@1, pass@256, P(all 4 correct) and P(4 samples all equal) of a drawn population."""
    return {
        "pass@1": float(p.mean()),
        "pass@256": float((1 - (1 - p) ** 256).mean()),
        "all4_correct": float((p**4).mean()),
        "zero_var@4": float((p**4 + (1 - p) ** 4).mean()),
        "unsolvable": float((p == 0).mean()),
    }
