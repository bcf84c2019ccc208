"""Logging of every process of a run: one format, and the level of `run.log_level` (INFO by default)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup(level: str = "INFO") -> None:
    """Log to stderr in the run's one format at `level` (called once the config is known; again, it changes the
    level only)."""
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
