"""The README's result tables, rendered from bench/results/*.json, so a quoted number cannot drift from its result.

    python -m bench.readme_results [--write] [--readme README.md] [--results bench/results]

Each table sits in the README between `<!-- results:NAME -->` and `<!-- /results:NAME -->`; NAME is a key of
TABLES, whose function renders it from the JSON a bench wrote. Without --write the command exits 1 and names the
tables that differ (tests/test_readme.py fails the same way); with --write it rewrites them in place.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench import output

ROOT = Path(__file__).resolve().parents[1]
RULES = {"fixed": "GRPO", "pos": "Ada-pos", "balance": "Ada-balance"}


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def table2_reference(results: Path) -> str:
    """Table 2 in the cost model: model seconds per step and ratios against the paper's (bench.table2)."""
    d = _load(results, "table2.json")
    ref, paper = d["reference"], d["paper_seconds"]
    grpo_model, grpo_paper = ref["fixed"]["time_per_step"], paper["fixed"]
    rows = ["| strategy | model s/step | paper s/step | model x GRPO | paper x GRPO |", "|---|---:|---:|---:|---:|"]
    for rule in ("fixed", "pos", "balance"):
        model_s = ref[rule]["time_per_step"]
        if rule == "fixed":
            rows.append(f"| {RULES[rule]} | {model_s:.1f} | {paper[rule]:.0f} | 1.00 | 1.00 |")
            continue
        mr, pr = model_s / grpo_model, paper[rule] / grpo_paper
        rows.append(f"| {RULES[rule]} | {model_s:.1f} | {paper[rule]:.0f} | **{mr:.2f}** | {pr:.2f} "
                    f"({(mr / pr - 1) * 100:+.0f}%) |")
    return "\n".join(rows)


def table2_band(results: Path) -> str:
    """Table 2's ratios with every constant varied at once (the band), and one ratio predicted from the other."""
    d = _load(results, "table2.json")
    b = d["joint_band"]
    lines = [f"| ratio | model | 5-95% band, constants within 1/{b['spread']:g}x..{b['spread']:g}x | paper | "
             "paper inside | draws within +-20% of the paper | predicted when the other ratio is calibrated |",
             "|---|---:|---|---:|---|---:|---|"]
    oos = {r["predict"]: r for r in d["out_of_sample"] if r.get("scale") is not None}
    for rule in ("pos", "balance"):
        r, o = b[rule], oos.get(rule)
        pred = f"{o['predicted']:.2f} ({o['error']:+.0%})" if o else "no fit in range"
        lines.append(f"| {RULES[rule]} x GRPO | {d['ratios'][rule]:.2f} | {r['p5']:.2f}-{r['p95']:.2f} | "
                     f"{r['paper']:.2f} | {'yes' if r['paper_inside'] else 'no'} | {r['within_20pct_share']:.0%} | "
                     f"{pred} |")
    return "\n".join(lines)


def table2_streaming(results: Path) -> str:
    """Streaming setups in the cost model against GRPO at its best: the cheapest of GRPO with keep and drop on
    every split, per useful group (bench.table2's `streaming` rows)."""
    rows_in = _load(results, "table2.json")["streaming"]
    best = min((r for r in rows_in if r["rule"] == "fixed"), key=lambda r: r["s_per_useful"])["s_per_useful"]
    by = {(r["split"], r["rule"], r["unresolved"]): r for r in rows_in}
    rows = ["| split | strategy | `keep`: s/step | `keep`: x best GRPO | `drop`: s/step | `drop`: x best GRPO |",
            "|---|---|---:|---:|---:|---:|"]
    for split in dict.fromkeys(r["split"] for r in rows_in):
        for rule in ("fixed", "pos", "balance"):
            cells = []
            for unresolved in ("keep", "drop"):
                r = by[(split, rule, unresolved)]
                x = r["s_per_useful"] / best
                cells += [f"{r['time_per_step']:.1f}", f"**{x:.2f}**" if abs(x - 1) < 1e-9 else f"{x:.2f}"]
            rows.append(f"| {split} | {RULES[rule]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pipeline_vs_reference(results: Path) -> str:
    """Steps per second against the round-synchronous reference, median (min-max) over repeats (bench.pipeline)."""
    d = _load(results, "pipeline.json")
    names = {"scripted": "scripted engine", "vllm": "vLLM on the tiny model"}
    rows = ["| engine | reference s/step | max_staleness 0 | 1 | 2 |", "|---|---:|---:|---:|---:|"]
    for engine, e in d["engines"].items():
        a = e["arms"]
        keys = sorted((k for k in a if k != "reference"), key=int)  # the max_staleness of each streaming arm
        cells = [f"{a[k]['x_reference']['median']:.2f} ({a[k]['x_reference']['min']:.2f}-"
                 f"{a[k]['x_reference']['max']:.2f})" for k in keys]
        rows.append(f"| {names.get(engine, engine)}, {e['repeats']} repeats | "
                    f"{a['reference']['s_per_step']['median']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def peer_trl(results: Path) -> str:
    """This project's arms beside TRL's GRPOTrainer on SmolLM2-135M-Instruct (bench.peer_trl)."""
    from bench.peer_trl import table

    return "\n".join(table(_load(results, "peer_trl.json")))


def peer_grpo(results: Path) -> str:
    """TRL's GRPO against this project's GRPO, seed by seed, with the optimizer matched (bench.peer_trl --arms
    trl-grpo grpo, written to bench/results/peer_grpo/)."""
    from bench.peer_trl import parity_table

    return "\n".join(parity_table(_load(results / "peer_grpo", "peer_trl.json")))


def e2e_tiny(results: Path) -> str:
    """The tiny-model sweep: final accuracy, samples per step, and each variant minus GRPO at the same step, at
    equal samples and at equal seconds, paired by seed (bench.e2e; an interval clear of zero in bold)."""
    d = _load(results, "e2e.json")
    label = {s["name"]: s["label"] for s in d["strategies"]}
    k = d["args"]["k"]
    rows = [f"| setting | strategy | final Ave@{k} (mean +- std) | samples/step | minus GRPO at the same step [95% CI] "
            "| at equal samples generated | at equal wall-clock seconds |", "|---|---|---:|---:|---|---|---|"]
    for setting, summ in d["summary"].items():
        for name, st in summ["strategies"].items():
            cells = [setting, label[name], f"{st['final_accuracy']['mean']:.3f} +- {st['final_accuracy']['std']:.3f}",
                     f"{st['samples_per_step']['mean']:.0f}"]
            for kind in ("final", "equal_samples", "equal_seconds"):
                x = summ["differences"].get(name, {}).get(kind)
                if x is None or x.get("lo") is None:
                    cells.append("")
                    continue
                text = f"{x['mean']:+.3f} [{x['lo']:+.3f}, {x['hi']:+.3f}]"
                cells.append(f"**{text}**" if x["lo"] > 0 or x["hi"] < 0 else text)
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def allocation(results: Path) -> str:
    """Engine seconds per useful group against streaming GRPO in the same run, early and late (bench.allocation)."""
    d = _load(results, "allocation.json")
    phases = ("early", "late")
    pops, goals = d["populations"], d["goals"]
    best = {ph: goals[ph]["balance"]["best_fixed_m"] for ph in phases}

    def row(label: str, values: list[float]) -> str:
        return f"| {label} | " + " | ".join(f"{v:.2f}x" for v in values) + " |"

    return "\n".join([
        "| | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases),
        row("Ada-balance, `min_cost` (the default yield floor)",
            [pops[ph]["rows"]["Ada-balance min_cost"]["vs_stream_grpo"] for ph in phases]),
        row("Ada-balance, the best fixed M (M = " + ", ".join(f"{best[ph]} {ph}" for ph in phases) + ")",
            [pops[ph]["rows"][f"Ada-balance fixed M={best[ph]}"]["vs_stream_grpo"] for ph in phases]),
        row("Ada-balance, round-synchronous reference",
            [pops[ph]["rows"]["Ada-balance round-sync"]["vs_stream_grpo"] for ph in phases]),
        row("an oracle that knows every pass rate, which never drifts (samples, nothing deferred; for comparison, "
            "not a bound)", [pops[ph]["oracle"]["balance_vs_grpo"] for ph in phases]),
        row("Ada-pos, `min_cost`", [pops[ph]["rows"]["Ada-pos min_cost"]["vs_stream_grpo"] for ph in phases]),
    ])


def cost_per_gain(results: Path) -> str:
    """Samples and train seconds per +0.01 of held-out gain, every arm including every GRPO variant the results
    hold, the gain's interval carried through (bench.cost_per_gain)."""
    from bench.cost_per_gain import table

    return "\n".join(table(results))


def throughput(results: Path) -> str:
    """Each component against its plain baseline in the same run, the ratio with its spread (bench.throughput)."""
    from bench.throughput.study import number

    d = _load(results, "throughput.json")
    rows = ["| component | ours | baseline (same run) | ratio (min-max over repeats) |", "|---|---:|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['component']} | {number(r['ours'])} | {r['baseline_name']}: {number(r['baseline'])} | "
                    f"{_ratio(r['ratio'], r['ratio_spread'])} |")
    rows += [f"| {f['name']} | failed ({f['code']}) | | |" for f in d["failures"]]
    loads = d["loadavg"]["samples_1min"]
    rows += ["", f"`{d['command']}`: {d['minutes']:.1f} min on {d['cpu_count']} cores; the 1-minute load average at "
             f"its benches' starts and ends was {min(loads):.1f}-{max(loads):.1f} (its own load included)."]
    return "\n".join(rows)


def train_throughput(results: Path) -> str:
    """Generation inside `train` against vLLM offline on the same model and cores, and the time to the first learner
    step (bench.train_throughput): its report without the title."""
    from bench.train_throughput import render

    return render(_load(results, "train_throughput.json")).split("\n", 2)[2].rstrip("\n")


def _ratio(ratio: float, spread: dict | None) -> str:
    """0.37 (0.27-0.54), or below 0.1 as a fraction: 1/433 (1/16,900-1/98)."""
    if ratio >= 0.1:
        return f"{ratio:.2f}" + (f" ({spread['min']:.2f}-{spread['max']:.2f})" if spread else "")
    return f"1/{1 / ratio:,.0f}" + (f" (1/{1 / spread['min']:,.0f}-1/{1 / spread['max']:,.0f})" if spread else "")


TABLES: dict[str, Callable[[Path], str]] = {
    "e2e": e2e_tiny,
    "allocation": allocation,
    "peer-trl": peer_trl,
    "peer-grpo": peer_grpo,
    "table2": table2_reference,
    "table2-band": table2_band,
    "table2-streaming": table2_streaming,
    "pipeline": pipeline_vs_reference,
    "cost-per-gain": cost_per_gain,
    "throughput": throughput,
    "train-throughput": train_throughput,
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- results:{re.escape(name)} -->\n)(.*?)(\n<!-- /results:{re.escape(name)} -->)", re.S)


def drift(text: str, results: Path) -> list[str]:
    """The names of the tables whose README text differs from what their results render (or that are missing)."""
    out = []
    for name, render in TABLES.items():
        m = _pattern(name).search(text)
        if m is None or m.group(2) != render(results):
            out.append(name)
    return out


def rewrite(text: str, results: Path) -> str:
    for name, render in TABLES.items():
        pat = _pattern(name)
        if pat.search(text) is None:
            raise SystemExit(f"README has no <!-- results:{name} --> ... <!-- /results:{name} --> block")
        m = pat.search(text)
        text = text[:m.start(2)] + render(results) + text[m.end(2):]
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.readme_results", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the tables in the README")
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--results", default=str(output.RESULTS))
    a = p.parse_args(argv)
    path, results = Path(a.readme), Path(a.results)
    text = path.read_text()
    if a.write:
        new = rewrite(text, results)
        if new != text:
            path.write_text(new)
        print(f"{path}: result tables {'rewritten' if new != text else 'already current'}")
        return 0
    stale = drift(text, results)
    if stale:
        print(f"{path}: tables differ from {results}: {', '.join(stale)}; run `python -m bench.readme_results "
              "--write`", file=sys.stderr)
        return 1
    print(f"{path}: every result table matches {results}")
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
