"""A member of a dist weight group without vLLM, for tests and bench/weights.py: the real DistLoader and the real
worker-side receive (pipeline/weights/dist_receive.py), with a worker whose "model" is a dict of the tensors it
received.

    python -m pipeline.testing.weight_member NAME [--slow SECONDS] [--timing] [--max-mb MIB] -- CONFIG OVERRIDES...

Reads one announcement per line on stdin ("URI KEY": its uri and key) and loads it; its "model" takes at most
--max-mb MiB per version (a worker's model_bytes). Prints one JSON line per load:
{"ok": true, "version": v, "sums": {name: float64 sum}} or {"ok": false, "error": "..."}. With --slow, the
"model" sleeps that long per tensor it takes (a slow receiver, to be killed mid-broadcast); it prints
{"receiving": v} when the first tensor arrives. With --timing (bench/weights.py) it prints
{"ok": true, "version": v, "done": wall-clock time the load finished} instead of the sums.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.weights.dist_loader import DistLoader
from pipeline.weights.dist_plan import Plan
from pipeline.weights.dist_receive import receive
from pipeline.weights.uris import parse_dist_uri


class _Parallel:
    rank = 0


class FakeWorker:
    parallel_config = _Parallel()
    device = torch.device("cpu")

    def __init__(self, slow_s: float, max_bytes: int) -> None:
        self.slow_s, self.max_bytes = slow_s, max_bytes
        self.model: dict[str, torch.Tensor] = {}


class FakeEngine:
    """The part of pipeline.producer.engine.Engine that DistLoader uses, with one worker in a thread."""

    num_workers = 1

    def __init__(self, worker: FakeWorker) -> None:
        self.worker, self.version = worker, 0

    async def receive_weights(self, plan: Plan) -> float:
        def reload(tensors):
            for i, (name, t) in enumerate(tensors):
                if i == 0:
                    print(json.dumps({"receiving": plan.version}), flush=True)
                held = self.worker.model.get(name)  # copied into the tensor it holds, as an engine does
                if held is None or held.shape != t.shape or held.dtype != t.dtype:
                    self.worker.model[name] = t.clone()
                else:
                    held.copy_(t)
                time.sleep(self.worker.slow_s)
            return {"refreshed": 0}

        result = await asyncio.to_thread(receive, self.worker, Plan.decode(plan.encode()), reload,
                                         self.worker.max_bytes)
        if not result["ok"]:
            raise RuntimeError(f"receive failed (touched={result['touched']}): {result['error']}")
        self.version = plan.version
        return result["seconds"]


def request_line(ann: P.WeightAnnouncement) -> str:
    """The stdin line that asks a member to load `ann` (its key goes on stdin, never on a command line)."""
    return f"{ann.uri} {ann.key} {ann.signer}\n"


async def serve(loader: DistLoader, engine: FakeEngine, timing: bool) -> None:
    for line in sys.stdin:
        uri, key, signer = ([*line.split(), "", "", ""])[:3]
        if not uri:
            continue
        try:
            await loader.load(P.WeightAnnouncement(parse_dist_uri(uri)[2], uri, 0, key, signer))
            if timing:
                print(json.dumps({"ok": True, "version": engine.version, "done": time.time()}), flush=True)
                continue
            sums = {k: float(v.double().sum()) for k, v in engine.worker.model.items()}
            print(json.dumps({"ok": True, "version": engine.version, "sums": sums}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--max-mb", type=int, default=1024)
    args, overrides = parser.parse_known_args()
    cfg = load_config(None, [o for o in overrides if o != "--"])
    engine = FakeEngine(FakeWorker(args.slow, args.max_mb << 20))
    asyncio.run(serve(DistLoader(cfg.weights, engine, args.name), engine, args.timing))


if __name__ == "__main__":
    main()
