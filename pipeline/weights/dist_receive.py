"""The dist transport inside a vLLM worker: join the weight group the plan names and stream the broadcast buckets
into the model's own parameters (`reload_weights(weights_iterator=...)`), one bucket in memory at a time.

Runs in the worker process (called by worker_ext.WeightReloadExtension.receive_weights between engine steps). The
worker keeps its group from one version to the next and leaves it when a plan names another generation.

Never raises for a failed transfer; it reports {"ok": False, "touched": ..., "error": ...}. `touched` says whether
any tensor reached the model: a transfer that breaks after that leaves the model with a mix of two versions (vLLM
finishes the reload with what it got), so the engine must not generate until a complete version is in (engine.py
keeps it paused). A failure before the first bucket arrives leaves the model as it was.

Trust: the plan was opened and bounded by the loader (dist_loader.py, dist_plan.py); here its size is bounded again
by the receiver's own model (`max_bytes`) before anything is allocated, and a bucket's tensors reach the model only
once its bytes match the plan's SHA-256, so a peer that takes rank 0's place in the group (the store holds the
group's rendezvous, open to anyone who reaches it) can break a transfer but not put its tensors into the model.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed import TCPStore

from pipeline.weights.dist_group import WeightGroup, open_group
from pipeline.weights.dist_plan import Plan, digest, group_prefix, local_address, unpack

_ATTR = "_reinforce_ada_weight_group"  # (session, gen, group) on the worker object


def receive(worker: Any, plan: Plan, reload: Callable[[Iterator[tuple[str, torch.Tensor]]], dict],
            max_bytes: int) -> dict:
    """Receive `plan`'s version into the worker's model through `reload` (which feeds vLLM's reload_weights);
    a plan of more than `max_bytes` (what the worker's model can hold, model_bytes) is refused before anything
    is allocated."""
    start = time.perf_counter()
    if plan.num_bytes > max_bytes:
        return {"ok": False, "touched": False, "error": f"the plan sends {plan.num_bytes} bytes, more than this "
                f"worker's model can take ({max_bytes}); the learner's model must be the producer's (--model)"}
    try:
        group = _group_for(worker, plan)
        first = _receive(group, plan, 0)
    except Exception as exc:  # noqa: BLE001 - reported to the producer, which retries
        leave(worker)
        return {"ok": False, "touched": False, "error": f"{type(exc).__name__}: {exc}"}
    progress = {"touched": False, "error": None, "num_tensors": 0}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        buf = first
        for i, bucket in enumerate(plan.buckets):
            if i:
                try:
                    buf = _receive(group, plan, i)  # a fresh buffer: vLLM may hold views until a layer is full
                except Exception as exc:  # noqa: BLE001 - end the iterator so vLLM finishes its reload cleanly
                    progress["error"] = exc
                    return
            for name, tensor in unpack(buf, bucket):
                progress["touched"] = True
                progress["num_tensors"] += 1
                yield name, tensor

    info = reload(tensors())
    if progress["error"] is not None:
        leave(worker)
        exc = progress["error"]
        return {"ok": False, "touched": progress["touched"], "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "touched": True, "seconds": time.perf_counter() - start,
            "num_tensors": progress["num_tensors"], "num_bytes": plan.num_bytes, **info}


def _receive(group: WeightGroup, plan: Plan, i: int) -> torch.Tensor:
    """Bucket `i` of `plan`, its bytes checked against the plan's digest."""
    buf = group.receive(plan.buckets[i].nbytes)
    if digest(buf) != plan.digests[i]:
        raise ValueError(f"bucket {i} of version {plan.version} does not match the plan's SHA-256: someone other "
                         "than the learner sent it (the weight group's rendezvous is in the store, open to anyone "
                         "who reaches it)")
    return buf


def model_bytes(model: torch.nn.Module, num_shards: int = 1) -> int:
    """The most bytes a version of `model` can take: 8 per parameter (float64, the widest dtype carried) across
    `num_shards` tensor-parallel shards, plus 64 MiB for alignment and buffers."""
    return 8 * num_shards * sum(p.numel() for p in model.parameters()) + (64 << 20)


def _group_for(worker: Any, plan: Plan) -> WeightGroup:
    """The worker's group of `plan`'s generation: the one it holds, or a new one (leaving the old)."""
    held = getattr(worker, _ATTR, None)
    if held is not None and held[:2] == (plan.session, plan.gen):
        return held[2]
    leave(worker)
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    store = TCPStore(plan.host, plan.port, is_master=False, timeout=timeout)
    rank = plan.rank + int(worker.parallel_config.rank)  # tensor-parallel workers take consecutive ranks
    device = worker.device if plan.backend == "nccl" else None
    group = open_group(plan.backend, store, group_prefix(plan.session, plan.gen), rank, plan.world_size,
                       plan.timeout_s, local_address(plan.host, plan.port), device)
    setattr(worker, _ATTR, (plan.session, plan.gen, group, store))
    return group


def leave(worker: Any) -> None:
    """Close the worker's weight group, if it holds one."""
    held = getattr(worker, _ATTR, None)
    if held is not None:
        setattr(worker, _ATTR, None)
        held[2].close()
