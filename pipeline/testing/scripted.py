"""Scripted stand-ins for the model processes, for benchmarks and tests of the buffer and the supervisor:
a producer whose "engine" returns random tokens with rewards drawn from a per-prompt pass rate after a fixed
generation time, and a learner that takes batches, checks them, and bumps the version.

They speak the real wire protocol to a real buffer process over real ZeroMQ sockets; only the model is scripted.
Both survive a buffer restart: a request without a reply within --request-timeout is sent again (ZeroMQ
reconnects by itself), and the learner announces its version again before each retry. The learner presents the
learner role as the real one does: its CurveZMQ key (--keys-dir) or the run's token (--token-file).

    python -m pipeline.testing.scripted producer --connect 127.0.0.1:5555 --id p0 --round-seconds 0.05
    python -m pipeline.testing.scripted learner --connect 127.0.0.1:5555 --steps 5 --batch 8 --out summary.json

processes.py starts these (scripted_command) and a real buffer process, and probes it.
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
from pipeline.auth import LEARNER
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
                 tokens: int = 16, seed: int = 0, control_port: int | None = None, vocab: int = 32,
                 request_timeout_s: float = 5.0, heartbeat_s: float = 1.0, ignore_aborts: bool = False,
                 keys_dir: str = "", timeline: str = "") -> dict:
    """Serve rounds until the buffer shuts down (or SIGTERM). Returns counters (`rounds` = results sent).

    Every assignment "generates" for `round_seconds` (its rounds run concurrently, as in an engine), sending
    heartbeats and reading aborts meanwhile. `ignore_aborts` plays a producer whose control channel lags: it
    sends every result, so results of expired rounds reach the buffer late. The scripted engine loads new
    weights instantly: it adopts every learner version it hears of (VersionUpdate or an Assignments reply).
    With `timeline`, every WorkRequest (sent, answered) and every assignment (start, end, rounds, version) is
    written there as JSONL when it stops, in wall-clock seconds (bench.pipeline's timeline).
    """
    router_url, control_url = parse_connect(connect, control_port)
    client = BufferClient(router_url, control_url, producer_id, keys_dir)
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(producer_id.encode(), digest_size=4).digest(),
                                               "little") + seed)
    state = {"version": 0, "stop": False, "last_beat": 0.0}
    counts = {"rounds": 0, "samples": 0, "aborted": 0, "assignments": 0, "request_timeouts": 0}
    signal.signal(signal.SIGTERM, lambda *a: state.__setitem__("stop", True))
    aborted: set[int] = set()
    events: list[dict] = []

    def control(wait_s: float = 0.0) -> None:
        for msg in client.poll_control(wait_s):
            if isinstance(msg, P.VersionUpdate):
                state["version"] = max(state["version"], msg.version)
            elif isinstance(msg, P.Abort) and not ignore_aborts:
                aborted.update(msg.round_ids)
            elif isinstance(msg, P.Shutdown):
                state["stop"] = True
        now = time.monotonic()
        if now - state["last_beat"] >= heartbeat_s:
            state["last_beat"] = now
            client.send(P.Heartbeat(producer_id, "producer", state["version"], {"busy": 1.0, "running": 0.0}))

    try:
        while not state["stop"]:
            control()
            if state["stop"]:
                break
            asked = time.time()
            reply = client.request(P.WorkRequest(producer_id, max_rounds, state["version"]), P.Assignments,
                                   request_timeout_s)
            events.append({"kind": "request", "start": asked, "end": time.time(),
                           "rounds": len(reply.rounds) if reply is not None else 0})
            if reply is None:  # the buffer is down or restarting: ask again (ZeroMQ reconnects by itself)
                counts["request_timeouts"] += 1
                continue
            state["version"] = max(state["version"], reply.learner_version,
                                   reply.weights.version if reply.weights is not None else 0)
            if not reply.rounds:
                continue
            counts["assignments"] += 1
            version = state["version"]  # the weights the round starts with (the sample's oldest version)
            started, end = time.time(), time.monotonic() + round_seconds
            while (left := end - time.monotonic()) > 0 and not state["stop"]:
                control(min(left, heartbeat_s / 2, 0.1))
            events.append({"kind": "generate", "start": started, "end": time.time(), "rounds": len(reply.rounds),
                           "version": version})
            for rnd in reply.rounds:
                if state["stop"]:
                    break
                if rnd.round_id in aborted:
                    aborted.discard(rnd.round_id)
                    counts["aborted"] += 1
                    continue
                p = pass_rate(rnd.prompt, seed)
                samples = []
                for _ in range(rnd.num_samples):
                    ids = rng.integers(0, vocab, size=tokens, dtype=np.int32)
                    lp = -rng.random(tokens, dtype=np.float32)
                    samples.append(P.Sample(ids, lp, float(rng.random() < p), version, "stop"))
                # a prompt's tokens are the same in every round, as a tokenizer's are (the buffer checks it)
                prompt_ids = np.array([ord(c) % vocab for c in rnd.prompt[:32]] or [1], dtype=np.int32)
                client.send(P.RoundResult(producer_id, rnd.round_id, rnd.prompt_id, prompt_ids, samples,
                                          round_seconds, rnd.kind))
                counts["rounds"] += 1
                counts["samples"] += len(samples)
    finally:
        client.close()  # lingers until queued results are sent
        if timeline:
            with open(timeline, "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in events)
    return counts


def poisoned(group: P.Group, version: int) -> int:
    """Samples of `group` holding a value no honest producer sends (what the buffer's edge must keep out)."""
    bad = 0
    for s in group.samples:
        lp = s.logprobs
        bad += not (s.reward in (0.0, 1.0) and 1 <= s.token_ids.size <= 4096 and s.version <= version and
                    lp.size == s.token_ids.size and bool(np.isfinite(lp).all()) and float(lp.max()) <= 0.0 and
                    s.finish_reason in ("stop", "length") and group.prompt_token_ids.size > 0)
    return bad


def run_learner(connect: str, steps: int, batch: int, train_seconds: float = 0.0, max_staleness: int = 1,
                group_size: int = 4, control_port: int | None = None, timeout_s: float = 120.0,
                shutdown: bool = True, request_timeout_s: float = 10.0, duration_s: float = 0.0,
                keys_dir: str = "", token_file: str | None = None) -> dict:
    """Take `steps` batches (or stop after `duration_s` > 0), check every group, bump the version after each.

    A BatchRequest without a reply within `request_timeout_s` is sent again on a fresh socket, after the
    current VersionUpdate (a restarted buffer may have lost both). A Batch for another version (the late reply
    to an earlier request) is not trained: its groups are counted in `late_groups` / `late_prompt_ids`.
    Returns a summary.
    """
    router_url, control_url = parse_connect(connect, control_port)
    client = BufferClient(router_url, control_url, "scripted-learner", keys_dir, role=LEARNER, token_file=token_file)
    version = 0
    wait_ms = int(min(2000.0, request_timeout_s * 500))  # the buffer answers (maybe empty) well within the timeout
    summary: dict = {"steps": 0, "groups": 0, "bad_group_size": 0, "max_staleness_seen": 0, "mixed_groups": 0,
                     "resolved_groups": 0, "resolved_mixed": 0, "step_seconds": [], "wait_seconds": [],
                     "versions": [], "prompt_ids": [], "retries": 0, "late_groups": 0, "late_prompt_ids": [],
                     "poisoned": 0}
    start = time.monotonic()
    out_of_time = lambda: duration_s > 0 and time.monotonic() - start > duration_s  # noqa: E731
    try:
        for _ in range(steps):
            t0 = time.monotonic()
            groups: list = []
            while not groups and not out_of_time():
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"no batch within {timeout_s} s at version {version}")
                reply = client.request(P.BatchRequest("scripted-learner", version, batch, wait_ms), P.Batch,
                                       request_timeout_s)
                if reply is None:  # the buffer may be restarting: one fresh request, not a queue of them
                    summary["retries"] += 1
                    client.reconnect()
                    client.send(P.VersionUpdate(version))  # idempotent; a restarted buffer may not know it
                elif reply.learner_version != version:
                    summary["late_groups"] += len(reply.groups)
                    summary["late_prompt_ids"] += [g.prompt_id for g in reply.groups]
                else:
                    groups = reply.groups
            if not groups:
                break
            waited = time.monotonic() - t0
            for g in groups:
                summary["groups"] += 1
                summary["prompt_ids"].append(g.prompt_id)
                summary["bad_group_size"] += len(g.samples) != group_size
                summary["poisoned"] += poisoned(g, version)
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
        snap = None
        for _ in range(3):
            snap = client.request(P.MetricsRequest("scripted-learner"), P.MetricsSnapshot, 5.0)
            if snap is not None:
                break
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
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds to wait for a reply before asking again (producer 5, learner 10)")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="producer heartbeat interval in seconds")
    parser.add_argument("--ignore-aborts", action="store_true", help="producer: send results of aborted rounds")
    parser.add_argument("--duration", type=float, default=0.0, help="learner: stop after this many seconds")
    parser.add_argument("--no-shutdown", action="store_true", help="learner: leave the buffer running at the end")
    parser.add_argument("--keys-dir", default="", help="CurveZMQ keys directory (see `reinforce-ada keys`)")
    parser.add_argument("--token-file", default=None, help="learner: the run's learner token file (loopback)")
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--timeline", default="", help="producer: write its requests and assignments here (JSONL)")
    args = parser.parse_args(argv)
    if args.role == "producer":
        result = run_producer(args.connect, args.id, args.round_seconds, args.max_rounds, args.tokens,
                              control_port=args.control_port, vocab=args.vocab,
                              request_timeout_s=args.request_timeout or 5.0, heartbeat_s=args.heartbeat,
                              ignore_aborts=args.ignore_aborts, keys_dir=args.keys_dir, timeline=args.timeline)
    else:
        result = run_learner(args.connect, args.steps, args.batch, args.train_seconds,
                             group_size=args.group_size, control_port=args.control_port,
                             shutdown=not args.no_shutdown, request_timeout_s=args.request_timeout or 10.0,
                             duration_s=args.duration, keys_dir=args.keys_dir, token_file=args.token_file)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
