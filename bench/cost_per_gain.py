"""What a unit of held-out gain cost each arm: generated training samples and training seconds per +0.01 Ave@k, from
results that exist (bench/results/e2e.json, the tiny model's sweep; bench/results/peer_trl.json and
peer_grpo/peer_trl.json, SmolLM2-135M beside TRL). The README's `cost-per-gain` table (bench.readme_results).

Invariants:
- a cost is a total over training (samples generated for training, train seconds; evaluation excluded) divided by
  the gain in units of 0.01, with the gain's 95% interval carried through: the cost's interval is the total over
  the interval's ends, and a gain whose interval reaches 0 gives no upper bound (shown as "gain not established",
  with the lower bound that still holds);
- the gain's interval is the one its source reports: over seeds (Student t) for the tiny sweep, over problems
  (paired, pooled over seeds) for the SmolLM2 runs, which leaves out the seed-to-seed spread;
- GRPO at its best is, per group of comparable runs, the GRPO variant with the lowest samples per +0.01 among those
  whose gain is established; a group without one has none, and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.e2e.stats import mean, paired_interval

UNIT = 0.01  # a cost is per +0.01 of held-out Ave@k
PEER_LABELS = {"trl-grpo": "TRL GRPOTrainer (GRPO)", "grpo": "GRPO (this project)", "ada-pos": "Ada-pos",
               "ada-balance": "Ada-balance"}


def _arm(group: str, label: str, grpo: bool, seeds: int, gain: float, lo: float, hi: float, samples: float,
         seconds: float) -> dict:
    return {"group": group, "label": label, "grpo": grpo, "seeds": seeds, "gain": gain, "lo": lo, "hi": hi,
            "samples": samples, "seconds": seconds}


def e2e_arms(d: dict) -> list[dict]:
    """The tiny-model sweep: per setting and strategy, the per-seed gains' t-interval and mean totals."""
    out = []
    for setting in d["summary"]:
        for s in d["strategies"]:
            runs = [r for r in d["runs"] if r["setting"] == setting and r["strategy"] == s["name"]
                    and r.get("curve")]
            g = paired_interval([r["curve"][-1]["accuracy"] - r["curve"][0]["accuracy"] for r in runs])
            group = f"tiny model, {setting}, {d['args']['steps']} steps"
            out.append(_arm(group, s["label"], s["name"].startswith("grpo"), len(runs), g["mean"], g["lo"], g["hi"],
                            mean([r["curve"][-1]["samples"] for r in runs]),
                            mean([r["curve"][-1]["seconds"] for r in runs])))
    return out


def peer_arms(doc: dict, group: str, grpo_note: str = "") -> list[dict]:
    """SmolLM2-135M runs of bench.peer_trl: each arm's pooled per-problem gain interval and mean totals."""
    out = []
    for arm, s in doc["summary"].items():
        label = PEER_LABELS.get(arm, arm) + (grpo_note if arm == "grpo" else "")
        out.append(_arm(group, label, "grpo" in arm, s["seeds"], s["gain"], s["gain"] - s["gain_ci95"],
                        s["gain"] + s["gain_ci95"], s["samples"], s["wall_s"]))
    return out


def arms(results: Path) -> list[dict]:
    """Every arm the results hold, in groups of comparable runs (same model, data, steps and seeds)."""
    peer = json.loads((results / "peer_trl.json").read_text())
    matched = json.loads((results / "peer_grpo" / "peer_trl.json").read_text())
    return [*e2e_arms(json.loads((results / "e2e.json").read_text())),
            *peer_arms(peer, f"SmolLM2-135M, {peer['steps']} steps, seeds {_seeds(peer)}", _optimizer_note(peer)),
            *peer_arms(matched, f"SmolLM2-135M, {matched['steps']} steps, seeds {_seeds(matched)}",
                       _optimizer_note(matched))]


def _optimizer_note(doc: dict) -> str:
    """Whether TRL trained with the learner's optimizer in these runs (bench.peer_trl records it per TRL run)."""
    from bench.peer_trl import trl_runs  # imports TRL's side's dependencies: only when rendering

    trl = trl_runs(doc)
    return ", optimizer matched" if trl and all("optimizer" in r for r in trl) else ", optimizer not matched"


def _seeds(doc: dict) -> str:
    return ", ".join(str(s) for s in doc["seeds"])


def bounds(total: float, a: dict) -> tuple[float, float]:
    """The interval of `total` per +0.01 of the arm's gain (inf where the gain's interval reaches 0)."""
    inf = float("inf")
    if a["hi"] is None or a["hi"] <= 0:
        return inf, inf
    return total * UNIT / a["hi"], (total * UNIT / a["lo"] if a["lo"] is not None and a["lo"] > 0 else inf)


def against(a: dict, best: dict | None, key: str) -> str:
    """An arm against GRPO at its best on one cost (`samples` or `seconds`): dearer or cheaper where the two
    intervals do not overlap (a conservative test), else not separated."""
    if best is None or a is best:
        return ""
    lo, hi = bounds(a[key], a)
    best_lo, best_hi = bounds(best[key], best)
    return "dearer" if lo > best_hi else "cheaper" if hi < best_lo else "not separated"


def cost(total: float, a: dict) -> str:
    """`total` per +0.01 of the arm's gain, with its interval, or why there is no upper bound."""
    if a["hi"] is None or a["hi"] <= 0:
        return "no gain"
    floor = f">= {_num(total * UNIT / a['hi'])}"
    if a["lo"] is None or a["lo"] <= 0:
        return f"gain not established ({floor})" if a["gain"] > 0 else f"no gain measured ({floor})"
    return f"{_num(total * UNIT / a['gain'])} ({_num(total * UNIT / a['hi'])}-{_num(total * UNIT / a['lo'])})"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def best_grpo(group: list[dict]) -> dict | None:
    """GRPO at its best in a group: the established-gain GRPO variant with the fewest samples per unit of gain."""
    ok = [a for a in group if a["grpo"] and a["lo"] is not None and a["lo"] > 0]
    return min(ok, key=lambda a: a["samples"] / a["gain"]) if ok else None


def _versus(a: dict, best: dict | None) -> str:
    both = [against(a, best, "samples"), against(a, best, "seconds")]
    return ", ".join(both) if all(both) else ""


def table(results: Path) -> list[str]:
    """The README's table: every arm by group, GRPO at its best in bold, each other arm against it."""
    rows = ["| runs | arm | seeds | gain (95% CI) | samples | samples per +0.01 (95% CI) | train s | "
            "s per +0.01 (95% CI) | against best GRPO: samples, s |", "|---|---|---:|---|---:|---|---:|---|---|"]
    all_arms = arms(results)
    for group in dict.fromkeys(a["group"] for a in all_arms):
        members = [a for a in all_arms if a["group"] == group]
        best = best_grpo(members)
        for a in members:
            interval = "" if a["lo"] is None else f" ({a['lo']:+.3f}, {a['hi']:+.3f})"
            label = f"**{a['label']}** (best GRPO)" if a is best else a["label"]
            rows.append(f"| {group} | {label} | {a['seeds']} | {a['gain']:+.3f}{interval} | {a['samples']:,.0f} | "
                        f"{cost(a['samples'], a)} | {a['seconds']:.0f} | {cost(a['seconds'], a)} | "
                        f"{_versus(a, best)} |")
        if best is None:
            rows.append(f"| {group} | no GRPO gain established: no best GRPO | | | | | | | |")
    return rows
