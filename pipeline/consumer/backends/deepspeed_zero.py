"""The DeepSpeed backend: ZeRO (stage from learner.zero_stage) with torch's AdamW as the client optimizer.

deepspeed is an optional dependency: this is the only module that imports it, and `make_backend` imports this
module only when learner.backend is "deepspeed". Torch's AdamW avoids compiling DeepSpeed's fused/CPU Adam ops
(no compiler needed on CPU machines); ZeRO shards its state all the same (`zero_allow_untested_optimizer`).
Micro-batches are driven by `set_gradient_accumulation_boundary`, so their number may change from step to step.

Skipping a non-finite step: under ZeRO-1/2/3 the reduced gradients live in DeepSpeed's partitioned buffers, and
only DeepSpeed's own overflow path (taken when the global norm is not finite, in fp32, fp16 and bf16 with
`check_grad_overflow`) drops them without touching the weights, the optimizer or the lr schedule; ZeRO-0 hands
the all-reduced gradients to AdamW as they are, so there the norm is taken and checked here.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipeline.consumer.backends.common import BETAS, EPS, lr_lambda
from pipeline.transport import free_port
from pipeline.weights.state import to_publish

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator when first imported
import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401 - patched below

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.consumer.batching import MicroBatch
    from pipeline.consumer.model import PolicyModule

if not torch.cuda.is_available():
    # DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce op (minutes, needs a C++ compiler)
    # that only inference_all_reduce uses; training never calls it, so skip the build. (The package attribute
    # `deepspeed.comm.torch` is the real torch, hence sys.modules.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


class DeepSpeedBackend:
    """DeepSpeed ZeRO-0..3 on the policy module, one engine per rank."""

    name = "deepspeed"

    def __init__(self, cfg: Config, policy: PolicyModule) -> None:
        cuda = torch.cuda.is_available()
        if "WORLD_SIZE" not in os.environ:  # a single process without torchrun: DeepSpeed still wants env://
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        lc = cfg.learner
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        bf16, fp16 = cuda and cfg.model.dtype == "bfloat16", cuda and cfg.model.dtype == "float16"
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": lc.grad_clip,
            "zero_optimization": {"stage": lc.zero_stage, "overlap_comm": cuda, "contiguous_gradients": True},
            "bf16": {"enabled": bf16, "check_grad_overflow": True},  # skip non-finite steps (module docstring)
            "fp16": {"enabled": fp16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lc.lr, betas=BETAS, eps=EPS, weight_decay=lc.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=policy, optimizer=optimizer, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lc.warmup_steps)))
        self.module = self.engine.module
        self.zero_stage = lc.zero_stage
        self._plain_grads = lc.zero_stage == 0 and not (bf16 or fp16)  # AdamW steps on p.grad as it is
        self._params = params

    @contextlib.contextmanager
    def accumulate(self, last: bool) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last)
        yield

    def forward(self, mb: MicroBatch, with_entropy: bool = True, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.engine(mb.input_ids_BT, mb.position_ids_BT, mb.mask_BT, with_entropy, entropy_grad)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        # the boundary was set by accumulate(last=True): this is the optimizer step
        if self._plain_grads:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in self._params if p.grad is not None]))
            if not math.isfinite(norm):
                self.engine.zero_grad()
                return norm
            self.engine.step()
            return norm
        self.engine.step()
        if not self.engine.was_step_applied():
            return float("inf")  # DeepSpeed's overflow path: gradients dropped, nothing applied
        norm = self.engine.get_global_grad_norm()
        assert norm is not None and math.isfinite(norm), f"DeepSpeed applied a step with gradient norm {norm}"
        return float(norm)

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """HF-named weights on rank 0; under ZeRO-3 gathered layer by layer (collective: call on every rank)."""
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.module.state_dict() if self.rank == 0 else None
        if self.rank != 0 or state is None:
            return None
        return to_publish(state, "lm.", dtype)

    def save(self, path: Path) -> None:
        # collective: every rank writes its ZeRO shard
        self.engine.save_checkpoint(str(path), tag="deepspeed", save_latest=False)

    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path), tag="deepspeed", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"no DeepSpeed checkpoint under {path}/deepspeed")
