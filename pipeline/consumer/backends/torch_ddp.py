"""The torch backend: AdamW on float32 weights in one process, or DDP (gloo on CPU, nccl on GPU) under torchrun.

Every rank holds a full replica of the weights and the optimizer state, so `full_state_dict` needs no gather
and rank 0 alone writes checkpoints. DDP all-reduces the gradients in the last micro-batch's backward; the
gradient norm is then the same on every rank, and so is the decision to skip a non-finite step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from pipeline.consumer.backends.common import BETAS, EPS, lr_lambda, setup_dist
from pipeline.weights.state import to_publish

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.consumer.batching import MicroBatch
    from pipeline.consumer.model import PolicyModule


class TorchBackend:
    """AdamW on float32 weights; DDP when launched by torchrun with > 1 rank."""

    name = "torch"
    zero_stage = None

    def __init__(self, cfg: Config, policy: PolicyModule) -> None:
        lc = cfg.learner
        cuda = torch.cuda.is_available()
        self.rank, self.world_size, local_rank = setup_dist("nccl" if cuda else "gloo")
        self.device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.policy = policy.to(self.device)
        self.module = policy
        self.wrapped: torch.nn.Module = self.policy
        if self.world_size > 1:
            self.wrapped = DistributedDataParallel(self.policy, device_ids=[local_rank] if cuda else None)
        self.autocast_dtype = None
        if cuda and cfg.model.dtype != "float32":
            self.autocast_dtype = getattr(torch, cfg.model.dtype)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lc.lr, betas=BETAS, eps=EPS, weight_decay=lc.weight_decay,
                                           **({"fused": True} if cuda else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(lc.warmup_steps))
        self.grad_clip = lc.grad_clip
        self._params = params

    @contextlib.contextmanager
    def accumulate(self, last: bool) -> Iterator[None]:
        """DDP reduces gradients only in the last micro-batch's backward (no_sync before)."""
        if self.world_size > 1 and not last:
            with self.wrapped.no_sync():
                yield
        else:
            yield

    def forward(self, mb: MicroBatch, with_entropy: bool = True, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            return self.wrapped(mb.input_ids_BT, mb.position_ids_BT, mb.mask_BT, with_entropy, entropy_grad)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        if math.isfinite(norm):  # else the clip has turned every gradient into NaN: drop them, change nothing
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """HF-named weights on rank 0 (None elsewhere); every rank holds a full replica, no gather needed."""
        if self.rank != 0:
            return None
        return to_publish(self.module.lm.state_dict(), "", dtype)

    def save(self, path: Path) -> None:
        if self.rank == 0:
            torch.save({"model": self.module.lm.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, path / "torch_state.pt")

    def load(self, path: Path) -> None:
        state = torch.load(path / "torch_state.pt", map_location=self.device, weights_only=True)
        self.module.lm.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
