"""Overlap of sampling and training with real processes: the real buffer and the real learner (the tiny model,
torch, one thread), producers with a scripted engine of fixed speed. Time per learner step for max_staleness
0, 1 and 2 against the ideal max(generation time, training time), all measured in the same run.

- generation time per step: the same buffer and producers feeding a scripted learner that trains instantly;
- training time per step: the real learner's own compute time per step (`learner_seconds`);
- max_staleness 0 is synchronous (generation and training take turns), 1 and 2 let them overlap.

    python -m bench.pipeline [--steps 12] [--batch 16] [--round-seconds 0.05]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.testing.processes import buffer_command, scripted_command, start
from pipeline.transport import free_port_pair

RESULTS = Path(__file__).parent / "results"
WARMUP = 2  # steps left out of the medians (engine/learner start-up)
TOKENS = 24  # completion tokens of a scripted sample (the buffer's sampling.max_new_tokens bounds them)


def _buffer(run_dir: Path, port: int, batch: int, staleness: int, model_dir: str) -> subprocess.Popen:
    return start(buffer_command(port, run_dir, "--buffer.max_staleness", str(staleness), "--sampling.max_new_tokens",
                                str(TOKENS), "--run.name", "bench", batch=batch, model=model_dir))


def _producers(port: int, n: int, round_seconds: float, max_rounds: int) -> list[subprocess.Popen]:
    return [start(scripted_command("producer", port, "--id", f"p{i}", "--round-seconds", str(round_seconds),
                                   "--max-rounds", str(max_rounds), "--vocab", "99", "--tokens", str(TOKENS)))
            for i in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])][WARMUP:]


def generation_only(args, model_dir: str) -> float:
    """Median seconds per step when training is free (scripted learner)."""
    port = free_port_pair()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [_buffer(Path(tmp), port, args.batch, 1, model_dir)]
        try:  # the buffer and producers stop however this ends
            procs += _producers(port, args.producers, args.round_seconds, args.max_rounds)
            out = Path(tmp) / "summary.json"
            subprocess.run(scripted_command("learner", port, "--steps", str(args.steps), "--batch", str(args.batch),
                                            "--out", str(out)), check=True, stdout=subprocess.DEVNULL)
            summary = json.loads(out.read_text())
        finally:
            _stop(procs)
    return statistics.median(summary["step_seconds"][WARMUP:])


def with_learner(args, model_dir: str, staleness: int) -> tuple[float, float, float]:
    """(median seconds per step, median learner compute seconds per step, max staleness seen) with the real
    learner."""
    port = free_port_pair()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [_buffer(Path(tmp), port, args.batch, staleness, model_dir)]
        try:  # the buffer and producers stop however this ends
            procs += _producers(port, args.producers, args.round_seconds, args.max_rounds)
            rows = _learner_rows(args, model_dir, staleness, port, tmp)
        finally:
            _stop(procs)
    step = statistics.median(_intervals([r["time"] for r in rows]))
    train = statistics.median([r["learner_seconds"] for r in rows][WARMUP:])
    return step, train, max(r["staleness_max"] for r in rows)


def _learner_rows(args, model_dir: str, staleness: int, port: int, tmp: str) -> list[dict]:
    """Run the real learner for args.steps steps against the buffer on `port`; its metrics rows."""
    cmd = [sys.executable, "-m", "pipeline.cli", "learner", "--connect", f"127.0.0.1:{port}",
           "--model", model_dir, "--learner.batch_prompts", str(args.batch), "--learner.mini_batches", "1",
           "--learner.num_steps", str(args.steps), "--learner.checkpoint_every", "0", "--learner.lr", "1e-4",
           "--learner.cpu_threads", "1", "--buffer.max_staleness", str(staleness), "--run.dir", tmp,
           "--run.name", "bench", "--weights.dir", f"{tmp}/weights"]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the learner exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="groups per learner step")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--round-seconds", type=float, default=0.05, help="scripted engine time per assignment")
    parser.add_argument("--max-rounds", type=int, default=8, help="rounds a scripted producer runs at once")
    parser.add_argument("--out", default=str(RESULTS / "pipeline.md"), help="where the table goes")
    args = parser.parse_args(argv)
    from pipeline.models import TINY_DIR
    from pipeline.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model(TINY_DIR))
    t_gen = generation_only(args, model_dir)
    rows = []
    for k in (0, 1, 2):
        step, train, seen = with_learner(args, model_dir, k)
        rows.append((k, step, train, seen))
    t_train = statistics.median(r[2] for r in rows)
    ideal = max(t_gen, t_train)
    lines = [
        "# Pipeline overlap: sampling and training",
        "",
        f"`python -m bench.pipeline --steps {args.steps} --batch {args.batch} --round-seconds {args.round_seconds}"
        f" --max-rounds {args.max_rounds}` ({args.producers} scripted producers, the real buffer, the real learner"
        " on the tiny model; medians after "
        f"{WARMUP} warm-up steps)",
        "",
        f"generation alone: {t_gen:.3f} s/step; training alone: {t_train:.3f} s/step; "
        f"ideal max(gen, train) = {ideal:.3f} s/step; strictly alternating (gen + train) = {t_gen + t_train:.3f}",
        "",
        "| max_staleness | s/step | ideal / measured | (gen + train) / measured | staleness seen |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, step, _, seen in rows:
        lines.append(f"| {k} | {step:.3f} | {ideal / step:.2f} | {(t_gen + t_train) / step:.2f} | {seen:.0f} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
