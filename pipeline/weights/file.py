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
  symlinks are resolved (`file_uri_problem`);
- the weights folder is private: created atomically with mode 0700, and refused when reused if it is a symbolic
  link, not this user's, or open to group or others (the default folder's name in /dev/shm is predictable, so
  another local user could create it first and swap the files producers load); weight files are 0600, written
  through a temporary file created with O_EXCL (a link planted at its name is removed, never followed), and
  opened for reading with O_NOFOLLOW: no link is ever followed to write or read weights.

Several machines: `weights.dir` must then be a filesystem every producer reads (NFS, a shared disk); the dist
transport (dist.py) needs none.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeline import protocol as P
from pipeline.weights.private import WEIGHT_FILE_MODE, open_private_dir
from pipeline.weights.uris import FILE_NAME, local_path, weights_path


def iter_file(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a published file, one tensor at a time (memory-mapped; what reload_weights takes).

    A missing or unreadable file raises here, before the first tensor is asked for (a reload that fails midway
    would leave the model half loaded); so does a file that is a symbolic link, or in a folder that is not private
    (`open_private_dir`)."""
    p = Path(path)
    folder = open_private_dir(p.parent)
    try:
        fd = os.open(p.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights file {p} does not exist (the learner writes it before it announces the "
                                "version; was it pruned? weights.keep too small?)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"weights file {p} is a symbolic link: weight files are never read through a "
                                  f"link; remove it (rm {p}): the learner writes each version as a file") from None
        raise
    finally:
        os.close(folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"weights file {p} is not a regular file of this user (uid {st.st_uid}); remove "
                                  "it: only the learner's own files are loaded")
        f = safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu")  # this very file, whatever its name
    finally:
        os.close(fd)  # the memory map keeps the file

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


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _write_safetensors(fd: int, state_dict: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`state_dict` in the safetensors format, streamed to the open file `fd` one tensor at a time (safetensors'
    own save_file takes a path, which it would follow if it were a link, and save() would hold a second copy of
    every tensor in memory)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    names = sorted(state_dict)
    for name in names:
        t = state_dict[name]
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data start 8-byte aligned, as safetensors writes them
    _write_all(fd, len(head).to_bytes(8, "little") + head)
    for name in names:
        t = state_dict[name].detach().cpu().contiguous()
        if t.numel():
            _write_all(fd, t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


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
    final = weights_path(out_dir, version)
    tmp = f".{final.name}.tmp"
    metadata = {"format": "pt", "version": str(version)}
    folder = open_private_dir(out_dir, create=True)
    try:
        try:  # a leftover of a crash, or a link planted at the name: unlink removes the link, never its target
            os.unlink(tmp, dir_fd=folder)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, WEIGHT_FILE_MODE,
                     dir_fd=folder)
        try:
            os.fchmod(fd, WEIGHT_FILE_MODE)
            _write_safetensors(fd, state_dict, metadata)
            os.fsync(fd)  # the data reach the disk before the name does (free on /dev/shm)
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, final.name, src_dir_fd=folder, dst_dir_fd=folder)
        try:
            os.fsync(folder)
        except OSError:
            pass  # some filesystems refuse a directory fsync; the rename itself is still atomic
        num_bytes = os.stat(final.name, dir_fd=folder, follow_symlinks=False).st_size
    finally:
        os.close(folder)
    prune(out_dir, keep)
    return P.WeightAnnouncement(version=version, uri=str(final), num_bytes=num_bytes)


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
        path = local_path(ann.uri)  # its folder resolved, its own name not: a link there is refused, not followed
        return await self.engine.load_weights(os.path.join(os.path.realpath(os.path.dirname(path)),
                                                           os.path.basename(path)), ann.version)

    def close(self) -> None:
        pass
