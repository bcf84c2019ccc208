"""Weight transport: time per version of the dist broadcast vs a memcpy of the same bytes vs the file transport.

    .venv/bin/python -m bench.weights [--reps 5] [--members 2] [--bucket-mb 256] [--big-mib 512]

Two tensor sets: the tiny model's weights (.cache/tiny-model) and a synthetic set of `--big-mib` MiB (float32
tensors of 16 MiB). Per version, interleaved rep by rep after a warm-up, each measured from the learner's call to the
weights being in the receivers' tensors:
  - memcpy: copying the same tensors into preallocated ones (the floor: one pass over the bytes; the fastest of
            5 copies per rep);
  - file:   `publish_weights` into /dev/shm (write, fsync, rename) and the producer-side read of the file into
            preallocated tensors (what the file transport costs on one machine);
  - dist:   `DistPublisher.publish` (packing a copy into buckets) and the gloo broadcast to 1 and to `--members`
            receiver processes (pipeline/testing/weight_member.py: the real DistLoader and worker-side receive, copying
            into preallocated tensors, as an engine does), until the last receiver has its copy.
Writes bench/results/weights.json and weights.md with medians and their ratios to memcpy, measured side by side,
and each ratio's spread over the reps (min-max of the per-rep ratios: memcpy and the transport of one rep run
seconds apart, so the machine's load cancels). The memcpy destination is preallocated and written during the
warm-up rep, so the baseline pays no page faults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import output
from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.testing.weight_member import request_line
from pipeline.weights.dist import DistPublisher
from pipeline.weights.file import iter_file, publish_weights

ROOT = Path(__file__).resolve().parents[1]


def tiny_state() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from pipeline.tiny_model import ensure_tiny_model

    # a model directory, not a weights folder: read it directly (iter_file accepts private weights folders only)
    path = ensure_tiny_model(ROOT / ".cache" / "tiny-model", seed=0) / "model.safetensors"
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def big_state(mib: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.randn(4 << 20) for i in range(mib // 16)}  # 16 MiB each


def time_memcpy(state: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], inner: int = 5) -> float:
    """The fastest of `inner` copies into the preallocated `dst`: the floor, which the machine's load and a
    preemption can only lengthen (a single 1.7 MiB copy measured 0.3-62 ms on the shared 2 cores)."""
    best = float("inf")
    for _ in range(inner):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    return best


def time_file(state: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], shm: Path, version: int) -> float:
    t0 = time.perf_counter()
    ann = publish_weights(state, shm, version, keep=1)
    for k, v in iter_file(ann.uri):
        dst[k].copy_(v)
    return time.perf_counter() - t0


class Members:
    """Receiver processes of the dist group, driven line by line."""

    def __init__(self, count: int, overrides: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "pipeline.testing.weight_member", f"bench{i}", "--timing",
                                        "--", *overrides], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True, env=env) for i in range(count)]

    def load(self, ann: P.WeightAnnouncement) -> float:
        """Ask every member to load `ann`; the wall-clock time the last one finished."""
        for p in self.procs:
            p.stdin.write(request_line(ann))
            p.stdin.flush()
        done = []
        for p in self.procs:
            msg = {"receiving": True}
            while "receiving" in msg:  # the member says when its first tensor arrives; then when it is done
                msg = json.loads(p.stdout.readline())
            if not msg.get("ok"):
                raise RuntimeError(f"a receiver failed: {msg}")
            done.append(msg["done"])
        return max(done)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()


def time_dist(pub: DistPublisher, members: Members, state: dict[str, torch.Tensor], version: int
              ) -> tuple[float, float]:
    """(publish to the last receiver's copy, the broadcast alone) in seconds."""
    t0 = time.time()
    ann = pub.publish(state, version)
    done = members.load(ann)
    return done - t0, pub.stats()["weight_broadcast_seconds"]


def bench_set(name: str, state: dict[str, torch.Tensor], reps: int, num_members: int, bucket_mb: int) -> dict:
    overrides = ["--weights.transport", "dist", "--weights.bucket_mb", str(bucket_mb),
                 "--weights.dist_timeout_s", "120", "--weights.dist_wait_s", "30"]
    cfg = load_config(None, overrides)
    num_bytes = sum(v.numel() * v.element_size() for v in state.values())
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {"memcpy": [], "file": [], "dist_1": [], f"dist_{num_members}": [],
                                     "broadcast_1": [], f"broadcast_{num_members}": []}
    sizes = [1, num_members] if num_members > 1 else [1]
    pubs: dict[int, DistPublisher] = {}
    groups: dict[int, Members] = {}
    try:  # receivers and publishers are closed however this ends
        for n in sizes:
            pubs[n] = DistPublisher(cfg.weights)
            groups[n] = Members(n, overrides)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            for rep in range(reps + 1):  # rep 0 warms up (page faults, group formation)
                version = rep + 1
                got = {"memcpy": time_memcpy(state, dst), "file": time_file(state, dst, Path(shm), version)}
                for n in sizes:
                    got[f"dist_{n}"], got[f"broadcast_{n}"] = time_dist(pubs[n], groups[n], state, version)
                if rep:
                    for k, v in got.items():
                        times[k].append(v)
                print(f"{name} rep {rep}: " + ", ".join(f"{k} {v:.3f} s" for k, v in got.items()), flush=True)
    finally:
        for members in groups.values():
            members.close()
        for pub in pubs.values():
            pub.close()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    per_rep = {k: [t / m for t, m in zip(v, times["memcpy"])] for k, v in times.items() if v}
    return {"set": name, "num_tensors": len(state), "num_bytes": num_bytes, "reps": reps,
            "median_s": med, "ratio_to_memcpy": {k: v / med["memcpy"] for k, v in med.items()},
            "ratio_spread": {k: {"min": min(v), "max": max(v)} for k, v in per_rep.items()},
            "memcpy_s_spread": {"min": min(times["memcpy"]), "max": max(times["memcpy"])},
            "dist_GBps": {k: num_bytes / v / 1e9 for k, v in med.items() if k.startswith("dist_")}}


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Weight transport: time per version", "",
             f"`python -m bench.weights --reps {args.reps} --members {args.members} --bucket-mb {args.bucket_mb} "
             f"--big-mib {args.big_mib}` on {platform.machine()}, {os.cpu_count()} CPU(s), torch "
             f"{torch.__version__}; medians of {args.reps} versions after a warm-up, measured side by side. "
             "Everything runs on one machine over loopback: the dist numbers are the transport's own cost, not a "
             "network's. Cells: median seconds (ratio of medians to memcpy; min-max of the per-rep ratios).", "",
             "| tensor set | bytes | memcpy | file (/dev/shm write + read) | dist, 1 receiver | "
             f"dist, {args.members} receivers | broadcast alone ({args.members}) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    n = args.members
    for r in results:
        m, x, sp = r["median_s"], r["ratio_to_memcpy"], r["ratio_spread"]
        cell = {k: f"{m[k]:.4f} s ({x[k]:.1f}x; {sp[k]['min']:.1f}-{sp[k]['max']:.1f})" for k in m}
        mc = r["memcpy_s_spread"]
        lines.append(f"| {r['set']} ({r['num_tensors']} tensors) | {r['num_bytes'] / 2**20:.1f} MiB | "
                     f"{m['memcpy']:.4f} s ({mc['min']:.4f}-{mc['max']:.4f}) | {cell['file']} | {cell['dist_1']} | "
                     f"{cell[f'dist_{n}']} | "
                     f"{cell[f'broadcast_{n}']} |")
    lines += ["", "Ratios are to memcpy of the same bytes. dist includes packing a copy of the weights into buckets "
              "on the learner (its training loop goes on right after), the request through the rendezvous store, "
              "the gloo broadcast and each receiver's copy into its tensors; 'broadcast alone' is the sender "
              "thread's time in the broadcast."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--big-mib", type=int, default=512)
    ap.add_argument("--out", default=str(output.RESULTS), help="folder for weights.json and weights.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = [bench_set("tiny model", tiny_state(), args.reps, args.members, args.bucket_mb),
               bench_set(f"{args.big_mib} MiB set", big_state(args.big_mib), args.reps, args.members,
                         args.bucket_mb)]
    output.write(Path(args.out) / "weights.md", markdown(results, args), {"args": vars(args), "results": results},
                 indent=2)
    print(markdown(results, args))
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
