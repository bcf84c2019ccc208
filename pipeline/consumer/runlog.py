"""Rank 0's record of the run: one metrics.jsonl row per learner version, and the same to the trackers
(run.trackers, pipeline/trackers.py) together with the buffer's evaluations and tables of sample completions.

Invariants:
- metrics.jsonl holds at most one row per version, in increasing order. A resumed learner first drops the rows
  past the version of the checkpoint it restored: the updates they describe were lost with the process that made
  them (a stopped learner checkpoints before it exits, so normally there are none), and the versions it trains
  next must not appear twice. Rows are dropped by an atomic rewrite (pipeline/jsonl.py), never edited in place.
- a row is appended only after its version was announced to the buffer (loop.py), so every row names weights
  that producers could load; the trackers get each row right after metrics.jsonl does.
- every eval.jsonl row (the buffer writes them) reaches the trackers once, when the learner next logs a step; a
  resumed run passes on only those past its checkpoint (the stopped run logged the others). The evaluation of the
  last version is written after the learner's Shutdown: `finish` waits for it, up to a bound.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import protocol as P
from pipeline.config import dumps_toml, to_toml_dict
from pipeline.jsonl import JsonlTail, keep_rows
from pipeline.trackers import Trackers, open_trackers

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
EVAL_POLL_S = 0.5


def row_version(row: dict[str, Any]) -> int:
    """The learner version a metrics.jsonl (or eval.jsonl) row belongs to."""
    return int(row.get("version", row.get("step", 0)))


class RunLog:
    """metrics.jsonl and the trackers (rank 0 only)."""

    def __init__(self, cfg: Config, resumed_from: int | None = None) -> None:
        """`resumed_from`: the version of the restored checkpoint (0 when a resume found none), or None for a
        fresh start; rows past it are dropped. Raises TrackerError when a tracker of run.trackers cannot start."""
        self.cfg = cfg
        self.path: Path = cfg.run_dir / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_from is not None:
            dropped = keep_rows(self.path, lambda row: row_version(row) <= resumed_from)
            if dropped:
                log.warning("dropped %d row(s) past version %d from %s: their updates were not in the checkpoint",
                            dropped, resumed_from, self.path)
        self.trackers = Trackers([])
        if cfg.run.trackers:
            self.trackers = open_trackers(cfg.run.trackers, cfg.run_dir, cfg.run.name, cfg.run.project,
                                          to_toml_dict(cfg), dumps_toml(cfg), resumed_from)
        self.evals = JsonlTail(cfg.run_dir / EVAL_FILE)
        self.evals_after = -1 if resumed_from is None else resumed_from
        self.evals_logged: set[int] = set()
        self._tokenizer: Any = None

    def step(self, row: dict[str, Any], groups: list[P.Group] | None = None) -> None:
        """Record one learner step's metrics (already announced to the buffer), and pass it, the evaluations
        written since, and every run.samples_every steps a table of `groups`' completions to the trackers."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if not self.trackers:
            return
        self.trackers.log_step(row)
        self.poll_evals()
        every = self.cfg.run.samples_every
        if groups and every and row_version(row) % every == 0:
            self.trackers.log_samples(self.sample_rows(groups), row_version(row))

    def poll_evals(self) -> int | None:
        """Pass the eval.jsonl rows written since the last call to the trackers; returns the newest version."""
        newest = None
        for row in self.evals.read():
            version = row_version(row)
            if version > self.evals_after and version not in self.evals_logged:
                self.evals_logged.add(version)
                self.trackers.log_eval(row)
            newest = version if newest is None else max(newest, version)
        return newest

    def finish(self, version: int, stopping: Callable[[], bool]) -> None:
        """After the last step: wait for the buffer's evaluation of `version` (written after the Shutdown) and
        pass it on, up to buffer.lease_s + 30 s or until `stopping()`. Nothing to wait for without trackers."""
        if not self.trackers or not self.cfg.learner.eval_every:
            return
        deadline = time.monotonic() + self.cfg.buffer.lease_s + 30.0
        while version not in self.evals_logged and time.monotonic() < deadline and not stopping():
            self.poll_evals()
            time.sleep(EVAL_POLL_S)
        if version not in self.evals_logged:
            log.warning("the evaluation of version %d did not reach the trackers (not in %s yet)", version,
                        self.evals.path)

    def sample_rows(self, groups: list[P.Group]) -> list[list[Any]]:
        """The first run.num_table_samples completions of `groups`, group by group: prompt, completion, reward,
        rounds, version (decoded with the run's tokenizer; token ids when the model has none)."""
        rows = []
        for g in groups:
            for s in g.samples:
                if len(rows) == self.cfg.run.num_table_samples:
                    return rows
                rows.append([self._decode(g.prompt_token_ids, False), self._decode(s.token_ids, True),
                             float(s.reward), int(g.num_rounds), int(s.version)])
        return rows

    def _decode(self, ids: Any, skip_special: bool) -> str:
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.cfg)
        if self._tokenizer is False:
            return " ".join(str(int(i)) for i in ids)
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def close(self) -> None:
        self.trackers.close()


def _load_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer, or False when its directory holds none (a model built for tests)."""
    from pipeline.models import TOKENIZER_FILES

    path = Path(cfg.model.tokenizer or cfg.model.path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return False
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
