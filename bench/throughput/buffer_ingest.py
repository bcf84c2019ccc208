"""How fast the buffer service ingests round results, against raw ZeroMQ PUSH/PULL of the same frames.

Both sides run as separate processes on loopback TCP. The buffer is the real `reinforce-ada buffer` process; a
sender asks it for rounds, then streams their results (8 samples of 1,000 tokens each: int32 ids and float32
log-probs as extra frames) as fast as it can, and finally asks for metrics: the reply comes after every result
was processed (one connection keeps order), so first send -> reply is the ingest time. The raw baseline sends
the very same frames from a PUSH to a PULL that only receives them.

    python -m bench.throughput.buffer_ingest [--rounds 2500] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import zmq

from bench import output
from pipeline import protocol as P
from pipeline.testing.processes import buffer_command, wait_for_buffer
from pipeline.transport import BufferClient, free_port, free_port_pair


def _frames_for(rounds: list[P.RoundAssignment], tokens: int, seed: int = 0) -> list[list]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 32000, size=tokens, dtype=np.int32)
    lps = -rng.random(tokens, dtype=np.float32)
    prompt = np.arange(64, dtype=np.int32)
    enc = P.Encoder()
    out = []
    for rnd in rounds:
        samples = [P.Sample(ids, lps, float(rng.random() < 0.5), 0, "stop") for _ in range(rnd.num_samples)]
        out.append(list(enc.encode(P.RoundResult("bench", rnd.round_id, rnd.prompt_id, prompt, samples, 0.0))))
    return out


def _pull(port: int, count: int, conn) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(f"tcp://127.0.0.1:{port}")
    conn.send("ready")
    sock.recv_multipart(copy=False)
    t0 = time.perf_counter()
    for _ in range(count - 1):
        sock.recv_multipart(copy=False)
    conn.send(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()


def raw_pushpull(frames: list[list]) -> float:
    """Seconds for a PULL process to receive all messages (first excluded: connection setup)."""
    port = free_port()
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_pull, args=(port, len(frames), child))
    proc.start()
    parent.recv()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for f in frames:
        sock.send_multipart(f, copy=False)
    seconds = parent.recv()
    proc.join()
    sock.close(0)
    ctx.term()
    return seconds


def buffer_ingest(num_rounds: int, tokens: int) -> tuple[float, dict]:
    """Seconds for a real buffer process to ingest `num_rounds` results, and its metrics afterwards."""
    router = free_port_pair()
    control = router + 1
    run_dir = tempfile.mkdtemp(prefix="reinforce-ada-bench-")  # its own: benches and tests may run at once
    cmd = buffer_command(router, run_dir, "--data.num_arithmetic_train", str(num_rounds * 2),
                         "--buffer.lease_s", "600", batch=num_rounds * 2)
    # one core for the buffer, as a deployment would give it: the sender runs on the other
    buf = subprocess.Popen(["taskset", "-c", "0"] + cmd if _have_taskset() else cmd,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = BufferClient(f"tcp://127.0.0.1:{router}", f"tcp://127.0.0.1:{control}", "bench")
    try:
        wait_for_buffer(router, 60, proc=buf)
        rounds: list[P.RoundAssignment] = []
        while len(rounds) < num_rounds:
            reply = client.request(P.WorkRequest("bench", min(512, num_rounds - len(rounds)), 0), P.Assignments, 5)
            rounds += reply.rounds
        frames = _frames_for(rounds, tokens)
        t0 = time.perf_counter()
        for f in frames:
            client.sock.send_multipart(f, copy=False)
        snap = client.request(P.MetricsRequest("bench"), P.MetricsSnapshot, 120)
        seconds = time.perf_counter() - t0
        client.send(P.Shutdown("bench over"))
        return seconds, snap.metrics
    finally:
        client.close()
        try:
            buf.wait(10)
        except subprocess.TimeoutExpired:
            buf.kill()
            buf.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _have_taskset() -> bool:
    return os.path.exists("/usr/bin/taskset") and (os.cpu_count() or 1) > 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2500)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(output.RESULTS / "buffer_ingest.md"), help="markdown (JSON beside it)")
    args = parser.parse_args(argv)
    samples = args.rounds * 8
    frames = _frames_for([P.RoundAssignment(i, i, "", "", 8, 1.0) for i in range(args.rounds)], args.tokens)
    raw_t, buf_t = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        raw_t.append(raw_pushpull(frames))
        seconds, metrics = buffer_ingest(args.rounds, args.tokens)
        assert metrics["samples_received"] == samples, metrics["samples_received"]
        buf_t.append(seconds)
    ratios = [r / b for r, b in zip(raw_t, buf_t)]  # buffer / raw throughput, per interleaved pair
    raw_rate = samples / float(np.median(raw_t))
    buf_rate = samples / float(np.median(buf_t))
    mb = samples * args.tokens * 8 / 1e6
    lines = [
        "# Buffer ingest vs raw ZeroMQ",
        "",
        f"`python -m bench.throughput.buffer_ingest --rounds {args.rounds} --tokens {args.tokens}` "
        f"({samples:,} samples of {args.tokens:,} tokens, {mb:.0f} MB of arrays; median of {args.repeats})",
        "",
        "| path | samples/s | MB/s |",
        "|---|---:|---:|",
        f"| raw ZeroMQ PUSH/PULL, same frames | {raw_rate:,.0f} | {raw_rate * args.tokens * 8 / 1e6:,.0f} |",
        f"| buffer service (decode, validate, schedule, pool) | {buf_rate:,.0f} | "
        f"{buf_rate * args.tokens * 8 / 1e6:,.0f} |",
        "",
        f"**ratio buffer / raw = {buf_rate / raw_rate:.2f}** (per repeat {min(ratios):.2f}-{max(ratios):.2f}; "
        "target: buffer >= 20,000 samples/s on one core)",
    ]
    text = "\n".join(lines)
    print(text)
    numbers = {"samples": samples, "tokens": args.tokens, "raw_samples_per_s": raw_rate,
               "buffer_samples_per_s": buf_rate, "ratio_spread": {"min": min(ratios), "max": max(ratios)}}
    output.write(args.out, text, numbers)  # the JSON is read by bench.throughput
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
