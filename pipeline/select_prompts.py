"""`reinforce-ada select-prompts`: the paper's data selection. Deduplicate, sample 16 responses per prompt with
the base model, and keep prompts whose pass rate lies in [min_rate, max_rate] (the paper: at least 1/16, at most
0.125 for its hard set or 0.313 for its easy one), written as JSONL: each kept row as it is in its input file
(so the same data.* keys read the output), plus its measured `pass_rate` and its `source` (file:line)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.data import Example, normalize_problem, read_rows, short_source
from pipeline.models import effective_max_model_len, load_tokenizer
from pipeline.prompts import ARITHMETIC, fit_prompts, load_examples, render_examples

PRESETS = {"hard": 0.125, "easy": 0.313}


def select(cfg, model_dir: str, files: list[str], samples: int, min_rate: float, max_rate: float,
           limit: int = 0) -> tuple[list[dict], dict]:
    """(kept rows with their pass rates, counts) for the problems of `files`, read and rendered as the buffer
    does for data.train_files and scored by reward.fn with the prompts' extras."""
    from pipeline.offline import make_llm, sample_and_score
    from pipeline.rewards import check_reward_config

    check_reward_config(cfg)
    seen: set[str] = set()
    candidates: list[tuple[int, Example]] = []  # (index of its file, example)
    for i, f in enumerate(files):
        for ex in load_examples(cfg, f, train=True):  # dedups within a file; `seen` dedups across files
            key = normalize_problem(ex.problem)
            if key not in seen:
                seen.add(key)
                candidates.append((i, ex))
    if limit:
        candidates = candidates[:limit]
    tokenizer = load_tokenizer(cfg, model_dir)
    rendered = render_examples(cfg, [ex for _, ex in candidates], tokenizer, "candidates")
    prompts = fit_prompts(rendered, tokenizer, effective_max_model_len(cfg, model_dir), cfg.sampling.max_new_tokens,
                          "candidate")
    fitting = {id(p) for p in prompts}
    candidates = [c for c, p in zip(candidates, rendered) if id(p) in fitting]
    llm = make_llm(cfg, model_dir)
    rewards = sample_and_score(llm, [p.text for p in prompts], [p.answer for p in prompts], samples,
                               cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens, cfg.run.seed,
                               cfg.producers.reward_workers, cfg.producers.reward_timeout_s, reward_fn=cfg.reward.fn,
                               extras=[p.extras for p in prompts])
    rates = [sum(r) / samples for r in rewards]
    chosen = [(i, ex, rate) for (i, ex), rate in zip(candidates, rates) if min_rate <= rate <= max_rate]
    kept = []
    for i, f in enumerate(files):
        mine = [(ex, rate) for j, ex, rate in chosen if j == i]
        if f == ARITHMETIC:  # generated: no input rows to copy
            kept += [{"problem": ex.problem, "answer": ex.answer, "pass_rate": rate, "source": ex.source}
                     for ex, rate in mine]
        elif mine:
            kept += _input_rows(f, {ex.source: rate for ex, rate in mine})  # a file's sources are unique
    counts = {"problems": len(candidates), "kept": len(kept), "samples_per_problem": samples,
              "min_rate": min_rate, "max_rate": max_rate}
    return kept, counts


def _input_rows(name: str, rates: dict[str, float]) -> list[dict]:
    """The rows of dataset `name` whose source is in `rates`, as they are, with their pass_rate and source."""
    out = []
    for where, row in read_rows(name):
        source = short_source(where)
        if source in rates:
            out.append({**row, "pass_rate": rates[source], "source": source})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada select-prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="base model directory (or \"tiny\")")
    parser.add_argument("--data", nargs="+", required=True,
                        help="problems with answers: JSONL/Parquet files, Hugging Face dataset directories or names "
                             "(read with the config's data.* keys)")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--samples", type=int, default=16, help="responses sampled per prompt (default 16)")
    parser.add_argument("--set", choices=sorted(PRESETS), default="easy",
                        help="max pass rate preset: hard 0.125, easy 0.313 (default easy)")
    parser.add_argument("--min-rate", type=float, default=None, help="default: 1/samples")
    parser.add_argument("--max-rate", type=float, default=None, help="overrides --set")
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems")
    parser.add_argument("--config", help="TOML config for the engine, data keys, template, sampling and reward")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.data import DatasetError
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
        kept, counts = select(cfg, model_dir, args.data, args.samples, min_rate, max_rate, args.limit)
    except (ConfigError, DatasetError, FileNotFoundError) as exc:
        print(f"select-prompts: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for row in kept:
            f.write(json.dumps(row, default=str) + "\n")  # default: bytes or dates of a Parquet row
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
