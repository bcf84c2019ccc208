"""`reinforce-ada plot RUN [RUN ...]`: PNG plots of one run, or several overlaid.

Reads `RUN/metrics.jsonl` (one row per learner step) and `RUN/eval.jsonl` (one row per held-out evaluation).
`ledger.png` stacks the generated tokens by fate (the rows' `ledger/<fate>_tokens`, pipeline/buffer/ledger.py)
over the steps, of the first run that has them: stacked areas of several runs cannot be overlaid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (file name, title, y label, [(metrics key, legend suffix)], source)
PANELS = [
    ("reward.png", "training reward (pass rate of the samples generated per step)", "reward",
     [("buffer/positive_rate_step", " all samples generated"), ("reward_mean", " trained groups (balanced)")], "steps"),
    ("accuracy.png", "held-out accuracy per benchmark (Ave@k solid, pass@k dashed; T = 1.0)", "accuracy",
     [("accuracy", "")], "eval"),
    ("samples_per_group.png", "samples generated per released group", "samples",
     [("buffer/samples_per_released_group", "")], "steps"),
    ("staleness.png", "staleness of trained samples (learner version - sample version)", "versions",
     [("staleness_mean", " mean"), ("staleness_max", " max")], "steps"),
    ("utilisation.png", "utilisation", "busy fraction",
     [("producers/busy", " producers"), ("learner_busy", " learner")], "steps"),
]


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash
    return rows


def eval_curves(rows: list[dict]) -> list[tuple[str, list[tuple[int, float]], str]]:
    """(legend suffix, (version, value) points, line style) of each benchmark's Ave@k and pass@k in eval.jsonl
    rows, and of the size-weighted Ave@k over all benchmarks when there are several (older rows: that alone)."""
    names = sorted({name for r in rows for name in r.get("benchmarks", {})})
    curves = []
    for name in names:
        for key, style in (("ave_at_k", "-"), ("pass_at_k", "--")):
            pts = [(r["version"], r["benchmarks"][name][key]) for r in rows
                   if key in r.get("benchmarks", {}).get(name, {})]
            curves.append((f" {name} {'Ave' if key == 'ave_at_k' else 'pass'}@k", pts, style))
    if len(names) != 1:
        curves.append((" all (Ave@k)", [(r["version"], r["accuracy"]) for r in rows if "accuracy" in r], "-"))
    return curves


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Draw every panel for the runs (overlaid when several) into `out_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    data = {Path(r): (read_jsonl(Path(r) / "metrics.jsonl"), read_jsonl(Path(r) / "eval.jsonl")) for r in run_dirs}
    written = []
    for fname, title, ylabel, series, source in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for run, (steps, evals) in data.items():
            rows = steps if source == "steps" else evals
            xkey = "step" if source == "steps" else "version"
            curves = eval_curves(rows) if source == "eval" else [
                (suffix, [(r[xkey], r[key]) for r in rows if key in r and xkey in r], "-") for key, suffix in series]
            for suffix, pts, style in curves:
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, marker="o" if len(pts) < 30 else None, ms=3, label=f"{run.name}{suffix}")
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("learner step (= weight version)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    written.append(plot_ledger(data, out_dir / LEDGER_PNG, plt))
    return written


LEDGER_PNG = "ledger.png"


def plot_ledger(data: dict[Path, tuple[list[dict], list[dict]]], path: Path, plt: object) -> Path:
    """A stacked area of the generated tokens by fate (cumulative) over learner steps; see the module docstring."""
    from pipeline.buffer.ledger import FATES

    fig, ax = plt.subplots(figsize=(8, 4.5))
    name, rows = next(((run.name, [r for r in steps if "ledger/generated_tokens" in r and "step" in r])
                       for run, (steps, _) in data.items()
                       if any("ledger/generated_tokens" in r for r in steps)), ("", []))
    fates = [f for f in FATES if any(r.get(f"ledger/{f}_tokens", 0) for r in rows)]
    if rows and fates:
        xs = [r["step"] for r in rows]
        ax.stackplot(xs, *[[max(0.0, r.get(f"ledger/{f}_tokens", 0.0)) for r in rows] for f in fates],
                     labels=fates, alpha=0.85)
        ax.plot(xs, [r["ledger/generated_tokens"] for r in rows], "k--", lw=1, label="generated")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"every generated token by fate (cumulative){' - ' + name if name else ''}")
    ax.set_xlabel("learner step (= weight version)")
    ax.set_ylabel("completion tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (several: overlaid)")
    parser.add_argument("--out", help="output directory (default: RUN/plots, or runs/compare for several)")
    args = parser.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not (r / "metrics.jsonl").is_file() and not (r / "eval.jsonl").is_file():
            print(f"plot: {r} holds no metrics.jsonl or eval.jsonl (is it a run directory?)", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else (runs[0] / "plots" if len(runs) == 1 else runs[0].parent / "compare")
    for path in plot_runs(runs, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
