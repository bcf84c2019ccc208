"""The learner process's loop (every rank): fetch a batch, train, publish, announce, checkpoint.

Only rank 0 talks to the buffer; it shares each step's batch (or error, or stop) with the other ranks (ranks.py).
A SIGINT or SIGTERM stops the loop after the step in progress (or at once while it waits for a batch), and the
version reached is checkpointed before the process exits (stopping.py), so a stopped run loses no trained step.
Invariant: version v+1 is announced (VersionUpdate) only once producers can load it (its weight file is complete
on disk, or its broadcast is staged: pipeline/weights/).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline import protocol as P
from pipeline.consumer import checkpoint, ranks
from pipeline.consumer.fetch import LearnerError, fetch_batch
from pipeline.consumer.learner import Learner
from pipeline.consumer.runlog import RunLog
from pipeline.consumer.stopping import Stopped, StopSignals
from pipeline.cores import pin_cores
from pipeline.hf import HF_DIR, HfSource
from pipeline.transport import BufferClient, parse_connect, unique_identity

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)


def _step_line(m: dict[str, Any], num_groups: int, requested: int) -> str:
    line = (f"step {m['step']} | reward {m.get('reward_mean', 0.0):.2f} | kept {num_groups}/{requested} | "
            f"stale {int(m.get('staleness_max', 0))} | {m['step_seconds']:.1f} s | loss {m['loss']:.4f} | "
            f"kl {m['kl_behaviour']:.2e} | wait {m['wait_seconds']:.1f} s")
    if m.get("skipped_steps"):  # non-finite loss or gradients: see the learner's warning for the prompt ids
        line += f" | skipped {m['skipped_steps']} optimizer step(s)"
    return line


def next_batch(client: BufferClient | None, learner: Learner, learner_id: str, stop: StopSignals) -> P.Batch | None:
    """The batch every rank trains on next (rank 0 fetches it), or None to stop (a Shutdown from the buffer, or a
    stop signal on rank 0). Raises LearnerError on every rank when rank 0 cannot get one."""
    lc = learner.cfg.learner
    if learner.rank == 0:
        assert client is not None
        try:
            with stop.interruptible():
                batch = fetch_batch(client, learner_id, learner.version, lc.batch_prompts, lc.batch_timeout_s)
        except Stopped as exc:
            log.info("%s at version %d: checkpointing, then exiting", exc, learner.version)
            ranks.broadcast(ranks.Stop(str(exc)), 0, learner.world_size, learner.device)
            return None
        except Exception as exc:  # the other ranks wait in the broadcast: tell them, or they hang
            text = str(exc) if isinstance(exc, LearnerError) else f"rank 0 failed: {type(exc).__name__}: {exc}"
            ranks.broadcast(ranks.RankError(text), 0, learner.world_size, learner.device)
            raise
        msg = ranks.Stop("shutdown from the buffer") if batch is None else ranks.BatchFrames.of(batch)
        ranks.broadcast(msg, 0, learner.world_size, learner.device)
        return batch
    msg = ranks.broadcast(None, learner.rank, learner.world_size, learner.device)
    if isinstance(msg, ranks.RankError):
        raise LearnerError(msg.text)
    if isinstance(msg, ranks.Stop):
        return None
    return msg.batch()


def run(cfg: Config, connect: str | None = None, resume: bool = False) -> int:
    """The learner loop (every rank); returns the process exit code (128 + the signal's number when a signal
    stopped it)."""
    lc = cfg.learner
    stop = StopSignals()
    pin_cores(lc.cpu_cores, "learner.cpu_cores")  # before torch starts its threads: they inherit the pin
    if lc.cpu_threads:
        torch.set_num_threads(lc.cpu_threads)  # leave the other cores to the engines on a shared CPU machine
    learner = Learner(cfg)
    rank0 = learner.rank == 0
    learner_id = unique_identity(f"learner-{cfg.run.name}")  # its role is its key or token, never this name
    if resume:
        extra = learner.load_checkpoint()
        if rank0:
            print(f"resumed at version {learner.version}" if extra is not None else
                  "no checkpoint found: starting at version 0", flush=True)
    runlog = RunLog(cfg, learner.version if resume else None) if rank0 else None
    client = None
    if rank0:
        if connect:
            router_url, control_url = parse_connect(connect)
        else:
            router_url, control_url = parse_connect(f"{cfg.endpoints.host}:{cfg.endpoints.router_port}",
                                                    cfg.endpoints.control_port)
        client = BufferClient.for_learner(cfg, router_url, control_url, learner_id)  # the learner's key or token
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        _continue_versions(learner, client)
    ann = learner.publish() if learner.version > 0 else None  # a resumed run's producers need its weights
    if client is not None:
        client.send(P.VersionUpdate(learner.version, ann))
    last_ckpt, last_metrics = learner.version, {}
    try:
        while learner.version < lc.num_steps:
            t_wait = time.perf_counter()
            batch = next_batch(client, learner, learner_id, stop)
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
                client.send(P.VersionUpdate(learner.version, ann))
                metrics.update(learner.publisher.stats())  # weight_*: publishes, broadcasts and their failures
                metrics.update(batch.metrics)  # already namespaced by the buffer (buffer/*, eval/*, producers/*)
                metrics["time"] = time.time()
                runlog.step(metrics, batch.groups)
                print(_step_line(metrics, len(batch.groups), lc.batch_prompts), flush=True)
            last_metrics = dict(batch.metrics)
            if lc.checkpoint_every and learner.version % lc.checkpoint_every == 0:
                save_checkpoint(learner, last_metrics)
                last_ckpt = learner.version
        if learner.version != last_ckpt:
            save_checkpoint(learner, last_metrics)
        if client is not None and learner.version >= lc.num_steps:
            client.send(P.Shutdown("learner finished"))
            runlog.finish(learner.version, lambda: bool(stop.signum))  # the final evaluation, for the trackers
    finally:
        if client is not None:
            client.close()
        if runlog is not None:
            runlog.close()
        stop.restore()
        if learner.publisher is not None:
            learner.publisher.close()
    return stop.exit_code


def _continue_versions(learner: Learner, client: BufferClient | None) -> None:
    """After a crash the buffer (and producers) may be ahead of the checkpoint: continue numbering above the
    buffer's version, so the restored weights are announced as the newest and versions only ever increase. A
    buffer at the checkpoint's own version (a stopped run resumed, or a crash right after a checkpoint) holds these
    very weights: the learner goes on from there, and no version is skipped."""
    buffer_version = 0
    if client is not None:
        snap = client.request(P.MetricsRequest(client.identity), P.MetricsSnapshot, 30.0)
        if snap is not None:
            buffer_version = int(snap.metrics.get("learner_version", 0))
    if learner.world_size > 1:
        t = torch.tensor([buffer_version], dtype=torch.long, device=learner.device)  # nccl wants device tensors
        dist.broadcast(t, 0)
        buffer_version = int(t.item())
    if buffer_version > learner.version:
        log.warning("the buffer is at version %d, ahead of the checkpoint's %d (steps since the checkpoint were "
                    "lost): continuing at version %d", buffer_version, learner.version, buffer_version + 1)
        learner.version = buffer_version + 1


def save_checkpoint(learner: Learner, buffer_metrics: dict) -> Path:
    """Checkpoint the current version with its Hugging Face export in hf/ (collective); rank 0 says where."""
    path = checkpoint.save_checkpoint(learner.checkpoint_root, learner.backend, learner.version,
                                      learner.optimizer_steps, _extra(learner.version, buffer_metrics),
                                      hf=HfSource.of(learner.cfg))
    if learner.rank == 0:
        print(f"checkpoint {path} (Hugging Face model: {path / HF_DIR})", flush=True)
    return path


def _extra(version: int, buffer_metrics: dict) -> bytes:
    # the opaque resume blob; the buffer keeps its own data position, this records what the learner saw
    return json.dumps({"version": version, "buffer_metrics": buffer_metrics}).encode()
