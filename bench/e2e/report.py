"""Markdown and plots of `bench.e2e`'s JSON (the bench writes the JSON with its summary; this only formats it).

The conclusion paragraph is generated from the summary's paired intervals: a difference is called distinguishable
from zero only when its 95% interval excludes zero, and every limit of the data is stated with its number.
"""

from __future__ import annotations

from pathlib import Path

from bench.e2e.stats import COMPARISONS

CONCLUSION_LIMITS = (
    "The intervals are over training seeds on one fixed held-out set measured with fixed sampling seeds: they say "
    "how the difference varies with training randomness on these problems, not over other problem sets. "
    "What this data cannot show: anything about the paper's setting. The task is two-digit addition and "
    "subtraction, the model a 1.8 MB character-level transformer, the hardware two shared CPU cores, and the runs are "
    "short; the paper trains 1.5B-7B models on competition mathematics for hundreds of steps. An interval that "
    "includes zero is not evidence that two strategies are equal: with few seeds it is wide, and only differences "
    "about as large as its half-width could have been detected. Wall-clock comparisons carry the load of the "
    "machine's other users (the load average is recorded above)."
)


def _pm(stat: dict | None, fmt: str = "{:.3f}") -> str:
    if stat is None or stat.get("mean") is None:
        return "-"
    s = fmt.format(stat["mean"])
    return s + (f" ± {fmt.replace('+', '').format(stat['std'])}" if stat.get("std") is not None else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _labels(d: dict) -> dict[str, str]:
    return {s["name"]: s["label"] for s in d["strategies"]}


def _interval(diff: dict) -> str:
    if diff["n"] < 2:
        return f"n = {diff['n']} seed: no interval"
    return f"[{diff['lo']:+.3f}, {diff['hi']:+.3f}]"


def verdict(diff: dict) -> str:
    """'better', 'worse', 'not distinguishable' (the interval holds 0) or 'untested' (fewer than 2 pairs)."""
    if diff["n"] < 2 or diff["lo"] is None:
        return "untested"
    if diff["lo"] > 0:
        return "better"
    if diff["hi"] < 0:
        return "worse"
    return "not distinguishable"


def setup_section(d: dict) -> list[str]:
    a = d["args"]
    lines = ["## Setup", "", f"Each run is `reinforce-ada train` on `{d['config']}` with the overrides below, "
             f"{a['steps']} learner steps of 32 groups of n = 4, seeds {', '.join(map(str, range(a['seeds'])))} "
             "(run.seed: training draw and order, engines, learner; the tiny model is the one built with seed 0). "
             "The runs of one seed follow each other on the same machine. Evaluation is off during training; "
             f"afterwards one vLLM engine loads each evaluated version's published weights (every {a['eval_every']} "
             f"steps and the last) and measures Ave@{a['k']} at T = 1 on the held-out problems, with the same "
             f"per-request seed ({a['eval_seed']}) for every version, strategy and seed. Wall-clock seconds count "
             "from the start of the learner process (the supervisor starts it once the engines are up; the engines' "
             "start-up is not counted), to the row of each learner step.", ""]
    lines += _table(["strategy", "overrides", "semantics"],
                    [[s["label"], "`" + " ".join(s["overrides"]) + "`", s["semantics"]] for s in d["strategies"]])
    h = d["held_out"]
    lines += ["", f"Held-out set: {h['problems']:,} two-digit problems (`{h['file']}`, drawn with seed {h['seed']}), "
              f"the same for every run, none of them among the {h['excluded_training_problems']:,} training problems "
              "of the sweep's runs. Checked per run the way the pipeline builds it (training problems removed):", ""]
    for name, st in d["settings"].items():
        counts = "; ".join(f"seed {seed}: {c['problems']} of {c['drawn']} used, {c['overlap_removed']} removed as "
                           "training problems" for seed, c in st["held_out"].items())
        lines.append(f"- **{name}**: {st['description']}. Held-out check: {counts}.")
        sel = st.get("selection")
        if sel:
            lines.append(f"  Hard set: {sel['kept']:,} of {sel['problems']:,} generated problems solved "
                         f"{sel['spec']['min_correct']}-{sel['spec']['max_correct']} times of "
                         f"{sel['samples_per_problem']} (`{sel['command']}`, {sel['seconds']:.0f} s, cached in "
                         f"`{sel['file']}`).")
    return lines + [""]


def results_section(d: dict, setting: str) -> list[str]:
    summ, lab = d["summary"][setting], _labels(d)
    k = d["args"]["k"]
    if not any(st["seeds"] for st in summ["strategies"].values()):
        return [f"## Setting: {setting}", "", "No run of this setting finished (see the failures below).", ""]
    rows = []
    for name, st in summ["strategies"].items():
        v0 = st["curve"][0] if st["curve"] else None
        rows.append([lab[name], str(len(st["seeds"])), _pm(v0 and {"mean": v0["accuracy"], "std": v0["std"]}),
                     _pm(st["final_accuracy"]), _pm(st["gain"], "{:+.3f}"), _pm(st["samples_per_step"], "{:.0f}"),
                     _pm(st["samples_per_group"], "{:.1f}"), _pm(st["zero_adv"], "{:.2f}"), _pm(st["mixed"], "{:.2f}"),
                     _pm(st["dropped"], "{:.0f}"), _pm(st["wall_s"], "{:.0f}"), _pm(st["s_per_step"], "{:.2f}")])
    lines = [f"## Setting: {setting}", "", f"Mean ± std over seeds. `Ave@{k}` on the held-out set; `zero-adv` = share "
             "of trained samples with advantage 0; `mixed` = share of trained groups holding both rewards; "
             "`dropped` = prompts dropped without a group; `wall s` = seconds from the learner's start to its last "
             "step; `s/step` = seconds per step from its first batch on.", ""]
    lines += _table(["strategy", "seeds", f"Ave@{k} v0", f"final Ave@{k}", "gain", "samples/step", "samples/group",
                     "zero-adv", "mixed", "dropped", "wall s", "s/step"], rows)
    lines += ["", f"Difference to {lab[d['baseline']]}, paired by seed (strategy minus {lab[d['baseline']]}, "
              "95% t-interval over the per-seed differences):", ""]
    drows = []
    for name, kinds in summ["differences"].items():
        for kind, diff in kinds.items():
            per = ", ".join(f"{x:+.3f}" for _, x in diff["per_seed"])
            mean = "-" if diff["mean"] is None else f"{diff['mean']:+.3f}"
            noise = "-" if diff.get("eval_se") is None else f"{diff['eval_se']:.3f}"
            drows.append([lab[name], COMPARISONS[kind][1], mean, _interval(diff), str(diff["n"]), per or "-", noise,
                          verdict(diff)])
    lines += _table(["strategy", "compared", "mean difference", "95% interval", "seeds", "per seed",
                     "evaluation noise of one seed's difference (SE)", "verdict"], drows)
    curves = {n: {p["version"]: p for p in st["curve"]} for n, st in summ["strategies"].items()}
    versions = sorted({v for c in curves.values() for v in c})
    lines += ["", f"Held-out Ave@{k} by version (mean ± std over seeds):", ""]
    lines += _table(["version"] + [lab[n] for n in curves],
                    [[str(v)] + [_pm({"mean": c[v]["accuracy"], "std": c[v]["std"]}) if v in c else "-"
                                 for c in curves.values()] for v in versions])
    return lines + [""]


SHORT = {"final": "at the same step", "equal_samples": "at equal samples", "equal_seconds": "at equal seconds"}


def _cost(summ: dict, name: str, base: str, base_label: str) -> str:
    a, b = summ["strategies"][name]["samples_per_step"]["mean"], summ["strategies"][base]["samples_per_step"]["mean"]
    return f" ({a / b:.1f}x {base_label}'s samples per step)" if a and b else ""


def conclusion(d: dict) -> list[str]:
    """One paragraph per setting, generated from the paired intervals, then the data's limits."""
    lab, base = _labels(d), d["baseline"]
    lines = ["## What the data says", "",
             f"Each line: strategy minus {lab[base]}, mean over seeds and 95% t-interval of the per-seed differences.",
             ""]
    for setting, summ in d["summary"].items():
        lines.append(f"**{setting}**:")
        found: dict[str, list[str]] = {"better": [], "worse": []}
        widths = []
        for name, kinds in summ["differences"].items():
            cells = []
            for kind, diff in kinds.items():
                v = verdict(diff)
                if diff["mean"] is None:
                    cells.append(f"{SHORT[kind]}: no pair of finished runs")
                    continue
                if diff["n"] < 2:
                    cells.append(f"{SHORT[kind]} {diff['mean']:+.3f} ({diff['n']} seed, no interval)")
                else:
                    cells.append(f"{SHORT[kind]} {diff['mean']:+.3f} {_interval(diff)} ({diff['n']} seeds): {v}")
                if v in found:
                    found[v].append(f"{lab[name]} {SHORT[kind]}")
                if diff["lo"] is not None:
                    widths.append((diff["hi"] - diff["lo"]) / 2)
            lines.append(f"- {lab[name]}{_cost(summ, name, base, lab[base])}: " + "; ".join(cells) + ".")
        said = [f"{', '.join(found[v])} {v} than {lab[base]}" for v in ("better", "worse") if found[v]]
        lines.append("")
        if said:
            lines.append(f"Distinguishable from zero at 95%: {'; '.join(said)}. No other difference is.")
        elif widths:
            lines.append(f"No difference to {lab[base]} is distinguishable from zero at 95%.")
        else:
            lines.append("No interval: fewer than 2 seeds, so nothing here can be told from noise.")
        if widths:
            lines.append(f"The intervals' half-widths average {sum(widths) / len(widths):.3f}: a true difference "
                         "much smaller than that would likely go undetected with these seeds.")
        ses = [e["se"] for r in d["runs"] if r["setting"] == setting for e in r.get("curve", [])]
        noise = [k["final"]["eval_se"] for k in summ["differences"].values() if k["final"].get("eval_se") is not None]
        if ses:
            lines.append(f"One evaluation's own sampling error (standard error over the held-out problems) is about "
                         f"{sum(ses) / len(ses):.3f}; in one seed's difference at the last step, measured on the same "
                         f"problems with the same sampling seeds, about {sum(noise) / len(noise):.3f}." if noise else
                         f"One evaluation's own sampling error (standard error over the held-out problems) is about "
                         f"{sum(ses) / len(ses):.3f}.")
        lines.append("")
    return lines + [CONCLUSION_LIMITS, ""]


def render(d: dict) -> str:
    m = d["machine"]
    load = f"load average {m['load_start']:.1f} at the start, {m.get('load_end', float('nan')):.1f} at the end"
    lines = ["# End to end: GRPO vs Reinforce-Ada on the tiny model", "",
             f"Command: `{d['command']}` ({d.get('minutes', 0):.1f} min in all, expected "
             f"{d['expected_s'] / 60:.0f}; {d['date']}, {m['cpus']} CPUs, {load}).", ""]
    lines += setup_section(d)
    for setting in d["summary"]:
        lines += results_section(d, setting)
    lines += conclusion(d)
    failed = [r for r in d["runs"] if r["code"] != 0]
    for r in failed:
        lines += [f"`{r['key']}` failed ({r['code']}); last lines of its output:", "", "```", r.get("tail", ""), "```",
                  ""]
    lines.append(f"Plot: `{d['plot']}` (held-out accuracy against learner step, samples "
                 "generated and wall-clock seconds; mean over seeds, shaded ± one std).")
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> None:
    import matplotlib  # lazy: only the plotting path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(d["summary"])
    axes_x = (("version", "learner step"), ("samples", "samples generated for training"),
              ("seconds", "wall-clock seconds of training"))
    fig, axes = plt.subplots(len(settings), 3, figsize=(15, 4.2 * len(settings)), squeeze=False, sharey="row")
    lab = _labels(d)
    for row, setting in zip(axes, settings):
        for name, st in d["summary"][setting]["strategies"].items():
            c = st["curve"]
            if not c:
                continue
            y = [p["accuracy"] for p in c]
            sd = [p["std"] or 0.0 for p in c]
            for ax, (field, _) in zip(row, axes_x):
                x = [p[field] for p in c]
                (line,) = ax.plot(x, y, marker="o", ms=3, label=f"{lab[name]} (n = {len(st['seeds'])})")
                ax.fill_between(x, [a - s for a, s in zip(y, sd)], [a + s for a, s in zip(y, sd)],
                                color=line.get_color(), alpha=0.18)
        empty = not any(st["curve"] for st in d["summary"][setting]["strategies"].values())
        for ax, (_, xlabel) in zip(row, axes_x):
            if empty:
                ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.set_title(f"{setting}")
        row[0].set_ylabel(f"held-out Ave@{d['args']['k']}")
        if not empty:
            row[0].legend(fontsize=8)
    fig.suptitle(f"Tiny model, two-digit arithmetic: mean ± std over seeds ({d['args']['eval_problems']} held-out "
                 "problems)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
