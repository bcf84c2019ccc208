"""When a dead child is started again, and when the run stops instead: a pure function of the child's deaths.

Policy: each role has a budget of restarts (a producer 5, the learner and the buffer 3 each). Independently, a
child that died `same_error_limit` times in a row with the same error (the last exception line of its log, equal
after memory addresses are masked) is in a crash loop: restarting it again would only repeat the error, so the
run stops with that line, the process and its log path. A death without an exception line (SIGKILL, a clean
`sys.exit(3)`) never counts toward a crash loop and breaks one in progress. A child that exits with EXIT_FATAL
stopped the run on purpose (the buffer saw that the reward never fires, the learner that nothing arrives): it is
never restarted, and the run stops with the last line it logged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.exits import EXIT_FATAL

SAME_ERROR_LIMIT = 3

_TRACEBACK = "Traceback (most recent call last):"
# vLLM prefixes its engine process's output with "(EngineCore_DP0 pid=1234) "; colours come from some loggers
_PREFIX = re.compile(r"^\(\S+ pid=\d+\) ?")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:.*)?$")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Death:
    """One exit of a child: its exit code and the last exception line of that run's log ('' when none)."""

    code: int
    error: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    same_error_limit: int = SAME_ERROR_LIMIT

    def __post_init__(self) -> None:
        assert self.max_restarts >= 0 and self.same_error_limit >= 1, self


@dataclass(frozen=True)
class GiveUp:
    """Why a child is not restarted again; `describe` words it for the person running the job."""

    crash_loop: bool
    deaths: tuple[Death, ...]
    fatal: bool = False  # the child stopped the run on purpose (EXIT_FATAL)

    def describe(self, name: str, log_path: object, tail: str) -> str:
        last = self.deaths[-1]
        if self.fatal:
            said = last.error or next((line for line in reversed(tail.splitlines()) if line.strip()), "")
            return f"{name} stopped the run (exit code {last.code}):\n    {said.strip()}\n  log: {log_path}"
        if self.crash_loop:
            return (f"{name} died {len(self.deaths)} times in a row with the same error (not restarted again):\n"
                    f"    {last.error}\n  exit code {last.code}; log: {log_path}")
        return (f"{name} died {len(self.deaths)} times (last exit code {last.code}); last lines of {log_path}:\n"
                f"{tail}")


POLICIES = {"producer": RestartPolicy(5), "learner": RestartPolicy(3), "buffer": RestartPolicy(3)}


def decide(deaths: Sequence[Death], policy: RestartPolicy) -> GiveUp | None:
    """None: restart the child; else why not. `deaths` is the child's whole history, oldest first."""
    assert deaths, "decide is called after a death"
    if deaths[-1].code == EXIT_FATAL:
        return GiveUp(False, tuple(deaths), fatal=True)
    k = policy.same_error_limit
    recent = deaths[-k:]
    if len(recent) == k and recent[-1].error and all(d.error == recent[-1].error for d in recent):
        return GiveUp(True, tuple(deaths))
    if len(deaths) > policy.max_restarts:
        return GiveUp(False, tuple(deaths))
    return None


def last_error_line(log_text: str) -> str:
    """The exception line that ended a Python process's log ('' when the log shows none).

    The line after the last traceback's frames (`ValueError: bad value`); without a traceback, the last line
    that looks like one. Prefixes added by vLLM's engine process and memory addresses are removed, so the same
    error in two runs gives the same line.
    """
    lines = [_PREFIX.sub("", _ANSI.sub("", line)).rstrip() for line in log_text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line == _TRACEBACK]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line and not line[0].isspace():
                return _ADDRESS.sub("0x?", line.strip())
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()):
            return _ADDRESS.sub("0x?", line.strip())
    return ""
