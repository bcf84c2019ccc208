"""Test helper: DeepSpeed ZeRO-2 and ZeRO-3 learners on two ranks write checkpoints with their Hugging Face export.

    torchrun --nproc-per-node 2 -m tests.export_worker MODEL_DIR OUT_DIR   # from the repository root

For each stage: train 2 steps on fixed groups, checkpoint through the learner loop's `save_checkpoint` (hf/
gathered on rank 0) under OUT_DIR/zero{stage}/test/, and write the weights that `full_state_dict` gathers at that
point to OUT_DIR/zero{stage}/reference.safetensors (rank 0), for test_export.py to compare.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from pipeline.config import dumps_toml
from pipeline.consumer.learner import Learner
from pipeline.consumer.loop import save_checkpoint
from pipeline.consumer.main import exit_process
from pipeline.testing.learner import make_cfg, make_groups


def main(model_dir: Path, out_dir: Path) -> None:
    groups = make_groups(model_dir)
    for stage in (2, 3):
        learner = Learner(make_cfg(model_dir, out_dir / f"zero{stage}", "deepspeed", stage))
        for _ in range(2):
            learner.train_step(groups)
        if learner.rank == 0:
            learner.cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (learner.cfg.run_dir / "config.toml").write_text(dumps_toml(learner.cfg))
        reference = learner.state_dict_for_publish()  # collective under ZeRO-3
        if reference is not None:
            path = out_dir / f"zero{stage}" / "reference.safetensors"
            save_file({k: v.clone() for k, v in reference.items()}, str(path))
        save_checkpoint(learner, {})
        del learner


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    if dist.is_initialized():  # a rank that exits with gloo work in flight aborts (SIGABRT) at teardown
        dist.barrier()
    # leave the group and skip the C++ static destructors, as the learner's ranks do: one of them ended a finished
    # rank with "terminate called without an active exception" (SIGABRT) in CI, after all its files were written
    exit_process(0)
