"""Datasets: examples with a problem and a gold answer, prompt templates, and a built-in arithmetic task.

Invariant: every Example has a non-empty `problem` and a non-empty `answer` (the gold final answer as a
string that math-verify can parse).
Loading never silently drops a row: a row without a problem or an answer is a DatasetError naming
file:line; only exact duplicates (whitespace and case ignored) are dropped, and only when dedup is on.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec


class Example(msgspec.Struct, frozen=True):
    """One training or evaluation problem."""

    problem: str  # the question text, without any template
    answer: str  # the gold final answer (e.g. "42", "\\frac{1}{2}")
    source: str = ""  # where it came from: "file.jsonl:17" or "arithmetic"


# ---- the built-in arithmetic task (for the tiny character-level model) ----

ARITHMETIC_LEVELS = (1, 2, 3)  # operands have up to `level` digits


def arithmetic_problem(rng: random.Random, level: int) -> Example:
    """One addition or subtraction problem whose operands have 1..`level` digits."""
    if level not in ARITHMETIC_LEVELS:
        raise ValueError(f"arithmetic level must be one of {ARITHMETIC_LEVELS}, got {level}")
    hi = 10**level - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return Example(problem=f"{a}{op}{b}", answer=str(value), source=f"arithmetic:L{level}")


def make_arithmetic(num: int, levels: tuple[int, ...] = ARITHMETIC_LEVELS, seed: int = 0) -> list[Example]:
    """`num` distinct arithmetic problems, levels drawn uniformly from `levels`, deterministic for a seed."""
    rng = random.Random(seed)
    out: list[Example] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot draw {num} distinct arithmetic problems at levels {levels}")
        ex = arithmetic_problem(rng, rng.choice(levels))
        if ex.problem not in seen:
            seen.add(ex.problem)
            out.append(ex)
    return out


# ---- \boxed{} extraction (shared with the rewards) ----

# `\boxed{`, `\fbox{` or `\framebox{` (AIME solutions use \framebox); the brace is part of the match
_BOXED_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s*\{")
# structural braces only: `\\` (a LaTeX line break) and `\{` `\}` (literal braces) are skipped
_BRACE_RE = re.compile(r"\\\\|\\[{}]|[{}]")


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, or None.

    Braces are matched (escaped `\\{ \\}` don't count), so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`.
    A final box cut off before its closing brace is skipped in favour of the last complete one. Linear in
    len(text): one pass over the braces after the first box.
    """
    starts = [m.end() - 1 for m in _BOXED_RE.finditer(text)]  # positions of each box's opening brace
    if not starts:
        return None
    wanted = set(starts)
    closing: dict[int, int] = {}  # opening-brace position -> its closing-brace position
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text, starts[0]):
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}" and stack:
            opened = stack.pop()
            if opened in wanted:
                closing[opened] = m.start()
    for start in reversed(starts):
        if start in closing:
            return text[start + 1 : closing[start]].strip()
    return None


# ---- loading JSONL / Parquet ----

PROBLEM_KEYS = ("problem", "question")
ANSWER_KEYS = ("answer", "final_answer")
SOLUTION_KEY = "solution"
DATASET_SUFFIXES = (".jsonl", ".ndjson", ".parquet")


class DatasetError(ValueError):
    """A dataset file or one of its rows cannot be used; the message names file:line and the fix."""


def normalize_answer(value: Any) -> str | None:
    """A gold answer from a file as a string: 27.0 -> "27", [1, 2] -> "1, 2"; None/""/NaN -> None."""
    if hasattr(value, "tolist"):  # numpy scalars and arrays (pandas rows)
        value = value.tolist()
    if value is None or isinstance(value, bool):
        return None  # a bool is never a math answer; treat it as missing so the error says so
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        parts = [normalize_answer(v) for v in value]
        if not parts or any(p is None for p in parts):
            return None
        return ", ".join(parts)
    if isinstance(value, str):
        return value.strip() or None
    return None


def normalize_problem(text: str) -> str:
    """The dedup key of a problem: whitespace collapsed, case-folded."""
    return " ".join(text.split()).casefold()


def _read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number, 1-based; decoded row) for a JSONL or Parquet file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(
                        f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                        "each line of a .jsonl file must be one JSON object"
                    ) from None
    elif suffix == ".parquet":
        yield from enumerate(_read_parquet(path), 1)
    else:
        raise DatasetError(f"{path}: unsupported file type {suffix!r}; use one of {DATASET_SUFFIXES}")


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow (or pandas with a Parquet engine); "
            "install it with `pip install pyarrow`, or convert the file to JSONL"
        ) from None
    return pd.read_parquet(path).to_dict("records")


def _row_to_example(
    row: Any, where: str, problem_key: str | None, answer_key: str | None, solution_key: str | None
) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    pkeys = (problem_key,) if problem_key else PROBLEM_KEYS
    problem = next((row[k].strip() for k in pkeys if isinstance(row.get(k), str) and row[k].strip()), None)
    if problem is None:
        raise DatasetError(
            f"{where}: no problem text (looked for {' or '.join(map(repr, pkeys))} among the keys "
            f"{sorted(row)}); set data.problem_key to the key that holds the problem"
        )
    akeys = (answer_key,) if answer_key else ANSWER_KEYS
    answer = next((a for a in (normalize_answer(row.get(k)) for k in akeys) if a is not None), None)
    skey = solution_key or SOLUTION_KEY
    if answer is None and not answer_key and isinstance(row.get(skey), str):
        answer = last_boxed(row[skey])
    if answer is None:
        looked = " or ".join(map(repr, akeys))
        if not answer_key:
            looked += f", or a \\boxed{{}} in {skey!r}"
        raise DatasetError(
            f"{where}: no answer found (looked for {looked} among the keys {sorted(row)}); "
            "set data.answer_key to the key that holds the final answer, "
            "or data.solution_key to a solution that ends in \\boxed{...}"
        )
    return Example(problem=problem, answer=answer, source=where)


def load_dataset(
    path: str | Path,
    problem_key: str | None = None,
    answer_key: str | None = None,
    solution_key: str | None = None,
    dedup: bool = True,
    limit: int | None = None,
) -> list[Example]:
    """Examples from a JSONL or Parquet file, in file order.

    The problem is `problem_key`, else "problem" or "question". The answer is `answer_key`, else "answer"
    or "final_answer", else the last \\boxed{} of `solution_key` (default "solution"). Numbers and lists
    become strings (27.0 -> "27"). With `dedup`, later rows whose problem equals an earlier one (whitespace
    and case ignored) are dropped. `limit` keeps the first `limit` examples after dedup.
    Each Example.source is "file.jsonl:LINE" (Parquet: the 1-based row). Raises DatasetError naming
    file:line for a bad row, and for a file with no rows.
    """
    path = Path(path)
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}; check data.train_files and data.eval_files")
    out: list[Example] = []
    seen: set[str] = set()
    for lineno, row in _read_rows(path):
        ex = _row_to_example(row, f"{path}:{lineno}", problem_key, answer_key, solution_key)
        ex = Example(problem=ex.problem, answer=ex.answer, source=f"{path.name}:{lineno}")
        if dedup:
            key = normalize_problem(ex.problem)
            if key in seen:
                continue
            seen.add(key)
        out.append(ex)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DatasetError(f"{path}: no examples in the file; check data.train_files and data.eval_files")
    return out


# ---- prompt templates ----

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("auto", "plain", "raw")  # or a format string with a {problem} field


def validate_template(template: str) -> None:
    """Raise ValueError unless `template` is a named template or a format string whose only field is
    {problem}. Cheap, so configs can check it at load time."""
    if template in TEMPLATES:
        return
    if not isinstance(template, str) or "{problem}" not in template:
        raise ValueError(
            f"unknown prompt template {template!r}; use one of {TEMPLATES} or a format string containing "
            "{problem}, e.g. '{problem}='"
        )
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(
            f"prompt template {template!r} is not a valid format string ({e}); "
            "write literal braces as {{ and }}"
        ) from None
    if fields != {"problem"}:
        raise ValueError(
            f"prompt template {template!r} may only use the field {{problem}}, found "
            f"{sorted(fields - {'problem'})}; write literal braces as {{{{ and }}}}"
        )


def render_prompt(problem: str, template: str, tokenizer: Any = None) -> str:
    """The prompt text for one problem.

    "auto": the tokenizer's chat template with one user message (the problem plus INSTRUCTION) and the
    generation prompt, when the tokenizer has a chat template; otherwise "plain".
    "plain": a plain-text prompt asking for the answer in \\boxed{}. "raw": the problem unchanged.
    Anything else must be a format string whose only field is {problem} (e.g. "{problem}=").
    """
    validate_template(template)
    if template == "auto":
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        template = "plain"
    if template == "plain":
        return f"Problem: {problem}\n{INSTRUCTION}\nSolution:"
    if template == "raw":
        return problem
    return template.format(problem=problem)
