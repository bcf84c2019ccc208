"""What a round-synchronous (reference) run did, kept so its time can be recomputed for other constants.

In the reference, the Scheduler's decisions (which prompt gets which round, when it exits, which samples its group
keeps) depend on rewards only, never on time or length. So a run's trace - every sample's pass rate, correctness
and random draws, which engine generated it in which round, and which samples each step trained on - fixes its
samples, and `replay` gives the step times under any `Constants` in closed form (`batch_decode_s` per engine
and round) without running the Scheduler again. The sensitivity table of `bench.table2` uses it.

Invariant (tests/test_bench_table2.py): `replay` with the constants of the run equals the simulated step times,
which holds because every reference round starts all its samples at once (each engine has a slot for each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.sim.costmodel import Constants, batch_decode_s, learner_s, response_lengths


@dataclass
class _Step:
    rounds: list[tuple[list[np.ndarray], list[int], int]] = field(default_factory=list)  # per engine, prompts, scored
    kept: np.ndarray | None = None


class Trace:
    """Samples and steps of one reference run (see the module docstring)."""

    def __init__(self) -> None:
        self._p: list[np.ndarray] = []
        self._correct: list[np.ndarray] = []
        self._z: list[np.ndarray] = []
        self._u: list[np.ndarray] = []
        self.num_samples = 0
        self.steps: list[_Step] = []

    def add_samples(self, p: np.ndarray, correct: np.ndarray, z: np.ndarray, u: np.ndarray) -> int:
        """Record a round's samples; returns the index of the first."""
        first = self.num_samples
        self._p.append(p)
        self._correct.append(correct)
        self._z.append(z)
        self._u.append(u)
        self.num_samples += len(p)
        return first

    def begin_step(self) -> None:
        self.steps.append(_Step())

    def add_round(self, per_engine: list[np.ndarray], prompts: list[int], scored: int) -> None:
        """A barrier round: the sample indices each engine generated, its prompt count, samples scored after it."""
        self.steps[-1].rounds.append((per_engine, prompts, scored))

    def set_kept(self, indices: np.ndarray) -> None:
        self.steps[-1].kept = indices

    def replay(self, c: Constants, gpus: int, batch_size: int, group_size: int, slots: int) -> list[float]:
        """Seconds of every step under constants `c` on `gpus` colocated GPUs with `slots` sequences each."""
        p, correct = np.concatenate(self._p), np.concatenate(self._correct)
        lengths = response_lengths(p, correct, np.concatenate(self._z), np.concatenate(self._u), c)
        prefill = c.prompt_tokens * c.prefill_s_per_token
        out = []
        for step in self.steps:
            seconds = 0.0
            for per_engine, prompts, scored in step.rounds:
                assert all(len(idx) <= slots for idx in per_engine), "replay needs every round to fit the slots"
                gen = max(batch_decode_s(lengths[idx], c) + n * prefill for idx, n in zip(per_engine, prompts))
                seconds += gen + c.round_overhead_s + c.reward_s_per_sample * scored
            assert step.kept is not None, "a step without its kept samples"
            tokens = lengths[step.kept].sum() + len(step.kept) * c.prompt_tokens
            seconds += c.reward_s_per_sample * batch_size * group_size + learner_s(tokens, gpus, c, recompute=True)
            out.append(float(seconds))
        return out
