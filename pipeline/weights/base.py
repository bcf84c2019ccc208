"""The weight-transport seam: a publisher on the learner's rank 0 and a loader in each producer.

    learner rank 0:  ann = publisher.publish(state, version)  -> VersionUpdate(version, ann) to the buffer
    buffer:          relays `ann` on its control channel, and in Assignments.weights to a producer that missed it
    producer:        await loader.load(ann)                   -> the engine holds `ann.version` (or newer)

`weights.transport` picks the pair: "file" (file.py: a safetensors file per version in `weights.dir`, one machine or
a shared filesystem) or "dist" (dist.py + dist_loader.py: a torch.distributed broadcast from rank 0 straight into
the engines, no filesystem). A new transport is a new pair of classes here plus a config value.

Invariants:
- `publish` returns only when the announced version can be loaded: its file is complete, or its broadcast is staged;
- `load` either leaves the engine on its old weights (and raises) or puts it on the announced version or newer;
  a load never lets the engine generate with a mix of two versions (dist pauses the engine until a complete
  version is in, see engine.py);
- an announcement a producer did not expect is refused and counted (`weight_load_refused`), never loaded:
  `uri_problem` (its location) and `version_problem` (its version) say why; the buffer applies `uri_problem` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pipeline import protocol as P
from pipeline.weights.uris import dist_uri_problem, file_uri_problem

if TYPE_CHECKING:
    from pipeline.config import Config


class WeightPublisher(Protocol):
    """The learner's side (rank 0 only)."""

    def publish(self, state: dict[str, Any], version: int) -> P.WeightAnnouncement:
        """Make `state` (HF-named CPU tensors in the publish dtype) loadable as `version`; returns its
        announcement. The tensors may alias live parameters: a publisher copies what it keeps."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges for the learner's metrics row (`weight_*`)."""
        ...

    def close(self) -> None:
        """Stop serving (idempotent)."""
        ...


class WeightLoader(Protocol):
    """A producer's side."""

    async def load(self, ann: P.WeightAnnouncement) -> float:
        """Load `ann` (or a newer version the learner holds) into the engine; returns the seconds it took.
        Raises on failure; the engine then keeps the weights it had."""
        ...

    def close(self) -> None:
        ...


def make_publisher(cfg: Config, device: Any = None) -> WeightPublisher:
    """The publisher `weights.transport` names (call on the learner's rank 0; `device` is the learner's torch
    device, which decides dist_backend "auto")."""
    if cfg.weights.transport == "dist":
        from pipeline.weights.dist import DistPublisher

        return DistPublisher(cfg.weights, device, max(cfg.weights.dist_max_members, cfg.producers.count))
    from pipeline.weights.file import FilePublisher

    return FilePublisher(cfg.weights_dir, cfg.weights.keep)


def make_loader(cfg: Config, engine: Any, member: str) -> WeightLoader:
    """The loader `weights.transport` names, for `engine` (an Engine) of the producer named `member`."""
    if cfg.weights.transport == "dist":
        from pipeline.weights.dist_loader import DistLoader

        return DistLoader(cfg.weights, engine, member)
    from pipeline.weights.file import FileLoader

    return FileLoader(engine, cfg.weights_dir)


def uri_problem(ann: P.WeightAnnouncement, cfg: Config) -> str:
    """Why `ann` does not lie where this run's transport publishes version `ann.version` ("" if it does): the
    buffer relays, and a producer loads, only weights of the run's own transport and place (uris.py)."""
    if cfg.weights.transport == "dist":
        return dist_uri_problem(ann.uri, cfg.weights.dist_host, cfg.weights.dist_port, ann.version)
    return file_uri_problem(ann.uri, cfg.weights_dir, ann.version)


def version_problem(ann: P.WeightAnnouncement, learner_version: int) -> str:
    """Why a producer must not load `ann` given `learner_version`, the newest learner version the buffer has stated
    to it ("" if it may): a version beyond learner_version + 1, or below 1 (version 0 is the model directory).

    The bound is the buffer's learner version, not the engine's: a restarted engine is back at version 0, and
    "engine + 1" would refuse every catch-up; were every producer restarted, none could come within
    buffer.max_staleness again. The + 1 covers a dist publisher that serves its newest version a moment before
    the buffer has relayed its announcement."""
    if ann.version < 1:
        return f"weights version {ann.version} < 1 (version 0 is the model directory every engine starts from)"
    if ann.version > learner_version + 1:
        return f"weights version {ann.version} is ahead of the learner's version {learner_version} + 1"
    return ""
