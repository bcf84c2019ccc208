"""Scripted stand-ins for the model processes, for benchmarks and tests of the buffer and the supervisor:
a producer whose "engine" returns random tokens with rewards drawn from a per-prompt pass rate after a fixed
generation time, and a learner that takes batches, checks them, and bumps the version.

They speak the real wire protocol to a real buffer process over real ZeroMQ sockets; only the model is scripted.

    python -m bench.scripted producer --connect 127.0.0.1:5555 --id p0 --round-seconds 0.05
    python -m bench.scripted learner --connect 127.0.0.1:5555 --steps 5 --batch 8 --out summary.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time

import numpy as np

from pipeline import protocol as P
from pipeline.transport import BufferClient, parse_connect


def pass_rate(prompt: str, seed: int = 0) -> float:
    """A fixed pass rate per prompt: a fifth unsolvable, a tenth always solved, the rest uniform."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{prompt}".encode(), digest_size=8).digest(), "little")
    u = (h % 10_000) / 10_000
    if u < 0.2:
        return 0.0
    if u > 0.9:
        return 1.0
    return (u - 0.2) / 0.7


def run_producer(connect: str, producer_id: str, round_seconds: float = 0.0, max_rounds: int = 16,
                 tokens: int = 16, seed: int = 0, control_port: int | None = None, vocab: int = 32) -> dict:
    """Serve rounds until the buffer shuts down (or SIGTERM). Returns counters."""
    router_url, control_url = parse_connect(connect, control_port)
    client = BufferClient(router_url, control_url, producer_id)
    rng = np.random.default_rng(abs(hash(producer_id)) % 2**32 + seed)
    version = 0
    counts = {"rounds": 0, "samples": 0, "aborted": 0}
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("flag", True))
    aborted: set[int] = set()
    last_beat = 0.0
    try:
        while not stop["flag"]:
            for msg in client.poll_control():
                if isinstance(msg, P.VersionUpdate):
                    version = max(version, msg.version)
                elif isinstance(msg, P.Abort):
                    aborted.update(msg.round_ids)
                elif isinstance(msg, P.Shutdown):
                    stop["flag"] = True
            if stop["flag"]:
                break
            now = time.monotonic()
            if now - last_beat > 1.0:
                last_beat = now
                client.send(P.Heartbeat(producer_id, "producer", version, {"busy": 1.0, "running": 0.0}))
            reply = client.request(P.WorkRequest(producer_id, max_rounds, version), P.Assignments, 5.0)
            if reply is None:
                continue
            if reply.weights is not None:
                version = max(version, reply.weights.version)
            if not reply.rounds:
                continue
            if round_seconds:
                time.sleep(round_seconds)  # all rounds of one assignment "run" concurrently, as in an engine
            for rnd in reply.rounds:
                if rnd.round_id in aborted:
                    counts["aborted"] += 1
                    continue
                p = pass_rate(rnd.prompt, seed)
                samples = []
                for _ in range(rnd.num_samples):
                    ids = rng.integers(0, vocab, size=tokens, dtype=np.int32)
                    lp = -rng.random(tokens, dtype=np.float32)
                    samples.append(P.Sample(ids, lp, float(rng.random() < p), version, "stop"))
                prompt_ids = rng.integers(0, vocab, size=min(len(rnd.prompt), 32) or 1, dtype=np.int32)
                client.send(P.RoundResult(producer_id, rnd.round_id, rnd.prompt_id, prompt_ids, samples,
                                          round_seconds))
                counts["rounds"] += 1
                counts["samples"] += len(samples)
    finally:
        client.close()
    return counts


def run_learner(connect: str, steps: int, batch: int, train_seconds: float = 0.0, max_staleness: int = 1,
                group_size: int = 4, control_port: int | None = None, timeout_s: float = 120.0,
                shutdown: bool = True) -> dict:
    """Take `steps` batches, check every group, bump the version after each; returns a summary."""
    router_url, control_url = parse_connect(connect, control_port)
    client = BufferClient(router_url, control_url, "scripted-learner")
    version = 0
    summary: dict = {"steps": 0, "groups": 0, "bad_group_size": 0, "max_staleness_seen": 0, "mixed_groups": 0,
                     "resolved_groups": 0, "resolved_mixed": 0, "step_seconds": [], "wait_seconds": [],
                     "versions": [], "prompt_ids": []}
    try:
        for _ in range(steps):
            t0 = time.monotonic()
            groups: list = []
            while not groups:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"no batch within {timeout_s} s at version {version}")
                reply = client.request(P.BatchRequest("scripted-learner", version, batch, 2000), P.Batch, 10.0)
                groups = reply.groups if reply is not None else []
            waited = time.monotonic() - t0
            for g in groups:
                summary["groups"] += 1
                summary["prompt_ids"].append(g.prompt_id)
                summary["bad_group_size"] += len(g.samples) != group_size
                stale = max(version - s.version for s in g.samples)
                summary["max_staleness_seen"] = max(summary["max_staleness_seen"], stale)
                rewards = {s.reward for s in g.samples}
                summary["mixed_groups"] += len(rewards) > 1
                if g.resolved:
                    summary["resolved_groups"] += 1
                    summary["resolved_mixed"] += len(rewards) > 1
            if train_seconds:
                time.sleep(train_seconds)
            version += 1
            client.send(P.VersionUpdate(version))
            summary["steps"] += 1
            summary["versions"].append(version)
            summary["wait_seconds"].append(waited)
            summary["step_seconds"].append(time.monotonic() - t0)
        snap = client.request(P.MetricsRequest("scripted-learner"), P.MetricsSnapshot, 5.0)
        summary["buffer"] = snap.metrics if snap is not None else {}
        if shutdown:
            client.send(P.Shutdown("scripted learner finished"))
            time.sleep(0.2)
    finally:
        client.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["producer", "learner"])
    parser.add_argument("--connect", required=True)
    parser.add_argument("--control-port", type=int, default=None)
    parser.add_argument("--id", default="scripted-producer")
    parser.add_argument("--round-seconds", type=float, default=0.0)
    parser.add_argument("--max-rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32, help="token ids are drawn from [0, vocab)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--train-seconds", type=float, default=0.0)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--out", help="write the summary JSON here")
    args = parser.parse_args(argv)
    if args.role == "producer":
        result = run_producer(args.connect, args.id, args.round_seconds, args.max_rounds, args.tokens,
                              control_port=args.control_port, vocab=args.vocab)
    else:
        result = run_learner(args.connect, args.steps, args.batch, args.train_seconds,
                             group_size=args.group_size, control_port=args.control_port)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
