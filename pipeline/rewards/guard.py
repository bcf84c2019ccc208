"""A time limit and an error fence around one reward call, in the main thread of a process.

Why a signal: a reward can loop forever in Python (a sympy simplification, a user's function); a `setitimer`
deadline raises _Deadline into whatever Python code runs, and _Deadline is a BaseException so the function's
own `except Exception` cannot swallow it. Code stuck in C never sees the signal: only killing its process stops
it, which the pool does. Signals reach only the main thread, so other threads go through a worker process.

Invariants: `call_with_deadline` never raises for anything the function does (it raises, returns a non-number,
calls sys.exit, or runs past the limit: the outcome says which, the score is 0.0), and it gives back the
caller's own SIGALRM handler and timer as they were (less the time spent; one due meanwhile fires at once).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

OK, ERROR, TIMEOUT, CRASHED = "ok", "error", "timeout", "crashed"  # the outcome of one scored sample
Outcome = tuple[float, str, str]  # (score, OK | ERROR | TIMEOUT | CRASHED, what went wrong)


class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so a reward's `except Exception` lets it through."""


def _raise_deadline(signum, frame):
    raise _Deadline


def _text(value: Any, limit: int) -> str:
    try:
        return str(value)[:limit]
    except Exception:  # noqa: BLE001 -- a user's object whose __str__ fails
        return f"<{type(value).__name__}>"


def as_score(value: Any) -> float | None:
    """`value` as a finite float (bools and numpy scalars included), else None."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        score = float(value)
    except Exception:  # noqa: BLE001 -- a user's object whose __float__ fails
        return None
    return score if math.isfinite(score) else None


def call_with_deadline(fn: Callable[..., Any], timeout_s: float, completion: str, answer: str,
                       extras: Mapping[str, Any] | None = None) -> Outcome:
    """fn(completion, answer, **extras) limited to `timeout_s` seconds; main thread only."""
    assert threading.current_thread() is threading.main_thread(), "SIGALRM reaches only the main thread"
    if not timeout_s > 0:  # also NaN
        return 0.0, TIMEOUT, f"no time to score (timeout_s = {timeout_s!r})"
    old_handler = signal.signal(signal.SIGALRM, _raise_deadline) or signal.SIG_DFL  # None: set from C
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        try:
            value = fn(completion, answer, **(extras or {}))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return 0.0, TIMEOUT, f"ran past its time limit of {timeout_s:g} s"
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- a reward never raises: a failure scores 0.0
        return 0.0, ERROR, f"raised {type(e).__name__}: {_text(e, 300)}"
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # the caller had its own timer (e.g. pytest-timeout): give back what is left
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)
    score = as_score(value)
    if score is None:
        return 0.0, ERROR, f"returned {_text(value, 100)!r} ({type(value).__name__}), not a finite number"
    return score, OK, ""
