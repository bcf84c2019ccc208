"""The learner: one `train_step` per batch of groups, several optimizer steps per batch, versioned weights.

Version semantics: the learner holds version v (0 = the initial weights). It trains on a batch whose samples
satisfy version >= v - max_staleness, after which it holds v + 1 and publishes those weights.

Per train_step:
1. split the groups into learner.mini_batches contiguous runs (one optimizer step each);
2. plan each mini-batch: this rank's share of sequences in micro-batches of <= micro_batch_tokens tokens;
3. decoupled PPO only: recompute the proximal log-probs of every micro-batch with the current weights;
4. per mini-batch: forward/backward every micro-batch with loss * world_size (ranks average gradients, the
   loss is a token-mean over the global mini-batch), then clip and step.

A mini-batch whose loss (on any rank) or gradient norm is not finite is skipped on every rank: no weight,
optimizer or lr-schedule update, its gradients dropped; it is counted (`skipped_steps`) and logged with its
groups' prompt ids. The version still advances: the batch was consumed.
Every rank runs the same code on the same groups (rank 0 broadcasts them); metrics are reduced over ranks.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline import protocol as P
from pipeline.consumer import batching, checkpoint
from pipeline.consumer import loss as loss_mod
from pipeline.consumer.backends import make_backend
from pipeline.consumer.model import PolicyModule, load_model
from pipeline.weights import WeightPublisher, make_publisher

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)


class Learner:
    """Policy, optimizer and version counter of the consumer (one per rank)."""

    def __init__(self, cfg: Config, attn_implementation: str = "sdpa") -> None:
        self.cfg = cfg
        lc = cfg.learner
        if lc.tis_cap and not lc.decoupled:
            log.warning("learner.tis_cap has no effect without learner.decoupled: the behaviour weight is 1")
        torch.manual_seed(cfg.run.seed)
        # float32 master weights for the torch backend; DeepSpeed casts to bf16/fp16 itself on GPUs
        model = load_model(cfg.model.path, "float32", attn_implementation, lc.gradient_checkpointing)
        self.policy = PolicyModule(model, cfg.sampling.temperature)
        self.backend = make_backend(cfg, self.policy)
        self.rank, self.world_size, self.device = self.backend.rank, self.backend.world_size, self.backend.device
        self.version = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0  # optimizer steps skipped (non-finite loss or gradients) since this process started
        self.publish_dtype = getattr(torch, cfg.model.dtype)
        # rank 0 hands each version to the producers (weights.transport: a file, or a broadcast)
        self.publisher: WeightPublisher | None = make_publisher(cfg, self.device) if self.rank == 0 else None
        self.loss_cfg = loss_mod.LossConfig.from_learner(lc)

    # ------------------------------------------------------------------ training

    def _proximal(self, plans: list[tuple[list[batching.MicroBatch], int]]) -> None:
        """Decoupled PPO: log-probs of the current weights, before any update of this step (no grad)."""
        with torch.no_grad():
            for micro, _ in plans:
                for i, mb in enumerate(micro):
                    logp, _ = self.backend.forward(mb.to(self.device), with_entropy=False)
                    micro[i].prox_logp_BT = logp.detach()

    def train_step(self, groups: list[P.Group]) -> dict[str, Any]:
        """Train on one batch (all its mini-batches), advance the version, return the step's metrics."""
        if not groups:
            raise ValueError("train_step needs at least one group (an empty Batch means: wait for more)")
        lc = self.cfg.learner
        t0 = time.perf_counter()
        data_stats = batching.batch_stats(groups, self.version)
        oldest_ok = self.version - self.cfg.buffer.max_staleness
        too_old = sum(s.version < oldest_ok for g in groups for s in g.samples)
        if too_old:  # the buffer should never send these; train anyway, the ratio corrects, but say so
            log.warning("%d sample(s) are staler than buffer.max_staleness=%d at version %d", too_old,
                        self.cfg.buffer.max_staleness, self.version)
        data_stats["staleness_violations"] = too_old
        minis = batching.split_minibatches(groups, lc.mini_batches)
        plans = [batching.plan_minibatch(m, self.rank, self.world_size, lc.micro_batch_tokens) for m in minis]
        if lc.decoupled:
            self._proximal(plans)
        self.policy.train()
        totals, skipped_totals, losses, grad_norms, lrs, skipped = None, None, [], [], [], 0
        for k, (micro, num_tokens) in enumerate(plans):
            lr = self.backend.lr
            acc, grad_norm = self._mini_batch(micro, num_tokens)
            if not math.isfinite(grad_norm):  # nothing was applied, on any rank (backends/__init__.py)
                skipped += 1
                skipped_totals = loss_mod.add_stats(skipped_totals, acc)
                self._log_skipped(k, len(plans), acc, grad_norm, minis[k])
                continue
            self.optimizer_steps += 1
            lrs.append(lr)
            grad_norms.append(grad_norm)
            mini = loss_mod.finalize_stats(acc)
            losses.append(mini["pg_loss"] - lc.entropy_coef * mini["entropy"])
            totals = loss_mod.add_stats(totals, acc)
        self.skipped_steps += skipped
        self.version += 1
        seconds = time.perf_counter() - t0
        nan = float("nan")  # every mini-batch skipped: no loss was optimised
        out = {"step": self.version, "version": self.version, "optimizer_steps": self.optimizer_steps,
               "loss": sum(losses) / len(losses) if losses else nan,
               "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else nan,
               "lr": lrs[-1] if lrs else self.backend.lr, "learner_seconds": seconds,
               "skipped_steps": skipped, "skipped_steps_total": self.skipped_steps}
        out.update(loss_mod.finalize_stats(totals if totals is not None else skipped_totals))
        out.update(data_stats)
        num_seq_tokens = sum(g.prompt_token_ids.size * len(g.samples) + sum(s.token_ids.size for s in g.samples)
                             for g in groups)
        out["tokens_per_s"] = num_seq_tokens / max(seconds, 1e-9)
        return out

    def _mini_batch(self, micro: list[batching.MicroBatch], num_tokens: int
                    ) -> tuple[dict[str, torch.Tensor], float]:
        """Forward/backward this rank's micro-batches of one mini-batch and step; returns the stats summed over
        ranks and the global gradient norm (not finite: the step was skipped on every rank)."""
        acc = None
        want_entropy_grad = self.loss_cfg.entropy_coef > 0
        for i, mb in enumerate(micro):
            mb = mb.to(self.device)
            with self.backend.accumulate(last=i == len(micro) - 1):
                logp_BT, ent_BT = self.backend.forward(mb, with_entropy=True, entropy_grad=want_entropy_grad)
                loss, stats = loss_mod.ppo_loss(
                    logp_BT, mb.old_logp_BT, mb.adv_B, mb.mask_BT, self.loss_cfg, entropy_BT=ent_BT,
                    num_tokens=max(num_tokens, 1), prox_logp_BT=mb.prox_logp_BT)
                # A non-finite loss on any one rank must skip the step on all of them. Scaled by NaN, its
                # gradients turn non-finite; the global gradient norm, on which every backend's step() decides,
                # is reduced over ranks, so each rank then sees it. (A finite loss is scaled by world_size.)
                scale = torch.where(torch.isfinite(loss), float(self.world_size), float("nan"))
                self.backend.backward(loss * scale)
            acc = loss_mod.add_stats(acc, stats)
        grad_norm = self.backend.step()
        return self._reduce(acc), grad_norm

    def _log_skipped(self, k: int, num_mini: int, acc: dict[str, torch.Tensor], grad_norm: float,
                     groups: list[P.Group]) -> None:
        if self.rank != 0:
            return
        loss_sum = float(acc["loss_sum"])
        if self.loss_cfg.entropy_coef:
            loss_sum -= self.loss_cfg.entropy_coef * float(acc["entropy_sum"])
        log.warning("skipped optimizer step %d/%d of the batch at version %d: %s (gradient norm %s); nothing "
                    "was applied to the weights. Prompt ids of its %d group(s): %s", k + 1, num_mini,
                    self.version, "the loss is not finite" if not math.isfinite(loss_sum) else "finite loss",
                    grad_norm, len(groups), [g.prompt_id for g in groups])

    def _reduce(self, acc: dict) -> dict:
        """Sum the stats over ranks (max for ratio_max): one collective per mini-batch."""
        if self.world_size == 1:
            return acc
        sums = torch.stack([acc[k].to(self.device) for k in loss_mod.STAT_SUMS])
        dist.all_reduce(sums)
        mx = acc["ratio_max"].to(self.device).reshape(1).clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        out = {k: sums[i] for i, k in enumerate(loss_mod.STAT_SUMS)}
        out["ratio_max"] = mx[0]
        return out

    # ------------------------------------------------------------------ weights and checkpoints

    def state_dict_for_publish(self) -> dict[str, Any] | None:
        """Full HF-named weights in model.dtype on rank 0 (None on other ranks); collective under ZeRO-3.

        On CPU with float32 the tensors alias the live parameters: use them before the next train_step.
        """
        return self.backend.full_state_dict(self.publish_dtype)

    def publish(self) -> P.WeightAnnouncement | None:
        """Publish the current weights as version `self.version` (collective under ZeRO-3); returns the
        announcement on rank 0, None elsewhere."""
        state = self.state_dict_for_publish()
        if state is None:
            return None
        assert self.publisher is not None, "rank 0 holds the publisher"
        return self.publisher.publish(state, self.version)

    @property
    def checkpoint_root(self) -> Path:
        return self.cfg.run_dir / "checkpoints"

    def save_checkpoint(self, extra: bytes = b"", keep: int = 2) -> Path:
        """Checkpoint the current version (collective). `extra` is an opaque blob returned by load."""
        return checkpoint.save_checkpoint(self.checkpoint_root, self.backend, self.version, self.optimizer_steps,
                                          extra, keep)

    def load_checkpoint(self, path: str | Path | None = None) -> bytes | None:
        """Restore `path` (default: the latest checkpoint); returns its extra blob, or None if none exists."""
        if path is None:
            path = checkpoint.latest_checkpoint(self.checkpoint_root)
            if path is None:
                return None
        meta, extra = checkpoint.load_checkpoint(Path(path), self.backend)
        self.version = int(meta["version"])
        self.optimizer_steps = int(meta["optimizer_steps"])
        return extra
