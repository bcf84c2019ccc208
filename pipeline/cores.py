"""Pinning a process to a set of CPU cores (`learner.cpu_cores`, `producers.engine.cpu_cores`).

On a machine where the learner and the engines share the CPU, each role's share of the cores is then set
explicitly instead of by the OS scheduler; the pin is inherited by every process and thread started after it
(vLLM's engine core, torch's OpenMP pool).
"""

from __future__ import annotations

import os


def parse_cores(spec: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; raises ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a core number or a range like 2-5 (write e.g. \"0-3,6\")")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"the range {part!r} runs backwards (write {last}-{first})")
        cores.update(range(first, last + 1))
    return sorted(cores)


def pin_cores(spec: str | int, setting: str) -> list[int] | None:
    """Pin this process (and what it starts later) to the cores of `spec`; "" leaves it as it is. Cores this
    machine does not offer to the process are an error naming `setting` and the cores it has."""
    spec = str(spec)  # a single core may come as a number
    if not spec:
        return None
    cores = parse_cores(spec)
    offered = os.sched_getaffinity(0)
    missing = [c for c in cores if c not in offered]
    if missing:
        raise ValueError(f"{setting} = {spec!r} names core(s) {missing} that this process cannot run on here "
                         f"(it may use {compact(sorted(offered))}): pick cores from those, or \"\" for no pinning")
    os.sched_setaffinity(0, cores)
    return cores


def compact(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
