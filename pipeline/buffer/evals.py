"""Held-out evaluation during training: k samples of every held-out problem at chosen learner versions.

`Evals` is pure and clock-injected like the Scheduler: every event carries the caller's `now`, and nothing here
does I/O. It hands out evaluation rounds (RoundAssignment kind "eval": one per problem, k samples, the eval
max_new_tokens), takes their results, re-issues lost rounds (lease passed, or producer silent) under new ids, and
turns each finished evaluation into one row: Ave@k and pass@k overall and per benchmark, and each problem's count of
correct samples (in the held-out set's order: with common random numbers, two versions' rows pair problem by problem).

Invariants:
- round ids come from the allocator the Scheduler uses: no id ever serves both a training and an eval round;
- each problem of an evaluation is counted once, from the result of its current round; results of re-issued
  rounds (late) and ids never issued here (unknown) are ignored and counted;
- rows come out in the order the evaluations started, which is version order (versions only rise): a finished
  evaluation is held until every earlier one has finished;
- a problem's rounds carry its index as their seed key: each evaluation (and each re-issue) samples it with the
  same seeds, so two versions' scores differ by the weights, not by the luck of the draw (common random numbers);
- Ave@k divides by k: missing samples count as wrong, and a problem whose result holds no samples (the producer
  could not serve it) counts as unsolved and is reported in `failed`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import protocol as P
from pipeline.buffer.policy.advantages import is_positive
from pipeline.buffer.state import RoundIds
from pipeline.prompts import Prompt

IGNORE_REASONS = ("late", "unknown")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) of a problem with c correct among n samples: 1 - C(n-c, k) / C(n, k).

    With n == k it is 1 when any sample is correct, else 0; with fewer than k samples, any correct one counts.
    """
    if c <= 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class _Issued:
    problem: int
    producer_id: str
    deadline: float


@dataclass
class _Run:
    version: int
    started: float
    queue: deque[int]  # problems waiting for a round (never issued, or their round was lost)
    issued: dict[int, _Issued] = field(default_factory=dict)  # round id in flight -> its problem
    correct: dict[int, int] = field(default_factory=dict)  # problem -> correct samples, once its result is in
    received: dict[int, int] = field(default_factory=dict)  # problem -> samples in its result
    finished: float | None = None


class Evals:
    """Evaluation rounds and their scores; see the module docstring."""

    def __init__(self, prompts: Sequence[Prompt], k: int, lease_s: float, max_new_tokens: int, threshold: float,
                 round_ids: RoundIds) -> None:
        if k < 1:
            raise ValueError(f"eval.k must be >= 1 (samples per problem), got {k}")
        self.prompts = list(prompts)
        self.k, self.lease_s, self.max_new_tokens, self.threshold = k, lease_s, max_new_tokens, threshold
        self.round_ids = round_ids
        self.runs: dict[int, _Run] = {}  # by version, in start order; a run leaves once its row is popped
        self._version_of: dict[int, int] = {}  # round id in flight -> version of its run
        self.counts = {"rounds_issued": 0, "rounds_reissued": 0, "results_failed": 0,
                       **{f"results_{reason}": 0 for reason in IGNORE_REASONS}}

    # ------------------------------------------------------------ events

    def start(self, version: int, now: float) -> bool:
        """Start evaluating `version` (once per version; never without held-out prompts). True if started."""
        if not self.prompts or version in self.runs:
            return False
        self.runs[version] = _Run(version, now, deque(range(len(self.prompts))))
        return True

    def take(self, limit: int, producer_id: str, now: float) -> list[P.RoundAssignment]:
        """Up to `limit` eval rounds for `producer_id`, oldest evaluation first."""
        out: list[P.RoundAssignment] = []
        for run in self.runs.values():
            while run.queue and len(out) < limit:
                problem = run.queue.popleft()
                round_id = self.round_ids.take()
                run.issued[round_id] = _Issued(problem, producer_id, now + self.lease_s)
                self._version_of[round_id] = run.version
                prompt = self.prompts[problem]
                out.append(P.RoundAssignment(round_id, problem, prompt.text, prompt.answer, self.k, self.lease_s,
                                             "eval", self.max_new_tokens, extras=prompt.extras,
                                             seed_key=problem))
        self.counts["rounds_issued"] += len(out)
        return out

    def submit(self, round_id: int, samples: Sequence[P.Sample], now: float) -> str:
        """Score the result of eval round `round_id`: "accepted", or ignored as "late" / "unknown"."""
        version = self._version_of.pop(round_id, None)
        if version is None:
            reason = "late" if self.round_ids.issued(round_id) else "unknown"
            self.counts[f"results_{reason}"] += 1
            return reason
        run = self.runs[version]
        problem = run.issued.pop(round_id).problem
        run.correct[problem] = min(self.k, sum(is_positive(s.reward, self.threshold) for s in samples))
        run.received[problem] = len(samples)
        self.counts["results_failed"] += not samples
        if len(run.correct) == len(self.prompts):
            run.finished = now
        return "accepted"

    def expire(self, now: float, is_silent: Callable[[str], bool]) -> list[int]:
        """Re-queue rounds whose lease passed or whose producer is silent; returns their ids (to abort)."""
        lost = []
        for run in self.runs.values():
            for round_id, rnd in list(run.issued.items()):
                if now > rnd.deadline or is_silent(rnd.producer_id):
                    del run.issued[round_id]
                    del self._version_of[round_id]
                    run.queue.append(rnd.problem)  # handed out again under a new id by `take`
                    lost.append(round_id)
        self.counts["rounds_reissued"] += len(lost)
        return lost

    def reject(self, round_id: int) -> bool:
        """Give up on the result of eval round `round_id` (the caller found it unusable): its problem is queued
        again, to be handed out under a new id. False if the round is not in flight."""
        version = self._version_of.pop(round_id, None)
        if version is None:
            return False
        run = self.runs[version]
        run.queue.append(run.issued.pop(round_id).problem)
        self.counts["rounds_reissued"] += 1
        return True

    def pop_rows(self) -> list[dict[str, Any]]:
        """Rows of the finished evaluations that no unfinished one started before, in version order."""
        rows = []
        while self.runs:
            run = next(iter(self.runs.values()))
            if run.finished is None:
                break
            del self.runs[run.version]
            rows.append(self._row(run))
        return rows

    # ------------------------------------------------------------ observation

    def owns(self, round_id: int) -> bool:
        """Whether `round_id` is an eval round in flight."""
        return round_id in self._version_of

    @property
    def available(self) -> int:
        """Eval rounds waiting to be handed out."""
        return sum(len(run.queue) for run in self.runs.values())

    @property
    def outstanding(self) -> int:
        """Evaluations started whose rows have not been popped yet."""
        return len(self.runs)

    def in_progress(self) -> list[dict[str, int]]:
        """Per evaluation not yet written: its version, problems done, problems in all."""
        return [{"version": run.version, "done": len(run.correct), "problems": len(self.prompts)}
                for run in self.runs.values()]

    def _row(self, run: _Run) -> dict[str, Any]:
        k = self.k
        by_bench: dict[str, list[int]] = {}
        for i, prompt in enumerate(self.prompts):
            by_bench.setdefault(prompt.benchmark, []).append(i)

        def scores(problems: Sequence[int]) -> tuple[float, float]:
            ave = sum(run.correct[i] / k for i in problems) / len(problems)
            passed = sum(pass_at_k(max(run.received[i], run.correct[i]), run.correct[i], k) for i in problems)
            return ave, passed / len(problems)

        ave, passed = scores(range(len(self.prompts)))
        benchmarks = {}
        for name, problems in by_bench.items():
            b_ave, b_pass = scores(problems)
            benchmarks[name] = {"problems": len(problems), "ave_at_k": b_ave, "pass_at_k": b_pass}
        assert run.finished is not None
        return {"version": run.version, "accuracy": ave, "pass_at_k": passed, "k": k, "problems": len(self.prompts),
                "failed": sum(not run.received[i] for i in range(len(self.prompts))),
                "seconds": run.finished - run.started, "benchmarks": benchmarks,
                "correct": [run.correct[i] for i in range(len(self.prompts))]}
