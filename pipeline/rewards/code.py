"""A code reward (`reward.fn = "pipeline.rewards.code:unit_tests"`): the completion's last ```python block and
the prompt's tests, run together in a fresh Python subprocess; 1.0 if the tests run to their end, else 0.0.

The tests are Python code that raises on failure (asserts): the prompt's `tests` extra (data.extra_keys =
["extra_info.tests"], a string or a list of strings), else the gold answer itself.

What protects the caller (a reward worker) from a hostile or broken program:
- the program runs in its own process and session, in an empty temporary directory, with `python -I` (no
  environment variables, no user site) and a minimal environment; the whole process group is killed when the
  call returns, times out, or is interrupted by the worker's own deadline;
- limits set before the program starts: CPU seconds, address space, file size, no core files; it dies with its
  parent (PR_SET_PDEATHSIG) if the worker is killed;
- its stdout and stderr go to /dev/null (a flood of output costs nothing), and destructive functions are
  replaced by ones that raise (os.system, os.kill, os.fork, os._exit, os.remove, subprocess.Popen, ...);
- success is a random token that the harness writes to its own file only after the tests returned: exiting
  early with status 0 (sys.exit(0), os._exit(0)) scores 0.0.
This is the reliability guard of OpenAI's human-eval, not a security sandbox: a program that sets out to escape
(ctypes, reading the harness's frames) can. Run untrusted code at scale inside a container.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TIME_LIMIT_S = 10.0  # wall-clock seconds per program (the reward worker's own limit may stop it sooner)
MAX_MEMORY_BYTES = 2 << 30  # address space of the program's process
MAX_FILE_BYTES = 1 << 20  # the largest file the program may write
PYTHON_TAGS = ("python", "py", "python3")

# Runs first in the subprocess: limits, then the guard, then the program, then the token (see the docstring).
HARNESS = r"""
import os, sys


def guard(limit_s, max_memory, max_file):
    import ctypes, resource, shutil, subprocess
    for res, value in ((resource.RLIMIT_CPU, int(limit_s) + 1), (resource.RLIMIT_AS, max_memory),
                       (resource.RLIMIT_FSIZE, max_file), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError):
            pass
    try:
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL
    except Exception:
        pass
    def denied(*args, **kwargs):
        raise PermissionError("not allowed in a reward program")
    for name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "_exit", "abort", "execv", "execve",
                 "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp",
                 "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove",
                 "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "ftruncate", "chmod",
                 "fchmod", "chown", "fchown", "lchown", "chroot", "putenv", "unsetenv", "setuid", "setgid", "link",
                 "symlink"):
        if hasattr(os, name):
            setattr(os, name, denied)
    shutil.rmtree = shutil.move = shutil.chown = subprocess.Popen = denied


def main():
    token = sys.stdin.readline().strip().encode()
    sys.stdin.close()
    result = os.open("result", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open("program.py") as f:
        code = compile(f.read(), "program.py", "exec")
    guard(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    exec(code, {"__name__": "__main__"})
    os.write(result, token)


main()
"""


def last_python_block(text: str) -> str | None:
    """The body of the last complete ```python (or ```py, ```python3) block of `text`, else None. Linear time."""
    parts = text.split("```")  # odd indices are inside fences; a last, unclosed fence is not a block
    closed = len(parts) if len(parts) % 2 else len(parts) - 1
    for i in range(closed - 2, 0, -2):
        header, _, body = parts[i].partition("\n")
        if header.strip().lower() in PYTHON_TAGS:
            return body
    return None


def run_program(source: str, time_limit_s: float = TIME_LIMIT_S) -> bool:
    """True if `source` runs to its end in a guarded subprocess (see the module docstring) within the limit."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="reward-code-") as tmp:
        (Path(tmp) / "program.py").write_text(source)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", HARNESS, repr(float(time_limit_s)), str(MAX_MEMORY_BYTES),
             str(MAX_FILE_BYTES)],
            cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": os.defpath, "HOME": tmp, "LANG": "C.UTF-8"},
        )
        try:
            try:
                proc.stdin.write(token.encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:  # it died at once: its exit status says how
                pass
            proc.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            return False
        finally:  # also on the worker's deadline (a BaseException): nothing the program started outlives it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        result = Path(tmp) / "result"
        return proc.returncode == 0 and result.is_file() and result.read_bytes()[:64] == token.encode()


def unit_tests(completion: str, answer: str, tests: str | list[str] | None = None,
               time_limit_s: float = TIME_LIMIT_S) -> float:
    """1.0 if the last ```python block of `completion` passes `tests` (else the gold `answer`, as test code),
    run in a guarded subprocess within `time_limit_s`; 0.0 otherwise (no block, a failed assert, an error, a
    timeout, an early exit). Raises ValueError when there are no tests at all (a data error, counted by the pool)."""
    code = last_python_block(completion) if isinstance(completion, str) else None
    checks = answer if tests is None else tests
    if isinstance(checks, (list, tuple)):
        checks = "\n".join(str(t) for t in checks)
    if not isinstance(checks, str) or not checks.strip():
        raise ValueError("no tests to run: give them in the `tests` extra (data.extra_keys) or as the answer")
    if code is None:
        return 0.0
    return float(run_program(f"{code}\n\n{checks}\n", time_limit_s))
