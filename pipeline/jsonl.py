"""JSONL files that one process appends to while others read them as they grow (metrics.jsonl, eval.jsonl).

Invariants: a reader never returns a partial last line (it waits for the newline); a file that was replaced (a
resumed learner rewrites metrics.jsonl without the rows past its checkpoint) or truncated is read again from its
start, so a reader may see a row twice and must tell rows apart by their version; `keep_rows` replaces a file
atomically (temp file, fsync, rename), so a reader sees the old rows or the new ones, never a mix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


class JsonlTail:
    """Reads the rows appended to a JSONL file since the last call (tolerates a partial last line)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.partial = b""
        self.inode: int | None = None

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset:  # replaced or truncated: from the start
                    self.inode, self.offset, self.partial = st.st_ino, 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows


def read_rows(path: Path) -> list[dict]:
    """Every complete, well-formed row of a JSONL file ([] when there is none)."""
    return JsonlTail(path).read()


def keep_rows(path: Path, keep: Callable[[dict], bool]) -> int:
    """Rewrite `path` with only the rows for which `keep` is true (atomically); returns how many were dropped.
    Lines that are not JSON (a partial line left by a killed writer) are dropped too."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_bytes().split(b"\n")
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and keep(row):
            kept.append(line)
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped
