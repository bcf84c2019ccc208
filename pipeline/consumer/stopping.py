"""Stopping the learner on SIGINT or SIGTERM (the supervisor's stop, a Ctrl-C) without losing its work.

A signal never cuts a training step, a weight publish or a checkpoint short: it only records the reason, and the
loop stops after the step in progress and checkpoints the version it reached (loop.py). Only while rank 0 waits
for a batch (`interruptible`), where nothing can be lost, does the signal end the wait at once, as `Stopped`.
Ranks other than 0 never stop on their own: they follow rank 0's Stop message (ranks.py), so every rank saves the
same checkpoint. After the first signal the previous handlers are back: a second Ctrl-C stops at once, as usual.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """A stop signal arrived while rank 0 waited for a batch."""


class StopSignals:
    """Records the first SIGINT / SIGTERM; see the module docstring. Handlers are installed only from the main
    thread (elsewhere Python refuses them, and the process's owner handles signals)."""

    def __init__(self) -> None:
        self.signum = 0
        self._interruptible = False
        self._old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    @property
    def reason(self) -> str:
        """'' while no signal arrived, else e.g. "stopped by SIGTERM"."""
        return f"stopped by {signal.Signals(self.signum).name}" if self.signum else ""

    @property
    def exit_code(self) -> int:
        """The conventional exit code of a process stopped by the signal (128 + its number), 0 without one."""
        return 128 + self.signum if self.signum else 0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum
        self.restore()  # a second signal acts as it would without us
        if self._interruptible:
            self._interruptible = False
            raise Stopped(self.reason)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait that a signal may end (raising Stopped); raises at once when one already arrived."""
        if self.signum:
            raise Stopped(self.reason)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
