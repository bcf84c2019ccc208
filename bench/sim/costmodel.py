"""The cost model behind `bench.table2`: every constant of the paper's setup, with its source, and the formulas.

Setup modelled (Reinforce-Ada, arXiv 2510.04996, Table 2): Qwen2.5-Math-1.5B on 8 H100 SXM GPUs, 512 prompts per
step, n = 4, up to M x N = 8 x 4 samples, T = 1.0, at most 2048 new tokens, verl with vLLM and FSDP colocated.
Each constant below is a field of `Constants` whose comment says where the number comes from; `SOURCES` repeats
that for the results file. Nothing here is fitted to Table 2: the population (`bench.sim.population`) is fitted to the
paper's Fig. 3 and Fig. 5, every time constant is derived from public hardware and model facts or measured here.

Formulas (legend: b = sequences decoding on one GPU, C = their total context tokens, N = parameters):
- one decode step of a vLLM engine takes t0 + t1 * b + tkv * C seconds (fixed cost: weights read once plus the
  engine's per-step overhead; per sequence: its share of the GEMMs, sampling and bookkeeping; per context token:
  reading its KV cache), and a prompt's prefill takes prefill_s_per_token per prompt token (prefix caching: the
  samples of one round share one prefill);
- a response's length depends on its correctness and its prompt's difficulty (`response_lengths`);
- a learner pass costs flops_per_token_fwd (= 2N) per token for a forward (the old-log-prob recompute) and 4x that
  for an update with gradient checkpointing (forward, recomputed forward, backward = 2x forward), at learner_mfu of
  the GPUs' peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class Constants:
    # ---- hardware and model (public facts)
    peak_flops: float = 989e12  # H100 SXM dense bf16 FLOP/s (NVIDIA datasheet)
    hbm_bytes_s: float = 3.35e12  # H100 SXM HBM3 bandwidth, B/s (NVIDIA datasheet)
    params: float = 1.54e9  # Qwen2.5-Math-1.5B parameters, tied 0.23B embedding included (model card)
    kv_bytes_per_token: float = 28672  # 28 layers x (K, V) x 2 KV heads x 128 dims x 2 bytes (model config.json)
    # ---- vLLM decode, per GPU (one engine per GPU, tensor parallel 1, CUDA graphs)
    t0: float = 4.0e-3  # s per decode step: 3.1 GB of weights at 80% of HBM (1.15 ms) + ~2.9 ms engine overhead
    #   (graph launch, scheduler, sampler; vLLM's per-step CPU cost for a small model): ~250 tok/s single stream
    t1: float = 14e-6  # s per running sequence per step: 2N = 3.1 GFLOP at 40% of peak (7.8 us) + sampling over
    #   151,936 logits and per-request bookkeeping (~6 us); with tkv: ~25k tok/s at b = 256, ~30k at b = 512
    tkv: float = 10.7e-9  # s per context token per step: 28,672 B of KV read at 80% of HBM bandwidth
    prefill_s_per_token: float = 6.2e-6  # 2N FLOPs per prompt token at 50% of peak (compute-bound)
    prompt_tokens: float = 250  # system + problem + instruction; the reference drops problems over 700 tokens
    # ---- response lengths (tokens): correct answers shorter than wrong ones, hard prompts longer
    len_correct: float = 400  # median of a correct answer at p = 1; Qwen2.5-Math-1.5B solutions run a few hundred
    #   tokens and wrong ones ~1.5-2x longer (Liu et al. 2025, arXiv 2503.20783, length of correct vs incorrect)
    len_wrong: float = 700  # median of a wrong, untruncated answer at p = 1
    len_sigma: float = 0.5  # log-normal spread of both
    len_difficulty: float = 0.4  # medians scale by 1 + len_difficulty * (1 - p): a hard prompt's answers are longer
    trunc_wrong: float = 0.15  # a wrong answer runs to the cap (loops, rambling) with probability trunc_wrong*(1-p)
    max_new_tokens: int = 2048  # the paper's cap
    # ---- verl colocated (the reference), per step and per round
    round_overhead_s: float = 3.0  # per generate call: wake vLLM, reshard 3.1 GB FSDP -> vLLM, sleep (free KV),
    #   Ray dispatch of prompts and collection of outputs padded to 3072 tokens (~1 s each)
    reward_s_per_sample: float = 5e-3  # NaiveRewardManager scores in the driver, one sample at a time: math-verify
    #   3.3 ms (measured on this machine, one core) + detokenising ~1k tokens + per-sample DataProto slicing
    step_overhead_s: float = 3.0  # per update: batch balancing, advantages, Ray transfer of the batch, 4 AdamW steps
    learner_mfu: float = 0.25  # FSDP forward/backward of a 1.5B model, remove-padding micro-batches of ~6k tokens
    # ---- this project's split setup (streaming)
    publish_s: float = 1.5  # learner rank 0 writes 3.1 GB of safetensors to /dev/shm at 2,092 MiB/s
    #   (bench/results/throughput.md, weight publish)
    load_s: float = 1.0  # a producer reads the file into the GPU (reload_from_file); running sequences are then
    #   preempted and their context is prefilled again (charged at prefill_s_per_token on top)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Constants.{f.name} must be a finite number >= 0, got {value!r}")
        if self.max_new_tokens < 1 or self.len_correct <= 0 or self.len_wrong <= 0 or self.learner_mfu <= 0:
            raise ValueError("Constants: max_new_tokens, len_correct, len_wrong and learner_mfu must be > 0")
        if self.trunc_wrong > 1:
            raise ValueError(f"Constants.trunc_wrong is a probability, got {self.trunc_wrong}")

    @property
    def flops_per_token_fwd(self) -> float:
        return 2.0 * self.params

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` tokens of context in all."""
        return self.t0 + self.t1 * batch + self.tkv * context_tokens


# the constants the sensitivity table varies by +-50% (the hardware facts are inputs of the derived ones)
SENSITIVITY = (
    "t0", "t1", "tkv", "prefill_s_per_token", "prompt_tokens", "len_correct", "len_wrong", "len_sigma",
    "len_difficulty", "trunc_wrong", "round_overhead_s", "reward_s_per_sample", "step_overhead_s", "learner_mfu",
)


def response_lengths(p: np.ndarray, correct: np.ndarray, z: np.ndarray, u: np.ndarray, c: Constants) -> np.ndarray:
    """Response lengths (int tokens, 1..max_new_tokens) of samples of prompts with pass rates `p`.

    `correct` says which samples are right; `z` (standard normal) and `u` (uniform) are each sample's own random
    draws, passed in so that changing a constant moves every length smoothly (common random numbers). A wrong
    answer runs to the cap with probability trunc_wrong * (1 - p); otherwise its length is log-normal around
    len_correct or len_wrong, scaled by 1 + len_difficulty * (1 - p): hard prompts get longer answers.
    """
    median = np.where(correct, c.len_correct, c.len_wrong) * (1.0 + c.len_difficulty * (1.0 - p))
    length = np.clip(np.rint(median * np.exp(c.len_sigma * z)), 1, c.max_new_tokens)
    truncated = ~correct & (u < c.trunc_wrong * (1.0 - p))
    return np.where(truncated, c.max_new_tokens, length).astype(np.int64)


def batch_decode_s(lengths: np.ndarray, c: Constants) -> float:
    """Seconds for one engine to generate `lengths` when all start at once and fit its slots (a reference round).

    Closed form of the step model: step k runs b_k = #{L > k} sequences holding b_k * (prompt + k) context
    tokens, plus one prefill per round of samples; `bench.sim.engine.Engine` gives the same for this case.
    """
    if len(lengths) == 0:
        return 0.0
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))
    alive = len(lengths) - np.cumsum(counts)[:-1]  # b_k for k = 0 .. max(L) - 1
    k = np.arange(len(alive), dtype=np.float64)
    steps = len(alive) * c.t0 + c.t1 * alive.sum() + c.tkv * (alive * (c.prompt_tokens + k)).sum()
    return float(steps)


def learner_s(tokens: float, gpus: int, c: Constants, recompute: bool) -> float:
    """Seconds for one update over `tokens` (prompt + response) on `gpus` GPUs; `recompute` adds the
    old-log-prob forward pass the reference runs first (this project's learner uses the behaviour log-probs)."""
    if gpus < 1:
        raise ValueError(f"the learner needs at least one GPU, got {gpus}")
    passes = 4.0 + (1.0 if recompute else 0.0)  # in forward-pass units: update = 4, recompute = 1
    return tokens * passes * c.flops_per_token_fwd / (gpus * c.peak_flops * c.learner_mfu) + c.step_overhead_s


def derived(c: Constants) -> dict[str, float]:
    """Figures that follow from the constants, for the results file (to check them against public numbers)."""
    ctx = c.prompt_tokens + 750.0  # a typical mid-generation context
    return {
        "single-stream decode tok/s": 1.0 / c.decode_step_s(1, ctx),
        "decode tok/s per GPU at b=256": 256 / c.decode_step_s(256, 256 * ctx),
        "decode tok/s per GPU at b=512": 512 / c.decode_step_s(512, 512 * ctx),
        "2048-token tail alone, s": c.max_new_tokens * c.decode_step_s(1, ctx),
        "learner tok/s per GPU (update + recompute)": c.peak_flops * c.learner_mfu / (5 * c.flops_per_token_fwd),
    }


SOURCES = {
    "peak_flops": "H100 SXM dense bf16, NVIDIA datasheet",
    "hbm_bytes_s": "H100 SXM HBM3, NVIDIA datasheet",
    "params": "Qwen2.5-Math-1.5B model card (tied embedding included)",
    "kv_bytes_per_token": "28 layers x K,V x 2 KV heads x 128 dims x bf16 (config.json)",
    "t0": "weights 3.1 GB at 80% HBM (1.15 ms) + vLLM per-step overhead ~2.9 ms",
    "t1": "2N FLOPs at 40% of peak (7.8 us) + sampling and per-request bookkeeping (~6 us)",
    "tkv": "KV bytes per token at 80% HBM bandwidth",
    "prefill_s_per_token": "2N FLOPs at 50% of peak",
    "prompt_tokens": "OpenR1 problem + system prompt + instruction (reference drops problems > 700 tokens)",
    "len_correct": "few-hundred-token solutions of Qwen2.5-Math-1.5B (Liu et al. 2025, 2503.20783)",
    "len_wrong": "wrong answers ~1.5-2x longer than right ones (same source)",
    "len_sigma": "log-normal spread (assumption)",
    "len_difficulty": "hard prompts get longer answers (assumption)",
    "trunc_wrong": "share of wrong answers that loop to the 2048 cap, times (1 - p) (assumption)",
    "max_new_tokens": "the paper's setup",
    "round_overhead_s": "verl generate call: wake, reshard 3.1 GB, sleep, Ray dispatch/collect (~1 s each)",
    "reward_s_per_sample": "math-verify 3.3 ms measured here + detokenise + DataProto slicing, sequential",
    "step_overhead_s": "batch balancing, advantages, Ray transfer, 4 AdamW steps",
    "learner_mfu": "FSDP 1.5B, remove-padding micro-batches (assumption within the usual 0.2-0.4)",
    "publish_s": "3.1 GB at 2,092 MiB/s (bench/results/throughput.md)",
    "load_s": "reload_from_file of 3.1 GB into the GPU (assumption), plus re-prefill of running contexts",
}
