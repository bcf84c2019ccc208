"""`reinforce-ada select-prompts`: the paper's data selection. Deduplicate, sample 16 responses per prompt with
the base model, and keep prompts whose pass rate lies in [min_rate, max_rate] (the paper: at least 1/16, at most
0.125 for its hard set or 0.313 for its easy one), written as JSONL with the measured pass rates."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PRESETS = {"hard": 0.125, "easy": 0.313}


def select(cfg, model_dir: str, files: list[str], samples: int, min_rate: float, max_rate: float,
           limit: int = 0) -> tuple[list[dict], dict]:
    """(kept rows with their pass rates, counts) for the problems of `files`."""
    from pipeline.data import load_dataset, normalize_problem, render_prompt
    from pipeline.offline import make_llm, sample_and_score

    seen: set[str] = set()
    examples = []
    for f in files:
        for ex in load_dataset(f):  # dedups within a file; `seen` dedups across files
            key = normalize_problem(ex.problem)
            if key not in seen:
                seen.add(key)
                examples.append(ex)
    if limit:
        examples = examples[:limit]
    from pipeline.models import load_tokenizer_if_needed, prompt_template

    template = prompt_template(cfg)
    tokenizer = load_tokenizer_if_needed(cfg, model_dir)
    llm = make_llm(cfg, model_dir)
    prompts = [render_prompt(ex.problem, template, tokenizer) for ex in examples]
    rewards = sample_and_score(llm, prompts, [ex.answer for ex in examples], samples, cfg.sampling.temperature,
                               cfg.sampling.top_p, cfg.sampling.max_new_tokens, cfg.run.seed,
                               cfg.producers.reward_workers, cfg.producers.reward_timeout_s)
    kept = []
    for ex, r in zip(examples, rewards):
        rate = sum(r) / samples
        if min_rate <= rate <= max_rate:
            kept.append({"problem": ex.problem, "answer": ex.answer, "pass_rate": rate, "source": ex.source})
    counts = {"problems": len(examples), "kept": len(kept), "samples_per_problem": samples,
              "min_rate": min_rate, "max_rate": max_rate}
    return kept, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada select-prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="base model directory (or \"tiny\")")
    parser.add_argument("--data", nargs="+", required=True, help="JSONL/Parquet files of problems with answers")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--samples", type=int, default=16, help="responses sampled per prompt (default 16)")
    parser.add_argument("--set", choices=sorted(PRESETS), default="easy",
                        help="max pass rate preset: hard 0.125, easy 0.313 (default easy)")
    parser.add_argument("--min-rate", type=float, default=None, help="default: 1/samples")
    parser.add_argument("--max-rate", type=float, default=None, help="overrides --set")
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems")
    parser.add_argument("--config", help="TOML config for the engine, template and sampling settings")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.models import resolve_model_path

    min_rate = args.min_rate if args.min_rate is not None else 1 / args.samples
    max_rate = args.max_rate if args.max_rate is not None else PRESETS[args.set]
    try:
        if args.samples < 1:
            raise ConfigError("--samples must be >= 1")
        if not 0 <= min_rate <= max_rate <= 1:
            raise ConfigError(f"need 0 <= --min-rate ({min_rate}) <= --max-rate ({max_rate}) <= 1")
        cfg = load_config(args.config, ["--model.path", args.model] + overrides)
        model_dir = resolve_model_path(cfg)
    except ConfigError as exc:
        print(f"select-prompts: {exc}", file=sys.stderr)
        return 2
    kept, counts = select(cfg, model_dir, args.data, args.samples, min_rate, max_rate, args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for row in kept:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
