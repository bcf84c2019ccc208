"""A weight group: rank 0 (the learner) broadcasts flat byte buffers to every other rank (the engines' workers).

It is built beside any torch.distributed world the process already has (the learner's DDP/DeepSpeed group, vLLM's
own tensor-parallel group), never as the default group: on a PrefixStore of the learner's TCPStore, so each
generation of the group has its own keys.

- gloo (CPU): a `ProcessGroupGloo` with its own timeout; a dead peer fails the broadcast at once (connection reset)
  or after the timeout; rank 0 then closes the group, so the other ranks fail at once too.
- nccl (GPU): vLLM's `StatelessProcessGroup` for the rendezvous and `PyNcclCommunicator` for the data, as TRL's
  vLLM server and prime-rl do. NCCL has no time-out of its own: `NcclGroup.broadcast` runs under a watchdog that
  aborts the communicator when the timeout passes, so the caller gets an error instead of a hang.
"""

from __future__ import annotations

import datetime
import threading
from typing import Protocol

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, Store


class WeightGroup(Protocol):
    def broadcast(self, buf: torch.Tensor) -> None:
        """Rank 0: send `buf` (uint8) to every rank."""
        ...

    def receive(self, nbytes: int) -> torch.Tensor:
        """Other ranks: a fresh uint8 tensor of `nbytes` holding rank 0's next broadcast."""
        ...

    def close(self) -> None:
        ...


class _Group:
    """What both backends share: rank 0 sends a flat uint8 buffer, every other rank receives a fresh one."""

    device = torch.device("cpu")

    def _transfer(self, buf: torch.Tensor) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def broadcast(self, buf: torch.Tensor) -> None:
        self._transfer(buf.to(self.device))

    def receive(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._transfer(buf)
        return buf

    def close(self) -> None:
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean shutdown
            pass


class GlooGroup(_Group):
    """A weight group over gloo (CPU tensors)."""

    def __init__(self, store: Store, prefix: str, rank: int, world_size: int, timeout_s: float, address: str) -> None:
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        # bind on the interface peers reach us at (the default resolves the hostname, often 127.0.1.1)
        opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
        self.pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, world_size, opts)

    def _transfer(self, buf: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([buf], opts).wait()

    def _shutdown(self) -> None:
        # dropping the last reference closes the group's connections, so the peers of a failed broadcast fail at
        # once ("connection closed") instead of waiting out the time-out (pg.shutdown() leaves them open)
        self.pg = None


class NcclGroup(_Group):
    """A weight group over NCCL (CUDA tensors): the path of TRL's vLLM server. Needs vLLM with CUDA."""

    def __init__(self, store: Store, prefix: str, rank: int, world_size: int, timeout_s: float,
                 device: torch.device) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.device, self.timeout_s = device, timeout_s
        pg = StatelessProcessGroup(rank=rank, world_size=world_size, store=PrefixStore(prefix, store))
        self.comm = PyNcclCommunicator(pg, device=device)

    def _transfer(self, buf: torch.Tensor) -> None:
        if self.comm.disabled:  # aborted by an earlier time-out: broadcast() would return without sending
            raise RuntimeError("the NCCL weight group was aborted")
        done = threading.Event()

        def watchdog() -> None:
            if not done.wait(self.timeout_s):
                self.comm.destroy()  # ncclCommAbort: the blocked broadcast returns with an error

        threading.Thread(target=watchdog, daemon=True, name="nccl-weight-watchdog").start()
        stream = torch.cuda.current_stream(self.device)
        try:
            self.comm.broadcast(buf, src=0, stream=stream)
            stream.synchronize()
        finally:
            done.set()
        if self.comm.disabled:
            raise TimeoutError(f"an NCCL weight broadcast did not finish within {self.timeout_s:g} s (aborted)")

    def _shutdown(self) -> None:
        self.comm.destroy()


def open_group(backend: str, store: Store, prefix: str, rank: int, world_size: int, timeout_s: float,
               address: str, device: torch.device | None = None) -> WeightGroup:
    """Join the group (blocks until all `world_size` ranks have joined, or raises after `timeout_s`)."""
    if backend == "nccl":
        assert device is not None and device.type == "cuda", "an NCCL weight group needs a CUDA device"
        return NcclGroup(store, prefix, rank, world_size, timeout_s, device)
    assert backend == "gloo", backend
    return GlooGroup(store, prefix, rank, world_size, timeout_s, address)
