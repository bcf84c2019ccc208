"""End-to-end learning on the tiny model: GRPO vs Reinforce-Ada-pos vs Reinforce-Ada-balance (and any strategy of
`bench.e2e.strategies`), several seeds, a normal and a hard setting, each run a real `reinforce-ada train`.

    python -m bench.e2e --seeds 3                  the full sweep (both settings; prints its expected duration)
    python -m bench.e2e --quick                    what `make bench` runs: 1 seed, the normal setting, 20 steps
    python -m bench.e2e --seeds 3 --dry-run        the plan and its expected duration, nothing run
    python -m bench.e2e --render bench/results/e2e.json    the markdown and plot again, from the JSON

Per (setting, seed) every strategy trains in turn with the same seed (run.seed: data order, engines, learner; the
tiny model is always the one built with seed 0), then one evaluation process (`bench.e2e.evaluate`) scores every
evaluated version of every strategy on the same held-out problems (>= 1,000 two-digit problems by default, none of
them a training problem). Writes bench/results/NAME.json (everything, the summary included), NAME.md (rendered
from the JSON by `bench.e2e.report`) and NAME.png; NAME is `e2e`, or `e2e_quick` with --quick. The JSON is
rewritten after every (setting, seed), so an interrupted sweep keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import output
from bench.e2e.data import HardSpec, hard_files, hard_prompts, held_out_check, held_out_file, shown
from bench.e2e.report import plot, render
from bench.e2e.runs import attach_evals, eval_versions, run_training
from bench.e2e.stats import paired_se, summarise
from bench.e2e.strategies import BASELINE, CONFIG, DEFAULT_STRATEGIES, SETTINGS, parse_strategy, pick_strategies

ROOT = Path(__file__).resolve().parents[2]
# measured on the 2-core machine, shared (the validation sweep of bench/results/e2e*.md): start-up and shutdown of
# one `train` run, the evaluation engine's start, one evaluation of 1,000 problems x k = 4, the hard set's selection
STARTUP_S, EVAL_ENGINE_S, EVAL_S_PER_1000, SELECT_S = 60.0, 25.0, 5.0, 90.0
HARD_SLOWDOWN = 1.3  # Ada's rounds per group grow on prompts it rarely solves


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per strategy and setting (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="learner steps per run (default 80; --quick 20)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluated versions (default 10)")
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=None,
                    help="default: normal hard (--quick: normal)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help=f"comma-separated rows of bench/e2e/strategies.py (the baseline {BASELINE} is always run)")
    ap.add_argument("--strategy", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="one more strategy, e.g. 'ada-alloc=--sampling.exit_rule balance --sampling.allocation X'")
    ap.add_argument("--eval-problems", type=int, default=1000, help="held-out two-digit problems (default 1000)")
    ap.add_argument("--eval-seed", type=int, default=0, help="sampling seed of every evaluation (default 0)")
    ap.add_argument("--k", type=int, default=4, help="samples per held-out problem (Ave@k; default 4)")
    ap.add_argument("--hard-pool", type=int, default=HardSpec.pool, help="problems the hard set is selected from")
    ap.add_argument("--hard-correct", type=int, nargs=2, default=(HardSpec.min_correct, HardSpec.max_correct),
                    metavar=("MIN", "MAX"), help="hard set: solved MIN..MAX times of 16 by the tiny model (1 5)")
    ap.add_argument("--quick", action="store_true", help="1 seed, the normal setting, 20 steps; writes e2e_quick.*")
    ap.add_argument("--smoke", action="store_true", help="one producer and eager engines (no compilation) in every "
                    "run and the evaluation: the test suite's check that every path runs; timings are not the bench's")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its expected duration, run nothing")
    ap.add_argument("--render", metavar="JSON", help="only redo the summary, markdown and plot of a results JSON")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before one training run is abandoned")
    ap.add_argument("--run-dir", default="", help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--out", default=str(output.RESULTS), help="folder for NAME.json, NAME.md and NAME.png")
    ap.add_argument("--name", default=None, help="output name (default e2e; --quick: e2e_quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds = 1
        args.steps = args.steps or 20
        args.settings = args.settings or ["normal"]
    args.steps = args.steps or 80
    args.eval_every = args.eval_every or 10
    args.settings = args.settings or ["normal", "hard"]
    args.name = args.name or ("e2e_quick" if args.quick else "e2e")
    args.engine_overrides = ["--producers.count", "1", "--producers.engine.enforce_eager", "true"] if args.smoke else []
    for flag in ("seeds", "steps", "eval_every", "eval_problems", "k"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        args.strategy_rows = pick_strategies([s for s in args.strategies.split(",") if s],
                                             [parse_strategy(t) for t in args.strategy])
    except ValueError as exc:
        ap.error(str(exc))
    return args


def expected_seconds(args, hard_cached: bool) -> float:
    """The sweep's duration from the per-step times of the strategy table and the constants above."""
    versions = len(eval_versions(args.steps, args.eval_every))
    per_eval = EVAL_S_PER_1000 * args.eval_problems * args.k / 4000
    total = 0.0
    for setting in args.settings:
        slow = HARD_SLOWDOWN if setting == "hard" else 1.0
        train = sum(STARTUP_S + args.steps * s.s_per_step * (slow if s.name != BASELINE else 1.0)
                    for s in args.strategy_rows)
        evals = EVAL_ENGINE_S + per_eval * (1 + versions * len(args.strategy_rows))
        total += args.seeds * (train + evals)
    if "hard" in args.settings and not hard_cached:
        total += SELECT_S
    return total


def prepare(args, spec: HardSpec, seeds: list[int]) -> tuple[dict, dict, list[str]]:
    """(settings with their training overrides and checked held-out counts per seed, the held-out file's record,
    the evaluation overrides), before any run starts: a held-out set that is too small fails here."""
    settings: dict = {}
    for name in args.settings:
        text = SETTINGS[name].description.replace("MIN-MAX", f"{spec.min_correct}-{spec.max_correct}")
        settings[name] = {"description": text, "overrides": []}
        if name == "hard":
            path, record = hard_prompts(spec)
            settings[name]["overrides"] = ["--data.train_files", json.dumps([shown(path)])]
            settings[name]["selection"] = record
    runs = [["--run.seed", str(seed), *st["overrides"]] for st in settings.values() for seed in seeds]
    path, held_out = held_out_file(args.eval_problems, runs)
    evals = ["--data.eval_files", json.dumps([shown(path)]), "--eval.num_problems",
             str(args.eval_problems), "--eval.k", str(args.k)]
    for st in settings.values():
        st["held_out"] = {str(seed): held_out_check(["--run.seed", str(seed), *st["overrides"], *evals])
                          for seed in seeds}
    return settings, held_out, evals


def evaluate_batch(run_dir: Path, runs: list[dict], overrides: dict[str, list[str]], seed: int) -> None:
    """Score every evaluated version of `runs` (one setting and seed) in one `bench.e2e.evaluate` process."""
    spec = {"config": CONFIG, "seed": seed, "runs": [{"key": r["key"], "overrides": overrides[r["key"]],
                                        "versions": {str(v): f for v, f in r["weights"].items()}} for r in runs]}
    tag = runs[0]["key"].replace("/", "-")
    spec_path, out_path, log_path = (run_dir / f"eval-{tag}.{x}" for x in ("spec.json", "json", "out"))
    spec_path.write_text(json.dumps(spec, indent=1))
    with log_path.open("w") as log:
        code = subprocess.call([sys.executable, "-m", "bench.e2e.evaluate", str(spec_path), str(out_path)], cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        for r in runs:
            r["code"], r["tail"] = f"evaluation failed ({code})", tail
        print(f"--- evaluation exited with {code}:\n{tail}", flush=True)
        return
    scored = json.loads(out_path.read_text())["runs"]
    base = next((scored[r["key"]] for r in runs if r["strategy"] == BASELINE), None)
    for r in runs:
        mine = scored[r["key"]]
        r["held_out_evaluated"] = mine["problems"]
        attach_evals(r, mine["evals"])
        if base is not None and r["strategy"] != BASELINE:
            r["final_diff_eval_se"] = paired_se(mine["last_per_problem"], base["last_per_problem"])


def run_seed(args, run_dir: Path, setting: str, setting_overrides: list[str], seed: int,
             evals: list[str]) -> list[dict]:
    """Every strategy of one setting and seed, one after another, then their evaluation."""
    batch, overrides = [], {}
    versions = eval_versions(args.steps, args.eval_every)
    setting_overrides = [*setting_overrides, *args.engine_overrides]  # --smoke: one producer, eager engines
    for s in args.strategy_rows:
        key, name = f"{setting}/{s.name}/{seed}", f"{setting}-{s.name}-s{seed}"
        print(f"--- {key}: {args.steps} steps (output: {run_dir / (name + '.out')})", flush=True)
        r = run_training(run_dir, name, s, setting_overrides, seed, args.steps, versions, args.timeout)
        r.update(key=key, setting=setting, strategy=s.name, seed=seed)
        overrides[key] = ["--run.seed", str(seed), *setting_overrides, *s.overrides, *evals]
        print(f"--- {key}: exit {r['code']}, {r.get('steps', 0)} steps, {r.get('samples', 0):,.0f} samples, "
              f"{r.get('wall_s', 0):.0f} s training ({r['total_s']:.0f} s in all)", flush=True)
        if r["code"] != 0:
            print(r["tail"], flush=True)
        batch.append(r)
    trained = [r for r in batch if r["code"] == 0]
    if trained:
        print(f"--- evaluating {setting}, seed {seed}", flush=True)
        evaluate_batch(run_dir, trained, overrides, args.eval_seed)
    for r in batch:
        r.pop("weights", None)
        if r["code"] == 0:
            r.pop("tail", None)  # kept only to explain a failure
    return batch


def write_outputs(data: dict, out: Path, name: str) -> None:
    data["summary"] = summarise(data["runs"], BASELINE)
    data["plot"] = f"{name}.png"
    output.write(out / f"{name}.md", render(data), data)
    plot(data, out / f"{name}.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        path = Path(args.render)
        write_outputs(json.loads(path.read_text()), path.parent, path.stem)
        print(f"rendered {path.with_suffix('.md')} and {path.with_suffix('.png')}")
        return 0
    spec = HardSpec(pool=args.hard_pool, min_correct=args.hard_correct[0], max_correct=args.hard_correct[1])
    command = "python -m bench.e2e " + " ".join(sys.argv[1:] if argv is None else argv)
    seeds = list(range(args.seeds))
    names = ", ".join(s.name for s in args.strategy_rows)
    estimate = expected_seconds(args, all(p.is_file() for p in hard_files(spec)))
    print(f"e2e: {len(args.settings)} setting(s) x {len(seeds)} seed(s) x {len(args.strategy_rows)} strategies "
          f"({names}), {args.steps} steps, evaluation every {args.eval_every} on {args.eval_problems} problems x "
          f"{args.k}; expected duration about {estimate / 60:.0f} min on 2 cores", flush=True)
    if args.dry_run:
        return 0
    settings, held_out, evals = prepare(args, spec, seeds)
    data = {"command": command.strip(), "config": CONFIG, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0]}, "baseline": BASELINE,
            "args": {k: getattr(args, k) for k in ("seeds", "steps", "eval_every", "eval_problems", "eval_seed", "k")},
            "held_out": held_out,
            "strategies": [{"name": s.name, "label": s.label, "overrides": list(s.overrides), "semantics": s.semantics}
                           for s in args.strategy_rows],
            "settings": settings, "expected_s": estimate, "runs": []}
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="reinforce-ada-e2e-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        for setting in args.settings:
            for seed in seeds:
                data["runs"] += run_seed(args, run_dir, setting, settings[setting]["overrides"], seed, evals)
                data["machine"]["load_end"] = os.getloadavg()[0]
                data["minutes"] = (time.monotonic() - t0) / 60
                write_outputs(data, Path(args.out), args.name)
        print(render(data))
        print(f"wrote {Path(args.out) / args.name}.json, .md and .png in {data['minutes']:.1f} min "
              f"(expected {estimate / 60:.0f} min)")
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if data["runs"] and all(r["code"] == 0 for r in data["runs"]) else 1

