"""Flood: one real `reinforce-ada buffer` process on loopback under a flood of new identities and garbage, while an
honest scripted producer and learner keep training through it.

The flood (all from connections without the learner token, each identity new): undecodable and truncated frames,
messages of hundreds of frames, heartbeats of every size (oversized ones included), work requests for no rounds
(parked, then answered), results forged for guessed round ids, and learner-only messages (batches, versions with a
weights path, shutdowns). What it measures: the buffer's resident memory after warm-up and at the end (it must
stay flat: every per-client table is bounded), the honest learner's steps in every 10 s window (it must be served
throughout), and how the buffer counted what it dropped.

    python -m bench.flood --seconds 60

`attack_messages` and `poisoned_results` are also the adversarial suite's attacks (tests/test_adversarial_wire.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from bench import output
from pipeline import protocol as P
from pipeline.auth import create_token, learner_token_path
from pipeline.buffer.service import max_frames
from pipeline.config import load_config
from pipeline.testing.processes import (
    buffer_command,
    prompts_accounted,
    scripted_command,
    send_shutdown,
    start,
    wait_for_buffer,
)
from pipeline.transport import free_port_pair

MB = 1 << 20
POOL = 32  # attacker connections open at once; each new one has a new identity


def _frames(msg: Any) -> list[bytes]:
    return [bytes(f) for f in P.Encoder().encode(msg)]


def _sample(tokens: np.ndarray, logprobs: np.ndarray, reward: float = 1.0, version: int = 0,
            finish: str = "stop") -> P.Sample:
    return P.Sample(tokens, logprobs, reward, version, finish)


def attack_messages(rng: random.Random, weights_dir: str = "/tmp", frames: int = 0) -> list[list[bytes]]:
    """One burst of hostile messages from a connection without the learner role (one of each kind); with
    `frames` > 0 also a message of that many frames (pass more than the buffer's max_frames)."""
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    tokens = nrng.integers(0, 32, size=8, dtype=np.int32)
    forged = [_sample(tokens, np.zeros(8, np.float32), float(rng.random() < 0.5)) for _ in range(8)]
    guess = rng.randrange(0, 5000)  # round ids are sequential: guessable
    stats = {f"k{i}": rng.random() for i in range(rng.randrange(0, 20))}
    return [
        [rng.randbytes(rng.randrange(1, 64))],  # garbage
        [_frames(P.WorkRequest("x", 1, 0))[0][:5]],  # truncated header
        [rng.randbytes(16) for _ in range(rng.randrange(100, 300))],  # many frames of garbage
        _frames(P.Heartbeat("victim", "producer", 0, stats)),  # claims another producer's name
        _frames(P.Heartbeat("x", "producer", 0, {f"s{i}": 1.0 for i in range(200)})),  # oversized: not decoded
        _frames(P.WorkRequest("x", -1, 0)),  # a negative count: invalid
        _frames(P.Heartbeat("x", "learner", 0, {})),  # a learner's heartbeat from a producer connection
        _frames(P.WorkRequest("victim", 0, 0)),  # parked, then answered empty
        _frames(P.RoundResult("victim", guess, guess, np.arange(4, dtype=np.int32), forged, 0.1)),
        _frames(P.RoundResult("victim", guess + 1, guess + 1, P.empty_array("int32"), [], 0.1)),  # "unservable"
        _frames(P.BatchRequest("thief", 0, 4, 10)),
        _frames(P.VersionUpdate(10**6, P.WeightAnnouncement(10**6, f"{weights_dir}/../../etc/passwd", 1))),
        _frames(P.Shutdown("flooded")),
        [msgspec.msgpack.encode(["Exec", "rm -rf /"])],
    ] + ([_frames(P.MetricsRequest("x")) + [b""] * frames] if frames else [])


def poisoned_results(rnd: P.RoundAssignment, prompt_ids: np.ndarray, max_new_tokens: int) -> dict[str, P.RoundResult]:
    """Results for a round the attacker holds, one per value the edge must refuse (the key: the reason counted)."""
    n = rnd.num_samples
    ok_tokens, ok_lp = np.arange(4, dtype=np.int32), np.full(4, -0.5, np.float32)

    def result(samples: list[P.Sample], prompt: np.ndarray = prompt_ids, prompt_id: int = rnd.prompt_id):
        return P.RoundResult("attacker", rnd.round_id, prompt_id, prompt, samples, 0.1, rnd.kind)

    def each(**kw: Any) -> list[P.Sample]:
        base = {"tokens": ok_tokens, "logprobs": ok_lp, "reward": 1.0, "version": 0, "finish": "stop", **kw}
        return [_sample(**base) for _ in range(n)]

    long = np.zeros(max_new_tokens + 1, np.int32)
    return {
        "reward": result(each(reward=1e200)),
        "logprob": result(each(logprobs=np.array([-0.5, float("nan"), -0.1, -0.2], np.float32))),
        "logprob+": result(each(logprobs=np.array([-0.5, 3.0, -0.1, -0.2], np.float32))),
        "logprob-inf": result(each(logprobs=np.array([-0.5, -np.inf, -0.1, -0.2], np.float32))),
        "version": result(each(version=2**63 - 1)),
        "length": result(each(tokens=long, logprobs=np.zeros(long.size, np.float32))),
        "length0": result(each(tokens=P.empty_array("int32"), logprobs=P.empty_array("float32"))),
        "prompt": result(each(), prompt=P.empty_array("int32")),
        "prompt_id": result(each(), prompt_id=rnd.prompt_id + 1),
        "finish_reason": result(each(finish="exploit")),
        "samples": result(each() + each()[:1]),  # one more than asked for (within the frame limit)
    }


class Flooder:
    """Sends `attack_messages` from a new identity per burst, keeping POOL connections open; thread-safe stop."""

    def __init__(self, port: int, seed: int = 0, weights_dir: str = "/tmp") -> None:
        self.url = f"tcp://127.0.0.1:{port}"
        self.rng = random.Random(seed)
        self.weights_dir = weights_dir
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.identities = self.messages = 0
        self.too_many = max_frames(load_config(None, [])) + 1  # a message over the buffer's frame limit
        self.stop = threading.Event()

    def burst(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"flood-{self.identities}-{self.rng.randrange(1 << 30)}".encode())
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.RCVHWM, 10)  # replies (parked work requests) are not read: the buffer drops them
        sock.connect(self.url)
        frames_attack = self.too_many if self.identities % 10 == 0 else 0
        for frames in attack_messages(self.rng, self.weights_dir, frames_attack):
            sock.send_multipart(frames)
            self.messages += 1
        self.identities += 1
        self.socks.append(sock)
        if len(self.socks) > POOL:
            self.socks.pop(0).close()

    def run(self, rate_per_s: float) -> None:
        """Bursts at `rate_per_s` new identities per second until `stop` is set."""
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.burst()
            ahead = self.identities / rate_per_s - (time.monotonic() - t0)
            if ahead > 0:
                self.stop.wait(ahead)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


def run_flood(seconds: float = 60.0, rate_per_s: float = 200.0, warmup_s: float = 10.0,
              run_dir: str | Path | None = None, log=print) -> dict:
    """Run the flood (see the module docstring) and return its numbers; processes are always cleaned up."""
    import psutil

    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flood-"))
    token = create_token(learner_token_path(run_dir / "tiny"))  # the learner holds it; the flood does not
    port = free_port_pair()
    procs, flooder = [], None
    try:
        buf = start(buffer_command(port, run_dir, batch=8), run_dir / "buffer.log")
        procs.append(buf)
        wait_for_buffer(port, proc=buf)
        mem = psutil.Process(buf.pid)
        rss_idle = mem.memory_info().rss
        out_p, out_l = run_dir / "producer.json", run_dir / "learner.json"
        procs.append(start(scripted_command("producer", port, "--id", "honest", "--round-seconds", "0.02",
                                            "--out", str(out_p)), run_dir / "producer.log"))
        learner = start(scripted_command("learner", port, "--steps", "1000000000", "--batch", "8", "--duration",
                                         str(seconds), "--no-shutdown", "--token-file", str(token),
                                         "--out", str(out_l)), run_dir / "learner.log")
        procs.append(learner)
        flooder = Flooder(port)
        thread = threading.Thread(target=flooder.run, args=(rate_per_s,), daemon=True)
        thread.start()
        t0 = time.monotonic()
        rss: list[tuple[float, int]] = []
        mem.cpu_percent(None)  # starts the buffer's CPU measurement
        steps: list[tuple[float, int]] = []  # the learner's version, seen from a probe, every second
        while learner.poll() is None and time.monotonic() - t0 < seconds + 60:
            now = time.monotonic() - t0
            rss.append((now, mem.memory_info().rss))
            m = wait_for_buffer(port, proc=buf, timeout_s=10)
            steps.append((now, m["learner_version"]))
            time.sleep(1.0)
        flooder.stop.set()
        thread.join()
        assert learner.wait(timeout=30) == 0, (run_dir / "learner.log").read_text()[-2000:]
        m = wait_for_buffer(port, proc=buf, timeout_s=20)
        rss_end = mem.memory_info().rss
        cpu = mem.cpu_percent(None)  # the buffer's share of one core over the whole flood
        send_shutdown(port, "flood over", token_file=token)
        buf.wait(timeout=30)
    finally:
        if flooder is not None:
            flooder.stop.set()
            flooder.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    summary = json.loads(out_l.read_text())
    warm = [r for t, r in rss if t >= warmup_s] or [rss_end]
    windows = [v for t, v in steps if t >= warmup_s]
    per_window = [b - a for a, b in zip(windows[::10], windows[10::10])]  # learner steps per 10 s
    result = {
        "seconds": seconds, "identities": flooder.identities, "attack_messages": flooder.messages,
        "rss_idle_mb": rss_idle / MB, "rss_warm_mb": warm[0] / MB, "rss_max_mb": max(warm) / MB,
        "rss_end_mb": rss_end / MB, "rss_growth": rss_end / warm[0] - 1.0,
        "rss_mb_every_2s": [round(r / MB, 1) for _, r in rss[::2]],
        "buffer_cpu_percent": cpu, "load_average": os.getloadavg()[0],
        "learner_steps": summary["steps"], "steps_per_10s": per_window, "poisoned": summary["poisoned"],
        "late_groups": summary["late_groups"], "prompts_accounted": prompts_accounted(m),
        "peers": m["peers"], "handler_errors": m["buffer/handler_errors"],
        **{k: m[f"buffer/{k}"] for k in ("malformed", "invalid", "refused_role", "results_foreign",
                                         "peers_evicted", "peers_expired", "peers_refused", "weights_refused",
                                         "unroutable")},
        "results_ignored": m["results_ignored"], "learner_version": m["learner_version"],
    }
    log(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=200.0, help="new attacker identities per second")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the reference memory sample")
    parser.add_argument("--run-dir", help="where logs go (default: a fresh temporary directory)")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    r = run_flood(args.seconds, args.rate, args.warmup, args.run_dir)
    if args.out:
        output.write_json(args.out, r)
    ok = r["rss_growth"] < 0.10 and min(r["steps_per_10s"] or [0]) > 0 and r["poisoned"] == 0 and \
        r["prompts_accounted"] and r["handler_errors"] == 0
    print(f"{r['identities']} identities, {r['attack_messages']} attack messages in {r['seconds']:.0f} s: buffer RSS "
          f"{r['rss_warm_mb']:.1f} MB after warm-up -> {r['rss_end_mb']:.1f} MB ({100 * r['rss_growth']:+.1f}%); "
          f"learner steps per 10 s {r['steps_per_10s']}; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
