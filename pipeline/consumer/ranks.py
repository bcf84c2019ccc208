"""What learner rank 0 tells the other ranks once per step: a batch to train on, an error, or stop.

Only rank 0 talks to the buffer. Each step it broadcasts one typed `RankMessage` to the other ranks, which act
on exactly the same thing: `BatchFrames` (the buffer's Batch as the protocol's own frames, decoded on every rank
with the protocol's typed decoder), `RankError` (rank 0 failed: the others raise the same error) or `Stop`.
The message travels as msgpack bytes in two tensor broadcasts (length, then bytes) on the process group's
device: nothing is pickled, not even between the ranks of one job.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from pipeline import protocol as P


class BatchFrames(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A batch to train on, as the wire frames the buffer's Batch encodes to."""

    frames: list[bytes]

    @classmethod
    def of(cls, batch: P.Batch) -> BatchFrames:
        return cls([bytes(f) for f in P.Encoder().encode(batch)])

    def batch(self) -> P.Batch:
        """The Batch, through the protocol's typed decoder (a malformed one raises P.ProtocolError)."""
        return P.Decoder(P.Batch).decode(self.frames)


class RankError(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Rank 0 stopped with this error; every rank raises it."""

    text: str


class Stop(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Stop training cleanly (the buffer said Shutdown)."""

    reason: str


RankMessage = BatchFrames | RankError | Stop

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RankMessage)


def broadcast(msg: RankMessage | None, rank: int, world_size: int, device: torch.device) -> RankMessage:
    """Rank 0's `msg` on every rank (collective; the other ranks pass None). One rank: `msg` itself."""
    if world_size == 1:
        assert msg is not None, "rank 0 must say something"
        return msg
    if rank == 0:
        assert msg is not None, "rank 0 must say something"
        data = _ENCODER.encode(msg)
        size = torch.tensor([len(data)], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if rank == 0:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    if rank == 0:
        return msg
    return _DECODER.decode(np.asarray(payload.cpu()).tobytes())
