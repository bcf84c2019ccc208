"""How every benchmark runs, and is run: it fails fast and leaves nothing behind.

- `main(fn)` is each bench's `if __name__ == "__main__"` entry. The bench process becomes a child subreaper (Linux),
  so a process orphaned inside its tree (a vLLM engine core whose parent died, a supervisor child that left the
  process group) is re-parented to it and stays findable; SIGTERM and SIGHUP raise SystemExit, so `finally` blocks
  and context managers run. However `fn` ends (return, exception, signal), every descendant still alive is
  terminated, then killed after `GRACE_S`. A failure exits at once with a non-zero code (`os._exit`: no atexit hook
  waits on an engine that is gone), and a clean-up that hangs is cut short by a watchdog after `GRACE_S`. A bench
  started by `run` also stops (as on SIGTERM) when the process that ran it dies, however it died (SIGKILL
  included: a killed test run or `make bench` leaves no bench running); one started from a shell does not (nohup).
- `run(cmd, timeout_s)` runs one bench as a subprocess in its own process group (the way `bench.run_all` and
  `bench.throughput` run theirs), echoing and keeping its output. Past the time limit it sends SIGTERM (the bench's
  own clean-up), then SIGKILL to its group and to every process of its tree.

Invariants: processes are found by pid (tree) and process group, never by name; when `run` returns, no process of
the bench's group, nor any descendant it had when it was stopped, is alive, and its output pipe is closed.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # seconds a stopped bench, or a process of its tree, gets before SIGKILL
PARENT_ENV = "REINFORCE_ADA_BENCH_RUNNER"  # set by `run`: the pid whose death stops the bench
PARENT_POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt the orphans of its tree (Linux); False where that is not available."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def group_members(pgid: int) -> list[psutil.Process]:
    """Every live process whose process group is `pgid` (zombies left out: they hold nothing but a pid)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def stop_processes(procs: list[psutil.Process], grace_s: float = GRACE_S) -> int:
    """SIGTERM every process, SIGKILL those still alive after `grace_s`, reap our own children; how many were
    alive."""
    alive = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                p.terminate()
                alive.append(p)
            else:
                p.wait(0)  # a zombie child of ours: reap it
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return len(alive)


def kill_tree(pid: int, grace_s: float = GRACE_S) -> int:
    """Stop every descendant of `pid` (not `pid` itself); how many were still running."""
    return stop_processes(descendants(pid), grace_s)


def _raise_exit(signum, _frame):
    signal.signal(signum, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
    raise SystemExit(128 + signum)


def _watch_runner() -> None:
    """When `run` started this process, SIGTERM it once that runner is gone (this process is re-parented then)."""
    runner = os.environ.pop(PARENT_ENV, "")  # popped: a bench this one starts by other means is not watched
    if not runner.isdigit() or int(runner) != os.getppid():
        return

    def watch() -> None:
        while os.getppid() == int(runner):
            time.sleep(PARENT_POLL_S)
        try:
            print(f"bench: the process that ran it (pid {runner}) is gone; stopping", file=sys.stderr, flush=True)
        except OSError:
            pass
        # the runner read this process's output: with it gone, a write would raise BrokenPipeError in the middle
        # of the clean-up, so the output goes nowhere from now on
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="runner-watch", daemon=True).start()


def main(fn: Callable[[], int | None], grace_s: float = GRACE_S) -> None:
    """Run a bench's `main` so that it fails fast and leaves no process behind (see the module docstring)."""
    become_subreaper()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    _watch_runner()
    code: int = 1
    try:
        result = fn()
        code = int(result or 0) if not isinstance(result, dict) else 0  # some mains return their numbers
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):  # SystemExit("message"): the message is the error
            print(exc.code, file=sys.stderr, flush=True)
        if code:
            print(f"bench stopped (exit {code})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - any failure: report it, stop everything, exit non-zero
        traceback.print_exc()
        code = 1
    if code:  # a clean-up that hangs must not keep a failed bench alive
        watchdog = threading.Timer(grace_s + 5, lambda: os._exit(code))
        watchdog.daemon = True
        watchdog.start()
    left = kill_tree(os.getpid(), grace_s)
    if left:
        print(f"bench: stopped {left} process(es) it had left running", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(0)


@dataclass
class Outcome:
    code: int | str  # the exit code, or "timeout"
    seconds: float
    tail: str  # the last lines of its output
    leftovers: int = 0  # processes of its group or tree still running when it ended, then stopped


def _stop_bench(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the bench (its own clean-up runs), then SIGKILL whatever of it is left."""
    tree = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace_s + 5)  # the bench's own watchdog ends it after grace_s
    except subprocess.TimeoutExpired:
        tree += descendants(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.kill()
        proc.wait()
    stop_processes(tree, 1.0)


def run(cmd: list[str], timeout_s: float, *, cwd: Path = ROOT, echo: bool = True, tail_lines: int = 20,
        grace_s: float = GRACE_S) -> Outcome:
    """Run one bench as a subprocess with a time limit; nothing of it is left running when this returns."""
    t0 = time.monotonic()
    ours_before = {p.pid for p in descendants(os.getpid())}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())})
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def read() -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            tail.append(line.rstrip("\n"))
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code: int | str
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = "timeout"
        _stop_bench(proc, grace_s)
    except BaseException:
        _stop_bench(proc, grace_s)
        raise
    finally:
        # whatever is still running of its group, or was re-parented to us (a subreaper) since it started, holds
        # its pipe: stop it
        adopted = [p for p in descendants(os.getpid()) if p.pid not in ours_before and p.pid != proc.pid]
        leftovers = group_members(proc.pid) + adopted
        left = stop_processes(leftovers, 2.0)
        reader.join(5)
        proc.stdout.close()
    return Outcome(code, time.monotonic() - t0, "\n".join(tail), left)
