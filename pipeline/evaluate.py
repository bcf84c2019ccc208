"""`reinforce-ada eval`: Ave@k (mean accuracy over k samples at T = 1.0, the paper's metric) of a model on
benchmark files, per benchmark and size-weighted over all of them, as a table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.models import effective_max_model_len, load_tokenizer
from pipeline.prompts import benchmark_name, fit_prompts, load_examples, render_examples


def evaluate(cfg, model_dir: str, files: list[str], k: int, temperature: float, max_new_tokens: int,
             limit: int = 0, samples_path: str | Path | None = None) -> dict:
    """{"benchmarks": {name: {"problems", "ave_at_k"}}, "weighted_ave_at_k", ...} for `model_dir`.

    Each entry of `files` is read and rendered as the buffer does for data.eval_files (data.* keys, template,
    system prompt; "arithmetic" = the built-in task) and scored by reward.fn with the prompts' extras.
    `samples_path`: a JSONL file receiving one row per problem (benchmark, the rendered prompt, the gold answer,
    the k completions and their rewards), to see why a model scores what it scores."""
    from pipeline.offline import make_llm, sample_and_score
    from pipeline.rewards import check_reward_config

    check_reward_config(cfg)
    tokenizer = load_tokenizer(cfg, model_dir)
    max_len = effective_max_model_len(cfg, model_dir)
    sets = {}
    for f in files:
        examples = load_examples(cfg, f, train=False)
        name = benchmark_name(f)
        rendered = render_examples(cfg, examples[:limit] if limit else examples, tokenizer, name)
        sets[name] = fit_prompts(rendered, tokenizer, max_len, max_new_tokens, name)
    llm = make_llm(cfg, model_dir)
    result: dict = {"model": model_dir, "k": k, "temperature": temperature, "benchmarks": {}}
    total, weighted = 0, 0.0
    out = open(samples_path, "w") if samples_path else None  # closed below, whatever happens
    try:
        for name, prompts in sets.items():
            t0 = time.monotonic()
            texts: list[list[str]] = []
            rewards = sample_and_score(llm, [p.text for p in prompts], [p.answer for p in prompts], k, temperature,
                                       1.0, max_new_tokens, cfg.run.seed, cfg.producers.reward_workers,
                                       cfg.producers.reward_timeout_s, reward_fn=cfg.reward.fn,
                                       extras=[p.extras for p in prompts], completions=texts)
            if out is not None:
                for p, comps, rs in zip(prompts, texts, rewards):
                    out.write(json.dumps({"benchmark": name, "prompt": p.text, "answer": p.answer,
                                          "completions": comps, "rewards": rs}) + "\n")
                out.flush()
            _score(result, name, prompts, rewards, k, time.monotonic() - t0)
    finally:
        if out is not None:
            out.close()
    for row in result["benchmarks"].values():
        total += row["problems"]
        weighted += row["ave_at_k"] * row["problems"]
    result["weighted_ave_at_k"] = weighted / max(1, total)
    result["problems"] = total
    return result


def _score(result: dict, name: str, prompts: list, rewards: list[list[float]], k: int, seconds: float) -> None:
    per_problem = [sum(r) / k for r in rewards]
    ave = sum(per_problem) / max(1, len(per_problem))
    result["benchmarks"][name] = {"problems": len(prompts), "ave_at_k": ave, "seconds": seconds}


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
    parser.add_argument("--model", required=True,
                        help="model directory, \"tiny\", or a run directory (its latest checkpoint's Hugging Face "
                             "export, read with the run's config.toml)")
    parser.add_argument("--data", nargs="+",
                        help="benchmarks: JSONL/Parquet files, Hugging Face dataset directories or names, or "
                             "\"arithmetic\" (read with the config's data.* keys); default with a run directory: "
                             "its data.eval_files")
    parser.add_argument("--k", type=int, default=32, help="samples per problem (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=0, help="default: sampling.max_new_tokens")
    parser.add_argument("--limit", type=int, default=0, help="first N problems of each file (0 = all)")
    parser.add_argument("--config", help="TOML config for the engine, data keys, template and reward settings "
                                         "(default with a run directory: its config.toml)")
    parser.add_argument("--out", help="write the JSON result here too")
    parser.add_argument("--samples", help="write every problem's rendered prompt, gold answer, completions and rewards "
                                          "here (JSONL), to see why a model scores what it scores")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.data import DatasetError, check_source
    from pipeline.export import ExportError, find_run_export
    from pipeline.models import resolve_model_path

    try:
        if args.k < 1:
            raise ConfigError("--k must be >= 1")
        run = find_run_export(args.model)
        if run is not None:  # the run's own config: its template, data keys and reward read the export
            model_dir, run_config = run
            cfg = load_config(args.config or run_config, overrides)
            model_dir = str(model_dir)
        else:
            cfg = load_config(args.config, ["--model.path", args.model] + overrides)
            model_dir = resolve_model_path(cfg)
        data = args.data or (cfg.data.eval_files if run is not None else None)
        if not data:
            raise ConfigError("--data: name the benchmark files (or pass a run directory as --model: its "
                              "data.eval_files)")
        for f in data:
            if f != "arithmetic":
                try:
                    check_source(f)
                except FileNotFoundError:
                    raise ConfigError(f"--data {f}: no such file or directory") from None
        result = evaluate(cfg, model_dir, data, args.k, args.temperature,
                          args.max_new_tokens or cfg.sampling.max_new_tokens, args.limit, args.samples)
    except (ConfigError, DatasetError, ExportError) as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    print_table(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
