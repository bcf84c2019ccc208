"""Datasets: examples with a problem and a gold answer, prompt templates, and a built-in arithmetic task.

`rows.py` turns one row into an Example (keys, dotted paths, chat prompts, extras); `sources.py` reads JSONL,
Parquet and Hugging Face datasets; `templates.py` renders a problem as prompt text; `answers.py` holds
`\\boxed{}` extraction and answer normalisation; `arithmetic.py` the generated task.

Invariant: every Example has a non-empty `problem` and a non-empty `answer` (the gold final answer as a string
that the reward can read). Loading never silently drops a row: a row without a problem or an answer is a
DatasetError naming file:line and the setting to fix; only exact duplicates (whitespace and case ignored) are
dropped, and only when dedup is on.
"""

from pipeline.data.answers import last_boxed, normalize_answer, normalize_problem
from pipeline.data.arithmetic import ARITHMETIC_LEVELS, arithmetic_problem, make_arithmetic
from pipeline.data.rows import ANSWER_KEYS, PROBLEM_KEYS, SOLUTION_KEY, DatasetError, Example, Message, extra_name
from pipeline.data.sources import (
    DATASET_SUFFIXES,
    check_source,
    load_dataset,
    read_rows,
    short_source,
    source_name,
)
from pipeline.data.templates import INSTRUCTION, TEMPLATES, render_prompt, validate_template

__all__ = [
    "ANSWER_KEYS", "ARITHMETIC_LEVELS", "DATASET_SUFFIXES", "INSTRUCTION", "PROBLEM_KEYS", "SOLUTION_KEY",
    "TEMPLATES", "DatasetError", "Example", "Message", "arithmetic_problem", "check_source", "extra_name",
    "last_boxed", "load_dataset", "make_arithmetic", "normalize_answer", "normalize_problem", "read_rows",
    "render_prompt", "short_source", "source_name", "validate_template",
]
