"""One reward worker: the process that scores samples, and the pool's handle on it.

Protocol on the worker's pipe: the worker sends "ready" once its function is imported and warmed up, then answers
each task (completion, answer, extras, timeout_s) with one Outcome (score, kind, detail); None asks it to exit.
Invariant: a worker never dies of anything its reward function does in Python (`guard.call_with_deadline` fences
it); only C code that hangs, a signal, or os._exit ends it, and the pool then replaces it.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

from pipeline.rewards import guard
from pipeline.rewards.base import RewardFn, load_reward_fn

FnRef = str | RewardFn  # "module:function" (imported again in each worker) or a picklable top-level function


def worker_main(conn, fn_ref: FnRef) -> None:
    """A worker process: import the function, warm up, say "ready", then score (completion, answer, extras,
    timeout_s) tasks, answering each with an Outcome."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    fn = load_reward_fn(fn_ref) if isinstance(fn_ref, str) else fn_ref
    warmup = getattr(fn, "warmup", None)
    if warmup is not None:
        warmup()
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:  # skip interpreter teardown: nothing to flush, and unloading sympy takes ~1 s
            conn.close()
            os._exit(0)
        completion, answer, extras, timeout_s = task
        conn.send(guard.call_with_deadline(fn, timeout_s, completion, answer, extras))


class Worker:
    """A worker process and the sample it is scoring."""

    def __init__(self, ctx, fn_ref: FnRef):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main, args=(child, fn_ref), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.future: Future | None = None  # the task it is scoring
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


