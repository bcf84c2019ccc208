"""`reinforce-ada eval`: Ave@k (mean accuracy over k samples at T = 1.0, the paper's metric) of a model on
benchmark files, per benchmark and size-weighted over all of them, as a table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def evaluate(cfg, model_dir: str, files: list[str], k: int, temperature: float, max_new_tokens: int,
             limit: int = 0) -> dict:
    """{"benchmarks": {name: {"problems", "ave_at_k"}}, "weighted_ave_at_k", ...} for `model_dir`."""
    from pipeline.data import load_dataset, make_arithmetic, render_prompt
    from pipeline.models import load_tokenizer_if_needed, prompt_template
    from pipeline.offline import make_llm, sample_and_score

    template = prompt_template(cfg)
    tokenizer = load_tokenizer_if_needed(cfg, model_dir)
    sets = {}
    for f in files:
        examples = make_arithmetic(cfg.data.num_arithmetic_eval, tuple(cfg.data.arithmetic_levels),
                                   seed=cfg.run.seed + 1_000_003) if f == "arithmetic" else load_dataset(f)
        sets[Path(f).stem] = examples[:limit] if limit else examples
    llm = make_llm(cfg, model_dir)
    result: dict = {"model": model_dir, "k": k, "temperature": temperature, "benchmarks": {}}
    total, weighted = 0, 0.0
    for name, examples in sets.items():
        t0 = time.monotonic()
        prompts = [render_prompt(ex.problem, template, tokenizer) for ex in examples]
        rewards = sample_and_score(llm, prompts, [ex.answer for ex in examples], k, temperature, 1.0,
                                   max_new_tokens, cfg.run.seed, cfg.producers.reward_workers,
                                   cfg.producers.reward_timeout_s)
        per_problem = [sum(r) / k for r in rewards]
        ave = sum(per_problem) / max(1, len(per_problem))
        result["benchmarks"][name] = {"problems": len(examples), "ave_at_k": ave,
                                      "seconds": time.monotonic() - t0}
        total += len(examples)
        weighted += ave * len(examples)
    result["weighted_ave_at_k"] = weighted / max(1, total)
    result["problems"] = total
    return result


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Ave@{result['k']} at T = {result['temperature']}: {result['model']}")
    table.add_column("benchmark")
    table.add_column("problems", justify="right")
    table.add_column(f"Ave@{result['k']}", justify="right")
    for name, row in result["benchmarks"].items():
        table.add_row(name, str(row["problems"]), f"{100 * row['ave_at_k']:.1f}")
    table.add_row("[bold]weighted average", str(result["problems"]), f"[bold]{100 * result['weighted_ave_at_k']:.1f}")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (or \"tiny\")")
    parser.add_argument("--data", nargs="+", required=True, help="JSONL/Parquet benchmark files (or \"arithmetic\")")
    parser.add_argument("--k", type=int, default=32, help="samples per problem (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=0, help="default: sampling.max_new_tokens")
    parser.add_argument("--limit", type=int, default=0, help="first N problems of each file (0 = all)")
    parser.add_argument("--config", help="TOML config for the engine, template and reward settings")
    parser.add_argument("--out", help="write the JSON result here too")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.models import resolve_model_path

    try:
        if args.k < 1:
            raise ConfigError("--k must be >= 1")
        cfg = load_config(args.config, ["--model.path", args.model] + overrides)
        model_dir = resolve_model_path(cfg)
        for f in args.data:
            if f != "arithmetic" and not Path(f).is_file():
                raise ConfigError(f"--data {f}: no such file")
    except ConfigError as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    result = evaluate(cfg, model_dir, args.data, args.k, args.temperature,
                      args.max_new_tokens or cfg.sampling.max_new_tokens, args.limit)
    print_table(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
