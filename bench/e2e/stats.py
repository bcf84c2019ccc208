"""Statistics of `bench.e2e`: mean and std over seeds, curves averaged over seeds, and each strategy's difference
to the baseline, paired by seed, with a Student-t confidence interval.

Invariants:
- a statistic that needs more seeds than there are is None (JSON null), never a made-up number: std needs 2
  seeds, an interval needs 2 pairs;
- a difference is strategy minus baseline, over the seeds where both runs finished, and each of its forms
  compares the two runs of one seed at the same point: the same learner step (final), the same number of samples
  generated, or the same wall-clock seconds (both curves interpolated linearly at the smaller of the two runs'
  totals, so neither is extrapolated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

COMPARISONS = {  # key -> (curve field on the x axis, or None for "the same final step"; what it means)
    "final": (None, "at the same learner step (the last one)"),
    "equal_samples": ("samples", "at the same number of samples generated (the smaller run's total)"),
    "equal_seconds": ("seconds", "at the same wall-clock seconds of training (the shorter run's total)"),
}


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1); None below 2 values."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_half(x: float, df: int, intervals: int = 2000) -> float:
    """P(T <= x) for x >= 0 (Simpson's rule on the density from 0 to x; the density is smooth there)."""
    h = x / intervals
    s = _t_pdf(0.0, df) + _t_pdf(x, df)
    s += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, intervals))
    return 0.5 + s * h / 3


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (p in (0.5, 1)), to about 1e-6."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_cdf_above_half(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf_above_half(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> dict:
    """Mean of the per-seed differences and its `level` t-interval (n - 1 degrees of freedom)."""
    n = len(diffs)
    out = {"n": n, "mean": mean(diffs), "std": std(diffs), "lo": None, "hi": None, "level": level, "t": None}
    if n >= 2:
        t = t_quantile(0.5 + level / 2, n - 1)
        half = t * out["std"] / math.sqrt(n)
        out.update(t=t, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def paired_se(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Standard error of mean(a) - mean(b) over problems, for per-problem scores of two models on the same problems
    (the evaluation's own noise in one seed's difference)."""
    assert len(a) == len(b), "paired scores must be of the same problems"
    d = [x - y for x, y in zip(a, b)]
    sd = std(d)
    return None if sd is None else sd / math.sqrt(len(d))


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """y at x on the polyline (xs ascending); None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def accuracy_at(curve: list[dict], field: str, x: float) -> float | None:
    return interp(x, [p[field] for p in curve], [p["accuracy"] for p in curve])


def aggregate_curve(curves: list[list[dict]]) -> list[dict]:
    """Per evaluated version present in every curve: accuracy mean and std over seeds, mean samples and seconds."""
    common = set.intersection(*({p["version"] for p in c} for c in curves)) if curves else set()
    out = []
    for v in sorted(common):
        pts = [next(p for p in c if p["version"] == v) for c in curves]
        acc = [p["accuracy"] for p in pts]
        out.append({"version": v, "accuracy": mean(acc), "std": std(acc), "n": len(pts),
                    "samples": mean([p["samples"] for p in pts]), "seconds": mean([p["seconds"] for p in pts])})
    return out


def pair_difference(base: list[dict], other: list[dict], kind: str) -> float | None:
    """other - base at the point `kind` names (see COMPARISONS); None when there is no such point."""
    field = COMPARISONS[kind][0]
    if not base or not other:
        return None
    if field is None:
        if base[-1]["version"] != other[-1]["version"]:
            return None
        return other[-1]["accuracy"] - base[-1]["accuracy"]
    x = min(base[-1][field], other[-1][field])
    a, b = accuracy_at(other, field, x), accuracy_at(base, field, x)
    return None if a is None or b is None else a - b


def summarise(runs: list[dict], baseline: str, level: float = 0.95) -> dict:
    """Per setting: per strategy the final numbers (mean, std over seeds) and the averaged curve, and per
    non-baseline strategy its paired differences to `baseline`. Only runs that finished (code 0) count."""
    ok = [r for r in runs if r.get("code") == 0 and r.get("curve")]
    out: dict = {}
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in ok if r["setting"] == setting]
        strategies = list(dict.fromkeys(r["strategy"] for r in runs if r["setting"] == setting))
        per: dict = {}
        for s in strategies:
            rs = sorted((r for r in mine if r["strategy"] == s), key=lambda r: r["seed"])
            stats = {"seeds": [r["seed"] for r in rs], "curve": aggregate_curve([r["curve"] for r in rs])}
            for field in ("final_accuracy", "gain", "samples_per_step", "zero_adv", "mixed", "wall_s", "s_per_step",
                          "samples_per_group", "dropped"):
                vals = [r[field] for r in rs if r.get(field) is not None]
                stats[field] = {"mean": mean(vals), "std": std(vals), "n": len(vals)}
            per[s] = stats
        base = {r["seed"]: r for r in mine if r["strategy"] == baseline}
        diffs: dict = {}
        for s in strategies:
            if s == baseline:
                continue
            pairs = [(base[r["seed"]], r) for r in sorted(mine, key=lambda r: r["seed"])
                     if r["strategy"] == s and r["seed"] in base]
            diffs[s] = {}
            for kind in COMPARISONS:
                d = [(b["seed"], pair_difference(b["curve"], o["curve"], kind)) for b, o in pairs]
                d = [(seed, x) for seed, x in d if x is not None]
                diffs[s][kind] = {**paired_interval([x for _, x in d], level), "per_seed": [list(p) for p in d]}
            ses = [o["final_diff_eval_se"] for _, o in pairs if o.get("final_diff_eval_se") is not None]
            diffs[s]["final"]["eval_se"] = mean(ses)  # measurement noise of one seed's final difference
        out[setting] = {"strategies": per, "differences": diffs}
    return out
