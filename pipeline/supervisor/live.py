"""What a run shows a person: a rich live view on a terminal, plain lines otherwise, and the closing summary.

The buffer's view comes from its MetricsSnapshot (`samples_received`, `positive_rate`, `active`, `released`,
`released_partial`, `dropped_unresolved`, `dropped_zero_variance`, `groups_waiting`, `learner_version`, and per
producer `tokens_per_s`, `samples_done`): the numbers that say why a slow run is slow (nothing generated, no
reward, every prompt dropped), and its `ledger`: every generated token by fate (pipeline/buffer/ledger.py), one
line in the live view and the progress lines, a table in the closing summary (from RUN/ledger.json, which the
buffer writes once the producers' final reports are in, else the last snapshot's). A missing key shows as "-",
never as an error.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from pipeline.buffer.ledger import compact, table
from pipeline.hf import HF_DIR, latest_checkpoint
from pipeline.jsonl import JsonlTail as JsonlTail  # the live view's reader of metrics.jsonl and eval.jsonl
from pipeline.plots import plot_runs

PROGRESS_EVERY_S = 30.0  # a plain progress line this often without a terminal

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


def _num(metrics: dict[str, Any], key: str, fmt: str = "{:.0f}") -> str:
    value = metrics.get(key)
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def prompts_text(buf: dict[str, Any]) -> str:
    """Where the prompts are: active, released (partly resolved among them), dropped (and why)."""
    return (f"active {_num(buf, 'active')} | released {_num(buf, 'released')} ({_num(buf, 'released_partial')} "
            f"unresolved) | dropped {_num(buf, 'dropped_unresolved')} unresolved, "
            f"{_num(buf, 'dropped_zero_variance')} zero-variance")


def progress_line(buf: dict[str, Any]) -> str:
    """One plain line of the buffer's progress (the live view's content, for logs and pipes)."""
    prods = buf.get("producers") or {}
    rates = ", ".join(f"{name} {_num(s, 'samples_done')} samples {_num(s, 'tokens_per_s')} tok/s"
                      for name, s in sorted(prods.items())) or "no producer seen"
    return (f"progress | samples {_num(buf, 'samples_received')} (pass rate {_num(buf, 'positive_rate', '{:.3f}')})"
            f" | prompts {prompts_text(buf)} | groups waiting {_num(buf, 'groups_waiting')} | learner version "
            f"{_num(buf, 'learner_version')} | {rates} | ledger {compact(buf.get('ledger') or {})}")


def render(state: RunState) -> Any:
    """A rich renderable of the whole run."""
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
    benches = state.evals[-1].get("benchmarks", {}) if state.evals else {}
    if len(benches) > 1:
        for name in benches:
            curve = [e["benchmarks"][name]["ave_at_k"] for e in state.evals if name in e.get("benchmarks", {})]
            learner.add_row(f"  {name} Ave / pass@k", f"{benches[name]['ave_at_k']:.3f} / "
                            f"{benches[name]['pass_at_k']:.3f}", sparkline(curve, lo=0, hi=1))
    learner.add_row("loss", f"{step.get('loss', float('nan')):+.4f}", "")
    learner.add_row("staleness max", f"{step.get('staleness_max', 0):.0f}", "")
    learner.add_row("step time", f"{step.get('step_seconds', 0):.1f} s",
                    f"learner busy {100 * step.get('learner_busy', 0):.0f}%")

    buf = state.buffer
    btable = Table(title="buffer", expand=True, show_header=False)
    btable.add_row("samples received", _num(buf, "samples_received"))
    btable.add_row("pass rate so far", _num(buf, "positive_rate", "{:.3f}"))
    btable.add_row("prompts", prompts_text(buf))
    btable.add_row("groups waiting", _num(buf, "groups_waiting"))
    btable.add_row("learner version", _num(buf, "learner_version"))
    for key in ("stale_evictions", "rounds_in_flight"):
        if key in buf:
            btable.add_row(key.replace("_", " "), str(buf[key]))
    if "samples_per_released_group" in buf:
        btable.add_row("samples/group", f"{buf['samples_per_released_group']:.1f}")
    btable.add_row("tokens by fate", compact(buf.get("ledger") or {}))
    if buf.get("rounds_to_exit"):
        btable.add_row("rounds to exit", " ".join(f"{k}:{v}" for k, v in sorted(buf["rounds_to_exit"].items())))

    prod = Table(title="producers", expand=True)
    for col in ("name", "state", "version", "samples", "tokens/s", "busy", "running", "restarts"):
        prod.add_column(col)
    stats = buf.get("producers") or {}
    for name, pstate, restarts in state.children:
        s = stats.get(name, {})
        prod.add_row(name, pstate, _num(s, "version"), _num(s, "samples_done"), _num(s, "tokens_per_s"),
                     f"{100 * s.get('busy_fraction', 0):.0f}%", _num(s, "running_rounds"), restarts)
    return Group(head, Panel(learner), btable, prod)


class Display:
    """Where the run's progress goes: a rich Live view on a terminal, else plain lines on stdout."""

    def __init__(self, state: RunState, tty: bool) -> None:
        self.state = state
        self.tty = tty
        self.live: Live | None = None
        self.last_progress = time.monotonic()

    def start(self) -> None:
        if self.tty:
            self.live = Live(render(self.state), refresh_per_second=2, transient=False)
            self.live.start()

    def step(self, row: dict) -> None:
        self.state.steps.append(row)
        if not self.tty:
            print(self.state.step_line(row), flush=True)

    def eval(self, row: dict) -> None:
        self.state.evals.append(row)
        if not self.tty:
            print(f"eval | version {row['version']} | Ave@{row['k']} {row['accuracy']:.3f} over {row['problems']} "
                  f"problems{per_benchmark(row)}", flush=True)

    def event(self, text: str) -> None:
        """Something a person should see at once (a restart)."""
        self.state.message = text
        if not self.tty:
            print(text, flush=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(render(self.state))
        elif self.state.buffer and time.monotonic() - self.last_progress >= PROGRESS_EVERY_S:
            self.last_progress = time.monotonic()
            print(progress_line(self.state.buffer), flush=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def per_benchmark(row: dict) -> str:
    """" | math500 Ave 0.41 pass 0.62 | ..." for an eval.jsonl row with several benchmarks ("" with one)."""
    benches = row.get("benchmarks", {})
    if len(benches) < 2:
        return ""
    return "".join(f" | {name} Ave {b['ave_at_k']:.3f} pass {b['pass_at_k']:.3f}" for name, b in benches.items())


def ledger_lines(run_dir: Path, last: dict[str, Any]) -> list[str]:
    """The closing ledger table: RUN/ledger.json (complete: every producer's final report was in), else `last`,
    the buffer's latest snapshot of it."""
    led, source = last, "the buffer's last report; the run ended before its final ledger"
    try:
        led = json.loads((run_dir / "ledger.json").read_text())
        source = "complete" if led.get("complete") else "written before every producer's final report came in"
    except (OSError, ValueError):
        pass
    if not led.get("generated_tokens"):
        return []
    lines = [f"every generated token by fate ({source}): {int(led['generated_samples']):,} samples, "
             f"{int(led['generated_tokens']):,} tokens"]
    lines += [f"  {fate:<14} {num:>10,} samples {tokens:>12,} tokens {share:7.1%}"
              for fate, num, tokens, share in table(led) if num or tokens]
    return lines


def summarise(state: RunState, run_dir: Path, wall_s: float) -> None:
    """The closing lines: held-out accuracy at the first and the latest version (eval.jsonl is in version order),
    per benchmark when there are several, steps and time, the exported model and the plots drawn."""
    if state.evals:
        first, last = min(state.evals, key=lambda e: e["version"]), max(state.evals, key=lambda e: e["version"])
        print(f"held-out Ave@{first['k']}: {first['accuracy']:.3f} at version {first['version']} -> "
              f"{last['accuracy']:.3f} at version {last['version']}{per_benchmark(last)}")
    print(f"{len(state.steps)} learner steps in {wall_s / 60:.1f} min; run directory {run_dir}")
    for line in ledger_lines(run_dir, state.buffer.get("ledger") or {}):
        print(line)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is not None and (ckpt / HF_DIR / "config.json").is_file():
        print(f"trained model (Hugging Face format, loads in transformers and vLLM): {ckpt / HF_DIR}; evaluate it "
              f"with `reinforce-ada eval --model {run_dir}`")
    try:
        paths = plot_runs([run_dir], run_dir / "plots")
        print(f"plots: {', '.join(str(p) for p in paths)}")
    except Exception as exc:  # noqa: BLE001 - plotting must never turn a finished run into a failure
        print(f"could not draw plots: {exc}", file=sys.stderr)
