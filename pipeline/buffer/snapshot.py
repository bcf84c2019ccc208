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
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from pipeline import protocol as P
from pipeline.config import Config

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


def write_snapshot(path: Path, snap: BufferSnapshot) -> int:
    """Write `snap` to `path` atomically; returns its size in bytes. Raises OSError (the old file stays valid)."""
    data = msgspec.msgpack.encode(snap)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the rename must never expose a file whose bytes are not on disk yet
    os.replace(tmp, path)
    return len(data)


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
