"""Test helpers for the learner: a tiny random Llama, a fixed batch of groups, and a torchrun worker.

    torchrun --nproc-per-node 2 tests/learner_worker.py MODEL_DIR GROUPS_FILE OUT_DIR STEPS ddp zero2 zero3 ...

runs `STEPS` train_steps on the fixed groups with each named setup in turn (same process group) and writes,
per setup, `OUT_DIR/<setup>/v{STEPS:06d}.safetensors` and `OUT_DIR/<setup>/metrics.json` (rank 0).
A setup named `<setup>_resume` instead checks that resuming from a checkpoint repeats the next loss.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file by path

from pipeline import protocol  # noqa: E402
from pipeline.config import load_config  # noqa: E402

VOCAB = 64


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random LlamaForCausalLM: hidden 64, 2 layers, head_dim 32, vocab 64 (no tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_groups(model_dir: Path | None, num_groups: int = 4, n: int = 4, seed: int = 0, noise: float = 0.3,
                temperature: float = 1.0) -> list[protocol.Group]:
    """Groups with random prompts/completions; behaviour log-probs = the model's own plus Gaussian noise
    (so some ratios clip and some do not); advantages +0.5 for even samples, -0.5 for odd ones."""
    import torch

    rng = np.random.default_rng(seed)
    model = None
    if model_dir is not None:
        from pipeline.consumer.model import load_model

        model = load_model(model_dir)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 9))).astype(np.int32)
        samples, adv = [], []
        for i in range(n):
            comp = rng.integers(0, VOCAB, int(rng.integers(1, 15))).astype(np.int32)
            if model is not None:
                from pipeline.consumer.model import token_logprobs

                ids = torch.from_numpy(np.concatenate([prompt, comp]).astype(np.int64))[None]
                with torch.no_grad():
                    lp, _ = token_logprobs(model, ids, None, temperature, with_entropy=False)
                lp = lp[0, prompt.size - 1: prompt.size - 1 + comp.size].numpy()
            else:
                lp = -np.log(VOCAB) * np.ones(comp.size)
            lp = (lp + noise * rng.standard_normal(comp.size)).astype(np.float32)
            lp = np.minimum(lp, -1e-3).astype(np.float32)
            samples.append(protocol.Sample(comp, lp, float(i % 2 == 0), 0, "stop"))
            adv.append(0.5 if i % 2 == 0 else -0.5)
        groups.append(protocol.Group(g, prompt, samples, adv, n, 1, True))
    return groups


def save_groups(groups: list[protocol.Group], path: Path) -> None:
    """The groups as one protocol Batch, frames length-prefixed (the wire encoding, no pickle)."""
    frames = protocol.Encoder().encode(protocol.Batch(0, groups, {}))
    with open(path, "wb") as f:
        for fr in frames:
            b = bytes(fr)
            f.write(struct.pack("<Q", len(b)))
            f.write(b)


def load_groups(path: Path) -> list[protocol.Group]:
    data = Path(path).read_bytes()
    frames, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        frames.append(data[i + 8: i + 8 + n])
        i += 8 + n
    return protocol.Decoder(protocol.Batch).decode(frames).groups


def make_cfg(model_dir: Path, run_dir: Path, backend: str = "torch", zero_stage: int = 2, *extra: str):
    """A learner config for the tests: 4 groups per batch in 2 mini-batches, small micro-batches, lr 1e-3."""
    return load_config(None, [
        "--model.path", str(model_dir), "--learner.backend", backend, "--learner.zero_stage", str(zero_stage),
        "--learner.lr", "1e-3", "--learner.batch_prompts", "4", "--learner.mini_batches", "2",
        "--learner.micro_batch_tokens", "64", "--learner.grad_clip", "1.0", "--learner.warmup_steps", "2",
        "--weights.dir", str(run_dir / "weights"), "--run.dir", str(run_dir), "--run.name", "test", *extra,
    ])


SETUPS = {"torch": ("torch", 2), "ddp": ("torch", 2), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}


def run_setups(model_dir: Path, groups_file: Path, out_dir: Path, steps: int, setups: list[str]) -> None:
    from pipeline.consumer.learner import Learner

    groups = load_groups(groups_file)
    for name in setups:
        if name.endswith("_resume"):
            resume_check(model_dir, groups, out_dir, name)
            continue
        backend, stage = SETUPS[name]
        cfg = make_cfg(model_dir, out_dir / name, backend, stage, "--weights.dir", str(out_dir / name))
        learner = Learner(cfg)
        losses = [learner.train_step(groups)["loss"] for _ in range(steps)]
        learner.publish()
        if learner.rank == 0:
            (out_dir / name / "metrics.json").write_text(json.dumps({"losses": losses,
                                                                     "world_size": learner.world_size}))
        del learner


def resume_check(model_dir: Path, groups, out_dir: Path, name: str) -> None:
    """Train 2 steps with a checkpoint after the first; a fresh learner resumed from it must repeat step 2."""
    from pipeline.consumer.learner import Learner

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


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir, groups_file, out_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    run_setups(model_dir, groups_file, out_dir, steps, sys.argv[5:])
