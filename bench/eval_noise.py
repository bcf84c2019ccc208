"""How much one held-out evaluation moves with the luck of its samples: the same weights scored many times.

A run's curve is a few evaluations of Ave@k on a few dozen problems; a difference between two of its points is only
a gain if it is larger than what the sampling seeds alone move one point by. This scores the base model of a config
`--draws` times on its held-out problems along both paths that evaluate in this project:

- `offline`: `pipeline.offline.sample_and_score` (vLLM's `LLM`, n = k, one seed per draw), which `reinforce-ada
  eval`, `select-prompts` and the benches' common evaluator use;
- `engine`: the producer's own engine (`pipeline.producer.engine.Engine`, one request per sample, a seed per
  sample) fed the buffer's evaluation rounds, which is what a run's eval.jsonl holds; each draw is another run seed.

It reports each path's draws, their mean, spread and range, beside the binomial standard error of one draw, and
whether the two paths agree (their means within the spread). Written to bench/results/eval_noise.{json,md}.

    python -m bench.eval_noise [--config configs/smollm2-135m.toml] [--draws 5] [--problems N] [--k K] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from pathlib import Path

from bench import guard, output

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/smollm2-135m.toml"


def offline_draws(cfg, model_dir: str, prompts: list, draws: int) -> list[dict]:
    from pipeline.offline import make_llm, shutdown_llm

    llm = make_llm(cfg, model_dir)
    try:
        return _sample_draws(llm, cfg, prompts, draws)
    finally:  # the engine core process goes before the producer's engine starts
        shutdown_llm(llm)


def _sample_draws(llm, cfg, prompts: list, draws: int) -> list[dict]:
    from pipeline.offline import sample_and_score

    max_new = cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    out = []
    for seed in range(draws):
        t0 = time.monotonic()
        rewards = sample_and_score(llm, [p.text for p in prompts], [p.answer for p in prompts], cfg.eval.k,
                                   cfg.sampling.temperature, cfg.sampling.top_p, max_new, seed,
                                   cfg.producers.reward_workers, cfg.producers.reward_timeout_s,
                                   reward_fn=cfg.reward.fn, extras=[p.extras for p in prompts])
        out.append(_draw(seed, rewards, cfg.sampling.positive_threshold, time.monotonic() - t0))
    return out


async def _engine_draws(cfg, model_dir: str, prompts: list, draws: int) -> list[dict]:
    from pipeline import protocol as P
    from pipeline.producer.engine import Engine
    from pipeline.rewards import RewardPool

    engine = await Engine.start(model_dir, cfg.model.dtype, cfg.producers.engine, cfg.sampling, 0)
    out = []
    try:
        with RewardPool.from_config(cfg) as pool:
            for seed in range(draws):
                engine.seed = seed  # another run seed: the buffer's seed keys stay the problems' indices
                t0 = time.monotonic()
                rounds = [P.RoundAssignment(j, j, p.text, p.answer, cfg.eval.k, 3600.0, "eval", cfg.eval.max_new_tokens,
                                            extras=p.extras, seed_key=j) for j, p in enumerate(prompts)]
                outs = await asyncio.gather(*(engine.generate_round(a) for a in rounds))
                rewards = [pool.score([c.text for c in o.completions], [p.answer] * len(o.completions),
                                      [p.extras] * len(o.completions)) for o, p in zip(outs, prompts)]
                out.append(_draw(seed, rewards, cfg.sampling.positive_threshold, time.monotonic() - t0))
    finally:
        await engine.shutdown()
    return out


def _draw(seed: int, rewards: list[list[float]], threshold: float, seconds: float) -> dict:
    from pipeline.buffer.policy.advantages import is_positive  # what the in-run evaluation counts as correct

    per_problem = [sum(is_positive(r, threshold) for r in rs) / len(rs) for rs in rewards]
    return {"seed": seed, "accuracy": statistics.fmean(per_problem), "seconds": seconds}


def summary(draws: list[dict], samples: int) -> dict:
    acc = [d["accuracy"] for d in draws]
    mean = statistics.fmean(acc)
    return {"draws": len(acc), "mean": mean, "std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "min": min(acc), "max": max(acc),
            "binomial_se": math.sqrt(mean * (1 - mean) / samples)}  # of one draw, were its samples independent


def report(doc: dict) -> str:
    lines = [f"# One evaluation's spread: {doc['model']}, Ave@{doc['k']} on {doc['problems']} held-out problems",
             "", f"`{doc['command']}`", "",
             "The same weights (the base model) scored again and again, each draw with other sampling seeds.", "",
             "| path | draws | mean | std of a draw | range | binomial SE of a draw | s per draw |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for path in ("offline", "engine"):
        s = doc["summary"][path]
        secs = statistics.fmean(d["seconds"] for d in doc["draws"][path])
        lines.append(f"| {path} | {s['draws']} | {s['mean']:.3f} | {s['std']:.3f} | {s['min']:.3f}-{s['max']:.3f} "
                     f"| {s['binomial_se']:.3f} | {secs:.0f} |")
    a, b = doc["summary"]["offline"], doc["summary"]["engine"]
    spread = max(a["std"], b["std"], a["binomial_se"])
    lines += ["", f"The paths' means differ by {abs(a['mean'] - b['mean']):.3f} "
              f"({'within' if abs(a['mean'] - b['mean']) <= 2 * spread else 'outside'} twice one draw's spread, "
              f"{2 * spread:.3f}). A single evaluation of this size can land anywhere in the range above: a gain "
              "between two points of a curve smaller than that is not shown by them. Evaluations inside a run "
              "sample each problem with the same seeds at every version (common random numbers), so what two of "
              "its points differ by is mostly the weights."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.eval_noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--problems", type=int, default=0, help="held-out problems (default: the config's eval)")
    ap.add_argument("--k", type=int, default=0, help="samples per problem (default: the config's eval.k)")
    ap.add_argument("--out", default=str(output.RESULTS))
    a, overrides = ap.parse_known_args(argv)  # the rest: config overrides
    from pipeline.config import load_config
    from pipeline.models import resolve_model_path
    from pipeline.prompts import build_prompts

    extra = [*overrides, *(["--eval.num_problems", str(a.problems)] if a.problems else []),
             *(["--eval.k", str(a.k)] if a.k else [])]
    cfg = load_config(ROOT / a.config, extra)
    model_dir = resolve_model_path(cfg)
    prompts = build_prompts(cfg, model_dir).evals
    if a.draws < 2 or not prompts:
        print(f"need --draws >= 2 and held-out problems (got {a.draws} draws, {len(prompts)} problems)",
              file=sys.stderr)
        return 2
    draws = {"offline": offline_draws(cfg, model_dir, prompts, a.draws),
             "engine": asyncio.run(_engine_draws(cfg, model_dir, prompts, a.draws))}
    samples = len(prompts) * cfg.eval.k
    doc = {"model": cfg.model.path, "config": a.config, "problems": len(prompts), "k": cfg.eval.k,
           "temperature": cfg.sampling.temperature, "draws": draws,
           "summary": {path: summary(d, samples) for path, d in draws.items()},
           "command": " ".join(["python -m bench.eval_noise", *argv])}
    output.write(Path(a.out) / "eval_noise.md", report(doc), doc)
    print(report(doc))
    return 0


if __name__ == "__main__":
    guard.main(main)
