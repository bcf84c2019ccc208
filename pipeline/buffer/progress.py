"""Progress a person can read without the live view: a log line every PROGRESS_EVERY_S seconds, and warnings
when a run cannot learn.

The line: samples received and tokens/s per producer, the pass rate so far, prompts active / released (of them
unresolved) / dropped, groups waiting, learner version. The warnings:
- the pass rate is exactly 0 (or 1) after WARN_AFTER_SAMPLES training samples: the reward never (or always)
  fires, so no group has signal;
- at least DROP_WARN_SHARE of the prompts settled so far (DROP_WARN_AFTER of them at least) were dropped.
The same numbers and warnings are in the MetricsSnapshot's `progress`, for the live view. A run whose reward never
(or always) fired in buffer.stop_without_signal samples is hopeless: the buffer stops it (`hopeless`). When the run
shares its rounds among several clients (producers, or producer keys), the samples of the client that sent most
are not enough: the others' must reach half the limit too (`Evidence`), so one client (a hostile producer sending
reward-0 samples before any honest positive) cannot stop the run alone.

Invariants: the line is logged at most once per PROGRESS_EVERY_S of the injected clock; a warning is logged when
its condition starts to hold at a report (and again only after it stopped holding for a while).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
WARN_AFTER_SAMPLES = 256  # "a few hundred": enough that a 1% pass rate would almost surely have shown a positive
DROP_WARN_AFTER = 32  # settled prompts before the drop share means anything
DROP_WARN_SHARE = 0.9
MAX_SOURCES = 1024  # clients whose samples `Evidence` keeps apart (the rest share one entry)
OTHERS = "#others"


class Evidence:
    """Training samples received per client (its CurveZMQ key, else its connection), and which of them were
    positive: what `hopeless` needs to stop a run only on evidence that no one client alone provides. Beyond
    MAX_SOURCES clients the rest share one entry (which makes a stop less likely, never more)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # client -> [samples, positives]

    def add(self, source: str, samples: int, positives: int) -> None:
        if not samples:
            return
        if source not in self.counts and len(self.counts) >= MAX_SOURCES:
            source = OTHERS
        entry = self.counts.setdefault(source, [0, 0])
        entry[0] += samples
        entry[1] += positives

    def without_largest(self) -> int:
        """Samples from every client but the one that sent most."""
        sizes = [n for n, _ in self.counts.values()]
        return sum(sizes) - max(sizes, default=0)


def warnings(m: dict[str, Any]) -> dict[str, str]:
    """The warnings that hold for Scheduler metrics `m`, by kind."""
    out = {}
    samples, positives = m["samples_received"], m["positives_received"]
    if samples >= WARN_AFTER_SAMPLES and positives in (0, samples):
        never = positives == 0
        out["reward_never_fires" if never else "reward_always_fires"] = (
            f"the pass rate is {0 if never else 1} after {samples} samples: the reward "
            f"{'never' if never else 'always'} fires, so no group carries a learning signal; check the answer "
            f"format, `data.template`, the reward function{'' if never else ', and whether the task is too easy'}")
    dropped = m["dropped_unresolved"] + m["dropped_zero_variance"]
    settled = m["released"] - m["reopened"] + dropped
    if settled >= DROP_WARN_AFTER and dropped >= DROP_WARN_SHARE * settled:
        out["prompts_dropped"] = (
            f"{dropped} of {settled} settled prompts were dropped without a group (all samples right, all wrong, or "
            "unservable): the learner gets almost nothing to train on; check the reward and the prompts' "
            'difficulty for this model, or raise sampling.max_rounds, or set buffer.unresolved = "keep"')
    return out


def hopeless(m: dict[str, Any], limit: int, evidence: Evidence | None = None, clients: int = 1) -> str:
    """Why the run should stop ("" if it should not): the reward never (or always) fired in `limit` samples, and,
    when the run shares its rounds among `clients` >= 2, in limit / 2 of them besides the largest client's."""
    samples, positives = m["samples_received"], m["positives_received"]
    if not limit or samples < limit or positives not in (0, samples):
        return ""
    if clients >= 2 and evidence is not None and 2 * evidence.without_largest() < limit:
        return ""
    never = positives == 0
    return (f"stopping the run: the reward {'never' if never else 'always'} fired in {samples} training samples "
            f"(buffer.stop_without_signal = {limit}), so no group can carry a learning signal; check the answer "
            "format, `data.template`, `reward.fn`" + ("" if never else ", and whether the task is too easy"))


def progress(m: dict[str, Any], producers: dict[str, dict[str, float]],
             samples_by_producer: dict[str, int]) -> dict[str, Any]:
    """The progress numbers from Scheduler metrics `m`, the producers' heartbeat stats and the samples (training
    and evaluation) received from each producer."""
    per = {pid: {"samples_received": samples_by_producer.get(pid, 0),
                 "tokens_per_s": float(producers.get(pid, {}).get("tokens_per_s", 0.0))}
           for pid in sorted(set(producers) | set(samples_by_producer))}
    return {
        "samples_received": m["samples_received"],
        "pass_rate": m["positive_rate"],
        "tokens_per_s": sum(p["tokens_per_s"] for p in per.values()),
        "producers": per,
        "prompts_active": m["active"],
        "prompts_released": m["released"],
        "prompts_unresolved": m["released_partial"],
        "prompts_dropped": m["dropped_unresolved"] + m["dropped_zero_variance"],
        "groups_waiting": m["groups_waiting"],
        "learner_version": m["learner_version"],
        "warnings": list(warnings(m).values()),
    }


def progress_line(p: dict[str, Any]) -> str:
    """One human-readable line of `progress(...)`."""
    per = ", ".join(f"{pid} {q['samples_received']} at {q['tokens_per_s']:.0f} tok/s"
                    for pid, q in p["producers"].items()) or "no producer yet"
    return (f"progress: {p['samples_received']} samples ({per}), pass rate {p['pass_rate']:.3f}; prompts "
            f"{p['prompts_active']} active, {p['prompts_released']} released ({p['prompts_unresolved']} "
            f"unresolved), {p['prompts_dropped']} dropped; {p['groups_waiting']} groups waiting; learner version "
            f"{p['learner_version']}")


class ProgressLog:
    """Logs the progress line every `every_s` seconds and each warning when it starts to hold."""

    def __init__(self, now: float, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self._next = now + every_s
        self._holding: set[str] = set()  # warning kinds that held at the last report

    def due(self, now: float) -> bool:
        return now >= self._next

    def report(self, now: float, m: dict[str, Any], p: dict[str, Any]) -> None:
        """Log `p` (from `progress(m, ...)`) and the warnings of `m` that did not hold at the last report."""
        self._next = now + self.every_s
        log.info("%s", progress_line(p))
        holding = warnings(m)
        for kind, text in holding.items():
            if kind not in self._holding:
                log.warning("%s", text)
        self._holding = set(holding)
