"""The file transport: one safetensors file per version in the run's weights directory, written atomically.

Invariants:
- a reader never sees a partial file: rank 0 writes `.v000012.safetensors.tmp`, fsyncs it and renames it to
  `v000012.safetensors` (rename is atomic within a filesystem; the producer opens the file by its final name,
  which it learns from the WeightAnnouncement sent after the rename);
- tensor names are the Hugging Face parameter names (what `model.state_dict()` of the HF model gives, tied
  duplicates dropped), which vLLM's `model_runner.reload_weights(weights_iterator=...)` maps onto its own
  fused layout;
- only the newest `keep` files stay; a producer that still reads an older one keeps its open mmap valid on
  Linux even after the unlink;
- a producer loads a file only when it is the run's file of the announced version: `weights_dir/v{version}` once
  symlinks are resolved (`file_uri_problem`).

Several machines: `weights.dir` must then be a filesystem every producer reads (NFS, a shared disk); the dist
transport (dist.py) needs none.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline import protocol as P
from pipeline.weights.uris import FILE_NAME, local_path, weights_path


def iter_file(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a published file, one tensor at a time (memory-mapped; what reload_weights takes).

    A missing or unreadable file raises here, before the first tensor is asked for (a reload that fails midway
    would leave the model half loaded)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights file {p} does not exist (the learner writes it before it announces the "
                                "version; was it pruned? weights.keep too small?)")
    f = safe_open(str(p), framework="pt", device="cpu")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in f.keys():
            yield name, f.get_tensor(name)

    return tensors()


def published_versions(weights_dir: str | Path) -> list[int]:
    """Versions of the complete weight files in `weights_dir`, oldest first."""
    d = Path(weights_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := FILE_NAME.match(p.name)))


def prune(weights_dir: str | Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` weight files; returns the versions deleted."""
    versions = published_versions(weights_dir)
    gone = versions[:-keep] if keep > 0 else []
    for v in gone:
        try:
            weights_path(weights_dir, v).unlink()
        except FileNotFoundError:
            pass
    return gone


def publish_weights(state_dict: dict[str, torch.Tensor], weights_dir: str | Path, version: int,
                    keep: int = 2) -> P.WeightAnnouncement:
    """Write `state_dict` as `weights_dir/v{version:06d}.safetensors` atomically; keep the newest `keep` files.

    Tensors must be on the CPU, contiguous and must not share storage.
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if keep < 1:
        raise ValueError(f"weights.keep must be >= 1 (the file just written), got {keep}")
    if not state_dict:
        raise ValueError("refusing to publish an empty state dict")
    out_dir = Path(weights_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = weights_path(out_dir, version)
    tmp = out_dir / f".{final.name}.tmp"
    save_file(state_dict, str(tmp), metadata={"format": "pt", "version": str(version)})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)  # the data reach the disk before the name does (free on /dev/shm)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(out_dir)
    prune(out_dir, keep)
    return P.WeightAnnouncement(version=version, uri=str(final), num_bytes=final.stat().st_size)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse a directory fsync; the rename itself is still atomic
    finally:
        os.close(fd)


class FilePublisher:
    """WeightPublisher of the file transport."""

    def __init__(self, weights_dir: str | Path, keep: int) -> None:
        self.weights_dir, self.keep = Path(weights_dir), keep
        self.num_published = 0

    def publish(self, state: dict[str, torch.Tensor], version: int) -> P.WeightAnnouncement:
        ann = publish_weights(state, self.weights_dir, version, self.keep)
        self.num_published += 1
        return ann

    def stats(self) -> dict[str, float]:
        return {"weight_publishes": float(self.num_published)}

    def close(self) -> None:
        pass


class FileLoader:
    """WeightLoader of the file transport: the engine reads the announced file in place."""

    def __init__(self, engine: Any, weights_dir: str | Path) -> None:
        self.engine, self.weights_dir = engine, Path(weights_dir)

    async def load(self, ann: P.WeightAnnouncement) -> float:
        return await self.engine.load_weights(os.path.realpath(local_path(ann.uri)), ann.version)

    def close(self) -> None:
        pass
