"""The learner tests' torchrun worker (the tiny model, groups and config it uses are in pipeline/testing/learner.py).

    torchrun --nproc-per-node 2 -m tests.learner_worker MODEL_DIR GROUPS_FILE OUT_DIR STEPS ddp zero2 zero3 ...

(from the repository root, so that this checkout's `pipeline` and `tests` are the ones imported)

runs `STEPS` train_steps on the fixed groups with each named setup in turn (same process group) and writes,
per setup, `OUT_DIR/<setup>/v{STEPS:06d}.safetensors` and `OUT_DIR/<setup>/metrics.json` (rank 0).
A setup named `<setup>_resume` instead checks that resuming from a checkpoint repeats the next loss, and
`<setup>_nan` that a batch holding a NaN is skipped on every rank with nothing applied; `ranks` sends each
kind of rank message from rank 0 and records what rank 1 received.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import protocol as P
from pipeline.consumer import ranks
from pipeline.consumer.backends import LearnerBackend
from pipeline.consumer.backends.common import setup_dist
from pipeline.consumer.learner import Learner
from pipeline.testing.learner import load_groups, make_cfg, poison

SETUPS = {"torch": ("torch", 2), "ddp": ("torch", 2), "zero0": ("deepspeed", 0), "zero2": ("deepspeed", 2),
          "zero3": ("deepspeed", 3)}


def run_setups(model_dir: Path, groups_file: Path, out_dir: Path, steps: int, setups: list[str]) -> None:
    groups = load_groups(groups_file)
    for name in setups:
        if name.endswith("_resume"):
            resume_check(model_dir, groups, out_dir, name)
            continue
        if name.endswith("_nan"):
            nan_check(model_dir, groups, out_dir, name)
            continue
        if name == "ranks":
            ranks_check(groups, out_dir)
            continue
        backend, stage = SETUPS[name]
        cfg = make_cfg(model_dir, out_dir / name, backend, stage, "--weights.dir", str(out_dir / name))
        learner = Learner(cfg)
        assert isinstance(learner.backend, LearnerBackend), type(learner.backend)
        losses = [learner.train_step(groups)["loss"] for _ in range(steps)]
        learner.publish()
        if learner.rank == 0:
            (out_dir / name / "metrics.json").write_text(json.dumps({"losses": losses,
                                                                     "world_size": learner.world_size}))
        del learner


def resume_check(model_dir: Path, groups, out_dir: Path, name: str) -> None:
    """Train 2 steps with a checkpoint after the first; a fresh learner resumed from it must repeat step 2."""
    backend, stage = SETUPS[name.removesuffix("_resume")]
    cfg = make_cfg(model_dir, out_dir / name, backend, stage)
    a = Learner(cfg)
    a.train_step(groups)
    a.save_checkpoint(extra=b"blob")
    expected = a.train_step(groups)["loss"]
    del a
    b = Learner(cfg)
    extra = b.load_checkpoint()
    got = b.train_step(groups)["loss"]
    if b.rank == 0:
        (out_dir / name / "metrics.json").write_text(json.dumps({
            "expected": expected, "got": got, "extra": extra.decode(), "version": b.version}))


def nan_check(model_dir: Path, groups, out_dir: Path, name: str) -> None:
    """A NaN behaviour log-prob in one sample of each mini-batch (so on one rank only): every optimizer step of
    the batch is skipped on every rank and the weights stay as they were; the next clean batch then trains
    exactly like a fresh learner's first (no gradient, optimizer or lr-schedule state leaked)."""
    backend, stage = SETUPS[name.removesuffix("_nan")]
    a = Learner(make_cfg(model_dir, out_dir / name / "a", backend, stage))
    before = a.state_dict_for_publish()  # on CPU in float32 these alias the live weights: copy them
    before = {k: v.clone() for k, v in before.items()} if before is not None else None
    skipped = a.train_step(poison(groups, [(1, 0), (3, 2)]))
    after = a.state_dict_for_publish()
    unchanged = after is None or all(torch.equal(before[k], after[k]) for k in before)
    got = a.train_step(groups)
    del a
    b = Learner(make_cfg(model_dir, out_dir / name / "b", backend, stage))
    expected = b.train_step(groups)
    if b.rank == 0:
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        (out_dir / name / "metrics.json").write_text(json.dumps({
            "skipped_steps": skipped["skipped_steps"], "optimizer_steps": skipped["optimizer_steps"],
            "loss": skipped["loss"], "unchanged": unchanged,
            "got": [got["loss"], got["grad_norm"], got["lr"]],
            "expected": [expected["loss"], expected["grad_norm"], expected["lr"]]}))


def ranks_check(groups, out_dir: Path) -> None:
    rank, world, _ = setup_dist("gloo")
    batch = P.Batch(3, groups, {"buffer/samples_received": 5.0})
    sent = [ranks.BatchFrames.of(batch), ranks.RankError("no batch arrived: check the buffer"), ranks.Stop("done")]
    got = [ranks.broadcast(msg if rank == 0 else None, rank, world, torch.device("cpu")) for msg in sent]
    if rank == 1:
        (out_dir / "ranks.json").write_text(json.dumps({
            "kinds": [type(m).__name__ for m in got],
            "same_batch": [bytes(f) for f in P.Encoder().encode(got[0].batch())] == got[0].frames
            == sent[0].frames,
            "error": got[1].text, "stop": got[2].reason}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir, groups_file, out_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    run_setups(model_dir, groups_file, out_dir, steps, sys.argv[5:])
    if dist.is_initialized():  # a rank that exits with gloo work in flight aborts (SIGABRT) at teardown
        dist.barrier()
        dist.destroy_process_group()
    # skip the C++ static destructors: one of them ended a finished rank with "terminate called without an
    # active exception" (SIGABRT) once in CI, after all its results were written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
