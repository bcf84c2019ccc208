"""Rewards: 1.0 or 0.0 from math-verify, with a time limit per sample, inline or in worker processes.

Invariants: `math_reward` never raises, and returns within its time limit unless it is stuck in C code
that never returns to Python (then only a pool worker can be stopped: it is killed). `RewardPool`
resolves every submitted sample exactly once (a score; 0.0 for a worker that hung or died; cancelled, or
a RuntimeError if already running, when the pool closes first) and keeps its worker count while open.

Why the care: math-verify bounds its own work with `signal.alarm`, which only works in the main thread and
only in whole seconds. We switch its timers off and arm one `setitimer` deadline around the whole call
instead (main thread only); from any other thread the call is sent to a one-worker process pool. A worker
stuck inside C code (a huge integer power) does not see the signal; the pool kills and replaces it.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import functools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Self

from pipeline.data import last_boxed

TAIL_CHARS = 8000  # only the tail of a completion is searched for its answer: bounds the time on huge ones
STARTUP_TIMEOUT_S = 120.0  # a worker must import math-verify and say "ready" within this
MAX_STARTUP_FAILURES = 3  # workers dying before "ready" this many times in a row break the pool

ScoreFn = Callable[[str, str, float], float]


class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so math-verify's `except Exception` lets it through."""


def _raise_deadline(signum, frame):
    raise _Deadline


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    from math_verify import parse

    # boxing takes the whole answer as one expression, whatever `$` or text it contains
    text = answer if last_boxed(answer) is not None else "\\boxed{" + answer + "}"
    return tuple(parse(text, parsing_timeout=None))


def _score_unguarded(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    answer = answer.strip()
    if not answer or not completion:
        return 0.0
    tail = completion[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    pred_text = tail if boxed is None else "\\boxed{" + boxed + "}"
    gold = list(_parse_gold(answer))
    if not gold:  # math-verify cannot read the gold answer: fall back to comparing the text
        return float(boxed is not None and "".join(boxed.split()) == "".join(answer.split()))
    pred = parse(pred_text, parsing_timeout=None)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))


def _silence_math_verify_timeout_warning() -> None:
    # math-verify warns once that its own timers are off; ours replace them, so the warning is noise
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True


def math_reward(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if `completion`'s final answer equals the gold `answer` by math-verify, else 0.0. Never raises.

    The gold answer is parsed as `\\boxed{answer}`. The prediction is the last complete \\boxed{} of the
    completion's tail (its last TAIL_CHARS = 8000 characters, where the final answer is; earlier text is
    ignored so a 1 MB completion costs no more than an 8 kB one); without a box, math-verify reads the
    tail itself (so a plain "46" scores). The whole call is limited to `timeout_s` seconds by a
    SIGALRM timer in the main thread; called from another thread it runs in a worker process instead.
    Errors and timeouts give 0.0.
    """
    if not (isinstance(completion, str) and isinstance(answer, str) and isinstance(timeout_s, (int, float))):
        return 0.0
    if not timeout_s > 0:  # also NaN
        return 0.0
    if threading.current_thread() is not threading.main_thread():
        try:
            return _fallback_pool().submit(completion, answer, timeout_s).result()
        except Exception:  # noqa: BLE001 -- pool closed at exit, or broken: a reward never raises
            return 0.0
    try:
        _silence_math_verify_timeout_warning()
    except Exception:  # noqa: BLE001 -- math-verify missing or broken: nothing can be verified
        return 0.0
    old_handler = signal.signal(signal.SIGALRM, _raise_deadline) or signal.SIG_DFL  # None: set from C
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        try:
            return _score_unguarded(completion, answer)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return 0.0
    except Exception:  # noqa: BLE001 -- a reward never raises: a parse error is a wrong answer
        return 0.0
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # the caller had its own timer (e.g. pytest-timeout): give back what is left
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


_FALLBACK: RewardPool | None = None
_FALLBACK_LOCK = threading.Lock()


def _fallback_pool() -> RewardPool:
    """One worker process for math_reward calls from threads other than the main one."""
    global _FALLBACK
    with _FALLBACK_LOCK:
        if _FALLBACK is None:
            _FALLBACK = RewardPool(num_workers=1)
            atexit.register(_FALLBACK.close)
        return _FALLBACK


# ---- the pool ----


def _worker_main(conn, score_fn: ScoreFn) -> None:
    """A worker process: warm up, say "ready", then score (completion, answer, timeout_s) tasks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    score_fn("\\boxed{1}", "1", 5.0)  # import math-verify and sympy before any deadline runs
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:  # skip interpreter teardown: nothing to flush, and unloading sympy takes ~1 s
            conn.close()
            os._exit(0)
        try:
            score = float(score_fn(*task))
        except BaseException:  # noqa: BLE001 -- a sample that fails scores 0.0; the worker lives on
            score = 0.0
        conn.send(score)


def _check_lengths(completions: list[str], answers: list[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one gold answer "
            "per completion"
        )


class _Worker:
    def __init__(self, ctx, score_fn: ScoreFn):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, score_fn), daemon=True)
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


class RewardPool:
    """Scores batches of (completion, answer) with `math_reward` in `num_workers` worker processes.

    A sample whose worker has not answered within timeout_s (+ a grace for the worker's own timer) or
    whose worker dies scores 0.0; that worker is killed and replaced and the pool goes on. Workers are
    started with `start_method` ("spawn" or "forkserver"), safe from callers that run threads (vLLM);
    a script using the pool needs `if __name__ == "__main__":`. num_workers=0 scores inline in the caller.
    `score_fn` (default math_reward) must be a picklable top-level function (completion, answer, timeout_s).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        score_fn: ScoreFn | None = None,
        start_method: str = "spawn",
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
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self._fn = score_fn or math_reward
        self._closed = False
        self._broken: str | None = None
        self.num_replaced = 0  # workers killed or dead and replaced (for metrics)
        if num_workers == 0:
            return
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._drained = False  # set once the dispatcher has stopped taking tasks
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [_Worker(self._ctx, self._fn) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # ---- public API ----

    def submit(self, completion: str, answer: str, timeout_s: float | None = None) -> Future:
        """A Future of the score of one sample (use asyncio.wrap_future to await it)."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if self._broken:
            raise RuntimeError(self._broken)
        fut: Future = Future()
        if self.num_workers == 0:
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(float(self._fn(completion, answer, t)))
            except Exception:  # noqa: BLE001 -- same contract as the workers: failure scores 0.0
                fut.set_result(0.0)
            return fut
        with self._lock:
            if self._drained:  # closed or broken after the check above
                raise RuntimeError(self._broken or "RewardPool is closed")
            self._queue.append((fut, (completion, answer, t)))
        self._wake_w.send_bytes(b"x")
        return fut

    def score(self, completions: list[str], answers: list[str]) -> list[float]:
        """Scores of each completion against the answer at the same index, in order."""
        _check_lengths(completions, answers)
        return [f.result() for f in [self.submit(c, a) for c, a in zip(completions, answers)]]

    async def ascore(self, completions: list[str], answers: list[str]) -> list[float]:
        """`score` for asyncio callers: awaits the futures without blocking the event loop."""
        _check_lengths(completions, answers)
        futs = [asyncio.wrap_future(self.submit(c, a)) for c, a in zip(completions, answers)]
        return list(await asyncio.gather(*futs))

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> bool:
        """Block until every worker has imported math-verify (True), or `timeout_s` passed (False)."""
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
        if self.num_workers:
            self._wake_w.send_bytes(b"x")
            self._thread.join()
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the dispatcher thread ----

    def _next_task(self):
        with self._lock:
            while self._queue:
                fut, task = self._queue.popleft()
                if fut.set_running_or_notify_cancel():  # False: the caller cancelled it
                    return fut, task
        return None

    def _replace(self, i: int) -> None:
        """Kill worker i (its sample, if any, scores 0.0) and start a new one in its place."""
        w = self._workers[i]
        w.kill()
        self._workers[i] = _Worker(self._ctx, self._fn)
        self.num_replaced += 1
        if w.future is not None:  # resolved last, so whoever waits on it sees the new worker
            w.future.set_result(0.0)

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
                    w.deadline = time.monotonic() + task[2] + max(1.0, 0.25 * task[2])
                    try:
                        w.conn.send(task)
                    except OSError:
                        pass  # it died: found below, its sample scores 0.0
                    except Exception:  # noqa: BLE001 -- unpicklable: nothing was sent, it scores 0.0
                        w.future.set_result(0.0)
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
                    if isinstance(msg, float) and w.future is not None:
                        w.future.set_result(msg)
                        w.future = None
                        continue
                    startup_failures += not w.ready
                    self._replace(i)
                elif w.proc.sentinel in ready:  # exited without closing the pipe first
                    startup_failures += not w.ready
                    self._replace(i)
                elif w.future is not None and now > w.deadline:  # hung past its time: kill it
                    self._replace(i)
                elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                    startup_failures += 1
                    self._replace(i)
            if startup_failures >= MAX_STARTUP_FAILURES:
                self._broken = (
                    f"RewardPool: {startup_failures} workers in a row died while starting; "
                    "check that math-verify imports in a fresh Python (python -c 'import math_verify')"
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
