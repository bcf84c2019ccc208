"""`make bench`: every benchmark, one after another, each writing its table (and plots) to bench/results/.

Each one measures its ratios side by side in the same run; this only sequences them and stops at the first
failure. The whole set is sized for 2 CPU cores and under 20 minutes: the end-to-end bench runs its short form
here (`--quick`: one seed, the normal setting, 20 steps; bench/results/e2e_quick.*); the 3-seed sweep with the
hard setting is its own command, `python -m bench.e2e --seeds 3` (about an hour; see bench/results/e2e.md).
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHES = [
    ("sampling", ["-m", "bench.sampling"]),
    ("pipeline overlap", ["-m", "bench.pipeline"]),
    ("throughput", ["-m", "bench.throughput"]),  # runs bench.buffer_ingest, bench.producer and bench.learner
    ("table 2 in the cost model", ["-m", "bench.table2"]),
    ("end to end, short", ["-m", "bench.e2e", "--quick"]),
]


def main() -> int:
    t_all = time.monotonic()
    for name, args in BENCHES:
        print(f"\n=== {name}: python {' '.join(args)}", flush=True)
        t0 = time.monotonic()
        code = subprocess.call([sys.executable, *args])
        print(f"=== {name}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
        if code != 0:
            return code
    print(f"\nall benchmarks done in {(time.monotonic() - t_all) / 60:.1f} min; tables in bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
