"""Held-out accuracy of the versions a `bench.e2e` run published: one vLLM engine, weights reloaded in place.

    python -m bench.e2e.evaluate SPEC.json OUT.json

SPEC: {"config": "configs/tiny.toml", "seed": S, "runs": [{"key": ..., "overrides": [...], "versions": {"10": "FILE",
...}}]}.
Version 0 is the base model. OUT: {"runs": {key: {"problems": P, "evals": [{"version", "accuracy", "se",
"pass_at_k", "seconds", "per_problem"}], "last_per_problem": [accuracy of each problem at the last version]}}}.
Samples are scored by the config's reward.fn.

Why not the buffer's own evaluation during training: it shares the producers with training (half of each work
request), so a 1,000-problem evaluation would take most of GRPO's wall-clock time and run over several learner
steps with weights that change under it. Here every version is evaluated exactly, after the run, and the training
runs' clocks hold training alone.

Invariants:
- the held-out prompts of a run are those `pipeline.prompts.build_prompts` gives its config (training problems
  removed), so evaluation matches what the run would have evaluated;
- every version of every run is sampled with the same per-request seed (SPEC's seed, not the run's) on its
  held-out prompts: with one held-out set for the sweep, the strategies are compared on common random numbers,
  and a version evaluated twice (version 0 of every strategy) is evaluated once;
- the engine's prefix cache is reset after each reload (no KV of old weights is reused).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.models import resolve_model_path
from pipeline.offline import sample_and_score
from pipeline.prompts import build_prompts

ROOT = Path(__file__).resolve().parents[2]


def make_reloading_llm(cfg, model_dir: str):
    """An offline vLLM `LLM` with the producers' engine arguments, worker extension included (weight reloads)."""
    from vllm import LLM
    from vllm.platforms import current_platform

    from pipeline.producer.engine import configure_cpu_env, engine_kwargs

    cpu = current_platform.is_cpu()
    if cpu:
        configure_cpu_env(cfg.producers.engine)
    return LLM(**engine_kwargs(model_dir, cfg.model.dtype, cfg.producers.engine, cfg.run.seed, cpu))


def scores(rewards: list[list[float]]) -> dict:
    """Ave@k, its standard error over problems (samples of one problem are correlated), and pass@k."""
    per_problem = [sum(r) / len(r) for r in rewards]
    n = len(per_problem)
    mean = sum(per_problem) / n
    var = sum((p - mean) ** 2 for p in per_problem) / (n - 1) if n > 1 else 0.0
    return {"accuracy": mean, "se": math.sqrt(var / n), "pass_at_k": sum(p > 0 for p in per_problem) / n,
            "problems": n}


def evaluate(spec: dict) -> dict:
    cfg0 = load_config(ROOT / spec["config"], spec["runs"][0]["overrides"])
    model_dir = resolve_model_path(cfg0)
    base = str(Path(model_dir) / "model.safetensors")
    llm = make_reloading_llm(cfg0, model_dir)
    loaded = base
    done: dict[tuple[str, str], dict] = {}  # (prompt set digest, weights file) -> scores
    out: dict = {"runs": {}}
    for run in spec["runs"]:
        cfg = load_config(ROOT / spec["config"], run["overrides"] + ["--learner.eval_every", "1"])
        prompts = build_prompts(cfg, model_dir).evals
        digest = hashlib.blake2b(json.dumps([(p.text, p.answer) for p in prompts]).encode(), digest_size=8).hexdigest()
        max_new = cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
        versions = {0: base, **{int(v): f for v, f in run["versions"].items()}}
        evals = []
        for version, weights in sorted(versions.items()):
            key = (digest, weights)
            if key not in done:
                if weights != loaded:
                    llm.collective_rpc("reload_from_file", args=(weights,))
                    llm.reset_prefix_cache()
                    loaded = weights
                t0 = time.monotonic()
                rewards = sample_and_score(llm, [p.text for p in prompts], [p.answer for p in prompts], cfg.eval.k,
                                           cfg.sampling.temperature, cfg.sampling.top_p, max_new, spec["seed"],
                                           cfg.producers.reward_workers, cfg.producers.reward_timeout_s,
                                           reward_fn=cfg.reward.fn)
                done[key] = {**scores(rewards), "seconds": time.monotonic() - t0,
                             "per_problem": [sum(r) / len(r) for r in rewards]}
            evals.append({"version": version, **done[key]})
            print(f"{run['key']} v{version}: Ave@{cfg.eval.k} {done[key]['accuracy']:.3f} "
                  f"+- {done[key]['se']:.3f} ({len(prompts)} problems)", flush=True)
        # the last version's per-problem accuracy: the caller pairs it with another run's on the same problems
        out["runs"][run["key"]] = {"problems": len(prompts), "k": cfg.eval.k, "evals": evals,
                                   "last_per_problem": done[(digest, versions[max(versions)])]["per_problem"]}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bench.e2e.evaluate SPEC.json OUT.json", file=sys.stderr)
        return 2
    result = evaluate(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
