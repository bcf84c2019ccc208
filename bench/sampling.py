"""The sampling cost of Reinforce-Ada at paper scale, without a model: `python -m bench.sampling [--quick]`.

Runs `bench.sim.run` (simulated vLLM engines and an instant learner driving the real `pipeline.buffer.Scheduler`)
for GRPO, the paper's round-synchronous Ada-pos / Ada-balance and this project's streaming scheduler, on an
early-training and a late-training prompt population, and writes bench/results/sampling.md and sampling.png.
Engine time only, on the same engines for every strategy; `bench.table2` models the learner, the weight sync and
the paper's own setup (and its selected population).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import output
from bench.sim.population import draw_pass_rates, early_population, late_population, population_stats
from bench.sim.run import STRATEGIES, SimConfig, simulate

__all__ = ["STRATEGIES", "SimConfig", "main", "run_regime", "simulate", "table"]
PAPER_RATIO = {"pos": 2.2, "balance": 2.8}  # paper Table 2 (1.5B), cost per step relative to GRPO, as quoted

NOTES = """Columns: per learner step of B groups. `x GRPO` = ratio to round-synchronous GRPO (n = 4). `x GRPO
+learner` adds a colocated learner whose step time equals GRPO's engine time (`--learner-factor`), as in a
synchronous trainer where generation and training take turns on the same GPUs. `paper x GRPO` = the paper's Table 2
(Qwen2.5-Math-1.5B) as quoted in the task brief. Utilisation = busy slot-time / total slot-time. Zero-adv groups =
trained groups whose advantages are all 0. Unresolved = prompts that used all N rounds without meeting the exit
rule (released with resolved=False, or dropped). Dropped = prompts that ended without a group (unresolved="drop").
Stale aborted+evicted = samples cut off mid-generation by an abort plus samples evicted from pools for staleness.
Max rounds/prompt = most rounds any prompt was issued. Samples / useful group = samples generated per trained group
with a non-zero advantage; the last column is engine time per such group relative to GRPO's.
"""


def run_regime(params: tuple[float, float, float], cfg: SimConfig, learner_factor: float = 1.0
               ) -> tuple[dict, dict[str, dict]]:
    """Population stats and every strategy's metrics (ratios to GRPO added) for one prompt population."""
    num = 4 * cfg.batch_size * (cfg.num_steps + cfg.warmup_steps + 2)  # enough that no prompt is seen twice
    pass_rates = draw_pass_rates(params, num, np.random.default_rng(cfg.seed))
    results = {s.name: simulate(s, pass_rates, cfg) for s in STRATEGIES}
    base = results[STRATEGIES[0].name]
    learner_s = learner_factor * base["time_per_step"]
    for r in results.values():
        r["samples_ratio"] = r["samples_per_step"] / base["samples_per_step"]
        r["time_ratio"] = r["time_per_step"] / base["time_per_step"]
        # a colocated learner adds the same time to every round-sync step (every step trains B groups of n)
        r["time_ratio_with_learner"] = (r["time_per_step"] + learner_s) / (base["time_per_step"] + learner_s)
        r["useful_time_ratio"] = r["time_per_useful_group"] / base["time_per_useful_group"]
    return population_stats(pass_rates), results


def table(results: dict[str, dict]) -> str:
    cols = ("strategy", "samples/step", "x GRPO", "engine s/step", "x GRPO", "x GRPO +learner", "paper x GRPO",
            "utilisation", "zero-adv groups", "unresolved/step", "dropped/step", "stale aborted+evicted/step",
            "max rounds/prompt", "samples/useful group", "engine s/useful group x GRPO")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in STRATEGIES:
        r = results[s.name]
        paper = "1.0" if s.exit_rule == "fixed" else ("-" if s.streaming else f"~{PAPER_RATIO[s.exit_rule]}")
        with_learner = "-" if s.streaming else f"{r['time_ratio_with_learner']:.2f}"
        cells = (
            s.name, f"{r['samples_per_step']:.0f}", f"{r['samples_ratio']:.2f}", f"{r['time_per_step']:.1f}",
            f"{r['time_ratio']:.2f}", with_learner, paper, f"{r['utilisation']:.1%}", f"{r['zero_adv_share']:.1%}",
            f"{r['unresolved_per_step']:.1f}", f"{r['dropped_per_step']:.1f}",
            f"{r['aborted_per_step'] + r['evicted_per_step']:.1f}", str(r["max_rounds_per_prompt"]),
            f"{r['samples_per_useful_group']:.1f}", f"{r['useful_time_ratio']:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(regimes: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib  # lazy: only the plotting path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4.2), sharey=True)
    x = np.arange(len(STRATEGIES))
    for ax, (regime, results) in zip(np.atleast_1d(axes), regimes.items()):
        bars = (("samples_ratio", "samples / step"), ("time_ratio", "engine time / step"),
                ("useful_time_ratio", "engine time / useful group"))
        for i, (key, label) in enumerate(bars):
            ax.bar(x + (i - 1) * 0.27, [results[s.name][key] for s in STRATEGIES], 0.27, label=label)
        for i, s in enumerate(STRATEGIES):
            if s.exit_rule in PAPER_RATIO and not s.streaming:
                ax.plot([i - 0.4, i + 0.4], [PAPER_RATIO[s.exit_rule]] * 2, "k--", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, [s.name.replace(" ", "\n", 1) for s in STRATEGIES], fontsize=8)
        ax.set_title(f"{regime} training")
    axes[0].set_ylabel("relative to GRPO (dashed: paper Table 2)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 64, 2 engines x 64 slots, 3 steps (seconds)")
    ap.add_argument("--steps", type=int, help="learner steps measured per strategy")
    ap.add_argument("--batch", type=int, help="prompts (groups) per learner step, B")
    ap.add_argument("--engines", type=int)
    ap.add_argument("--slots", type=int, help="concurrent sequences per engine")
    ap.add_argument("--learner-factor", type=float, default=1.0,
                    help="colocated learner time per step / GRPO engine time per step (the 'x GRPO +learner' column)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(output.RESULTS), help="directory for sampling.md and sampling.png")
    args = ap.parse_args(argv)
    if args.learner_factor < 0:
        raise ValueError(f"--learner-factor must be >= 0, got {args.learner_factor}")
    cfg = SimConfig(seed=args.seed, slots=256)
    if args.quick:
        cfg = replace(cfg, batch_size=64, num_engines=2, slots=64, num_steps=3, warmup_steps=1)
    overrides = {"num_steps": args.steps, "batch_size": args.batch, "num_engines": args.engines, "slots": args.slots}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    early = early_population()
    populations = {"early": early, "late": late_population(early[0])}
    started = time.perf_counter()
    command = "python -m bench.sampling " + " ".join(sys.argv[1:] if argv is None else argv)
    out = ["# Sampling cost of Reinforce-Ada (simulated engines, the real buffer Scheduler)\n",
           f"Command: `{command.strip()}`\n", f"Config: `{cfg}`\n", NOTES]
    regimes = {}
    for regime, params in populations.items():
        stats, results = run_regime(params, cfg, args.learner_factor)
        regimes[regime] = results
        grpo = results[STRATEGIES[0].name]
        out.append(
            f"## {regime} training\n\nPopulation: {params[0]:.1%} unsolvable + Beta({params[1]:.3f}, {params[2]:.3f}); "
            f"drawn: pass@1 {stats['pass@1']:.3f}, pass@256 {stats['pass@256']:.3f}, P(all 4 correct) "
            f"{stats['all4_correct']:.3f} (GRPO groups seen all correct: {grpo['all_correct_share']:.3f}), "
            f"P(zero variance at n=4) {stats['zero_var@4']:.3f}\n\n{table(results)}\n"
        )
        print(out[-1], flush=True)
    out.append(f"Simulation time: {time.perf_counter() - started:.1f} s.\n")
    print(out[-1])
    dest = Path(args.out)
    output.write(dest / "sampling.md", "\n".join(out))
    plot(regimes, dest / "sampling.png")
    print(f"wrote {dest / 'sampling.md'} and {dest / 'sampling.png'}")


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
