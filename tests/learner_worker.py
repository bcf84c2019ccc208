"""Test helpers for the learner: a tiny random Llama, a fixed batch of groups, and a torchrun worker.

    torchrun --nproc-per-node 2 tests/learner_worker.py MODEL_DIR GROUPS_FILE OUT_DIR STEPS ddp zero2 zero3 ...

runs `STEPS` train_steps on the fixed groups with each named setup in turn (same process group) and writes,
per setup, `OUT_DIR/<setup>/v{STEPS:06d}.safetensors` and `OUT_DIR/<setup>/metrics.json` (rank 0).
A setup named `<setup>_resume` instead checks that resuming from a checkpoint repeats the next loss, and
`<setup>_nan` that a batch holding a NaN is skipped on every rank with nothing applied; `ranks` sends each
kind of rank message from rank 0 and records what rank 1 received.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file by path

from pipeline import protocol as P  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.consumer import ranks  # noqa: E402
from pipeline.consumer.backends import LearnerBackend  # noqa: E402
from pipeline.consumer.backends.common import setup_dist  # noqa: E402
from pipeline.consumer.learner import Learner  # noqa: E402
from pipeline.consumer.model import load_model, token_logprobs  # noqa: E402

VOCAB = 64


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random LlamaForCausalLM: hidden 64, 2 layers, head_dim 32, vocab 64 (no tokenizer)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_groups(model_dir: Path | None, num_groups: int = 4, n: int = 4, seed: int = 0, noise: float = 0.3,
                temperature: float = 1.0) -> list[P.Group]:
    """Groups with random prompts/completions; behaviour log-probs = the model's own plus Gaussian noise
    (so some ratios clip and some do not); advantages +0.5 for even samples, -0.5 for odd ones."""
    rng = np.random.default_rng(seed)
    model = load_model(model_dir) if model_dir is not None else None
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 9))).astype(np.int32)
        samples, adv = [], []
        for i in range(n):
            comp = rng.integers(0, VOCAB, int(rng.integers(1, 15))).astype(np.int32)
            if model is not None:
                ids = torch.from_numpy(np.concatenate([prompt, comp]).astype(np.int64))[None]
                with torch.no_grad():
                    lp, _ = token_logprobs(model, ids, None, temperature, with_entropy=False)
                lp = lp[0, prompt.size - 1: prompt.size - 1 + comp.size].numpy()
            else:
                lp = -np.log(VOCAB) * np.ones(comp.size)
            lp = (lp + noise * rng.standard_normal(comp.size)).astype(np.float32)
            lp = np.minimum(lp, -1e-3).astype(np.float32)
            samples.append(P.Sample(comp, lp, float(i % 2 == 0), 0, "stop"))
            adv.append(0.5 if i % 2 == 0 else -0.5)
        groups.append(P.Group(g, prompt, samples, adv, n, 1, True))
    return groups


def save_groups(groups: list[P.Group], path: Path) -> None:
    """The groups as one protocol Batch, frames length-prefixed (the wire encoding, no pickle)."""
    frames = P.Encoder().encode(P.Batch(0, groups, {}))
    with open(path, "wb") as f:
        for fr in frames:
            b = bytes(fr)
            f.write(struct.pack("<Q", len(b)))
            f.write(b)


def load_groups(path: Path) -> list[P.Group]:
    data = Path(path).read_bytes()
    frames, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        frames.append(data[i + 8: i + 8 + n])
        i += 8 + n
    return P.Decoder(P.Batch).decode(frames).groups


def poison(groups: list[P.Group], where: list[tuple[int, int]]) -> list[P.Group]:
    """A copy of `groups` with the first behaviour log-prob of sample s of group g set to NaN, for (g, s) in
    `where` (written after construction: the buffer refuses such samples at its edge, but the learner must
    survive one all the same)."""
    out = copy.deepcopy(groups)
    for g, s in where:
        out[g].samples[s].logprobs[0] = np.nan
    return out


def make_cfg(model_dir: Path, run_dir: Path, backend: str = "torch", zero_stage: int = 2, *extra: str):
    """A learner config for the tests: 4 groups per batch in 2 mini-batches, small micro-batches, lr 1e-3."""
    return load_config(None, [
        "--model.path", str(model_dir), "--learner.backend", backend, "--learner.zero_stage", str(zero_stage),
        "--learner.lr", "1e-3", "--learner.batch_prompts", "4", "--learner.mini_batches", "2",
        "--learner.micro_batch_tokens", "64", "--learner.grad_clip", "1.0", "--learner.warmup_steps", "2",
        "--weights.dir", str(run_dir / "weights"), "--run.dir", str(run_dir), "--run.name", "test", *extra,
    ])


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
