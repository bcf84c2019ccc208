"""Producer generation throughput vs vLLM's own offline `LLM.generate`, and the in-place weight-load time.

    .venv/bin/python -m bench.throughput.producer [--model DIR] [--prompts 48] [--round-size 8] [--max-new-tokens 64]
        [--reps 7]

Throughput: the same model, prompts and sampling settings (T = 1, top_p = 1, sampled-token log-probs,
seed per round) go through
  - the producer's engine wrapper (`pipeline.producer.engine.Engine` on vLLM's AsyncLLM), driven by rounds the
    way the worker drives it: as many rounds in flight as `free_samples()` has room for, a new one as soon as
    room frees up, one `generate_round` per prompt; and
  - `vllm.LLM.generate` on all prompts at once (n = round size, the same per-round seeds, so both paths sample
    exactly the same tokens),
interleaved rep by rep (order alternating) after one warm-up each; the report gives median generated tokens/s
and the median of the per-rep ratios (target >= 0.9). Weight load: `Engine.load_weights` of the model's own
safetensors file, in place (file read + copy into the parameters + prefix-cache reset), median of --loads.
Writes bench/results/producer.md (and its numbers to producer.json). Without --model it builds a random tiny
Llama (the tiny model's shape).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench import guard, output
from pipeline.offline import shutdown_llm
from pipeline.testing.models import save_sharpened_tiny


def describe(model_dir: str, name: str) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return (f"{name} (hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, vocab "
            f"{cfg.get('vocab_size')}, {size / 2**20:.1f} MiB of weights)")


async def run_rounds(engine, assignments) -> tuple[int, float]:
    """Generated tokens and wall seconds for `assignments`, kept in flight while the engine has room for a round
    (`free_samples`, as the worker asks the buffer for work)."""
    pending, running, num_tokens = list(assignments), set(), 0
    start = time.perf_counter()
    while pending or running:
        while pending and (engine.free_samples() >= pending[0].num_samples or not running):
            running.add(asyncio.create_task(engine.generate_round(pending.pop(0))))
            await asyncio.sleep(0)  # the round registers with the engine on its first step
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        num_tokens += sum(len(c.token_ids) for t in done for c in t.result().completions)
    return num_tokens, time.perf_counter() - start


async def run_async_raw(engine, prompts, params) -> tuple[int, float]:
    """Diagnostic: every prompt at once straight into AsyncLLM.generate (n = round size), no wrapper."""
    async def one(i):
        async for out in engine.llm.generate({"prompt": prompts[i]}, params[i], f"raw{time.monotonic_ns()}-{i}"):
            last = out
        return sum(len(c.token_ids) for c in last.outputs)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return sum(counts), time.perf_counter() - start


def run_offline(llm, prompts, params) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - start


async def _measure(args, engine, llm, prompts: list[str]) -> list[dict]:
    """Interleaved reps of the three paths after a warm-up each; per rep {path: (tokens, seconds)}."""
    from vllm import SamplingParams

    from pipeline.producer.engine import round_seed
    from pipeline.protocol import RoundAssignment

    def assignments(base: int):
        return [RoundAssignment(base + i, i, p, "0", args.round_size, 600.0) for i, p in enumerate(prompts)]

    def offline_params(base: int, final_only: bool = False):
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
        return [SamplingParams(n=args.round_size, temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens,
                               seed=round_seed(0, base + i), logprobs=0, flat_logprobs=True, output_kind=kind)
                for i in range(len(prompts))]

    await run_rounds(engine, assignments(10_000_000)[:8])  # warm-up
    run_offline(llm, prompts[:8], offline_params(10_000_000)[:8])
    rows = []
    for rep in range(args.reps):
        base = rep * 100_000  # the same round ids (so seeds) for both paths within a rep
        order = ("producer", "offline", "async_raw") if rep % 2 == 0 else ("async_raw", "offline", "producer")
        res = {}
        for which in order:
            if which == "producer":
                res[which] = await run_rounds(engine, assignments(base))
            elif which == "offline":
                res[which] = run_offline(llm, prompts, offline_params(base))
            else:
                res[which] = await run_async_raw(engine, prompts, offline_params(base, final_only=True))
        rows.append(res)
        print(f"rep {rep}: " + ", ".join(f"{k} {n / t:.0f} tok/s ({n} tokens)" for k, (n, t) in res.items()),
              flush=True)
    return rows


async def bench(args) -> dict:
    from vllm import LLM

    from pipeline.config import EngineConfig, SamplingConfig
    from pipeline.data import make_arithmetic
    from pipeline.producer.engine import Engine, engine_kwargs

    engine_cfg = EngineConfig(max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    sampling = SamplingConfig(round_size=args.round_size, max_new_tokens=args.max_new_tokens, temperature=1.0)
    problems = make_arithmetic(args.prompts, seed=1)
    prompts = [f"{ex.problem}=" for ex in problems]

    t0 = time.perf_counter()
    engine = await Engine.start(args.model, "float32", engine_cfg, sampling, seed=0)
    llm = None
    try:  # the engines' processes stop however the bench ends (bench.guard kills whatever is left)
        start_s = time.perf_counter() - t0
        llm = LLM(**engine_kwargs(args.model, "float32", engine_cfg, 0))
        rows = await _measure(args, engine, llm, prompts)
        shutdown_llm(llm)
        llm = None
        # the loader refuses weights in a folder others can write (0700 only): load a copy from a private one
        with tempfile.TemporaryDirectory(prefix="bench-weights-") as private:
            weights = Path(shutil.copy2(Path(args.model) / "model.safetensors", private))
            loads = [await engine.load_weights(weights, v + 1) for v in range(args.loads)]
            weights_mib = weights.stat().st_size / 2**20
    finally:
        if llm is not None:
            shutdown_llm(llm)
        await engine.shutdown()
    return dict(rows=rows, loads=loads, start_s=start_s, weights_mib=weights_mib)


def numbers(out: dict) -> dict:
    """The report's headline numbers (median tokens/s of each path, the median paired ratio, weight loads)."""
    rate = {k: [r[k][0] / r[k][1] for r in out["rows"]] for k in ("producer", "offline", "async_raw")}
    loads_ms = [1000 * t for t in out["loads"]]
    return {"producer_tokens_per_s": statistics.median(rate["producer"]),
            "offline_tokens_per_s": statistics.median(rate["offline"]),
            "async_raw_tokens_per_s": statistics.median(rate["async_raw"]),
            "ratio": statistics.median(p / o for p, o in zip(rate["producer"], rate["offline"])),
            "ratio_spread": {"min": min(p / o for p, o in zip(rate["producer"], rate["offline"])),
                             "max": max(p / o for p, o in zip(rate["producer"], rate["offline"]))},
            "load": {"mib": out["weights_mib"], "ms": statistics.median(loads_ms), "loads": len(loads_ms),
                     "min_ms": min(loads_ms), "max_ms": max(loads_ms)}}


def report(args, out: dict) -> tuple[str, float]:
    rate = {k: [r[k][0] / r[k][1] for r in out["rows"]] for k in ("producer", "offline", "async_raw")}
    prod, off, raw = rate["producer"], rate["offline"], rate["async_raw"]
    # paired ratios (the two runs of a rep are seconds apart) cancel most of a shared machine's drift
    ratio = statistics.median(p / o for p, o in zip(prod, off))
    same = all(r["producer"][0] == r["offline"][0] == r["async_raw"][0] for r in out["rows"])
    import torch
    import vllm

    lines = [
        "# Producer benchmark", "",
        f"{platform.machine()} CPU ({os.cpu_count()} cores, shared), vLLM {vllm.__version__}, "
        f"torch {torch.__version__}; "
        f"model {args.model_desc}; {args.prompts} prompts x round size {args.round_size}, max_new_tokens "
        f"{args.max_new_tokens}, T = 1, sampled-token log-probs, max_num_seqs {args.max_num_seqs}, enforce_eager "
        f"{args.enforce_eager}; {args.reps} interleaved reps (order alternating) after a warm-up; the ratio is "
        f"the median of the per-rep ratios. All paths sample the same tokens (same per-round seeds): "
        f"{'yes' if same else 'NO'}. `AsyncLLM raw` (diagnostic) submits every prompt at once to AsyncLLM.generate "
        "(n = round size), without the wrapper or its capacity limit.", "",
        "| rep | producer tok/s | offline LLM.generate tok/s | AsyncLLM raw tok/s | producer / offline |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {i} | {p:.0f} | {o:.0f} | {r:.0f} | {p / o:.2f} |"
              for i, (p, o, r) in enumerate(zip(prod, off, raw))]
    ratios = [p / o for p, o in zip(prod, off)]
    lines += [f"| **median** | **{statistics.median(prod):.0f}** | **{statistics.median(off):.0f}** | "
              f"**{statistics.median(raw):.0f}** | **{ratio:.2f}** |", "",
              f"Per-rep ratios range {min(ratios):.2f}-{max(ratios):.2f}: on a shared machine other jobs' load "
              "changes from one run to the next, so only the median of many paired reps means much.", "",
              f"In-place weight load (`Engine.load_weights`, {out['weights_mib']:.1f} MiB safetensors, file read + "
              f"copy + prefix-cache reset): median {1000 * statistics.median(out['loads']):.1f} ms over "
              f"{len(out['loads'])} loads (min {1000 * min(out['loads']):.1f}, max {1000 * max(out['loads']):.1f}).",
              "", f"Engine start: {out['start_s']:.1f} s.", ""]
    return "\n".join(lines), ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="model directory (default: a random tiny Llama)")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--round-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--loads", type=int, default=10)
    p.add_argument("--out", default=str(output.RESULTS / "producer.md"))
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        built = not args.model
        if built:
            args.model = str(save_sharpened_tiny(Path(tmp) / "model"))
        args.model_desc = describe(args.model, "random tiny Llama" if built else args.model)
        out = asyncio.run(bench(args))
    text, ratio = report(args, out)
    output.write(args.out, text, numbers(out))  # the JSON is read by bench.throughput
    print(text)
    print(f"ratio producer / offline: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    guard.main(main)
