"""Rank 0's record of the run: one metrics.jsonl row per learner version.

Invariants:
- metrics.jsonl holds at most one row per version, in increasing order. A resumed learner first drops the rows
  past the version of the checkpoint it restored: the updates they describe were lost with the process that made
  them (a stopped learner checkpoints before it exits, so normally there are none), and the versions it trains
  next must not appear twice. Rows are dropped by an atomic rewrite (pipeline/jsonl.py), never edited in place.
- a row is appended only after its version was announced to the buffer (loop.py), so every row names weights
  that producers could load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.jsonl import keep_rows

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def row_version(row: dict[str, Any]) -> int:
    """The learner version a metrics.jsonl row belongs to."""
    return int(row.get("version", row.get("step", 0)))


class RunLog:
    """Appends the learner's rows to metrics.jsonl (rank 0 only)."""

    def __init__(self, cfg: Config, resumed_from: int | None = None) -> None:
        """`resumed_from`: the version of the restored checkpoint (0 when a resume found none), or None for a
        fresh start; rows past it are dropped."""
        self.cfg = cfg
        self.path: Path = cfg.run_dir / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_from is not None:
            dropped = keep_rows(self.path, lambda row: row_version(row) <= resumed_from)
            if dropped:
                log.warning("dropped %d row(s) past version %d from %s: their updates were not in the checkpoint",
                            dropped, resumed_from, self.path)

    def step(self, row: dict[str, Any]) -> None:
        """Record one learner step's metrics (already announced to the buffer)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Nothing to release yet; the trackers will need it."""
