"""The goals of issue #15 computed from `bench.allocation`'s JSON, and its markdown (this only reads and formats).

Goals (each figure measured side by side in one run, per population):
- Ada-balance (min_cost) engine time per useful group <= 1.3x streaming GRPO's; Ada-pos (min_cost) <= 1.1x;
- Ada-balance (min_cost) engine time per useful group <= 0.5x the round-synchronous reference Ada-balance's
  (per step at the same useful groups per step is the same ratio);
- min_cost needs no M: its round sizes alone (nothing deferred: floor=0) within 5% of the best fixed M, and
  cheaper than est (the default, which also defers, is reported next to it);
- no starving: trained groups' pass-rate histogram close to the population's (total variation distance, next to
  fixed M=8's), deferrals in a row never above MAX_DEFERRALS.
"""

from __future__ import annotations

RULES = ("balance", "pos")
BOUND_VS_GRPO = {"balance": 1.3, "pos": 1.1}
COLUMNS = (  # (header, key, format)
    ("samples/step", "samples_per_step", "{:.0f}"), ("engine s/step", "time_per_step", "{:.1f}"),
    ("useful groups/step", "useful_per_step", "{:.0f}"), ("samples/useful group", "samples_per_useful_group",
                                                          "{:.1f}"),
    ("engine s/useful group", "time_per_useful_group", "{:.4f}"), ("x streaming GRPO", "vs_stream_grpo", "{:.2f}"),
    ("x round-sync GRPO", "vs_sync_grpo", "{:.2f}"), ("rounds/prompt", "rounds_per_prompt", "{:.2f}"),
    ("unresolved", "unresolved_share", "{:.1%}"), ("deferred", "deferred_share", "{:.1%}"),
    ("wasted tokens", "wasted_token_share", "{:.1%}"), ("mean length", "mean_len", "{:.0f}"),
    ("kept mean length", "kept_mean_len", "{:.0f}"), ("kept/all length, correct", "len_bias_pos", "{:.3f}"),
    ("kept/all length, wrong", "len_bias_neg", "{:.3f}"), ("utilisation", "utilisation", "{:.0%}"),
)


def tv_distance(a: list[float], b: list[float]) -> float:
    """Total variation distance between two histograms over the same bins."""
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b))


def _per_useful(rows: dict, name: str) -> float | None:
    return rows[name]["time_per_useful_group"] if name in rows else None


def goals(data: dict) -> dict:
    """Every goal's measured figure per population (None where a row needed for it was not run)."""
    out: dict = {}
    for phase, pop in data["populations"].items():
        rows = pop["rows"]
        stream, sync = _per_useful(rows, "GRPO streaming"), _per_useful(rows, "GRPO round-sync")
        for r in rows.values():
            r["vs_stream_grpo"] = r["time_per_useful_group"] / stream if stream else None
            r["vs_sync_grpo"] = r["time_per_useful_group"] / sync if sync else None
            r["hist_tv"] = tv_distance(r["trained_hist"], pop["population_hist"])
        g: dict = {}
        for rule in RULES:
            mine, est = _per_useful(rows, f"Ada-{rule} min_cost"), _per_useful(rows, f"Ada-{rule} est")
            fixed = {m: _per_useful(rows, f"Ada-{rule} fixed M={m}") for m in (4, 8, 16)}
            ref = _per_useful(rows, f"Ada-{rule} round-sync")
            best_m = min((m for m in fixed if fixed[m]), key=lambda m: fixed[m], default=None)
            sizing = _per_useful(rows, f"Ada-{rule} min_cost floor=0")  # its round sizes alone, nothing deferred
            g[rule] = {
                "vs_stream_grpo": mine / stream if mine and stream else None,
                "vs_stream_grpo_bound": BOUND_VS_GRPO[rule],
                "vs_reference": mine / ref if mine and ref else None,
                "vs_best_fixed": sizing / fixed[best_m] if sizing and best_m else None,
                "default_vs_best_fixed": mine / fixed[best_m] if mine and best_m else None,
                "best_fixed_m": best_m,
                "vs_est": sizing / est if sizing and est else None,
            }
            name, base = f"Ada-{rule} min_cost", f"Ada-{rule} fixed M=8"
            if name in rows:
                g[rule]["hist_tv"] = rows[name]["hist_tv"]
                g[rule]["hist_tv_fixed_m8"] = rows[base]["hist_tv"] if base in rows else None
                g[rule]["deferred_share"] = rows[name]["deferred_share"]
                g[rule]["max_deferral_streak"] = rows[name]["max_deferral_streak"]
        out[phase] = g
    return out


def _fmt(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def goals_section(data: dict) -> str:
    rows = []
    maxd = data["config"]["max_deferrals"]
    for phase, g in data["goals"].items():
        for rule in RULES:
            x = g[rule]
            bound = x["vs_stream_grpo_bound"]
            checks = [
                (f"Ada-{rule} s/useful group x streaming GRPO <= {bound}", x["vs_stream_grpo"], bound),
                (f"Ada-{rule} s/useful group x round-sync Ada-{rule}" + (" <= 0.5" if rule == "balance" else ""),
                 x["vs_reference"], 0.5 if rule == "balance" else None),
                (f"Ada-{rule} min_cost, nothing deferred (floor=0), x best fixed M (M={x['best_fixed_m']}) <= 1.05",
                 x["vs_best_fixed"], 1.05),
                (f"Ada-{rule} min_cost (default floor) x best fixed M", x["default_vs_best_fixed"], None),
                (f"Ada-{rule} min_cost, nothing deferred (floor=0), x est < 1", x["vs_est"], 1.0 - 1e-9),
                (f"Ada-{rule} trained vs population pass rates, TV distance (fixed M=8: "
                 f"{_fmt(x.get('hist_tv_fixed_m8'))})", x.get("hist_tv"), None),
                (f"Ada-{rule} deferred share; longest deferral streak {x.get('max_deferral_streak')} <= {maxd}",
                 x.get("deferred_share"), None),
            ]
            oracle = data["populations"][phase].get("oracle")
            if oracle:
                checks.insert(1, ("an oracle's samples per useful group, a point for comparison, not a bound (every "
                                  "pass rate known and fixed, one sample at a time, nothing deferred) x GRPO's",
                                  oracle[f"{rule}_vs_grpo"], None))
            for label, value, limit in checks:
                met = "-" if limit is None or value is None else ("yes" if value <= limit else "**no**")
                rows.append((phase, label, _fmt(value, "{:.3f}"), met))
    return "## Goals (issue #15), measured\n\n" + _table(("population", "goal", "measured", "met"), rows) + "\n"


def tradeoff_section(data: dict) -> str:
    """min_cost at each sampling.yield_floor: cost against the coverage of hard prompts."""
    rows = []
    for phase, pop in data["populations"].items():
        for name, r in pop["rows"].items():
            if "min_cost" in name and "sample" not in name:
                rows.append((phase, name, _fmt(r["vs_stream_grpo"]), f"{r['deferred_share']:.1%}",
                             f"{r['unresolved_share']:.1%}", f"{r['hist_tv']:.3f}",
                             f"{sum(r['trained_hist'][:3]):.1%}", f"{sum(pop['population_hist'][:3]):.1%}"))
    head = ("population", "strategy", "s/useful group x streaming GRPO", "deferred", "unresolved",
            "TV distance to the population", "trained groups with p < 0.1", "population with p < 0.1")
    return ("## min_cost's trade-off: cost per useful group against the hard prompts trained\n\n"
            "sampling.yield_floor defers examples (and gives up on visits without a signal yet) whose expected "
            "yield of useful groups per sample is below that share of the run's average: cheaper per useful group, "
            "at the cost of training fewer hard prompts. Default: the row without `floor=`.\n\n"
            + _table(head, rows) + "\n")


def render(data: dict) -> str:
    """The whole markdown page."""
    cfg = data["config"]
    parts = [
        "# Adaptive allocation: cost per useful group (simulated engines, the real buffer Scheduler)\n",
        f"Command: `{data.get('command', 'python -m bench.allocation')}` ({data['elapsed_s']:.0f} s). "
        f"B = {cfg['batch_size']} groups per step, {cfg['num_engines']} engines x {cfg['slots']} slots, "
        f"{cfg['warmup_steps']} steps of warm-up then {cfg['num_steps']} measured, n = 4, M x N = 32 samples per "
        f"visit, data set of {cfg['dataset_batches']} batches, pass-rate drift {cfg['drift']} logit per epoch. "
        "Engine time only (instant learner). A useful group holds both rewards.\n",
        goals_section(data),
        tradeoff_section(data),
    ]
    bins = cfg["hist_bins"]
    labels = [f"{lo:g}-{min(hi, 1):g}" for lo, hi in zip(bins, bins[1:])]
    for phase, pop in data["populations"].items():
        rows = [(name, *[_fmt(r.get(key), fmt) for _, key, fmt in COLUMNS]) for name, r in pop["rows"].items()]
        head = ("strategy", *[h for h, _, _ in COLUMNS])
        hist = [("population", *[f"{x:.1%}" for x in pop["population_hist"]], "-")]
        hist += [(name, *[f"{x:.1%}" for x in r["trained_hist"]], f"{r['hist_tv']:.3f}")
                 for name, r in pop["rows"].items()]
        parts.append(f"## {phase} training (step {pop['step']}, mean pass rate {pop['mean_pass_rate']:.3f})\n\n"
                     f"{_table(head, rows)}\n\nPass rates of the trained groups' prompts (at their visit) against "
                     f"the data set's:\n\n{_table(('strategy', *labels, 'TV distance'), hist)}\n")
    return "\n".join(parts)
