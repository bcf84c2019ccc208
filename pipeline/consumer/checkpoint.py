"""Learner checkpoints: model, optimizer, scheduler, step/version, RNG states and the caller's opaque blob.

Layout under `run_dir/checkpoints/`:
    step_000050/meta.json        {"version", "optimizer_steps", "backend", "world_size", "zero_stage"}
    step_000050/extra.bin        the caller's bytes (data position / buffer snapshot)
    step_000050/rng_rank{r}.pt   python, numpy and torch RNG states of rank r
    step_000050/torch_state.pt   (torch backend) or step_000050/deepspeed/ (DeepSpeed's own shards)
    step_000050/hf/              the weights as a Hugging Face model directory (pipeline/hf.py), when asked
    latest                       text: the name of the newest complete checkpoint

Invariant: a checkpoint directory is complete or absent. Every rank writes into `.tmp-step_XXXXXX/` (the
ranks of one learner share a filesystem); after a barrier rank 0 renames it to `step_XXXXXX/` and then
replaces `latest` by rename, so a crash at any point leaves the previous checkpoint usable. The export in hf/
is part of the checkpoint: written (rank 0, from the weights `full_state_dict` gathers on every rank) before
the rename.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

# `latest_checkpoint` lives in hf.py, which imports no torch (the supervisor and `eval` read the pointer too); it is
# part of this module's interface all the same
from pipeline.hf import HF_DIR, LATEST, HfSource, write_hf
from pipeline.hf import latest_checkpoint as latest_checkpoint

if TYPE_CHECKING:
    from pipeline.consumer.backends import LearnerBackend


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": json.dumps(random.getstate()),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: Path, backend: LearnerBackend, version: int, optimizer_steps: int, extra: bytes = b"",
                    keep: int = 2, hf: HfSource | None = None) -> Path:
    """Write checkpoint `step_{version:06d}` under `root` on every rank (collective); returns its path.

    With `hf`, the checkpoint also holds the weights as a Hugging Face model directory (hf/), its config and
    tokenizer from `hf`'s model. Keeps the newest `keep` checkpoints (0 = all) and deletes older ones.
    """
    root = Path(root)
    name = f"step_{version:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    rank, world = backend.rank, backend.world_size
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left over by a crash
        tmp.mkdir(parents=True)
    _barrier(world)
    backend.save(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if hf is not None:
        state = backend.full_state_dict(hf.torch_dtype)  # collective under ZeRO-3; None except on rank 0
        if state is not None:
            write_hf(state, tmp / HF_DIR, hf)
    if rank == 0:
        meta = {"version": version, "optimizer_steps": optimizer_steps, "backend": backend.name,
                "world_size": world, "zero_stage": backend.zero_stage}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "extra.bin").write_bytes(bytes(extra))
    _barrier(world)
    if rank == 0:
        if final.exists():  # same step written again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, name.encode())
        if keep > 0:
            done = sorted(p for p in root.glob("step_*") if p.is_dir())
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(world)
    return final


def load_checkpoint(path: Path, backend: LearnerBackend) -> tuple[dict[str, Any], bytes]:
    """Restore weights, optimizer, scheduler and this rank's RNG from `path`; returns (meta, extra)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"{path} is not a learner checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta["backend"] != backend.name:
        raise ValueError(f"checkpoint {path} was written by the {meta['backend']} backend; resume with "
                         f"--learner.backend {meta['backend']}")
    # sharded state (ZeRO) resumes only on the layout that wrote it; full replicas resume on any number of ranks
    if backend.zero_stage is not None and (meta["world_size"] != backend.world_size
                                           or meta["zero_stage"] != backend.zero_stage):
        raise ValueError(f"checkpoint {path} holds ZeRO-{meta['zero_stage']} shards of {meta['world_size']} "
                         f"rank(s); resume with the same learner.num_ranks and learner.zero_stage")
    backend.load(path)
    rng = path / f"rng_rank{backend.rank}.pt"
    if not rng.is_file():
        rng = path / "rng_rank0.pt"  # torch backend resumed with more ranks than it was saved with
    _set_rng_state(torch.load(rng, weights_only=True))
    return meta, (path / "extra.bin").read_bytes()
