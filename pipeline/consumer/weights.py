"""Publishing weights to the producers: one safetensors file per version, written atomically.

Invariants:
- a reader never sees a partial file: rank 0 writes `.v000012.safetensors.tmp`, fsyncs it and renames it to
  `v000012.safetensors` (rename is atomic within a filesystem; the producer opens the file by its final name,
  which it learns from the WeightAnnouncement sent after the rename);
- tensor names are the Hugging Face parameter names (what `model.state_dict()` of the HF model gives, tied
  duplicates dropped), which vLLM's `model_runner.reload_weights(weights_iterator=...)` maps onto its own
  fused layout;
- only the newest `keep` files stay; a producer that still reads an older one keeps its open mmap valid on
  Linux even after the unlink.

Several machines: today `weights.dir` must be a filesystem the producers can read (NFS, a shared disk). Not
built yet, the planned network path: rank 0 also runs a small ZeroMQ ROUTER that answers `GET v000012` with
the file in fixed-size chunks (frames of e.g. 64 MiB, each `[offset, bytes]`, the last one flagged), secured
with the same CurveZMQ keys as the buffer. The announcement then carries
`tcp://host:port/v000012.safetensors` as its uri, the producer streams the chunks into its own
/dev/shm copy (same temp-then-rename rule) and loads that with `iter_weights`. A producer asks only for the
newest version it is told about, so a slow one never makes the learner keep more than `keep` files. On GPUs
an NCCL broadcast from the learner into the engines' weight loader would replace the file path entirely.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline import protocol as P

_NAME = re.compile(r"^v(\d{6,})\.safetensors$")


def weights_path(weights_dir: str | Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version:06d}.safetensors"


def publish_weights(state_dict: dict[str, torch.Tensor], weights_dir: str | Path, version: int,
                    keep: int = 2) -> P.WeightAnnouncement:
    """Write `state_dict` as `weights_dir/v{version:06d}.safetensors` atomically; keep the newest `keep` files.

    Call on rank 0 only. Tensors must be on the CPU, contiguous and must not share storage.
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


def published_versions(weights_dir: str | Path) -> list[int]:
    """Versions of the complete weight files in `weights_dir`, oldest first."""
    d = Path(weights_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


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


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a published file, one tensor at a time (memory-mapped; what reload_weights takes)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"weights file {p} does not exist (was it pruned? weights.keep too small?)")
    with safe_open(str(p), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def file_version(path: str | Path) -> int:
    """The version recorded in a published file's name."""
    m = _NAME.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a published weights file (expected v000123.safetensors)")
    return int(m.group(1))

