"""The reference's round-synchronous loop, as a buffer process: bench.pipeline's reference arm.

The official Reinforce-Ada loop (RLHFlow/Reinforce-Ada, `_generate_multi_round_adaptive_downsampling`) takes a
batch of B prompts and, for up to N rounds, makes one generate call over every prompt of the batch still active,
waits for all of it (a barrier), checks the exit rule on whole rounds, then downsamples each pool to n, trains, and
loads the new weights into the engines before the next batch. Here that loop runs on the same parts as the
pipeline's arms, so the two are timed with the same engines, learner, weight transport and sockets:

- `BarrierScheduler` is the real `Scheduler` (exit rules, downsampling, advantages) with the reference's dispatch:
  a barrier round is every prompt of the batch without a round (all B at its start), dealt to the producers that
  ask (each its fair share, as verl splits a batch over its data-parallel ranks); no round is issued again until
  every round of it is back. Run with the reference's settings (bench.pipeline passes them): max_staleness 0 (a
  batch starts only once the learner's new version is out and producers hold its weights), exit_check "round",
  unresolved "keep" (every admitted prompt is trained: exactly B per step), downsample "first", allocation
  "fixed".
- `main` is `reinforce-ada buffer` with that scheduler in place of the streaming one (same arguments).

Invariant (tests/test_bench_reference.py): a prompt's next round is issued only once every round issued before
its last result came back is back too (the barrier); each barrier round gives a prompt at most one round; a step
trains exactly the B prompts it admitted. (buffer.max_rounds_in_flight and a WorkRequest's sample budget are not
applied: the reference has neither.)
"""

from __future__ import annotations

from pipeline import protocol as P
from pipeline.buffer.scheduler import Scheduler


class BarrierScheduler(Scheduler):
    """The Scheduler with the reference's round-synchronous dispatch (see the module docstring). The Scheduler's own
    `request_work` deals the rounds (fair shares, leases); it only ever sees the prompts of the current barrier
    round as ready, and admits none of its own."""

    barrier_rounds = 0  # barrier rounds started (for tests)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._members: set[int] = set()  # prompts of the current barrier round not dealt yet
        self._pop_any = self.pools.pop_ready
        self.pools.pop_ready = self._pop_member  # what request_work deals from

    def request_work(self, producer_id: str, max_rounds: int, now: float, *args, **kwargs
                     ) -> list[P.RoundAssignment]:
        self._members &= self.pools.active.keys()
        if not self.leases.num_train and not self._members:  # the last barrier round is all back: the next starts
            self._start_barrier(now)
        return super().request_work(producer_id, max_rounds, now, *args, **kwargs)

    def _start_barrier(self, now: float) -> None:
        """Every active prompt without a round, and as many new ones as admission allows (a batch's start)."""
        members = []
        while (st := self._pop_any()) is not None:
            members.append(st)
        while super()._admission_open():
            members.append(self._admit(now))
        for st in members:
            self.pools.queue(st)
        self._members = {st.prompt_id for st in members}
        self.barrier_rounds += bool(members)

    def _pop_member(self):
        """The oldest ready prompt of the current barrier round; the others stay queued for the next one."""
        later = []
        while (st := self._pop_any()) is not None and st.prompt_id not in self._members:
            later.append(st)
        for other in later:
            self.pools.queue(other)
        return st

    def _admission_open(self) -> bool:
        return False  # prompts are admitted only when a barrier round starts (a batch's first)

    def _issue(self, st, producer_id: str, size: int, now: float) -> P.RoundAssignment:
        self._members.discard(st.prompt_id)
        return super()._issue(st, producer_id, size, now)


def main(argv: list[str] | None = None) -> int:
    """`reinforce-ada buffer` (same arguments) with the barrier scheduler."""
    from pipeline.buffer import core
    from pipeline.buffer import main as buffer_main

    core.Scheduler = BarrierScheduler  # BufferCore builds its scheduler from this name
    return buffer_main.main(argv)


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
