"""`reinforce-ada buffer`: load the prompts, bind the sockets, serve until the learner says it is done."""

from __future__ import annotations

import argparse
import logging
import random
import sys

from pipeline.config import Config, ConfigError, load_config


def load_examples(cfg: Config, files: list[str], train: bool) -> list:
    """The training (or held-out) examples named by `files`; "arithmetic" is the built-in generated task."""
    from pipeline.data import load_dataset, make_arithmetic

    examples = []
    levels = tuple(cfg.data.arithmetic_levels)
    for name in files:
        if name == "arithmetic":
            # train and eval draw from disjoint seeds; eval problems seen in training are removed below
            if train:
                examples += make_arithmetic(cfg.data.num_arithmetic_train, levels, seed=cfg.run.seed + 1)
            else:
                examples += make_arithmetic(cfg.data.num_arithmetic_eval, levels, seed=cfg.run.seed + 1_000_003)
        else:
            examples += load_dataset(name, problem_key=cfg.data.problem_key or None,
                                     answer_key=cfg.data.answer_key or None)
    return examples


def build_prompts(cfg: Config, model_dir: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training prompts, eval prompts) as (templated prompt text, gold answer), training ones shuffled by seed."""
    from pipeline.data import render_prompt, validate_template
    from pipeline.models import load_tokenizer_if_needed, prompt_template

    template = prompt_template(cfg)
    validate_template(template)
    tokenizer = load_tokenizer_if_needed(cfg, model_dir)
    train = load_examples(cfg, cfg.data.train_files, train=True)
    evals = load_examples(cfg, cfg.data.eval_files, train=False) if cfg.learner.eval_every else []
    train_problems = {ex.problem for ex in train}
    evals = [ex for ex in evals if ex.problem not in train_problems]
    if cfg.data.shuffle:
        random.Random(cfg.run.seed).shuffle(train)
    if cfg.data.max_prompts:
        train = train[: cfg.data.max_prompts]
    if cfg.eval.num_problems:
        evals = evals[: cfg.eval.num_problems]
    if not train:
        raise ConfigError("data.train_files: no training prompts were loaded")
    render = lambda ex: (render_prompt(ex.problem, template, tokenizer), ex.answer)  # noqa: E731
    return [render(ex) for ex in train], [render(ex) for ex in evals]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada buffer", description="Run the rollout buffer service.")
    parser.add_argument("--config", help="TOML config (default: built-in defaults)")
    parser.add_argument("--model", help="model directory (for the tokenizer's chat template); default model.path")
    args, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s buffer %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, overrides)
        from pipeline.models import prompt_template, resolve_model_path

        model_dir = args.model or resolve_model_path(cfg, build=prompt_template(cfg) == "auto")
        prompts, eval_prompts = build_prompts(cfg, model_dir)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"buffer: {exc}", file=sys.stderr)
        return 2
    from pipeline.buffer.service import BufferService

    service = BufferService(cfg, prompts, eval_prompts)
    logging.info("serving %d training prompts (%d eval) on %s, control %s", len(prompts), len(eval_prompts),
                 service.router_url, service.control_url)
    try:
        reason = service.serve()
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        service.close()
    logging.info("stopped: %s", reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
