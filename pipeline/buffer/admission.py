"""Which training example the buffer admits next, and what it remembers about each example across visits.

Examples are taken in the given order, wrapping around for further epochs; every admission gets a fresh
prompt_id. The allocation policy may defer an example (`Allocation.admit`): it is skipped this epoch and asked
about again at its next turn. `History` (one per example seen) holds the evidence on its pass rate, updated
with every sample that arrives for it, and its deferrals; it is part of the scheduler's snapshot.

Invariants:
- `cursor` counts examples taken or deferred: the epoch is cursor // len(prompts);
- an example is deferred at most MAX_DEFERRALS times in a row (the policy's `admit` says so), so `take` ends
  after at most len(prompts) * MAX_DEFERRALS + 1 turns and every example is tried at least once every
  MAX_DEFERRALS + 1 epochs;
- `positives` / `samples` count every sample observed, whatever its prompt: the population prior's data.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.buffer.policy import MAX_DEFERRALS, Allocation, Prior
from pipeline.buffer.state import History, PromptRow, PromptState


class Admission:
    """The data cursor, prompt ids and per-example histories; see the module docstring."""

    def __init__(self, prompts: Sequence[PromptRow], policy: Allocation) -> None:
        self.prompts, self.policy = prompts, policy
        self.cursor = 0
        self.next_prompt_id = 0
        self.history: dict[int, History] = {}
        self.positives = 0.0  # every sample observed: the population prior
        self.samples = 0.0
        self.deferrals = 0

    @property
    def epoch(self) -> int:
        return self.cursor // len(self.prompts)

    def prior(self, waste: float, yield_rate: float) -> Prior:
        """The population prior, with what the run measured: `waste` (the cost of a cut sample, as a share of a
        sample) and `yield_rate` (groups released per sample)."""
        return Prior.from_counts(self.positives, self.samples, waste, yield_rate)

    def take(self, now: float, prior: Prior) -> PromptState:
        """The next example the policy admits, as a new prompt (its earlier evidence decayed by the policy)."""
        for _ in range(len(self.prompts) * (MAX_DEFERRALS + 1) + 1):
            example = self.cursor % len(self.prompts)
            self.cursor += 1
            hist = self.history.get(example)
            if hist is None or self.policy.admit(hist, prior):
                break
            hist.deferred += 1
            hist.deferrals += 1
            self.deferrals += 1
        else:  # pragma: no cover - the policy contract makes this unreachable
            raise AssertionError("every example deferred beyond MAX_DEFERRALS: the policy breaks its contract")
        hist = self.history.setdefault(example, History())
        decay = self.policy.decay
        hist.pos, hist.neg = hist.pos * decay, hist.neg * decay
        hist.visits += 1
        hist.deferred = 0
        prompt, answer = self.prompts[example][:2]
        prompt_id = self.next_prompt_id
        self.next_prompt_id += 1
        return PromptState(prompt_id, example, prompt, answer, admitted_at=now, admitted_order=prompt_id)

    def observe(self, example: int, num_pos: int, num_neg: int) -> None:
        """Samples that arrived for `example` (every one counts as evidence, stale or discarded ones too)."""
        hist = self.history.setdefault(example, History())
        hist.pos += num_pos
        hist.neg += num_neg
        self.positives += num_pos
        self.samples += num_pos + num_neg

    def load(self, cursor: int, next_prompt_id: int, history: dict[int, History], positives: float,
             samples: float, deferrals: int) -> None:
        """Restore the state a snapshot holds."""
        self.cursor, self.next_prompt_id, self.history = cursor, next_prompt_id, dict(history)
        self.positives, self.samples, self.deferrals = positives, samples, deferrals
