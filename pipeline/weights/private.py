"""The weights folder of the file transport is private (no torch here: the supervisor checks it at start).

The default folder's name in /dev/shm is predictable (`reinforce-ada-<run>-<hash>`), so another local user could
create it first and swap the files producers load, or plant links the learner would write through. Invariant:
every write and read of weights goes through `open_private_dir`, which gives a descriptor of a real folder (not a
link) of this user with no access for group or others, made with mode 0700 in one mkdir when missing.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
WEIGHT_FILE_MODE = 0o600


def _folder_problem(path: Path, st: os.stat_result) -> str:
    if not stat.S_ISDIR(st.st_mode):
        return (f"weights folder {path} is not a folder; remove it (rm {path}) or set weights.dir to a folder of "
                "your own")
    if st.st_uid != os.geteuid():
        return (f"weights folder {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): another "
                "user may have created it to swap the weight files producers load; have it removed (by its owner or "
                "root) or set weights.dir to a folder of your own")
    if st.st_mode & 0o077:
        return (f"weights folder {path} has mode {stat.S_IMODE(st.st_mode):04o}: others could swap the weight files "
                f"producers load; it must be 0700 (only you): chmod 700 {path}")
    return ""


def open_private_dir(path: str | Path, create: bool = False) -> int:
    """A descriptor of the weights folder `path` (the caller closes it): a real folder (not a symbolic link) of
    this user with no access for group or others; with `create`, made first when missing (mode 0700, in one mkdir,
    so it is ours or the call fails). PermissionError naming the folder and the fix otherwise."""
    p = Path(path)
    if create:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, PRIVATE_DIR_MODE)
        except FileExistsError:
            pass  # reused: checked below like any other
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights folder {p} does not exist (the learner creates it when it publishes its "
                                "first version)") from None
    except OSError as e:
        if os.path.islink(p):
            raise PermissionError(f"weights folder {p} is a symbolic link (to {os.readlink(p)}): weights are never "
                                  f"written or read through a link; remove it (rm {p}) or set weights.dir to a "
                                  "folder of your own") from None
        if e.errno == errno.ENOTDIR:
            raise PermissionError(_folder_problem(p, os.lstat(p))) from None
        raise
    problem = _folder_problem(p, os.fstat(fd))
    if problem:
        os.close(fd)
        raise PermissionError(problem)
    return fd
