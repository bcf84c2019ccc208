"""`make bench`: every benchmark, one after another, each writing its table (and plots) to bench/results/.

Each one measures its ratios side by side in the same run; this only sequences them. A bench that fails or runs
past its time limit is stopped with every process it started (`bench.guard.run`), and the next one runs; the end
lists every failure with its last lines, and the exit code is 1 if any failed. The whole set is sized for 2 CPU
cores and about 25 minutes (25.1 on a fresh clone, install included): the end-to-end bench runs its short form
here (`--quick`: one seed, the normal setting, 20 steps; bench/results/e2e_quick.*); the 3-seed sweep with the hard
setting is its own command,
`python -m bench.e2e --seeds 3` (about an hour; see bench/results/e2e.md).

    python -m bench.run_all [--only NAME ...] [--timeout-factor 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import guard

# (name, python arguments, time limit in seconds: several times what it takes on 2 cores)
BENCHES = [
    ("sampling", ["-m", "bench.sampling"], 900),
    ("pipeline against the reference", ["-m", "bench.pipeline"], 3600),  # 8 of its runs start vLLM engines
    # runs its parts bench.throughput.buffer_ingest, .producer and .learner, each under its own limit
    ("throughput", ["-m", "bench.throughput"], 1500),
    ("table 2 in the cost model", ["-m", "bench.table2"], 900),
    ("end to end, short", ["-m", "bench.e2e", "--quick"], 3600),
    # last: the README's result tables from the results just written (tests/test_readme.py fails on drift)
    ("README result tables", ["-m", "bench.readme_results", "--write"], 60),
]


def main(argv: list[str] | None = None, benches: list[tuple[str, list[str], float]] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=None, help="run only these benches (by name)")
    ap.add_argument("--timeout-factor", type=float, default=1.0, help="scale every time limit (a slower machine)")
    args = ap.parse_args(argv)
    benches = BENCHES if benches is None else benches
    if args.only:
        unknown = set(args.only) - {name for name, _, _ in benches}
        if unknown:
            raise SystemExit(f"--only: no bench named {sorted(unknown)}; the benches are "
                             f"{[name for name, _, _ in benches]}")
        benches = [b for b in benches if b[0] in args.only]
    t_all = time.monotonic()
    failures = []
    for name, bench_args, limit in benches:
        print(f"\n=== {name}: python {' '.join(bench_args)}", flush=True)
        out = guard.run([sys.executable, *bench_args], limit * args.timeout_factor)
        left = f"; stopped {out.leftovers} process(es) it left running" if out.leftovers else ""
        print(f"=== {name}: exit {out.code} in {out.seconds:.0f} s{left}", flush=True)
        if out.code != 0:
            failures.append((name, bench_args, out))
    minutes = (time.monotonic() - t_all) / 60
    if failures:
        print(f"\n{len(failures)} of {len(benches)} benchmarks failed ({minutes:.1f} min in all):")
        for name, bench_args, out in failures:
            what = f"timed out after {out.seconds:.0f} s" if out.code == "timeout" else f"exit {out.code}"
            print(f"\n--- {name} ({what}): python {' '.join(bench_args)}\n{out.tail}")
        return 1
    print(f"\nall {len(benches)} benchmarks done in {minutes:.1f} min; tables in bench/results/")
    return 0


if __name__ == "__main__":
    guard.main(main)
