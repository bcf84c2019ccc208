"""Where a bench.pipeline run's time goes: each producer's busy and idle time, the learner's wait, train and publish,
the hand-off of new weights, and the tail of each batch; and the timeline as a picture.

Inputs, all in wall-clock seconds: the learner's metrics rows (`time` = a step's end, after its VersionUpdate was
sent; `wait_seconds`, `step_seconds` = train + publish, `publish_seconds`) and each scripted producer's timeline
(`pipeline.testing.scripted --timeline` or a vLLM producer's `--timeline`: WorkRequests, assignments with their
rounds, and a vLLM producer's weight loads). Only the measured window
counts: from the end of the last warm-up step to the end of the last step.

- busy: a producer generating (an assignment in progress); idle is the rest of the window;
- learner wait: from asking for a batch to getting it; the tail: the part of the learner's wait during which at
  least one producer was idle (the batch waits on a few prompts' rounds, not on the engines);
- hand-off: from a step's end to each producer's first assignment at the new version (loading the weights, the
  WorkRequest that fetches work: what an on-policy batch pays before it can start);
- CPU share: the CPU time the arm's own processes used over the window, as a share of the cores (`CpuSampler`):
  near 1.0, the machine is saturated and overlapping generation with training cannot add steps per second.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

Span = tuple[float, float]


def learner_spans(rows: list[dict]) -> dict[str, list[Span]]:
    """The learner's wait, train and publish intervals of every step."""
    out: dict[str, list[Span]] = {"wait": [], "train": [], "publish": []}
    for r in rows:
        end = r["time"]
        pub = end - r["publish_seconds"]
        start = end - r["step_seconds"]
        out["wait"].append((start - r["wait_seconds"], start))
        out["train"].append((start, pub))
        out["publish"].append((pub, end))
    return out


def _clip(spans: list[Span], lo: float, hi: float) -> list[Span]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def _length(spans: list[Span]) -> float:
    return sum(b - a for a, b in spans)


def _union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(spans: list[Span], lo: float, hi: float) -> list[Span]:
    out, t = [], lo
    for a, b in _union(_clip(spans, lo, hi)):
        if a > t:
            out.append((t, a))
        t = max(t, b)
    return out + ([(t, hi)] if hi > t else [])


def _intersect(x: list[Span], y: list[Span]) -> list[Span]:
    out = []
    for a, b in _union(x):
        out += _clip(_union(y), a, b)
    return out


class CpuSampler:
    """The CPU time of this process's descendants (buffer, producers and their engine cores, learner, reward
    workers), sampled every `every_s` in a thread: `share(lo, hi)` is the CPU they used over that wall-clock window
    as a share of the cores this process may use (1.0 = every core busy with the arm's own work; other load on the
    machine is not counted)."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, dict[int, float]]] = []  # (wall time, pid -> user + system CPU s)
        self.labels: dict[int, str] = {}  # pid -> its role: "producer", "producer/VLLM::EngineCor", ...
        self.cores = len(os.sched_getaffinity(0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            cpu = {}
            for child in me.children(recursive=True):
                try:
                    t = child.cpu_times()
                    cpu[child.pid] = t.user + t.system
                    # keep the most telling label seen: vLLM retitles its processes after they start, and a
                    # process read as it exits (or before its exec) shows no command line
                    label = _label(child, me.pid)
                    if _rank(label) >= _rank(self.labels.get(child.pid, "")):
                        self.labels[child.pid] = label
                except psutil.Error:  # it ended between the listing and the read
                    pass
            self.samples.append((time.time(), cpu))
            self._stop.wait(self.every_s)

    def by_role(self, lo: float, hi: float) -> dict[str, float]:
        """The CPU used between the samples nearest inside [lo, hi], over their interval x cores, per process role
        (the bench's own child it descends from, and its own name), largest first; {} for too short a window."""
        inside = [s for s in self.samples if lo <= s[0] <= hi]
        if len(inside) < 2:
            return {}
        (t0, a), (t1, b) = inside[0], inside[-1]
        out: dict[str, float] = {}
        for pid, v in b.items():  # a process started inside the window counts from 0
            role = self.labels.get(pid, "?")
            out[role] = out.get(role, 0.0) + (v - a.get(pid, 0.0)) / ((t1 - t0) * self.cores)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def share(self, lo: float, hi: float) -> float | None:
        """`by_role` summed: the arm's whole CPU share over the window (None for too short a window)."""
        roles = self.by_role(lo, hi)
        return sum(roles.values()) if roles else None


ROLES = ("reference_buffer", "buffer", "producer", "learner")


def _rank(label: str) -> int:
    """How much a label says: a role (1), and a vLLM process title (2)."""
    return (label.split("/")[0] in ROLES) + ("::" in label)


def _label(proc, root_pid: int) -> str:
    """'buffer', 'producer', 'learner' for the bench's own children (by their command line); a grandchild is its
    ancestor's role and its own process name ('producer/VLLM::EngineCor', 'producer/python': reward workers)."""
    chain = [proc]
    while chain[-1].ppid() != root_pid and chain[-1].parent() is not None:
        chain.append(chain[-1].parent())
    top = chain[-1]
    words = " ".join(top.cmdline()).replace(".", " ").split()
    role = next((r for r in ROLES if r in words), top.name())
    if top is proc:
        return role
    argv0 = (proc.cmdline() or [proc.name()])[0]  # vLLM retitles its processes: VLLM::EngineCore, VLLM::Worker
    return f"{role}/{argv0 if '::' in argv0 else proc.name()}"


def summarize(rows: list[dict], producers: dict[str, list[dict]], warmup: int, max_rounds: int,
              cpu: CpuSampler | None = None) -> dict:
    """Shares of the measured window and per-step medians (see the module docstring)."""
    lo, hi = rows[warmup - 1]["time"] if warmup else rows[0]["time"] - rows[0]["step_seconds"], rows[-1]["time"]
    steps = len(rows) - warmup
    window = hi - lo
    learner = {k: _clip(v, lo, hi) for k, v in learner_spans(rows).items()}
    busy = {p: _clip([(e["start"], e["end"]) for e in ev if e["kind"] == "generate"], lo, hi)
            for p, ev in producers.items()}
    idle_any = _union([s for spans in busy.values() for s in _complement(spans, lo, hi)])
    tail = _intersect(learner["wait"], idle_any)
    gens = [e for ev in producers.values() for e in ev if e["kind"] == "generate" and lo <= e["start"] < hi]
    loads = [e["end"] - e["start"] for ev in producers.values() for e in ev
             if e["kind"] == "weights" and lo <= e["start"] < hi]  # a vLLM producer's weight loads
    handoff = []
    for r in rows[warmup:-1]:
        for ev in producers.values():
            first = [e["start"] for e in ev if e["kind"] == "generate" and e["start"] >= r["time"]]
            if first:
                handoff.append(min(first) - r["time"])
    return {
        "window_s": window, "steps": steps,
        "producer_busy_share": {p: _length(_union(s)) / window for p, s in busy.items()},  # assignments overlap
        "learner_share": {k: _length(v) / window for k, v in learner.items()},
        "per_step_s": {"wait": _length(learner["wait"]) / steps, "train": _length(learner["train"]) / steps,
                       "publish": _length(learner["publish"]) / steps, "tail": _length(tail) / steps},
        "rounds_per_assignment": statistics.mean(e["rounds"] for e in gens) if gens else 0.0,
        "slots_used": statistics.mean(e["rounds"] for e in gens) / max_rounds if gens else 0.0,
        "handoff_s_median": statistics.median(handoff) if handoff else 0.0,
        "weight_load_s_median": statistics.median(loads) if loads else None,
        "cpu_share": cpu.share(lo, hi) if cpu is not None else None,
        "cpu_share_by_role": cpu.by_role(lo, hi) if cpu is not None else {},
    }


def plot(runs: dict[str, tuple[list[dict], dict[str, list[dict]]]], warmup: int, max_rounds: int, out: Path,
         num_steps: int = 6) -> None:
    """One panel per arm (name -> (learner rows, producer timelines)), `num_steps` measured steps each, on the same
    time scale: producers' assignments (darker = more of their round slots used), the learner's wait, train and
    publish, and each step's end."""
    import matplotlib  # lazy: only the plotting path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 1.1 * len(runs) * 1.6), sharex=True, squeeze=False)
    colors = {"wait": "#d9d9d9", "train": "#3b75af", "publish": "#ef8636"}
    for ax, (name, (rows, producers)) in zip(axes[:, 0], runs.items()):
        t0 = rows[warmup - 1]["time"] if warmup else rows[0]["time"]
        end = rows[min(len(rows) - 1, warmup - 1 + num_steps)]["time"]
        labels = [*sorted(producers), "learner"]
        for y, p in enumerate(sorted(producers)):
            for e in producers[p]:
                if e["kind"] == "generate" and e["end"] > t0 and e["start"] < end:
                    alpha = 0.25 + 0.75 * min(1.0, e["rounds"] / max_rounds)
                    ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - 0.35, 0.7), color="#2ca02c",
                                   alpha=alpha)
        y = len(producers)
        for kind, spans in learner_spans(rows).items():
            ax.broken_barh([(a - t0, b - a) for a, b in _clip(spans, t0, end)], (y - 0.35, 0.7), color=colors[kind],
                           label=f"learner {kind}")
        for r in rows:
            if t0 <= r["time"] <= end:
                ax.axvline(r["time"] - t0, color="k", lw=0.6, ls=":")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_xlim(0, end - t0)
    axes[0, 0].legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=3, frameon=False)
    axes[-1, 0].set_xlabel("seconds (green: producer generating, darker = more round slots used; dotted: step end)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
