"""Streamed samples waiting to be sent: per round, the samples scored since the last flush and what was aborted.

The producer queues each finished, scored sample of a streamed round here and flushes everything queued, of any
rounds, as one SampleResults (pipeline/producer/worker.py). Invariants: every part with samples carries its
round's prompt token ids (a part is checked on its own at the buffer's edge, and a lost first part must not
orphan the rest); a sample is either sent once or counted as aborted (with its tokens), never both; an aborted
round's queued samples become aborted counts.
"""

from __future__ import annotations

import numpy as np

from pipeline import protocol as P


class Outbox:
    """The parts of streamed rounds not sent yet; see the module docstring."""

    def __init__(self) -> None:
        self.parts: dict[int, P.RoundSamples] = {}

    def __len__(self) -> int:
        return len(self.parts)

    def _part(self, round_id: int, prompt_id: int) -> P.RoundSamples:
        part = self.parts.get(round_id)
        if part is None:
            part = self.parts[round_id] = P.RoundSamples(round_id, prompt_id, P.empty_array("int32"), [], [])
        return part

    def add(self, round_id: int, prompt_id: int, index: int, sample: P.Sample, prompt_ids: np.ndarray) -> None:
        """Queue sample `index` of a round."""
        part = self._part(round_id, prompt_id)
        part.prompt_token_ids = prompt_ids
        part.indices.append(index)
        part.samples.append(sample)

    def aborted(self, round_id: int, prompt_id: int, num: int = 0, tokens: int = 0) -> None:
        """Count `num` samples of a round (`tokens` tokens) as aborted; its queued samples are aborted too."""
        part = self._part(round_id, prompt_id)
        part.num_aborted += num + len(part.samples)
        part.aborted_tokens += tokens + sum(len(s.token_ids) for s in part.samples)
        part.indices.clear()
        part.samples.clear()

    def has_samples(self, round_id: int) -> bool:
        part = self.parts.get(round_id)
        return part is not None and bool(part.samples)

    def take(self) -> list[P.RoundSamples]:
        """Everything queued, emptying the outbox."""
        parts, self.parts = list(self.parts.values()), {}
        return parts
