"""The learner backend seam: where the optimizer lives and how gradients meet across ranks.

A backend wraps the policy module (see model.py) and hides how its parameters, gradients and optimizer state
are laid out over ranks, so the loss and the learner loop are written once. Built in:

    torch      torch_ddp.py      AdamW on float32 weights; one process, or DDP under torchrun
    deepspeed  deepspeed_zero.py DeepSpeed ZeRO-0..3 with torch's AdamW as the client optimizer

A new backend is a class that satisfies `LearnerBackend` in a module beside these, plus its name in
`make_backend` and in `learner.backend`'s allowed values (config schema).

Invariants every backend keeps:
- gradients are *averaged* over ranks (DDP and ZeRO do), while the loss is a token-mean over the global
  mini-batch: the learner multiplies each rank's loss by `world_size` (see learner.py);
- `step()` is collective and answers the same on every rank: it returns the global gradient norm, and when
  that norm is not finite it applies nothing (no weight, optimizer or lr-schedule update) and discards the
  gradients, so the next mini-batch starts from zero gradients on every rank;
- `full_state_dict` returns Hugging Face parameter names (what vLLM's weight loader expects), tied duplicates
  dropped, on rank 0 only; it may be collective (ZeRO-3 gathers), so every rank calls it.

Precision: the torch backend keeps float32 master weights and runs the forward under bf16/fp16 autocast on
GPUs when model.dtype asks for it; DeepSpeed runs its own bf16/fp16 mode on GPUs. On CPU both compute in
float32 (CPU bf16 kernels are slow and would not match what the engines compute anyway).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from pipeline.consumer.backends.torch_ddp import TorchBackend

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.consumer.batching import MicroBatch
    from pipeline.consumer.model import PolicyModule


@runtime_checkable
class LearnerBackend(Protocol):
    """What the learner and the checkpoints need from a backend (one instance per rank)."""

    name: str  # the learner.backend value; recorded in checkpoints, which resume only with the same one
    rank: int
    world_size: int
    device: torch.device  # where micro-batches go (and the tensors of collectives)
    zero_stage: int | None  # ZeRO stage of sharded state (a checkpoint then needs the same ranks); None: replicas

    def accumulate(self, last: bool) -> AbstractContextManager[None]:
        """Context of one micro-batch's forward and backward; gradients are reduced across ranks in the
        `last` one (the others only accumulate locally)."""
        ...

    def forward(self, mb: MicroBatch, with_entropy: bool = True, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's (logp_BT, entropy_BT) on a micro-batch already on `device` (see model.token_logprobs)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (already scaled by world_size)."""
        ...

    def step(self) -> float:
        """Clip and apply the accumulated gradients, advance the lr schedule, zero the gradients; returns the
        global gradient norm before clipping. A non-finite norm applies nothing (see the module docstring)."""
        ...

    @property
    def lr(self) -> float:
        """The learning rate the next step() applies."""
        ...

    def full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """HF-named CPU weights in `dtype` on rank 0, None elsewhere (collective)."""
        ...

    def save(self, path: Path) -> None:
        """Write weights, optimizer and lr schedule under `path` (collective; rank 0 or every rank writes)."""
        ...

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...


def make_backend(cfg: Config, policy: PolicyModule) -> LearnerBackend:
    """The backend named by learner.backend, wrapping the policy module."""
    name = cfg.learner.backend
    if name == "torch":
        return TorchBackend(cfg, policy)
    if name == "deepspeed":
        # deepspeed is an optional dependency: imported only when chosen
        from pipeline.consumer.backends.deepspeed_zero import DeepSpeedBackend

        return DeepSpeedBackend(cfg, policy)
    raise ValueError(f"learner.backend {name!r}: use 'torch' or 'deepspeed'")
