"""Where the code reward runs a box (`code_box.py`): the strongest isolation this machine allows, found once.

Tiers, strongest first (`isolation()` probes each once per process and keeps the first that starts a Python):
- "bwrap" (bubblewrap): new pid, network, IPC and UTS namespaces; a file system made only of read-only /usr (and
  the /bin, /lib links), the interpreter's own install, a fresh /proc and /dev, and a 16 MiB tmpfs /tmp as its
  working directory; the rest of the machine (run directory, keys, virtualenv, weights, home) is not there.
  As root the box becomes a fresh unprivileged uid of its own (random, above 2**28, no groups, no capabilities)
  right after bwrap starts it, so a process limit counts only its own processes; as another user it runs in a
  new user namespace. Killing bwrap kills every process of the box (its pid namespace ends).
- "unshare" (util-linux, when bwrap is missing or cannot start): new pid, network, IPC and UTS namespaces, so no
  network and no view of other processes, and every process dies with the box; but the file system is the
  trainer user's: the program can read what that user can.
- "none": a plain subprocess in its own session, with resource limits only: it can read and write what the
  trainer user can, open sockets, and outlive the call with setsid. A warning says so once per process.
In the two weaker tiers each box works in a fresh private directory the caller makes (`start_box`'s `workdir`,
also its HOME and TMPDIR), never in the caller's working directory, so a program's relative paths cannot write
into the checkout or the run directory it was started from.
Every tier sets limits before the program starts: CPU seconds, address space, file size, open files, no core
files, and (where the box has a uid or user namespace of its own) processes.

REINFORCE_ADA_CODE_ISOLATION=bwrap|unshare|none forces a tier (an error naming the fix if it is not available);
unset or "auto" probes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BWRAP, UNSHARE, NONE = "bwrap", "unshare", "none"
TIERS = (BWRAP, UNSHARE, NONE)
ENV_VAR = "REINFORCE_ADA_CODE_ISOLATION"
TMP_BYTES = 16 << 20  # the box's writable /tmp (bwrap), in memory
MAX_PROCESSES = 64  # tasks (threads count) per box, where the box has a user of its own
MAX_OPEN_FILES = 256
BOX_SOURCE = (Path(__file__).with_name("code_box.py")).read_text()
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"


@dataclass(frozen=True)
class Isolation:
    """How boxes are started here: `kind` (a tier), the command prefix, and whether bwrap runs as root (then the
    box changes to a uid of its own)."""

    kind: str
    prefix: tuple[str, ...]
    as_root: bool = False


def interpreter() -> tuple[str, str]:
    """The base interpreter (not the virtualenv's) and the folder it is installed in."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def bwrap_prefix(bwrap: str, as_root: bool) -> tuple[str, ...]:
    """bwrap's arguments: namespaces, the read-only system folders, the interpreter, a private /tmp."""
    cmd = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
           "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp"]
    if as_root:  # the box itself becomes an unprivileged uid: it needs these two, and only until then
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    _, home = interpreter()
    if not (home == "/usr" or home.startswith("/usr/")):
        for parent in reversed(Path(home).parents[:-1]):  # bwrap would copy their modes (/root is 0700)
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", home, home]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
            "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return tuple(cmd)


def unshare_prefix(unshare: str, as_root: bool) -> tuple[str, ...]:
    user = () if as_root else ("--user", "--map-root-user")
    return (unshare, *user, "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc", "--")


def _candidates() -> list[Isolation]:
    as_root = os.geteuid() == 0
    found = []
    if bwrap := shutil.which("bwrap"):
        found.append(Isolation(BWRAP, bwrap_prefix(bwrap, as_root), as_root))
    if unshare := shutil.which("unshare"):
        found.append(Isolation(UNSHARE, unshare_prefix(unshare, as_root), as_root))
    found.append(Isolation(NONE, (), as_root))
    return found


def _works(iso: Isolation) -> str:
    """"" if a box of this tier runs Python here, else why not."""
    if iso.kind == NONE:
        return ""
    probe = "import json"  # the standard library is readable
    if iso.kind == BWRAP and iso.as_root:  # and the box can become a uid of its own, as every box will
        uid = 1 << 28
        probe = f"import os; os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid}); "\
                + probe
    try:
        proc = subprocess.run([*iso.prefix, interpreter()[0], "-I", "-S", "-c", probe], capture_output=True,
                              timeout=30, env=box_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return repr(e)
    return "" if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()[-300:]


@functools.cache
def isolation() -> Isolation:
    """The strongest tier that works here (or the one forced by REINFORCE_ADA_CODE_ISOLATION); probed once."""
    forced = os.environ.get(ENV_VAR, "auto").strip().lower()
    if forced not in (*TIERS, "auto"):
        raise ValueError(f"{ENV_VAR}={forced!r}: use one of auto, {', '.join(TIERS)}")
    failures = []
    for iso in _candidates():
        if forced not in ("auto", iso.kind):
            continue
        if not (why := _works(iso)):
            break
        failures.append(f"{iso.kind}: {why or 'failed'}")
    else:
        why = "; ".join(failures) or "not installed"
        raise RuntimeError(f"{ENV_VAR}={forced}: that isolation is not available here ({why}); {INSTALL_HINT}, "
                           f"or unset {ENV_VAR}")
    if iso.kind != BWRAP:
        what = ("no network and no view of other processes, but the program can read every file the trainer's user "
                "can (run directory, keys)" if iso.kind == UNSHARE else
                "resource limits only: the program can read and write what the trainer's user can, open sockets, and "
                "outlive its call")
        log.warning("code reward: programs run with isolation %r (%s) because bubblewrap is %s; %s for a box "
                    "without the run directory, keys, virtualenv or network", iso.kind, what,
                    "; ".join(failures) or "not installed", INSTALL_HINT)
    return iso


def box_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


def box_limits(cpu_s: float, memory_bytes: int, file_bytes: int, iso: Isolation) -> dict[str, int]:
    """setrlimit values (resource module names) that a box applies to itself before anything untrusted runs."""
    limits = {"RLIMIT_CPU": int(cpu_s) + 1, "RLIMIT_AS": memory_bytes, "RLIMIT_FSIZE": file_bytes,
              "RLIMIT_CORE": 0, "RLIMIT_NOFILE": MAX_OPEN_FILES}
    if iso.kind == BWRAP:  # a uid of its own (root) or a user namespace of its own: the count is the box's alone
        limits["RLIMIT_NPROC"] = MAX_PROCESSES
    return limits


def start_box(iso: Isolation, role: str, limits: dict[str, int], *, stdin, stdout,
              pass_fds: tuple[int, ...] = (), workdir: str | None = None) -> subprocess.Popen:
    """Start one box running `code_box.py` in `role` ("program" or "tester"); `pass_fds` reach the tester as its
    channel to the program box. Its own session: `kill_box` ends it and everything it started. `workdir`: the
    box's working directory, HOME and TMPDIR in the weaker tiers (required there: a fresh private directory, which
    the caller removes once the box is killed); a bwrap box works in its own /tmp and needs none."""
    if iso.kind == BWRAP:
        cwd, env = None, box_env()
    elif workdir is None:
        raise ValueError(f"a box of isolation {iso.kind!r} shares the file system with the caller: pass workdir, a "
                         "fresh private directory (tempfile.TemporaryDirectory), so that the program does not write "
                         "into the caller's working directory")
    else:
        cwd, env = workdir, {**box_env(), "HOME": workdir, "TMPDIR": workdir}
    uid = (1 << 28) + secrets.randbelow(1 << 24) if iso.kind == BWRAP and iso.as_root else 0
    argv = [*iso.prefix, interpreter()[0], "-I", "-S", "-B", "-c", BOX_SOURCE, role, json.dumps(limits), str(uid),
            *map(str, pass_fds)]
    return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL, pass_fds=pass_fds,
                            start_new_session=True, env=env, cwd=cwd)


def kill_box(proc: subprocess.Popen) -> None:
    """SIGKILL the box's process group (with bwrap or unshare: its pid namespace dies with it), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
