"""What a run shows a person: a rich live view on a terminal, one plain line per learner step otherwise."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 32, lo: float | None = None, hi: float | None = None) -> str:
    """Block-character sparkline of the last `width` values."""
    vals = [v for v in values[-width:] if v == v]
    if not vals:
        return ""
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = (hi - lo) or 1.0
    return "".join(BARS[min(len(BARS) - 1, max(0, int((v - lo) / span * (len(BARS) - 1) + 0.5)))] for v in vals)


class JsonlTail:
    """Reads the rows appended to a JSONL file since the last call (tolerates a partial last line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows


@dataclass
class RunState:
    name: str
    total_steps: int
    started: float = field(default_factory=time.monotonic)
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    buffer: dict[str, Any] = field(default_factory=dict)
    children: list[tuple[str, str, str]] = field(default_factory=list)  # name, state, restarts
    message: str = ""

    def step_line(self, row: dict) -> str:
        """The one-line summary of a learner step (also the non-terminal output)."""
        kept = row.get("num_groups", 0)
        return (f"step {row.get('step', '?')} | reward {row.get('reward_mean', float('nan')):.3f} | "
                f"groups {kept} | "
                f"samples/group {row.get('buffer/samples_per_released_group', 0):.1f} | "
                f"stale {row.get('staleness_max', 0):.0f} | loss {row.get('loss', float('nan')):+.4f} | "
                f"{row.get('step_seconds', 0):.1f} s")

    def eta(self) -> str:
        if not self.steps:
            return "-"
        done = self.steps[-1].get("step", len(self.steps))
        elapsed = time.monotonic() - self.started
        left = elapsed / max(done, 1) * (self.total_steps - done)
        return f"{left / 60:.1f} min"


def render(state: RunState) -> Any:
    """A rich renderable of the whole run."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    step = state.steps[-1] if state.steps else {}
    done = step.get("step", 0)
    elapsed = time.monotonic() - state.started
    head = Table.grid(padding=(0, 2))
    head.add_row(f"[bold]{state.name}[/]", f"step {done}/{state.total_steps}", f"elapsed {elapsed / 60:.1f} min",
                 f"ETA {state.eta()}", state.message)

    learner = Table(title="learner", expand=True, show_header=False)
    rewards = [r.get("buffer/positive_rate_step", float("nan")) for r in state.steps]
    accs = [e["accuracy"] for e in state.evals]
    learner.add_row("sample pass rate", f"{rewards[-1]:.3f}" if rewards else "-", sparkline(rewards, lo=0, hi=1))
    learner.add_row("held-out Ave@k", f"{accs[-1]:.3f}" if accs else "-", sparkline(accs, lo=0, hi=1))
    learner.add_row("loss", f"{step.get('loss', float('nan')):+.4f}", "")
    learner.add_row("staleness max", f"{step.get('staleness_max', 0):.0f}", "")
    learner.add_row("step time", f"{step.get('step_seconds', 0):.1f} s",
                    f"learner busy {100 * step.get('learner_busy', 0):.0f}%")

    buf = state.buffer
    btable = Table(title="buffer", expand=True, show_header=False)
    for key in ("active", "admitted", "released", "released_partial", "dropped_unresolved",
                "dropped_zero_variance", "stale_evictions", "groups_waiting", "rounds_in_flight"):
        if key in buf:
            btable.add_row(key, str(buf[key]))
    if "samples_per_released_group" in buf:
        btable.add_row("samples/group", f"{buf['samples_per_released_group']:.1f}")
    if buf.get("rounds_to_exit"):
        btable.add_row("rounds to exit", " ".join(f"{k}:{v}" for k, v in sorted(buf["rounds_to_exit"].items())))

    prod = Table(title="producers", expand=True)
    for col in ("name", "state", "version", "tokens/s", "busy", "running", "restarts"):
        prod.add_column(col)
    stats = buf.get("producers", {})
    for name, pstate, restarts in state.children:
        s = stats.get(name, {})
        prod.add_row(name, pstate, f"{s.get('version', 0):.0f}", f"{s.get('tokens_per_s', 0):.0f}",
                     f"{100 * s.get('busy_fraction', 0):.0f}%", f"{s.get('running_rounds', 0):.0f}", restarts)
    return Group(head, Panel(learner), btable, prod)
