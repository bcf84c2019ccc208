"""Learner scaffolding for tests and benchmarks: the tests' tiny random Llama, fixed batches of groups (built,
saved in the wire encoding, poisoned) and a small learner config."""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import numpy as np

from pipeline import protocol as P
from pipeline.testing.models import save_random_llama

VOCAB = 64


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random LlamaForCausalLM: hidden 64, 2 layers, head_dim 32, vocab 64 (no tokenizer)."""
    return save_random_llama(path, vocab=VOCAB, hidden=64, layers=2, heads=2, kv_heads=2, head_dim=32,
                             intermediate=128, max_positions=256, seed=seed)


def make_groups(model_dir: Path | None, num_groups: int = 4, n: int = 4, seed: int = 0, noise: float = 0.3,
                temperature: float = 1.0, vocab: int = VOCAB, prompt_len: tuple[int, int] = (2, 9),
                completion_len: tuple[int, int] = (1, 15)) -> list[P.Group]:
    """Groups with random prompts/completions (lengths drawn from [lo, hi) of `prompt_len` / `completion_len`);
    behaviour log-probs = the model's own (without a model: uniform over `vocab`) plus Gaussian noise (so some
    ratios clip and some do not); advantages +0.5 for even samples, -0.5 for odd ones."""
    import torch

    from pipeline.consumer.model import load_model, token_logprobs

    rng = np.random.default_rng(seed)
    model = load_model(model_dir) if model_dir is not None else None
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(0, vocab, int(rng.integers(*prompt_len))).astype(np.int32)
        samples, adv = [], []
        for i in range(n):
            comp = rng.integers(0, vocab, int(rng.integers(*completion_len))).astype(np.int32)
            if model is not None:
                ids = torch.from_numpy(np.concatenate([prompt, comp]).astype(np.int64))[None]
                with torch.no_grad():
                    lp, _ = token_logprobs(model, ids, None, temperature, with_entropy=False)
                lp = lp[0, prompt.size - 1: prompt.size - 1 + comp.size].numpy()
            else:
                lp = -np.log(vocab) * np.ones(comp.size)
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
    from pipeline.config import load_config

    return load_config(None, [
        "--model.path", str(model_dir), "--learner.backend", backend, "--learner.zero_stage", str(zero_stage),
        "--learner.lr", "1e-3", "--learner.batch_prompts", "4", "--learner.mini_batches", "2",
        "--learner.micro_batch_tokens", "64", "--learner.grad_clip", "1.0", "--learner.warmup_steps", "2",
        "--weights.dir", str(run_dir / "weights"), "--run.dir", str(run_dir), "--run.name", "test", *extra,
    ])


def main_args(model_dir: Path, run_dir: Path, port: int, *extra: str) -> list[str]:
    """Arguments of `pipeline.consumer.main` for the tests: a learner of `model_dir` connected to a buffer (double)
    at 127.0.0.1:port, 4 groups per batch in 2 mini-batches, lr 1e-3, weights under `run_dir`/w."""
    return ["--connect", f"127.0.0.1:{port}", "--model", str(model_dir), "--learner.batch_prompts", "4",
            "--learner.mini_batches", "2", "--learner.lr", "1e-3", "--learner.micro_batch_tokens", "128",
            "--weights.dir", str(run_dir / "w"), "--run.dir", str(run_dir), "--run.name", "r", *extra]
