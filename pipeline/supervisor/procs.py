"""Child processes of a run: each in its own process group, with its own log file and recorded command.

Invariants: a child is watched by its pid (Popen.poll), killed by process group (never by name), and every
child the supervisor started is dead when `stop_all` returns. Children also get SIGTERM if the supervisor
itself dies (PR_SET_PDEATHSIG), so a killed supervisor leaves no orphan engines behind.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import psutil

from pipeline.supervisor.restarts import Death

START_MARK = b"\n==== "  # begins the line each start writes to the log (see Child.start)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the supervisor's own cleanup still kills the group
        pass


class Child:
    """One supervised process."""

    def __init__(self, name: str, role: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 cwd: str | None = None):
        self.name = name
        self.role = role
        self.cmd = cmd
        self.env = env or {}
        self.cwd = cwd  # None: the supervisor's own (a launcher that starts it elsewhere passes the run's)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.deaths: list[Death] = []  # every exit the supervisor saw, oldest first
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.cmd)

    def start(self) -> None:
        self.kill_group()  # a restart: whatever the previous incarnation left behind goes first
        env = dict(os.environ)
        env.update(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "ab")
        log.write(START_MARK + f"{time.strftime('%H:%M:%S')} start: {self.command_line()}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.cwd, preexec_fn=_die_with_parent)
        log.close()
        self.started_at = time.monotonic()

    def poll(self) -> int | None:
        """None while running, else the exit code (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Signal the leader only: it shuts its own helpers (vLLM engine processes) down in order. Signalling
        the whole group would kill the engine at once and lose the rounds the grace period should finish."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def signal_children(self, sig: int) -> bool:
        """Signal the leader's own children instead of the leader (torchrun's ranks: torchrun would give them only
        30 s before killing them, too little to checkpoint a large model); False when it has none."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return False
        for child in children:
            try:
                child.send_signal(sig)
            except psutil.Error:
                pass
        return bool(children)

    def kill_group(self) -> None:
        """SIGKILL everything left in the child's process group (also after the leader died: orphaned engines)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the leader, wait up to `grace_s`, then SIGKILL the whole group. Returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill_group()  # even when the leader exited: its engine processes may linger
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _log_end(self, max_bytes: int) -> bytes:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - max_bytes))
            return f.read()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(deque(self._log_end(64_000).decode(errors="replace").splitlines(), maxlen=lines))
        except OSError:
            return "(no log)"

    def log_since_start(self, max_bytes: int = 256_000) -> str:
        """What the current (or last) run of the child wrote: the log after its start line, at most `max_bytes`."""
        try:
            data = self._log_end(max_bytes)
        except OSError:
            return ""
        mark = data.rfind(START_MARK)
        if mark >= 0:
            data = data[data.find(b"\n", mark + len(START_MARK)) + 1:]
        return data.decode(errors="replace")


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """Stop every child: SIGTERM all first (so they shut down in parallel), then wait and SIGKILL stragglers."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        child.stop(max(0.1, deadline - time.monotonic()))


def write_commands(path: Path, children: list[Child], cwd: str) -> None:
    """Record each child's exact command so any stage can be rerun alone."""
    lines = ["#!/usr/bin/env bash", "# The exact command of each process of this run; rerun any one alone.",
             f"cd {shlex.quote(cwd)}"]
    for child in children:
        lines += ["", f"# {child.name} ({child.role}); log: {child.log_path}", child.command_line()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.supervisor.procs NAME LOG_DIR -- CMD...`: run CMD as `train` runs a child (its own process
    group, its log LOG_DIR/NAME.log, the whole group killed when the leader exits, so no orphaned engine keeps a
    Slurm step alive), passing SIGTERM and SIGINT on to the leader. Exits with CMD's code (128 + N: signal N)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or args[2] != "--":
        print("usage: python -m pipeline.supervisor.procs NAME LOG_DIR -- CMD...", file=sys.stderr)
        return 2
    child = Child(args[0], args[0], args[3:], Path(args[1]))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.signal(signum))
    child.start()
    while (code := child.poll()) is None:
        time.sleep(0.2)
    child.kill_group()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main())
