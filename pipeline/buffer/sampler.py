"""Reinforce-Ada's adaptive sampling inside your own training loop: `AdaptiveSampler` drives the buffer's
`Scheduler` with any `generate(prompts, num_samples)` function, no processes, sockets or GPUs of this project.

    sampler = AdaptiveSampler(prompts, batch_size=32)          # prompts: [(prompt text, gold answer), ...]
    for step in range(num_steps):
        groups = sampler.sample(generate)                     # 32 released groups of n samples each
        train_on(groups)                                      # advantages: group.advantages
        sampler.step()                                        # the policy moved: one version on

Each call of `generate` gets the prompts of every round the scheduler issues at once (one batch, as vLLM's
`LLM.generate` likes it) and returns, per prompt, that many `Rollout`s: the completion's token ids, their
behaviour log-probs, the reward, and the prompt's token ids. The sampler keeps sampling prompts in rounds until
their exit rule holds (`balance`, `pos`, or `fixed` = GRPO), downsamples each pool to a balanced group of n and
computes advantages from the whole pool, exactly as the asynchronous trainer does (the same Scheduler code).

Invariants: every group returned has exactly `sampling.group_size` samples, all generated at the current version
(the sampler is on-policy: max_staleness 0); `generate` is never asked for zero samples of a prompt; a `generate`
that returns the wrong number of rollouts is a ValueError naming the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler
from pipeline.buffer.state import PromptRow
from pipeline.config import BufferConfig, SamplingConfig

_SELF = "in-process"  # the scheduler's name for the one "producer": this process


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of a prompt, as `generate` returns it."""

    token_ids: Sequence[int]  # the completion's tokens
    logprobs: Sequence[float]  # log pi_behaviour of each, at the sampling temperature
    reward: float
    prompt_token_ids: Sequence[int]  # the prompt's tokens (the same for every rollout of a prompt)
    finish_reason: str = "stop"  # "stop" | "length"


Generate = Callable[[list[str], list[int]], Sequence[Sequence[Rollout]]]


class AdaptiveSampler:
    """Adaptive sampling for a synchronous training loop; see the module docstring."""

    def __init__(self, prompts: Sequence[PromptRow], batch_size: int, *,
                 sampling: SamplingConfig | None = None, buffer: BufferConfig | None = None, seed: int = 0) -> None:
        sampling = sampling or SamplingConfig(exit_check="round")
        buffer = buffer or BufferConfig(max_staleness=0)
        if buffer.max_staleness != 0:
            raise ValueError("AdaptiveSampler is on-policy: use buffer.max_staleness = 0 (the asynchronous trainer "
                             "is the one that trains on stale samples)")
        self.scheduler = Scheduler(sampling, buffer, batch_size, prompts, seed)
        self.batch_size = batch_size
        self._clock = 0.0
        self.generate_calls = 0

    @property
    def version(self) -> int:
        return self.scheduler.learner_version

    def step(self) -> None:
        """The policy was updated: samples drawn from now on carry the next version."""
        self.scheduler.set_learner_version(self.version + 1, self._tick())

    def sample(self, generate: Generate, max_calls: int = 1000) -> list[P.Group]:
        """`batch_size` released groups, calling `generate` on every round the scheduler issues until enough
        prompts have met their exit rule. Raises RuntimeError if `max_calls` calls do not get there."""
        for _ in range(max_calls):
            groups = self.scheduler.take_batch(self.version, self.batch_size, self._tick())
            if groups is not None:
                return groups
            rounds = self.scheduler.request_work(_SELF, 1 << 30, self._tick())
            if not rounds:
                raise RuntimeError(f"no round to sample and only {self.scheduler.groups_waiting} of "
                                   f"{self.batch_size} groups released: call step() after training on each batch")
            self.generate_calls += 1
            outputs = generate([r.prompt for r in rounds], [r.num_samples for r in rounds])
            if len(outputs) != len(rounds):
                raise ValueError(f"generate returned {len(outputs)} results for {len(rounds)} prompts")
            for r, rollouts in zip(rounds, outputs):
                self._submit(r, rollouts)
        raise RuntimeError(f"{max_calls} calls of generate released only {self.scheduler.groups_waiting} of "
                           f"{self.batch_size} groups: are the rewards always equal (check the reward function)?")

    def metrics(self) -> dict:
        """The scheduler's counters (samples received, released, dropped, ...)."""
        return self.scheduler.metrics()

    def _submit(self, r: P.RoundAssignment, rollouts: Sequence[Rollout]) -> None:
        if len(rollouts) != r.num_samples:
            raise ValueError(f"generate returned {len(rollouts)} rollouts for prompt {r.prompt[:60]!r}; it was asked "
                             f"for {r.num_samples}")
        samples = [P.Sample(np.asarray(x.token_ids, dtype=np.int32), np.asarray(x.logprobs, dtype=np.float32),
                            float(x.reward), self.version, x.finish_reason) for x in rollouts]
        prompt_ids = np.asarray(rollouts[0].prompt_token_ids, dtype=np.int32)
        self.scheduler.submit_result(_SELF, r.round_id, prompt_ids, samples, self._tick())

    def _tick(self) -> float:
        self._clock += 1.0  # a logical clock: rounds live only inside one `generate` call, so leases never expire
        return self._clock
