"""The reward worker pool: scores samples with a reward function in worker processes, each under a time limit.

Invariants: `RewardPool` resolves every submitted sample exactly once (a score; 0.0 for a function that raised,
returned a non-number, hung, or whose worker died; cancelled, or a RuntimeError if already running, when the
pool closes first), counts each failure by kind, and keeps its worker count while open. Nothing a reward
function does reaches the caller as an exception: a worker is a separate process, killed and replaced when
it hangs past its deadline or dies.

Each worker runs the function under `guard.call_with_deadline` (a SIGALRM timer: Python code that runs too long
is interrupted and the worker lives on); a worker that does not answer within the limit plus a grace (stuck in C
code, which no signal interrupts) is killed. With num_workers=0 the pool scores inline in the caller's main
thread; from other threads (signals cannot reach them) it uses one worker process of its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Self

from pipeline.config import Config
from pipeline.data import extra_name
from pipeline.rewards import guard
from pipeline.rewards.base import DEFAULT_REWARD_FN, check_signature, describe, load_reward_fn
from pipeline.rewards.worker import FnRef, Worker

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # a worker must import the reward function, warm up and say "ready" within this
MAX_STARTUP_FAILURES = 3  # workers dying before "ready" this many times in a row break the pool

def _check_lengths(completions: Sequence[str], answers: Sequence[str], extras: Sequence | None) -> None:
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one gold answer "
            "per completion"
        )
    if extras is not None and len(extras) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(extras)} extras; pass one dict per "
                         "completion (or none)")


class RewardPool:
    """Scores (completion, answer, extras) samples with a reward function in `num_workers` worker processes.

    `fn` is "package.module:function" (imported and checked here: a ConfigError naming reward.fn if it cannot be
    called as fn(completion, answer, **extras) with `extra_names`) or a picklable top-level function. A sample
    whose worker has not answered within timeout_s (+ a grace) or dies scores 0.0; that worker is killed and
    replaced and the pool goes on. Workers are started with `start_method` ("spawn" or "forkserver"), safe
    from callers that run threads (vLLM); a script using the pool needs `if __name__ == "__main__":`.
    num_workers=0 scores inline in the caller. `counts` holds the outcome of every sample (ok, error,
    timeout, crashed); `metrics()` the failures.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        fn: FnRef = DEFAULT_REWARD_FN,
        start_method: str = "spawn",
        extra_names: Sequence[str] = (),
    ):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0 (0 scores inline), got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver' (fork is unsafe with threads), "
                f"got {start_method!r}"
            )
        if isinstance(fn, str):
            self._fn = load_reward_fn(fn, extra_names)
        else:
            check_signature(fn, extra_names)
            self._fn = fn
        self._fn_ref, self.name = fn, describe(fn)
        self.num_workers, self.timeout_s, self.start_method = num_workers, float(timeout_s), start_method
        self._closed = False
        self._broken: str | None = None
        self.num_replaced = 0  # workers killed or dead and replaced (for metrics)
        self.counts: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._helper: RewardPool | None = None  # inline pools: one worker for calls from other threads
        if num_workers == 0:
            return
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._drained = False  # set once the dispatcher has stopped taking tasks
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [Worker(self._ctx, self._fn_ref) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: Config) -> RewardPool:
        """The pool of a producer: reward.fn, checked against data.extra_keys, in producers.reward_workers
        processes with producers.reward_timeout_s per sample."""
        return cls(cfg.producers.reward_workers, cfg.producers.reward_timeout_s, cfg.reward.fn,
                   extra_names=[extra_name(k) for k in cfg.data.extra_keys])

    # ---- public API ----

    def submit(self, completion: str, answer: str, timeout_s: float | None = None,
               extras: Mapping[str, Any] | None = None) -> Future:
        """A Future of the score of one sample (use asyncio.wrap_future to await it)."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if self._broken:
            raise RuntimeError(self._broken)
        extras = dict(extras or {})
        if self.num_workers == 0:
            if threading.current_thread() is not threading.main_thread():
                return self._thread_helper().submit(completion, answer, t, extras)
            fut: Future = Future()
            fut.set_running_or_notify_cancel()
            fut.set_result(self._record(guard.call_with_deadline(self._fn, t, completion, answer, extras)))
            return fut
        fut = Future()
        with self._lock:
            if self._drained:  # closed or broken after the check above
                raise RuntimeError(self._broken or "RewardPool is closed")
            self._queue.append((fut, (completion, answer, extras, t)))
        self._wake_w.send_bytes(b"x")
        return fut

    def score(self, completions: Sequence[str], answers: Sequence[str],
              extras: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        """Scores of each completion against the answer (and extras) at the same index, in order."""
        _check_lengths(completions, answers, extras)
        per = extras if extras is not None else [None] * len(completions)
        return [f.result() for f in [self.submit(c, a, extras=e) for c, a, e in zip(completions, answers, per)]]

    async def ascore(self, completions: Sequence[str], answers: Sequence[str],
                     extras: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        """`score` for asyncio callers: awaits the futures without blocking the event loop."""
        _check_lengths(completions, answers, extras)
        per = extras if extras is not None else [None] * len(completions)
        futs = [asyncio.wrap_future(self.submit(c, a, extras=e)) for c, a, e in zip(completions, answers, per)]
        return list(await asyncio.gather(*futs))

    def metrics(self) -> dict[str, int]:
        """Failure counters (cumulative): samples that raised or returned a non-number, that ran out of time,
        whose worker died, and workers replaced."""
        counts = self.counts + (self._helper.counts if self._helper else collections.Counter())
        replaced = self.num_replaced + (self._helper.num_replaced if self._helper else 0)
        return {"reward_errors": counts[guard.ERROR], "reward_timeouts": counts[guard.TIMEOUT],
                "reward_crashes": counts[guard.CRASHED], "reward_workers_replaced": replaced}

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> bool:
        """Block until every worker has imported and warmed up its function (True), or `timeout_s` passed."""
        end = time.monotonic() + timeout_s
        while self.num_workers and not all(w.ready for w in self._workers):
            if time.monotonic() > end or self._broken or self._closed:
                return False
            time.sleep(0.02)
        return True

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and tests)."""
        return [] if self.num_workers == 0 else [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers; samples not yet scored are cancelled. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._helper is not None:
            self._helper.close()
        if self.num_workers:
            self._wake_w.send_bytes(b"x")
            self._thread.join()
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- outcomes ----

    def _record(self, outcome: guard.Outcome) -> float:
        score, kind, detail = outcome
        with self._count_lock:
            self.counts[kind] += 1
            first = kind != guard.OK and self.counts[kind] == 1
        if first:
            log.warning("reward.fn %s: a sample %s, so it scores 0.0 (further ones are counted as reward_%s in the "
                        "metrics, not logged)", self.name, detail, "errors" if kind == guard.ERROR else kind + "s")
        return score

    def _thread_helper(self) -> RewardPool:
        with self._count_lock:
            if self._helper is None:
                self._helper = RewardPool(1, self.timeout_s, self._fn_ref, self.start_method)
            return self._helper

    # ---- the dispatcher thread ----

    def _next_task(self):
        with self._lock:
            while self._queue:
                fut, task = self._queue.popleft()
                if fut.set_running_or_notify_cancel():  # False: the caller cancelled it
                    return fut, task
        return None

    def _replace(self, i: int, outcome: str) -> None:
        """Kill worker i (its sample, if any, scores 0.0 as `outcome`: TIMEOUT or CRASHED) and start a new one."""
        w = self._workers[i]
        w.kill()
        self._workers[i] = Worker(self._ctx, self._fn_ref)
        self.num_replaced += 1
        if w.future is not None:  # resolved last, so whoever waits on it sees the new worker
            detail = ("did not answer within its time limit plus a grace (stuck in C code?): its worker was killed"
                      if outcome == guard.TIMEOUT else "ended its worker process (it died or was killed)")
            w.future.set_result(self._record((0.0, outcome, detail)))

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 -- a bug here must fail the futures, not hang them
            self._broken = f"RewardPool dispatcher failed: {e!r}"
        self._shutdown()

    def _loop(self) -> None:
        startup_failures = 0
        while not self._closed and not self._broken:
            for w in self._workers:  # hand tasks to idle workers
                if w.ready and w.future is None and (item := self._next_task()):
                    w.future, task = item
                    w.deadline = time.monotonic() + task[3] + max(1.0, 0.25 * task[3])
                    try:
                        w.conn.send(task)
                    except OSError:
                        pass  # it died: found below, its sample scores 0.0
                    except Exception as e:  # noqa: BLE001 -- unpicklable: nothing was sent, it scores 0.0
                        w.future.set_result(self._record((0.0, guard.ERROR, f"could not be sent ({e!r})")))
                        w.future = None
            now = time.monotonic()
            limits = [
                w.deadline if w.future else w.started + STARTUP_TIMEOUT_S
                for w in self._workers
                if w.future or not w.ready
            ]
            wait_s = max(0.0, min(limits) - now) if limits else None
            waitables = [
                self._wake_r,
                *(w.conn for w in self._workers),
                *(w.proc.sentinel for w in self._workers),
            ]
            ready = set(mpc.wait(waitables, wait_s))
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # died: the pipe closed
                        msg = None
                    if msg == "ready":
                        w.ready, startup_failures = True, 0
                        continue
                    if isinstance(msg, tuple) and w.future is not None:
                        w.future.set_result(self._record(msg))
                        w.future = None
                        continue
                    startup_failures += not w.ready
                    self._replace(i, guard.CRASHED)
                elif w.proc.sentinel in ready:  # exited without closing the pipe first
                    startup_failures += not w.ready
                    self._replace(i, guard.CRASHED)
                elif w.future is not None and now > w.deadline:  # hung past its time: kill it
                    self._replace(i, guard.TIMEOUT)
                elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                    startup_failures += 1
                    self._replace(i, guard.CRASHED)
            if startup_failures >= MAX_STARTUP_FAILURES:
                module = self.name.partition(":")[0]
                self._broken = (
                    f"RewardPool: {startup_failures} workers in a row died while starting; check that reward.fn "
                    f"{self.name} imports and warms up in a fresh Python (python -c 'import {module}')"
                )

    def _shutdown(self) -> None:
        with self._lock:
            pending, self._queue, self._drained = list(self._queue), collections.deque(), True
        reason = self._broken or "RewardPool closed before this sample was scored"
        for fut, _ in pending:
            if not self._broken:
                fut.cancel()
            elif fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(reason))
        for w in self._workers:
            if w.future is not None:
                w.future.set_exception(RuntimeError(reason))
            if not w.ready:  # still importing: nothing to wait for
                w.proc.kill()
                continue
            try:
                w.conn.send(None)  # a polite stop; kill() below if it does not exit
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(2)
            w.kill()
