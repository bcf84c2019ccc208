"""A code reward (`reward.fn = "pipeline.rewards.code:unit_tests"`): the prompt's tests run against the
completion's last ```python block; 1.0 if the tests run to their end, else 0.0.

The tests are Python code that raises on failure (asserts): the prompt's `tests` extra (data.extra_keys =
["extra_info.tests"], a string or a list of strings), else the gold answer itself.

RL optimises against this reward, so a program that can fake a pass will: the verdict is therefore decided where
the program cannot reach, from values it never sees. Each sample runs as two processes in two sandboxes
(`sandbox.py` says which isolation this machine allows, `code_box.py` what runs inside):
- the *program box* runs the program and then only answers calls on its functions and objects;
- the *tester box* runs the tests, calling the program's functions across a pipe (arguments go in, plain values
  or handles come back; the tests' expected values and their `assert` never enter the program box), and writes
  "pass" to this process only when the tests returned. The program holds no descriptor to that channel: exiting
  early, reading the caller's frames, patching builtins or AssertionError, or writing anywhere cannot pass.
Both boxes have no network, no writable file outside their own /tmp, no view of the run directory, keys,
virtualenv or weights (with bwrap; weaker tiers are logged), and limits on CPU, memory, file size, open files and
processes; both are killed, with everything they started, when the call returns, times out or is interrupted.
What a program can use: the standard library, its own /tmp (in the weaker tiers, a fresh private working
directory, never the caller's). Tests can pass plain values (numbers, strings, bytes, lists, tuples, dicts, sets)
and the program's own objects to its functions, not functions of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from pipeline.rewards import sandbox

TIME_LIMIT_S = 10.0  # wall-clock seconds per sample (the reward worker's own limit may stop it sooner)
MAX_MEMORY_BYTES = 2 << 30  # address space of each box's processes
MAX_FILE_BYTES = 1 << 20  # the largest file a box may write
PYTHON_TAGS = ("python", "py", "python3")


def last_python_block(text: str) -> str | None:
    """The body of the last complete ```python (or ```py, ```python3) block of `text`, else None. Linear time."""
    parts = text.split("```")  # odd indices are inside fences; a last, unclosed fence is not a block
    closed = len(parts) if len(parts) % 2 else len(parts) - 1
    for i in range(closed - 2, 0, -2):
        header, _, body = parts[i].partition("\n")
        if header.strip().lower() in PYTHON_TAGS:
            return body
    return None


def run_program(program: str, tests: str, time_limit_s: float = TIME_LIMIT_S,
                iso: sandbox.Isolation | None = None) -> bool:
    """True if `tests` run to their end against `program` (see the module docstring) within `time_limit_s`; `iso`
    is the isolation to use (default: the strongest this machine allows)."""
    iso = iso or sandbox.isolation()
    if iso.kind == sandbox.BWRAP:  # each box works in its own /tmp
        return _run_boxes(program, tests, time_limit_s, iso, None, None)
    # the weaker tiers share the file system: each box works in a fresh directory inside a private one (so "../x"
    # stays inside too), all removed after the call (after the boxes are killed), never the caller's directory
    with tempfile.TemporaryDirectory(prefix="reinforce-ada-boxes-", ignore_cleanup_errors=True) as private:
        program_dir, tester_dir = Path(private, "program"), Path(private, "tester")
        program_dir.mkdir(mode=0o700)
        tester_dir.mkdir(mode=0o700)
        return _run_boxes(program, tests, time_limit_s, iso, str(program_dir), str(tester_dir))


def _run_boxes(program: str, tests: str, time_limit_s: float, iso: sandbox.Isolation, program_dir: str | None,
               tester_dir: str | None) -> bool:
    limits = sandbox.box_limits(time_limit_s, MAX_MEMORY_BYTES, MAX_FILE_BYTES, iso)
    to_program_r, to_program_w = os.pipe()  # tester -> program box
    from_program_r, from_program_w = os.pipe()  # program box -> tester
    boxes = []
    try:
        boxes.append(sandbox.start_box(iso, "program", limits, stdin=to_program_r, stdout=from_program_w,
                                       workdir=program_dir))
        tester = sandbox.start_box(iso, "tester", limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   pass_fds=(to_program_w, from_program_r), workdir=tester_dir)
        boxes.append(tester)
        for fd in (to_program_r, to_program_w, from_program_r, from_program_w):
            os.close(fd)
        to_program_r = to_program_w = from_program_r = from_program_w = -1
        job = json.dumps({"program": program, "tests": tests}).encode()
        try:
            verdict, _ = tester.communicate(job, timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            return False
        return tester.returncode == 0 and verdict == b"pass\n"
    finally:  # also on the worker's deadline (a BaseException): nothing either box started outlives the call
        for box in boxes:
            sandbox.kill_box(box)
        for fd in (to_program_r, to_program_w, from_program_r, from_program_w):
            if fd >= 0:
                os.close(fd)


def unit_tests(completion: str, answer: str, tests: str | list[str] | None = None,
               time_limit_s: float = TIME_LIMIT_S) -> float:
    """1.0 if the last ```python block of `completion` passes `tests` (else the gold `answer`, as test code),
    run in two sandboxes within `time_limit_s`; 0.0 otherwise (no block, a failed assert, an error, a
    timeout, an early exit). Raises ValueError when there are no tests at all (a data error, counted by the pool)."""
    code = last_python_block(completion) if isinstance(completion, str) else None
    checks = answer if tests is None else tests
    if isinstance(checks, (list, tuple)):
        checks = "\n".join(str(t) for t in checks)
    if not isinstance(checks, str) or not checks.strip():
        raise ValueError("no tests to run: give them in the `tests` extra (data.extra_keys) or as the answer")
    if code is None:
        return 0.0
    return float(run_program(code, checks, time_limit_s))


unit_tests.warmup = sandbox.isolation  # type: ignore[attr-defined] -- a reward worker probes the isolation once, outside any sample's time limit
