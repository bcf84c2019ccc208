"""What the built-in backends share: the optimizer settings, the lr schedule, the process group, and the
conversion of a module's state dict into the weights that producers load."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

BETAS = (0.9, 0.999)  # AdamW betas (LearnerConfig has none yet)
EPS = 1e-8


def lr_lambda(warmup_steps: int) -> Callable[[int], float]:
    """Linear warm-up: optimizer step s runs at lr * (s + 1) / warmup_steps, then at lr."""
    return lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def setup_dist(backend_name: str) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; initialises the process group once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend_name)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0
