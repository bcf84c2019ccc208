"""What the producer's worker needs from the parts around it, as typed interfaces: the inference engine, the
buffer link and the reward scorer. `engine.Engine` (vLLM), `transport.AsyncBufferClient` (ZeroMQ) and
`rewards.RewardPool` implement them; the test doubles in tests/ implement them too. A new engine (another
inference server, say) is a class that satisfies `RoundEngine`.

Invariant: the worker calls nothing on these objects that is not declared here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pipeline import protocol as P


class RoundEngine(Protocol):
    """Generates rounds of samples of one prompt and loads new weights in place (pipeline/producer/engine.py)."""

    version: int  # the weight version the engine holds
    last_load_seconds: float
    on_sample_done: Callable[[], None] | None  # called whenever a sequence slot frees up

    @property
    def live_samples(self) -> int: ...  # sequences submitted and not finished

    @property
    def is_dead(self) -> bool: ...  # nothing more can be generated: the producer must exit

    def free_samples(self) -> int: ...  # samples to ask the buffer for now

    async def generate_round(self, assignment: P.RoundAssignment, on_sample: Any = None) -> Any:
        """The round's completions (engine.RoundOutput); raises engine.RoundAborted when aborted. `on_sample(i,
        completion)` is called as each sample finishes (streamed rounds)."""

    async def abort(self, round_id: int) -> bool: ...

    async def shutdown(self) -> None: ...


class BufferLink(Protocol):
    """The producer's connection to the buffer (pipeline/transport.py: AsyncBufferClient)."""

    async def send(self, msg: Any) -> None: ...

    async def recv(self) -> Any: ...  # the next reply (Assignments, Ack, MetricsSnapshot)

    async def recv_control(self) -> Any: ...  # the next broadcast (VersionUpdate, Abort, Shutdown)

    def close(self) -> None: ...


class Scorer(Protocol):
    """Scores completions with reward.fn (pipeline/rewards/pool.py: RewardPool)."""

    num_workers: int  # 0: `score` runs inline (the worker then calls it from a thread)

    def score(self, completions: Sequence[str], answers: Sequence[str],
              extras: Sequence[Mapping[str, Any]] | None = None) -> list[float]: ...

    async def ascore(self, completions: Sequence[str], answers: Sequence[str],
                     extras: Sequence[Mapping[str, Any]] | None = None) -> list[float]: ...

    def metrics(self) -> dict[str, int]: ...  # failure counters, sent in heartbeats
