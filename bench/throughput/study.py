"""The pipeline's speed against plain baselines, in one table: `python -m bench.throughput [--quick | --smoke]`.

Runs, one after another as subprocesses with modest settings, the component benchmarks that each measure their own
side-by-side ratio in the same run, then reads the numbers back from the JSON each writes under bench/results/:
  - bench.throughput.buffer_ingest: buffer service samples/s vs raw ZeroMQ PUSH/PULL of the same frames;
  - bench.throughput.producer: producer tokens/s vs vLLM's offline LLM.generate, and the in-place weight load time;
  - bench.throughput.learner: learner tokens/s vs a plain transformers step, weight publish vs memcpy.
The producer's weight load is set against a memcpy of the same number of bytes (and a read of them from a tmpfs
file into preallocated memory), measured here. Writes bench/results/throughput.md and the
same numbers to throughput.json, from which the README's table is rendered (bench.readme_results).

Every baseline is one that does not swing with page faults: copies go into preallocated memory written once
before timing. Each ratio comes with its spread over the repeats (min-max of the paired per-repeat ratios).
A component that fails or runs past --timeout is stopped with everything it started (`bench.guard.run`), the
others still run, and the table names each failure; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import guard, output

ROOT = Path(__file__).resolve().parents[2]

# (name, module, arguments, under --quick, under --smoke (seconds, for the test suite), the file it writes)
BENCHES = [
    ("buffer ingest", "bench.throughput.buffer_ingest", ["--rounds", "1000", "--repeats", "3"],
     ["--rounds", "500", "--repeats", "1"], ["--rounds", "20", "--tokens", "16", "--repeats", "1"], "buffer_ingest"),
    ("producer", "bench.throughput.producer", ["--prompts", "48", "--reps", "5", "--loads", "10"],
     ["--prompts", "24", "--reps", "3", "--loads", "5"],
     ["--prompts", "4", "--round-size", "2", "--max-new-tokens", "8", "--max-num-seqs", "8", "--reps", "1",
      "--loads", "2", "--enforce-eager"], "producer"),
    ("learner", "bench.throughput.learner", ["--reps", "3"], ["--reps", "2"],
     ["--reps", "1", "--hidden", "64", "--layers", "1", "--vocab", "256", "--groups", "2", "--big-mib", "32",
      "--publish-reps", "2"], "learner"),
]


# a row: (component, ours, baseline name, baseline value, ratio, ratio spread {"min", "max"} or None)


def parse_buffer(d: dict) -> list[tuple]:
    raw, ours = d["raw_samples_per_s"], d["buffer_samples_per_s"]
    return [("buffer ingest (samples/s)", ours, "raw ZeroMQ PUSH/PULL, same frames", raw, ours / raw,
             d.get("ratio_spread"))]


def parse_producer(d: dict) -> tuple[list[tuple], dict]:
    rows = [("producer generation (tokens/s)", d["producer_tokens_per_s"], "vLLM offline LLM.generate",
             d["offline_tokens_per_s"], d["ratio"], d.get("ratio_spread"))]
    return rows, d["load"]


def parse_learner(d: dict) -> list[tuple]:
    runners = d["runners"]
    best_plain = max(runners["plain_masked"]["tokens_per_s"], runners["plain_nomask"]["tokens_per_s"])
    rows = []
    for name, label in (("learner", "learner step (tokens/s, wall)"),
                        ("learner_micro4096", "learner step, micro_batch_tokens 4096 (tokens/s, wall)")):
        r = runners[name]
        rows.append((label + f"; CPU-time ratio {r['ratio_cpu']:.2f}", r["tokens_per_s"],
                     "plain transformers step (faster of masked / no mask)", best_plain, r["ratio_wall"],
                     r.get("ratio_wall_spread")))
    for name, label in (("bench model fp32", "weight publish, bench model fp32"),
                        ("synthetic bf16", "weight publish, bf16")):
        p = d["publish"][name]
        rows.append((f"{label} ({p['mb']:.0f} MiB, MiB/s)", p["publish_mbs"],
                     "memcpy into preallocated, pre-faulted memory", p["memcpy_mbs"],
                     p["ratio_to_memcpy_spread"]["median"], p["ratio_to_memcpy_spread"]))
    return rows


def copy_baselines(mib: float, reps: int = 50) -> dict:
    """Median ms to memcpy `mib` MiB into preallocated memory, and to read them from a tmpfs file into it."""
    nbytes = int(mib * 2**20)
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pre-fault the destination: the timed copies pay no page faults
    memcpy, read = [], []
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.write(src.tobytes())
        f.flush()
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            memcpy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(f.name, "rb", buffering=0) as fh:
                fh.readinto(memoryview(dst))
            read.append(time.perf_counter() - t0)
    return {"memcpy_ms": 1e3 * statistics.median(memcpy), "read_ms": 1e3 * statistics.median(read),
            "memcpy_ms_range": (1e3 * min(memcpy), 1e3 * max(memcpy)),
            "read_ms_range": (1e3 * min(read), 1e3 * max(read))}


def run_bench(module: str, args: list[str], timeout: float) -> tuple[int | str, float, str]:
    """Run one benchmark module (nothing of it left running afterwards); (exit code, seconds, its last lines)."""
    outcome = guard.run([sys.executable, "-m", module, *args], timeout, echo=False, tail_lines=10)
    return outcome.code, outcome.seconds, outcome.tail


def run_benches(sizing: str, results: Path, timeout: float, loads: list[float]) -> tuple[list, list, list, dict]:
    """Run every component bench at `sizing` (full, quick or smoke), appending the 1-minute load average at each
    one's start and end to `loads`; (rows, commands run, failures, the weight load)."""
    rows: list[tuple] = []
    lines_run, failures, load = [], [], {}
    for name, module, full, quick, smoke, file_name in BENCHES:
        sized = {"full": full, "quick": quick, "smoke": smoke}[sizing]
        bench_args = [*sized, "--out", str(results / f"{file_name}.md")]
        cmd = f"python -m {module} {' '.join(bench_args)}".replace(f"{ROOT}/", "")  # paths as a reader reruns them
        print(f"--- {name}: {cmd}", flush=True)
        loads.append(os.getloadavg()[0])
        code, seconds, tail = run_bench(module, bench_args, timeout)
        loads.append(os.getloadavg()[0])
        lines_run.append(f"{cmd}   # exit {code}, {seconds:.0f} s, load average {loads[-2]:.1f} -> {loads[-1]:.1f}")
        print(f"--- {name}: exit {code} in {seconds:.0f} s", flush=True)
        if code != 0:
            failures.append((name, code, tail))
            print(tail, flush=True)
            continue
        json_name = f"{file_name}.json"
        try:
            numbers = json.loads((results / json_name).read_text())
            if module == "bench.throughput.buffer_ingest":
                rows += parse_buffer(numbers)
            elif module == "bench.throughput.producer":
                prod_rows, load = parse_producer(numbers)
                rows += prod_rows
            else:
                rows += parse_learner(numbers)
        except (OSError, ValueError) as exc:
            failures.append((name, "unread", f"{json_name}: {exc}"))
        except KeyError as exc:
            failures.append((name, "unparsed", f"{json_name} lacks {exc}: was its format changed?"))
    return rows, lines_run, failures, load


def load_rows(load: dict) -> list[tuple]:
    """The producer's in-place weight load against a memcpy and a tmpfs read of the same bytes, measured here."""
    base = copy_baselines(load["mib"])
    label = f"producer in-place weight load ({load['mib']:.1f} MiB, ms; lower is better)"
    rows = []
    for key, base_name in (("memcpy", "memcpy of the same bytes into preallocated memory"),
                           ("read", "read from a tmpfs file into preallocated memory")):
        lo, hi = base[f"{key}_ms_range"]  # the load's spread against the baseline's: extremes paired
        rows.append((label, load["ms"], base_name, base[f"{key}_ms"], base[f"{key}_ms"] / load["ms"],
                     {"min": lo / load["max_ms"], "max": hi / load["min_ms"]}))
    return rows


def markdown(command: str, minutes: float, lines_run: list[str], rows: list[tuple], failures: list[tuple],
             load: dict) -> list[str]:
    text = ["# Throughput: the pipeline's parts against plain baselines", "",
            f"Command: `{command}` ({minutes:.1f} min in all, on {os.cpu_count()} shared CPU cores). "
            "It ran, one after another:", "", "```", *lines_run, "```", "",
            "Each benchmark measures ours and its baseline side by side in the same run (interleaved reps); the "
            "details are in buffer_ingest.md, producer.md and learner.md. Ratio = ours / baseline as throughput "
            "(for the weight load, baseline time / our time): 1.00 = as fast as the baseline. The ratio is the "
            "median over repeats; min-max is the spread of the per-repeat ratios (for the weight load, the extremes "
            "of both sides paired).", "",
            "| component | ours | baseline | baseline value | ratio | ratio min-max |",
            "|---|---:|---|---:|---:|---|"]
    for comp, ours, base_name, base, ratio, spread in rows:
        rng = f"{spread['min']:.2f}-{spread['max']:.2f}" if spread else "-"
        text.append(f"| {comp} | {number(ours)} | {base_name} | {number(base)} | {ratio_text(ratio)} | {rng} |")
    if load:
        text += ["", f"Weight load: median of {load['loads']} in-place loads (min {load['min_ms']:.1f} ms, max "
                 f"{load['max_ms']:.1f} ms) of the producer benchmark's model: file read, copy into the engine's "
                 "parameters, prefix-cache reset, and the round trip through vLLM's engine-core process. The "
                 "baselines copy the same number of bytes in this process (median of 50)."]
    for name, code, tail in failures:
        text += ["", f"**{name} failed ({code})**; last lines of its output:", "", "```", tail, "```"]
    return text


def number(x: float) -> str:
    """A throughput or a time with as many digits as its size needs (also the README's table, bench.readme_results)."""
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3f} (1/{1 / ratio:.0f})"


def as_json(command: str, minutes: float, lines_run: list[str], rows: list[tuple], failures: list[tuple],
            load: dict, loadavg: dict) -> dict:
    """Every row with its numbers, for the README's table (bench.readme_results) and the smoke test."""
    keys = ("component", "ours", "baseline_name", "baseline", "ratio", "ratio_spread")
    return {"command": command, "minutes": minutes, "cpu_count": os.cpu_count(), "loadavg": loadavg,
            "ran": lines_run, "rows": [dict(zip(keys, r)) for r in rows], "weight_load": load,
            "failures": [{"name": n, "code": str(c), "tail": t} for n, c, t in failures]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps and smaller inputs (about 3 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny inputs, one rep: checks that every part runs")
    ap.add_argument("--results", default=str(output.RESULTS), help="folder for the component benches' own files")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before one benchmark is abandoned")
    ap.add_argument("--out", default=str(output.RESULTS / "throughput.md"), help="the table; its numbers go beside it "
                    "as .json")
    args = ap.parse_args(argv)
    t_all = time.monotonic()
    loads: list[float] = []  # the machine's 1-minute load average at each bench's start and end
    sizing = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows, lines_run, failures, load = run_benches(sizing, Path(args.results), args.timeout, loads)
    if load:
        rows += load_rows(load)
    command = ("python -m bench.throughput " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    minutes = (time.monotonic() - t_all) / 60
    text = markdown(command, minutes, lines_run, rows, failures, load)
    loadavg = {"samples_1min": loads, "end_15min": os.getloadavg()[2]}
    output.write(args.out, "\n".join(text), as_json(command, minutes, lines_run, rows, failures, load, loadavg))
    print("\n".join(text))
    return 1 if failures else 0

