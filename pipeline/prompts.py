"""The prompts a run serves: datasets loaded, templated, and checked against the engine's context length.

`build_prompts` is what the buffer serves (training prompts shuffled by the run seed, held-out prompts tagged
with their benchmark); `eval` and `select-prompts` use `load_examples`, `render_examples` and `fit_prompts` on their
own sets, so all three read and render a dataset entry the same way (data.* keys, template, system prompt).

Invariants:
- a prompt's text comes from `render_examples` alone (a chat prompt through the tokenizer's chat template); a
  problem the template cannot render is a PromptsError naming its file:line;
- a Prompt carries its example's `extras` (data.extra_keys) unchanged, for reward.fn;
- a prompt is served only if its tokens plus `sampling.max_new_tokens` fit the engine's `max_model_len` (as vLLM
  counts them: the tokenizer with its special tokens); the others are counted and left out with ONE warning
  that gives the count and the longest prompt's length (verl's `filter_overlong_prompts`), and a set of which
  none fits is a `PromptsError` that says which setting to change;
- held-out problems that also occur in the training set are removed (problems compared after normalisation).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.data import (
    Example,
    load_dataset,
    make_arithmetic,
    normalize_problem,
    render_prompt,
    source_name,
    validate_template,
)
from pipeline.models import effective_max_model_len, load_tokenizer, prompt_template

log = logging.getLogger(__name__)

ARITHMETIC = "arithmetic"  # the built-in generated task's name in data.train_files / data.eval_files
EVAL_SEED_OFFSET = 1_000_003  # held-out arithmetic problems come from a seed the training draw never uses


class PromptsError(ConfigError):
    """No usable prompt: the message names the setting to change."""


@dataclass(frozen=True)
class Prompt:
    """One templated prompt with its gold answer and where it came from."""

    text: str
    answer: str
    benchmark: str  # the file stem ("math500") or "arithmetic"
    extras: dict[str, Any] = field(default_factory=dict)  # keyword arguments for reward.fn (data.extra_keys)


def benchmark_name(name: str) -> str:
    """"math500" for "data/math500.jsonl", "gsm8k" for the Hugging Face "openai/gsm8k:main@test"."""
    return ARITHMETIC if name == ARITHMETIC else source_name(name)


def load_examples(cfg: Config, name: str, train: bool) -> list[Example]:
    """The examples of one data.train_files / data.eval_files entry ("arithmetic" = the built-in task)."""
    if name == ARITHMETIC:
        levels = tuple(cfg.data.arithmetic_levels)
        fmt = cfg.data.arithmetic_format
        if train:
            return make_arithmetic(cfg.data.num_arithmetic_train, levels, seed=cfg.run.seed + 1, fmt=fmt)
        return make_arithmetic(cfg.data.num_arithmetic_eval, levels, seed=cfg.run.seed + EVAL_SEED_OFFSET, fmt=fmt)
    return load_dataset(name, problem_key=cfg.data.problem_key or None, answer_key=cfg.data.answer_key or None,
                        extra_keys=cfg.data.extra_keys)


def render_examples(cfg: Config, examples: list[Example], tokenizer: Any, benchmark: str) -> list[Prompt]:
    """The prompts of `examples` with data.template and data.system_prompt (a chat prompt as its messages)."""
    template = prompt_template(cfg, tokenizer)
    validate_template(template)
    out = []
    for ex in examples:
        try:
            text = render_prompt(ex.messages or ex.problem, template, tokenizer, cfg.data.system_prompt)
        except ValueError as exc:
            raise PromptsError(f"{ex.source}: {exc}") from None
        out.append(Prompt(text, ex.answer, benchmark, ex.extras))
    return out


def prompt_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of `texts` as the engine tokenizes a text prompt (special tokens included)."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]


def fit_prompts(prompts: list[Prompt], tokenizer: Any, max_model_len: int, max_new_tokens: int,
                what: str, max_share: float = 1.0) -> list[Prompt]:
    """The prompts whose tokens plus `max_new_tokens` fit `max_model_len`; warns once about the rest.

    Raises PromptsError when none fits (the run could never generate anything) or when more than `max_share`
    of them do not (a configuration mistake: the run would train on a sliver of its data). `tokenizer=None`
    skips the check (no tokenizer to count with, e.g. a scripted test without a model).
    """
    if tokenizer is None or not prompts:
        return prompts
    room = max_model_len - max_new_tokens
    lengths = prompt_lengths(tokenizer, [p.text for p in prompts])
    kept = [p for p, n in zip(prompts, lengths) if n <= room]
    if len(kept) == len(prompts):
        return prompts
    longest = max(lengths)
    fix = (f"raise producers.engine.max_model_len (now {max_model_len}, the model allows more only if its "
           f"max_position_embeddings does), lower sampling.max_new_tokens (now {max_new_tokens}), or use shorter "
           "prompts")
    message = (f"{len(prompts) - len(kept)} of {len(prompts)} {what} prompts do not fit: prompt tokens + "
               f"sampling.max_new_tokens ({max_new_tokens}) > max_model_len ({max_model_len}); the longest prompt "
               f"has {longest} tokens (room: {max(room, 0)})")
    if not kept:
        raise PromptsError(f"{message}, so none can be generated: {fix}")
    if len(prompts) - len(kept) > max_share * len(prompts):
        raise PromptsError(f"{message}: more than data.max_overlong_share ({max_share:g}) of them, so the run would "
                           f"train on a sliver of its data; {fix}, or raise data.max_overlong_share")
    log.warning("%s; they are left out: %s", message, fix)
    return kept


@dataclass
class RunPrompts:
    train: list[Prompt]
    evals: list[Prompt]
    num_overlong: int  # training + held-out prompts left out because they do not fit


def build_prompts(cfg: Config, model_dir: str, tokenizer: Any = None) -> RunPrompts:
    """The training prompts (shuffled by run.seed, data.max_prompts applied) and the held-out prompts
    (eval.num_problems of each eval file, none of them a training problem), overlong ones left out."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg, model_dir)
    train_ex: list[Example] = []
    for name in cfg.data.train_files:
        train_ex += load_examples(cfg, name, train=True)
    if cfg.data.shuffle:
        random.Random(cfg.run.seed).shuffle(train_ex)
    if cfg.data.max_prompts:
        train_ex = train_ex[: cfg.data.max_prompts]
    if not train_ex:
        raise PromptsError("data.train_files: no training prompts were loaded")
    seen = {normalize_problem(ex.problem) for ex in train_ex}
    max_len = effective_max_model_len(cfg, model_dir)
    new_tokens = cfg.sampling.max_new_tokens
    train = fit_prompts(render_examples(cfg, train_ex, tokenizer, "train"), tokenizer, max_len, new_tokens,
                        "training", cfg.data.max_overlong_share)
    evals: list[Prompt] = []
    if cfg.learner.eval_every:
        eval_tokens = cfg.eval.max_new_tokens or new_tokens
        for name in cfg.data.eval_files:
            examples = [ex for ex in load_examples(cfg, name, train=False) if normalize_problem(ex.problem) not in seen]
            if cfg.eval.num_problems:
                examples = examples[: cfg.eval.num_problems]
            rendered = render_examples(cfg, examples, tokenizer, benchmark_name(name))
            try:
                evals += fit_prompts(rendered, tokenizer, max_len, eval_tokens, f"held-out ({benchmark_name(name)})")
            except PromptsError as exc:  # a benchmark nothing of which fits is skipped; training goes on
                log.warning("%s: evaluation skips this benchmark", exc)
    overlong = len(train_ex) - len(train)
    return RunPrompts(train, evals, overlong)


def render_for_model(model_dir: str, problems: list, template: str = "auto", system_prompt: str = "") -> list[str]:
    """Prompt texts of `problems` (strings or chat prompts) for the model in `model_dir`, rendered as `train`,
    `eval` and `select-prompts` render them: with template "auto", the model's chat template when its tokenizer
    has one. For `AdaptiveSampler` and other loops of one's own."""
    from pipeline.config import load_config
    from pipeline.models import resolve_model_path

    cfg = load_config(None, ["--model.path", model_dir, "--data.template", template,
                             "--data.system_prompt", system_prompt])
    tokenizer = load_tokenizer(cfg, resolve_model_path(cfg))  # "smollm2-135m", a .gguf file: its directory
    examples = [Example(problem=p, answer="", source=f"problems:{i}") if isinstance(p, str) else
                Example(problem=p[-1]["content"], answer="", source=f"problems:{i}", messages=tuple(p))
                for i, p in enumerate(problems)]
    return [p.text for p in render_examples(cfg, examples, tokenizer, "problems")]
