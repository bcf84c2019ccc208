"""`reinforce-ada learner`: ask the buffer for batches, train, publish versioned weights, checkpoint.

    reinforce-ada learner --config FILE [--connect HOST:PORT] [--resume] [--model DIR] [--section.key VALUE ...]
    torchrun --nproc-per-node 2 -m pipeline.consumer.main --config FILE ...   (several ranks)

Only rank 0 talks to the buffer. It broadcasts each batch to the other ranks as the protocol's own frames
(decoded on every rank with the typed decoder), so nothing the buffer sent is ever unpickled.
Invariant: version v+1 is announced (VersionUpdate) only after its weight file is complete on disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger("pipeline.consumer")

POLL_S = 5.0  # how long one BatchRequest may wait at the buffer
REPLY_MARGIN_S = 30.0  # extra wait for the reply: never send a second request while the first may be answered


class LearnerError(RuntimeError):
    """A fatal learner condition (no data for too long); the message says what to check."""


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="reinforce-ada learner", allow_abbrev=False,
                                     description="Train on batches from the buffer and publish weights.")
    parser.add_argument("--config", help="TOML config file (default: all defaults)")
    parser.add_argument("--connect", help="buffer HOST:PORT (control channel on PORT+1); "
                                          "default: endpoints.host:endpoints.router_port")
    parser.add_argument("--resume", action="store_true", help="continue from run_dir/checkpoints/latest")
    parser.add_argument("--model", help="model directory (same as --model.path)")
    args, overrides = parser.parse_known_args(argv)
    if args.model:
        overrides += ["--model.path", args.model]
    return args, overrides


def _fetch_batch(client, learner_id: str, version: int, num_groups: int, timeout_s: float):
    """The next non-empty Batch for `version`, or None when a Shutdown arrived. Raises LearnerError on timeout."""
    from pipeline import protocol

    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    while True:
        for msg in client.poll_control():
            if isinstance(msg, protocol.Shutdown):
                log.info("shutdown from the buffer: %s", msg.reason)
                return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise LearnerError(f"no batch arrived for {timeout_s:.0f} s (learner.batch_timeout_s) at version "
                               f"{version}: is the buffer running and are producers generating? Check their logs")
        wait_s = min(left, POLL_S)
        client.send(protocol.Heartbeat(learner_id, "learner", version, {}))
        reply = client.request(protocol.BatchRequest(learner_id, version, num_groups, int(wait_s * 1000)),
                               protocol.Batch, wait_s + REPLY_MARGIN_S)
        if reply is not None and reply.learner_version == version and reply.groups:
            return reply
        if reply is not None and reply.learner_version != version:
            log.warning("dropping a batch for version %d at version %d", reply.learner_version, version)
        if time.monotonic() - last_note > 60:
            log.info("waiting for a batch at version %d (%.0f s left)", version, deadline - time.monotonic())
            last_note = time.monotonic()


def _broadcast_batch(batch, rank: int, world_size: int):
    """Rank 0's batch (or None / an error string) on every rank, as protocol frames."""
    if world_size == 1:
        return batch
    import torch.distributed as dist

    from pipeline import protocol

    if rank == 0:
        payload: Any = batch if isinstance(batch, str) or batch is None else \
            [bytes(f) for f in protocol.Encoder().encode(batch)]
        box = [payload]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    if payload is None or isinstance(payload, str) or rank == 0:
        return batch if rank == 0 else payload
    return protocol.Decoder(protocol.Batch).decode(payload)


def _step_line(m: dict[str, Any], num_groups: int, requested: int) -> str:
    return (f"step {m['step']} | reward {m.get('reward_mean', 0.0):.2f} | kept {num_groups}/{requested} | "
            f"stale {int(m.get('staleness_max', 0))} | {m['step_seconds']:.1f} s | loss {m['loss']:.4f} | "
            f"kl {m['kl_behaviour']:.2e} | wait {m['wait_seconds']:.1f} s")


def run(cfg, connect: str | None = None, resume: bool = False) -> int:
    """The learner loop (every rank); returns the process exit code."""
    from pipeline import protocol
    from pipeline.consumer.learner import Learner
    from pipeline.transport import BufferClient, parse_connect

    lc = cfg.learner
    if lc.cpu_threads:
        import torch

        torch.set_num_threads(lc.cpu_threads)  # leave the other cores to the engines on a shared CPU machine
    learner = Learner(cfg)
    rank0 = learner.rank == 0
    learner_id = f"learner-{cfg.run.name}"
    if resume:
        extra = learner.load_checkpoint()
        if rank0:
            print(f"resumed at version {learner.version}" if extra is not None else
                  "no checkpoint found: starting at version 0", flush=True)
    client = None
    if rank0:
        if connect:
            router_url, control_url = parse_connect(connect)
        else:
            router_url, control_url = parse_connect(f"{cfg.endpoints.host}:{cfg.endpoints.router_port}",
                                                    cfg.endpoints.control_port)
        client = BufferClient(router_url, control_url, learner_id, cfg.endpoints.keys_dir)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        _continue_versions(learner, client)
    ann = learner.publish() if learner.version > 0 else None  # a resumed run's producers need its weights
    if client is not None:
        client.send(protocol.VersionUpdate(learner.version, ann))
    last_ckpt, last_metrics = learner.version, {}
    try:
        while learner.version < lc.num_steps:
            t_wait = time.perf_counter()
            batch: Any = None
            if rank0:
                try:
                    batch = _fetch_batch(client, learner_id, learner.version, lc.batch_prompts, lc.batch_timeout_s)
                except LearnerError as exc:
                    _broadcast_batch(str(exc), 0, learner.world_size)
                    raise
            batch = _broadcast_batch(batch, learner.rank, learner.world_size)
            if isinstance(batch, str):
                raise LearnerError(batch)
            if batch is None:
                break
            t0 = time.perf_counter()
            metrics = learner.train_step(batch.groups)
            t_pub = time.perf_counter()
            ann = learner.publish()
            metrics["publish_seconds"] = time.perf_counter() - t_pub
            metrics["wait_seconds"] = t0 - t_wait
            metrics["step_seconds"] = time.perf_counter() - t0
            metrics["learner_busy"] = metrics["step_seconds"] / max(1e-9, time.perf_counter() - t_wait)
            if rank0:
                client.send(protocol.VersionUpdate(learner.version, ann))
                metrics.update(batch.metrics)  # already namespaced by the buffer (buffer/*, eval/*, producers/*)
                metrics["time"] = time.time()
                with open(cfg.run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                print(_step_line(metrics, len(batch.groups), lc.batch_prompts), flush=True)
            last_metrics = dict(batch.metrics)
            if lc.checkpoint_every and learner.version % lc.checkpoint_every == 0:
                learner.save_checkpoint(_extra(learner.version, last_metrics))
                last_ckpt = learner.version
        if learner.version != last_ckpt:
            learner.save_checkpoint(_extra(learner.version, last_metrics))
        if client is not None and learner.version >= lc.num_steps:
            client.send(protocol.Shutdown("learner finished"))
    finally:
        if client is not None:
            client.close()
    return 0


def _continue_versions(learner, client) -> None:
    """After a crash the buffer (and producers) may be ahead of the checkpoint: continue numbering above the
    buffer's version, so the restored weights are announced as the newest and versions only ever increase."""
    from pipeline import protocol

    buffer_version = 0
    if client is not None:
        snap = client.request(protocol.MetricsRequest(client.identity), protocol.MetricsSnapshot, 30.0)
        if snap is not None:
            buffer_version = int(snap.metrics.get("learner_version", 0))
    if learner.world_size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([buffer_version], dtype=torch.long)
        dist.broadcast(t, 0)
        buffer_version = int(t.item())
    if buffer_version > 0 and buffer_version >= learner.version:
        log.warning("the buffer is at version %d, ahead of the checkpoint's %d (steps since the checkpoint were "
                    "lost): continuing at version %d", buffer_version, learner.version, buffer_version + 1)
        learner.version = buffer_version + 1


def _extra(version: int, buffer_metrics: dict) -> bytes:
    # the opaque resume blob; the buffer keeps its own data position, this records what the learner saw
    return json.dumps({"version": version, "buffer_metrics": buffer_metrics}).encode()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `reinforce-ada learner`."""
    from pipeline.config import ConfigError, load_config

    args, overrides = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from pipeline.transport import SecurityError

    try:
        return run(cfg, args.connect, args.resume)
    except (LearnerError, SecurityError) as exc:
        print(f"learner error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
