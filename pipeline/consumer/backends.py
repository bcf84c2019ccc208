"""Where the optimizer lives: plain torch (one process, or DDP under torchrun) or DeepSpeed ZeRO.

Both backends expose the same small surface, so the loss and the learner loop are written once:
`accumulate(last)` (context for one micro-batch; gradients are reduced across ranks only where the backend
needs it), `forward(mb)`, `backward(loss)`, `step() -> grad_norm`, `lr`, `full_state_dict()`, `save(dir)`,
`load(dir)`.

Gradient scale: DDP and ZeRO *average* gradients over ranks, while the loss is a token-mean over the global
mini-batch; the learner therefore multiplies each rank's loss by `world_size` (see learner.py).

Precision: the torch backend keeps float32 master weights and runs the forward under bf16/fp16 autocast on
GPUs when model.dtype asks for it; DeepSpeed runs its own bf16/fp16 mode on GPUs. On CPU both compute in
float32 (CPU bf16 kernels are slow and would not match what the engines compute anyway).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.consumer.batching import MicroBatch

BETAS = (0.9, 0.999)  # AdamW betas (LearnerConfig has none yet)
EPS = 1e-8


def _lr_lambda(warmup_steps: int):
    # linear warm-up: optimizer step s runs at lr * (s + 1) / warmup_steps, then at lr
    return lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _setup_dist(backend_name: str) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; initialises the process group once."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend_name)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0


def _dedup_tied(state: dict[str, Any]) -> dict[str, Any]:
    """Drop the second name of a tied tensor (safetensors refuses shared storage; vLLM re-ties on load)."""
    out, seen = {}, {}
    for name, t in state.items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


def _to_publish(state: dict[str, Any], prefix: str, dtype) -> dict[str, Any]:
    out = {}
    for name, t in state.items():
        name = name[len(prefix):] if name.startswith(prefix) else name
        out[name] = t.detach()
    out = _dedup_tied(out)
    return {k: v.to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in out.items()}


class TorchBackend:
    """AdamW on float32 weights; DDP (gloo on CPU, nccl on GPU) when launched by torchrun with > 1 rank."""

    name = "torch"

    def __init__(self, cfg: Config, policy) -> None:
        import torch

        lc = cfg.learner
        cuda = torch.cuda.is_available()
        self.rank, self.world_size, local_rank = _setup_dist("nccl" if cuda else "gloo")
        self.device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.policy = policy.to(self.device)
        self.module = policy
        self.wrapped = self.policy
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.wrapped = DDP(self.policy, device_ids=[local_rank] if cuda else None)
        self.autocast_dtype = None
        if cuda and cfg.model.dtype != "float32":
            self.autocast_dtype = getattr(torch, cfg.model.dtype)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lc.lr, betas=BETAS, eps=EPS, weight_decay=lc.weight_decay,
                                           **({"fused": True} if cuda else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(lc.warmup_steps))
        self.grad_clip = lc.grad_clip
        self._params = params

    @contextlib.contextmanager
    def accumulate(self, last: bool):
        """DDP reduces gradients only in the last micro-batch's backward (no_sync before)."""
        if self.world_size > 1 and not last:
            with self.wrapped.no_sync():
                yield
        else:
            yield

    def forward(self, mb: MicroBatch, with_entropy: bool = True, entropy_grad: bool = False):
        import torch

        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            return self.wrapped(mb.input_ids_BT, mb.position_ids_BT, mb.mask_BT, with_entropy, entropy_grad)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> float:
        import torch

        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self, dtype) -> dict[str, Any] | None:
        """HF-named weights on rank 0 (None elsewhere); every rank holds a full replica, no gather needed."""
        if self.rank != 0:
            return None
        return _to_publish(self.module.lm.state_dict(), "", dtype)

    def save(self, path: Path) -> None:
        import torch

        if self.rank == 0:
            torch.save({"model": self.module.lm.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, path / "torch_state.pt")

    def load(self, path: Path) -> None:
        import torch

        state = torch.load(path / "torch_state.pt", map_location=self.device, weights_only=True)
        self.module.lm.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class DeepSpeedBackend:
    """DeepSpeed ZeRO (stage from learner.zero_stage) with torch's AdamW as the client optimizer.

    Torch's AdamW avoids compiling DeepSpeed's fused/CPU Adam ops (no compiler needed on CPU machines);
    ZeRO shards its state all the same (`zero_allow_untested_optimizer`). Micro-batches are driven by
    `set_gradient_accumulation_boundary`, so the number of micro-batches may change from step to step.
    """

    name = "deepspeed"

    def __init__(self, cfg: Config, policy) -> None:
        import torch

        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "WORLD_SIZE" not in os.environ:  # a single process without torchrun: DeepSpeed still wants env://
            from pipeline.transport import free_port

            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        import deepspeed

        if not cuda:
            # DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce op (minutes, needs a C++
            # compiler) that only inference_all_reduce uses; training never calls it, so skip the build.
            import deepspeed.comm.torch  # noqa: F401 - the package attribute `torch` is the real torch

            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        lc = cfg.learner
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": lc.grad_clip,
            "zero_optimization": {"stage": lc.zero_stage, "overlap_comm": cuda, "contiguous_gradients": True},
            "bf16": {"enabled": cuda and cfg.model.dtype == "bfloat16"},
            "fp16": {"enabled": cuda and cfg.model.dtype == "float16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lc.lr, betas=BETAS, eps=EPS, weight_decay=lc.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=policy, optimizer=optimizer, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(lc.warmup_steps)))
        self.module = self.engine.module
        self.zero_stage = lc.zero_stage

    @contextlib.contextmanager
    def accumulate(self, last: bool):
        self.engine.set_gradient_accumulation_boundary(last)
        yield

    def forward(self, mb: MicroBatch, with_entropy: bool = True, entropy_grad: bool = False):
        return self.engine(mb.input_ids_BT, mb.position_ids_BT, mb.mask_BT, with_entropy, entropy_grad)

    def backward(self, loss) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()  # the boundary was set by accumulate(last=True): this is the optimizer step
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def full_state_dict(self, dtype) -> dict[str, Any] | None:
        """HF-named weights on rank 0; under ZeRO-3 gathered layer by layer (collective: call on every rank)."""
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.module.state_dict() if self.rank == 0 else None
        if self.rank != 0 or state is None:
            return None
        return _to_publish(state, "lm.", dtype)

    def save(self, path: Path) -> None:
        # collective: every rank writes its ZeRO shard
        self.engine.save_checkpoint(str(path), tag="deepspeed", save_latest=False)

    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path), tag="deepspeed", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"no DeepSpeed checkpoint under {path}/deepspeed")


def make_backend(cfg: Config, policy):
    """The backend named by learner.backend, wrapping the policy module."""
    if cfg.learner.backend == "torch":
        return TorchBackend(cfg, policy)
    if cfg.learner.backend == "deepspeed":
        return DeepSpeedBackend(cfg, policy)
    raise ValueError(f"learner.backend {cfg.learner.backend!r}: use 'torch' or 'deepspeed'")
