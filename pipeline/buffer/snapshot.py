"""Buffer snapshots for `--resume`: what is written, where, and how.

After every `snapshot_every`-th new learner version (VersionUpdate) the buffer writes the Scheduler's state, the
learner version, the latest weight announcement and its counters atomically (tmp + fsync + rename) to
run_dir/buffer/snapshot.msgpack. A buffer restarted with `--resume` continues from the last snapshot. Exactly
what can repeat or be lost since then:
- groups handed to the learner after the snapshot may be handed out again (at most `snapshot_every` batches, one
  with the default of 1: the learner takes one batch per version), or re-opened if they became stale;
- prompts admitted after the snapshot are admitted again, under the same prompt ids and from the same data
  position; samples received after it are gone (their prompts need those rounds again);
- rounds in flight at the snapshot, and every round issued after it (training or evaluation), are issued again
  under new round ids; results for the old ids that arrive after the restart are ignored as late or unknown,
  never attributed to another round (round ids jump by RESUME_ROUND_ID_GAP on resume);
- counters and metrics continue from the snapshot's values; parked requests are lost (clients re-send them after
  their timeout); evaluations in progress are not resumed.
Nothing admitted before the snapshot is lost: admitted == released - reopened + dropped + active still holds.

Files: the snapshot is written to a fresh temp file beside it (mkstemp: O_EXCL, mode 0600, never through a file
or link already there), fsynced, renamed over the old one, and the directory is fsynced so the rename itself
survives a crash. Temp files a killed buffer left behind are removed when the next one starts.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.state import PromptRow
from pipeline.config import Config

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
SNAPSHOT_EVERY = 1  # default: a snapshot after every new learner version (`reinforce-ada buffer --snapshot-every`)
# Round ids skipped on resume: the crashed buffer may have issued ids above the snapshot's counter, and a late
# result for one of them must never match a new round. 2**32 rounds between two snapshots is out of reach.
RESUME_ROUND_ID_GAP = 1 << 32


def snapshot_path(cfg: Config) -> Path:
    """Where the buffer of run `cfg` writes its snapshot."""
    return cfg.run_dir / "buffer" / "snapshot.msgpack"


class BufferSnapshot(msgspec.Struct):
    """The file's content (a msgpack map: fields may be added; an older file's extra fields are ignored)."""

    format: int
    scheduler: bytes  # Scheduler.snapshot()
    learner_version: int
    latest_weights: P.WeightAnnouncement | None
    counters: dict[str, int]
    time: float  # wall clock when written


def _temp_prefix(path: Path) -> str:
    return f"{path.name}."


def prune_temp_files(path: Path) -> int:
    """Remove the temp files of snapshot `path` that a buffer killed mid-write left behind; returns how many."""
    removed = 0
    for tmp in path.parent.glob(f"{_temp_prefix(path)}*.tmp"):
        tmp.unlink(missing_ok=True)  # a link is removed, never followed
        removed += 1
    legacy = path.with_name(path.name + ".tmp")  # the fixed name older buffers wrote through
    if legacy.is_symlink() or legacy.exists():
        legacy.unlink()
        removed += 1
    return removed


def write_snapshot(path: Path, snap: BufferSnapshot) -> int:
    """Write `snap` to `path` atomically; returns its size in bytes. Raises OSError (the old file stays valid)."""
    data = msgspec.msgpack.encode(snap)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose a file whose bytes are not on disk yet
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename is durable only once its directory entry is
    finally:
        os.close(dir_fd)
    return len(data)


class Snapshots:
    """The snapshots of one buffer: written after every `every`-th new learner version (0 = never), restored on
    --resume. Counts `snapshots`, `snapshot_errors` and `resumes` in the buffer's `counters`."""

    def __init__(self, cfg: Config, every: int, counters: dict[str, int], wall_clock: Callable[[], float]) -> None:
        if every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = never), got {every}")
        self.cfg, self.every, self.counters, self.wall_clock = cfg, every, counters, wall_clock
        self.path = snapshot_path(cfg)
        prune_temp_files(self.path)  # left by a buffer killed while writing
        self.version = 0  # learner version of the last snapshot written or restored
        self.info: dict[str, float] = {}  # what metrics report of the last one written

    def due(self, learner_version: int) -> bool:
        return bool(self.every) and learner_version - self.version >= self.every

    def write(self, scheduler: Scheduler, latest_weights: P.WeightAnnouncement | None) -> bool:
        """Write the buffer's state atomically; False if it failed (a full disk must not stop training; the
        previous snapshot stays valid)."""
        t0 = time.perf_counter()
        version = scheduler.learner_version
        snap = BufferSnapshot(SNAPSHOT_FORMAT, scheduler.snapshot(), version, latest_weights, dict(self.counters),
                              self.wall_clock())
        try:
            size = write_snapshot(self.path, snap)
        except OSError as exc:
            self.counters["snapshot_errors"] += 1
            log.error("could not write the buffer snapshot %s: %s", self.path, exc)
            return False
        self.counters["snapshots"] += 1
        self.version = version
        self.info = {"version": float(version), "bytes": float(size), "seconds": time.perf_counter() - t0}
        return True

    def restore(self, prompts: Sequence[PromptRow]) -> tuple[Scheduler, BufferSnapshot] | None:
        """The Scheduler of the last snapshot (round ids moved on by RESUME_ROUND_ID_GAP) and the snapshot, its
        counters restored; None without one. Raises ValueError (naming the file and the fix) if unusable."""
        snap = read_snapshot(self.path)
        if snap is None:
            log.warning("--resume: no snapshot at %s, starting fresh", self.path)
            return None
        cfg = self.cfg
        try:
            scheduler = Scheduler.restore(snap.scheduler, cfg.sampling, cfg.buffer, cfg.learner.batch_prompts,
                                          prompts, round_id_offset=RESUME_ROUND_ID_GAP)
        except ValueError as exc:
            raise ValueError(f"cannot resume from {self.path}: {exc}") from None
        self.counters.update({k: v for k, v in snap.counters.items() if k in self.counters})
        self.counters["resumes"] += 1
        self.version = scheduler.learner_version
        log.info("resumed from %s: learner version %d, %d prompts active, %d groups waiting (written %.0f s ago)",
                 self.path, self.version, scheduler.metrics()["active"], scheduler.groups_waiting,
                 self.wall_clock() - snap.time)
        return scheduler, snap


def read_snapshot(path: Path) -> BufferSnapshot | None:
    """The snapshot at `path`, or None when there is none. Raises ValueError (naming the fix) if it is unusable."""
    if not path.is_file():
        return None
    try:
        snap = msgspec.msgpack.decode(path.read_bytes(), type=BufferSnapshot)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a buffer snapshot (or a corrupt one): {exc}; move it away to start "
                         "fresh") from None
    if snap.format != SNAPSHOT_FORMAT:
        raise ValueError(f"{path} has snapshot format {snap.format}, not {SNAPSHOT_FORMAT}; move it away to "
                         "start fresh")
    return snap
