"""One guarded reward call from any thread: `score_guarded` (what `math_reward` and other callers outside a pool
use).

Signals reach only a process's main thread, so a call from the main thread runs here under `guard`'s SIGALRM timer,
and a call from any other thread goes to a one-worker RewardPool per function, started on first use, kept for the
life of the process, and closed at exit.
Invariant: `score_guarded` never raises for anything the function does with a sample (a failure or a timeout
scores 0.0); only a `fn` that cannot be loaded is an error (ConfigError naming reward.fn), from any thread.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from typing import Any

from pipeline.rewards import guard
from pipeline.rewards.base import load_reward_fn
from pipeline.rewards.pool import RewardPool
from pipeline.rewards.worker import FnRef

_FALLBACK: dict[Any, RewardPool] = {}
_FALLBACK_LOCK = threading.Lock()


def _fallback_pool(fn: FnRef) -> RewardPool:
    """One worker process per function, for guarded calls from threads other than the main one."""
    with _FALLBACK_LOCK:
        if fn not in _FALLBACK:
            _FALLBACK[fn] = pool = RewardPool(num_workers=1, fn=fn)
            atexit.register(pool.close)
        return _FALLBACK[fn]


def score_guarded(fn: FnRef, completion: str, answer: str, timeout_s: float,
                  extras: Mapping[str, Any] | None = None) -> float:
    """fn(completion, answer, **extras) limited to `timeout_s` seconds, from any thread; 0.0 on any failure.

    In the main thread the call runs here under a SIGALRM timer; from another thread it is sent to a worker
    process (started on first use and kept) that runs it in its own main thread."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        return 0.0
    if threading.current_thread() is threading.main_thread():
        callable_fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        return guard.call_with_deadline(callable_fn, timeout_s, completion, answer, extras)[0]
    pool = _fallback_pool(fn)  # a bad fn is a ConfigError here, as in the main thread
    try:
        return pool.submit(completion, answer, timeout_s, extras).result()
    except Exception:  # noqa: BLE001 -- pool closed at exit, or broken: a reward never raises
        return 0.0
